"""Encoder snapshots: what a sequence needs, beyond its full blocks, to continue exactly at point P.

    payload = header | encoder rings (FP8 records) | ring positions | partial groups | tail block image
    header  = magic "FTES", version, P, enc_start, write_from, n_layers, window, slot_bytes,
              n_partial, hidden, tail_bytes                         (little-endian u32/i64 fields)

Partial-group rows are stored in the compute precision (fp32; fp64 in the exactness mode). The encoder
layers' window rings (20 x 128 x 528 B = 1.35 MB in the real model), each ratio-2 source's
partial group (present flag, position, fp32 kv row, fp32 score row) and the image of the partial tail
block (the global KV of tokens [floor(P / bs) * bs, P)). The decoder's rings are not part of it: the
decoder always replays the last window of a new prompt. Values are raw bytes (no pickle): a
snapshot read back from Redis is validated field by field and a mismatch raises ``ValueError``.
Decoding is pure: it returns an ``EncoderSnapshot`` that ``PagedSequence.install_snapshot`` applies.
"""

from __future__ import annotations

import struct

import numpy as np
import torch

from flashtier.engine.model.compressor import PartialGroup
from flashtier.engine.paged_kv import EncoderSnapshot, PagedSequence
from flashtier.engine.window_rings import WindowRings

MAGIC = b"FTES"
VERSION = 1
_HEADER = struct.Struct("<4sIqqqIIIIIq")


def encode_snapshot(kv: PagedSequence, n_encoder_layers: int, tail_image: bytes, partial_order: list[int]) -> bytes:
    """Serialise the encoder state of ``kv`` at P = len(kv.tokens) (copies; mutates nothing)."""
    rings = kv.rings.data[:n_encoder_layers].cpu().contiguous()
    pos = kv.rings.pos[:n_encoder_layers].cpu().contiguous()
    hidden = 0
    parts = []
    for src in partial_order:
        g = kv.partial.get(src)
        if g is None:
            parts.append(struct.pack("<bq", 0, -1))
        else:
            hidden = g.kv.numel()
            parts.append(struct.pack("<bq", 1, g.position))
            parts.append(g.kv.detach().to(kv.rings.dtype).cpu().numpy().tobytes())
            parts.append(g.score.detach().to(kv.rings.dtype).cpu().numpy().tobytes())
    if hidden == 0:
        hidden = kv.rings.head_dim
    header = _HEADER.pack(MAGIC, VERSION, len(kv.tokens), kv.enc_start, kv.write_from, rings.shape[0],
                          rings.shape[1], rings.shape[2], len(partial_order), hidden, len(tail_image))
    return b"".join([header, rings.numpy().tobytes(), pos.numpy().tobytes(), *parts, tail_image])


def decode_snapshot(
    payload: bytes, rings: WindowRings, n_encoder_layers: int, partial_order: list[int], expect_point: int,
    tail_bytes: int,
) -> EncoderSnapshot:
    """Decode and validate a snapshot for a sequence whose rings look like ``rings`` (read-only).

    Raises ValueError when the payload does not fit this model / point (the caller counts an error
    and falls back). Mutates nothing.
    """
    if len(payload) < _HEADER.size:
        raise ValueError("snapshot shorter than its header")
    magic, version, point, enc_start, write_from, n_layers, window, slot, n_partial, hidden, tail_len = (
        _HEADER.unpack_from(payload)
    )
    if magic != MAGIC or version != VERSION:
        raise ValueError("not a flashtier encoder snapshot of this version")
    if (point, n_layers, window, slot, n_partial) != (
        expect_point, n_encoder_layers, rings.window, rings.data.shape[2], len(partial_order)
    ):
        raise ValueError("snapshot geometry does not match this model or point")
    if tail_len not in (0, tail_bytes) or not 0 <= enc_start <= point or not 0 <= write_from:
        raise ValueError("snapshot header out of range")
    np_dtype = np.float64 if rings.dtype == torch.float64 else np.float32  # the compute precision
    at = _HEADER.size
    ring_bytes = n_layers * window * slot
    data = np.frombuffer(payload, dtype=np.uint8, count=ring_bytes, offset=at)
    at += ring_bytes
    pos = np.frombuffer(payload, dtype=np.int64, count=n_layers * window, offset=at)
    at += n_layers * window * 8
    groups: dict[int, PartialGroup | None] = {}
    for src in partial_order:
        present, gpos = struct.unpack_from("<bq", payload, at)
        at += 9
        if present:
            item = np.dtype(np_dtype).itemsize
            kvrow = np.frombuffer(payload, dtype=np_dtype, count=hidden, offset=at)
            score = np.frombuffer(payload, dtype=np_dtype, count=hidden, offset=at + item * hidden)
            at += 2 * item * hidden
            groups[src] = PartialGroup(_tensor(kvrow, rings), _tensor(score, rings), int(gpos))
        else:
            groups[src] = None
    if at + tail_len != len(payload):
        raise ValueError("snapshot length does not match its header")
    if pos.max(initial=-1) >= point:
        raise ValueError("snapshot ring holds positions at or beyond its point")
    return EncoderSnapshot(
        point=int(point),
        rings_data=torch.from_numpy(data.copy()).view(n_layers, window, slot),
        rings_pos=torch.from_numpy(pos.copy()).view(n_layers, window),
        partial=groups,
        enc_start=int(enc_start),
        write_from=int(write_from),
        tail_image=payload[at:],
    )


def _tensor(arr: np.ndarray, rings: WindowRings) -> torch.Tensor:
    return torch.from_numpy(arr.copy()).to(device=rings.data.device, dtype=rings.dtype)
