"""Encoder snapshots: what a sequence needs, beyond its full blocks, to continue exactly at point P.

    payload = header | encoder rings (FP8 records) | ring positions | partial groups
                     | replay tail x | replay tail pre | tail block image
    header  = magic "FTES", version, P, enc_start, write_from, n_layers, window, slot_bytes,
              n_partial, hidden, tail_bytes, tail_rows, hc, dim, dtype code   (little-endian u32/i64)

- the encoder layers' window rings and their positions;
- each ratio-2 source's partial group (present flag, position, kv row, score row);
- the replay tail: the encoder outputs (x [rows, hc, D], pre [rows, hc]) of positions [P - rows, P),
  rows = min(window, P - enc_start). A new prompt of n < P + window tokens starts its decoder replay at
  max(enc_start, n - window) <= P: those rows are the replay's input below P, so every point P <= n
  resumes exactly (P = n, a retried prompt: the tail is the whole decoder replay's input; without them
  only P <= n - window could, and shorter follow-ups fell back to an approximate encoder bounded replay);
- the image of the partial tail block (the global KV of tokens [floor(P / bs) * bs, P)).

Floating fields are raw bytes of the compute precision (fp32; fp64 in the exactness mode): exact.
Size in the real geometry (v4.1-flash, fp32, block size 64; ``payload_size``): rings 1,351,680 B +
positions 20,480 B + partial groups 12,315 B + replay tail 10,487,808 B (128 x 4 x 5120 x 4 B of x,
2,048 B of pre) + tail block 56,960 B + header 76 B = 11,929,319 B (11.4 MiB; 1,441,511 B without
the replay tail, so 8.3x). The decoder's rings are not part of a snapshot: the decoder always replays.
Values are validated field by field on decode (a mismatch raises ``ValueError``; a payload of an older
version is refused by ``is_stale`` before that, as a miss). Decoding is pure: it returns an
``EncoderSnapshot`` that ``PagedSequence.install_snapshot`` applies.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
import torch

from flashtier.engine.kv.manager import SequenceSpec
from flashtier.engine.model.compressor import PartialGroup
from flashtier.engine.kv.paged_kv import EncoderSnapshot, PagedSequence
from flashtier.engine.kv.window_rings import WindowRings

MAGIC = b"FTES"
VERSION = 2  # 2: the replay tail (version 1 payloads are stale: ``is_stale``)
_HEADER = struct.Struct("<4sIqqqIIIIIqIIII")
_PREFIX = struct.Struct("<4sI")
_GROUP = struct.Struct("<bq")
_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)  # header dtype code = index


def is_stale(payload: bytes) -> bool:
    """A snapshot this codec wrote in an older (or newer) version: a miss, not a corrupt payload."""
    if len(payload) < _PREFIX.size:
        return False
    magic, version = _PREFIX.unpack_from(payload)
    return magic == MAGIC and version != VERSION


def encode_snapshot(kv: PagedSequence, n_encoder_layers: int, tail_image: bytes, partial_order: list[int]) -> bytes:
    """Serialise the encoder state of ``kv`` at P = len(kv.tokens), replay tail included (copies;
    mutates nothing). A sequence without a tail (hand-built states) stores none: such a snapshot only
    serves prompts of n >= P + window. ValueError when the tail's rows, shapes or dtype are inconsistent."""
    rings = kv.rings.data[:n_encoder_layers].cpu().contiguous()
    pos = kv.rings.pos[:n_encoder_layers].cpu().contiguous()
    dtype = kv.rings.dtype
    hidden = 0
    parts = []
    for src in partial_order:
        g = kv.partial.get(src)
        if g is None:
            parts.append(_GROUP.pack(0, -1))
        else:
            hidden = g.kv.numel()
            parts += [_GROUP.pack(1, g.position), _raw(g.kv.detach().to(dtype)), _raw(g.score.detach().to(dtype))]
    if hidden == 0:
        hidden = kv.rings.head_dim
    x, pre = _tail_of(kv)
    rows, hc, dim = (0, 0, 0) if x is None else x.shape
    header = _HEADER.pack(MAGIC, VERSION, len(kv.tokens), kv.enc_start, kv.write_from, rings.shape[0],
                          rings.shape[1], rings.shape[2], len(partial_order), hidden, len(tail_image), rows, hc,
                          dim, _DTYPES.index(dtype))
    tail = [] if x is None else [_raw(x), _raw(pre)]
    return b"".join([header, _raw(rings), _raw(pos), *parts, *tail, tail_image])


def _tail_of(kv: PagedSequence) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    x, pre = kv.tail_x, kv.tail_pre
    if x is None or pre is None or x.shape[0] == 0:
        return None, None
    if x.dim() != 3 or pre.shape != x.shape[:2] or x.shape[0] > kv.window:
        raise ValueError(f"replay tail shapes {tuple(x.shape)} / {tuple(pre.shape)} do not fit window {kv.window}")
    if x.dtype != kv.rings.dtype or pre.dtype != kv.rings.dtype:
        raise ValueError(f"replay tail dtype {x.dtype}/{pre.dtype} is not the compute dtype {kv.rings.dtype}")
    if x.shape[0] > len(kv.tokens) - kv.enc_start:
        raise ValueError("replay tail holds more rows than positions fed since enc_start")
    return x, pre


def _raw(t: torch.Tensor) -> memoryview:
    """A view of the tensor's bytes (any dtype, bf16 included: numpy has none, so go through uint8); the
    payload's ``b"".join`` is then its only copy (the replay tail is ~10 MB in the real geometry)."""
    return memoryview(t.detach().cpu().contiguous().view(torch.uint8).numpy()).cast("B")


def decode_snapshot(
    payload: bytes, rings: WindowRings, spec: SequenceSpec, *, point: int, prompt_len: int, tail_bytes: int
) -> EncoderSnapshot:
    """Decode and validate a snapshot at ``point`` for a prompt of ``prompt_len`` tokens, for a sequence
    whose rings look like ``rings`` and whose geometry is ``spec`` (both read-only). Mutates nothing.

    Raises ValueError when the payload does not fit this model / point, or when its replay tail does not
    reach back to the decoder replay start of this prompt (the caller counts an error and falls back).
    """
    if len(payload) < _HEADER.size:
        raise ValueError("snapshot shorter than its header")
    (magic, version, p, enc_start, write_from, n_layers, window, slot, n_partial, hidden, tail_len, rows, hc,
     dim, code) = _HEADER.unpack_from(payload)  # fmt: skip
    if magic != MAGIC or version != VERSION:
        raise ValueError("not a flashtier encoder snapshot of this version")
    if (p, n_layers, window, slot, n_partial) != (
        point, spec.n_encoder_layers, rings.window, rings.data.shape[2], len(spec.partial_order)
    ):
        raise ValueError("snapshot geometry does not match this model or point")
    if tail_len not in (0, tail_bytes) or not 0 <= enc_start <= p or not 0 <= write_from:
        raise ValueError("snapshot header out of range")
    if code >= len(_DTYPES) or _DTYPES[code] != rings.dtype:
        raise ValueError("snapshot precision is not this engine's compute precision")
    _check_tail(p, enc_start, rows, (hc, dim), spec, prompt_len)
    dtype, at = rings.dtype, _HEADER.size
    data, at = _take(payload, at, torch.uint8, (n_layers, window, slot))
    pos, at = _take(payload, at, torch.int64, (n_layers, window))
    groups: dict[int, PartialGroup | None] = {}
    for src in spec.partial_order:
        present, gpos = _GROUP.unpack_from(payload, at)
        at += _GROUP.size
        groups[src] = None
        if present:
            kvrow, at = _take(payload, at, dtype, (hidden,))
            score, at = _take(payload, at, dtype, (hidden,))
            groups[src] = PartialGroup(kvrow.to(rings.data.device), score.to(rings.data.device), int(gpos))
    tail_x = tail_pre = None
    if rows:
        tail_x, at = _take(payload, at, dtype, (rows, hc, dim))
        tail_pre, at = _take(payload, at, dtype, (rows, hc))
    if at + tail_len != len(payload):
        raise ValueError("snapshot length does not match its header")
    if int(pos.max()) >= p:
        raise ValueError("snapshot ring holds positions at or beyond its point")
    return EncoderSnapshot(point=int(p), rings_data=data, rings_pos=pos, partial=groups, enc_start=int(enc_start),
                           write_from=int(write_from), tail_image=payload[at:], tail_x=tail_x, tail_pre=tail_pre)


def _check_tail(p: int, enc_start: int, rows: int, shape: tuple[int, int], spec: SequenceSpec, n: int) -> None:
    """The replay tail fits the model and covers [max(enc_start, n - window), P), the part of this
    prompt's decoder replay that lies below P."""
    if not p <= n:
        raise ValueError(f"snapshot point {p} is beyond the prompt end {n}")
    if rows > min(spec.window, p - enc_start) or (rows and shape != spec.stream_shape):
        raise ValueError("snapshot replay tail does not fit this model or point")
    if rows < p - max(enc_start, n - spec.window, 0):
        raise ValueError(f"snapshot replay tail ({rows} rows) does not reach this prompt's decoder replay start")


def _take(payload: bytes, at: int, dtype: torch.dtype, shape: tuple[int, ...]) -> tuple[torch.Tensor, int]:
    """A copy of the tensor stored at ``at`` and the offset after it; ValueError past the end."""
    nbytes = int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()
    if at + nbytes > len(payload):
        raise ValueError("snapshot length does not match its header")
    raw = np.frombuffer(payload, dtype=np.uint8, count=nbytes, offset=at).copy()
    return torch.from_numpy(raw).view(dtype).view(shape), at + nbytes


@dataclass(frozen=True)
class PayloadSize:
    """Bytes of a full snapshot payload (every partial group present, a full replay tail) by part."""

    header: int
    rings: int  # FP8 records and their int64 positions
    partial: int
    replay_tail: int  # x and pre of ``window`` rows
    tail_block: int

    @property
    def total(self) -> int:
        return self.header + self.rings + self.partial + self.replay_tail + self.tail_block


def payload_size(spec: SequenceSpec, block_bytes: int) -> PayloadSize:
    """The largest payload ``encode_snapshot`` writes for ``spec`` (pure arithmetic)."""
    item = torch.empty((), dtype=spec.dtype, device="meta").element_size()
    slot = spec.head_dim + spec.head_dim // 32
    hc, dim = spec.stream_shape
    n_partial = len(spec.partial_order)
    return PayloadSize(
        header=_HEADER.size,
        rings=spec.n_encoder_layers * spec.window * (slot + 8),
        partial=n_partial * (_GROUP.size + 2 * spec.head_dim * item),
        replay_tail=spec.window * hc * (dim + 1) * item,
        tail_block=block_bytes,
    )
