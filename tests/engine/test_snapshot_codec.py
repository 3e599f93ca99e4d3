"""Encoder snapshot payloads: encode -> decode gives back exactly what was stored (rings bit for bit,
partial groups, truncations, replay tail, tail image); every malformed payload is a ValueError, never a
wrong state; a replay tail too short for the prompt is refused; an older version is stale (a miss)."""

import struct

import pytest
import torch

from flashtier.engine.kv.manager import SequenceSpec
from flashtier.engine.model.compressor import PartialGroup
from flashtier.engine.model.config import preset
from flashtier.engine.tiers.snapshot_codec import VERSION, decode_snapshot, encode_snapshot, is_stale, payload_size
from flashtier.kvstore.layout import BlockLayout

from .scheduler_harness import Harness, prompt_of

POINT = 22
HEADER = "<4sIqqqIIIIIqIIII"


def _state(enc_start: int = 3, rows: int | None = None):
    h = Harness()
    kv = h.kvm.new_kv()
    kv.tokens = prompt_of(POINT)
    kv.enc_start, kv.write_from = enc_start, 20
    g = torch.Generator().manual_seed(5)
    kv.rings.data.copy_(torch.randint(0, 256, kv.rings.data.shape, generator=g, dtype=torch.uint8))
    kv.rings.pos[:] = torch.arange(POINT - kv.window, POINT)
    src = h.spec.partial_order[1]
    kv.partial[src] = PartialGroup(torch.randn(64, generator=g), torch.randn(64, generator=g), POINT - 1)
    rows = min(kv.window, POINT - enc_start) if rows is None else rows
    hc, dim = h.spec.stream_shape
    kv.tail_x, kv.tail_pre = torch.randn(rows, hc, dim, generator=g), torch.rand(rows, hc, generator=g)
    tail = bytes(range(256)) * (h.kvm.layout.block_bytes // 256) + bytes(h.kvm.layout.block_bytes % 256)
    return h, kv, src, encode_snapshot(kv, h.spec.n_encoder_layers, tail, h.spec.partial_order), tail


def _decode(h, kv, payload, point=POINT, prompt_len=POINT + 1):
    return decode_snapshot(payload, kv.rings, h.spec, point=point, prompt_len=prompt_len,
                           tail_bytes=h.kvm.layout.block_bytes)


def test_round_trip_is_exact():
    h, kv, src, payload, tail = _state()
    snap = _decode(h, kv, payload)
    n = h.spec.n_encoder_layers
    assert torch.equal(snap.rings_data, kv.rings.data[:n]) and torch.equal(snap.rings_pos, kv.rings.pos[:n])
    assert (snap.point, snap.enc_start, snap.write_from, snap.tail_image) == (POINT, 3, 20, tail)
    got, want = snap.partial[src], kv.partial[src]
    assert torch.equal(got.kv, want.kv) and torch.equal(got.score, want.score) and got.position == POINT - 1
    assert [s for s, g in snap.partial.items() if g is None] == [s for s in h.spec.partial_order if s != src]
    assert torch.equal(snap.tail_x, kv.tail_x) and torch.equal(snap.tail_pre, kv.tail_pre)  # bit for bit
    fresh = h.kvm.new_kv()
    fresh.install_snapshot(snap, prompt_of(40))
    assert fresh.tokens == prompt_of(POINT) and torch.equal(fresh.rings.data[:n], kv.rings.data[:n])
    assert torch.equal(fresh.tail_x, kv.tail_x) and torch.equal(fresh.tail_pre, kv.tail_pre)


def test_the_encoded_size_is_payload_size():
    h, kv, _, payload, _ = _state(enc_start=0)  # one partial group of three absent: 2 rows of 64 fp32 each
    full = payload_size(h.spec, h.kvm.layout.block_bytes)
    assert len(payload) == full.total - 2 * 2 * h.spec.head_dim * 4
    assert full.replay_tail == 16 * 4 * (64 + 1) * 4  # window x hc x (D of x + 1 of pre) x fp32


def test_real_geometry_size():
    """V4.1-Flash in fp32, 64-token blocks: the replay tail is 8.3x the rest of the snapshot."""
    spec = SequenceSpec.from_config(preset("v4.1-flash"), torch.float32, "meta")
    size = payload_size(spec, BlockLayout(spec.geometry, 64).block_bytes)
    assert (size.rings, size.partial, size.tail_block) == (20 * 128 * (528 + 8), 3 * (9 + 2 * 512 * 4), 56_960)
    assert size.replay_tail == 128 * 4 * 5120 * 4 + 128 * 4 * 4 == 10_487_808
    assert size.total == 11_929_319 and size.total - size.replay_tail == 1_441_511


@pytest.mark.parametrize("prompt_len, error", [
    (POINT + 1, "does not reach"), (POINT + 5, "does not reach"), (POINT + 6, None), (40, None),
    (POINT, "does not reach"),  # P = n (a retry): the tail must hold the whole decoder replay's input
    (POINT - 1, "beyond the prompt end"),
])
def test_the_tail_must_reach_the_decoder_replay_start(prompt_len, error):
    """Rows [P - 10, P) cover a decoder replay from n - 16 >= P - 10: prompts of n >= P + 6 (window 16)."""
    h, kv, _, payload, _ = _state(enc_start=0, rows=10)
    if error is None:
        assert _decode(h, kv, payload, prompt_len=prompt_len).tail_x.shape[0] == 10
    else:
        with pytest.raises(ValueError, match=error):
            _decode(h, kv, payload, prompt_len=prompt_len)


def test_a_full_tail_serves_the_same_prompt_again():
    """P = n (a retried prompt): a snapshot whose tail holds the whole window decodes for n = P."""
    h, kv, _, payload, _ = _state(enc_start=0)
    assert _decode(h, kv, payload, prompt_len=POINT).tail_x.shape[0] == kv.window


def test_a_tail_less_snapshot_serves_only_prompts_a_window_away():
    h, kv, _, _, tail = _state(enc_start=0)
    kv.tail_x = kv.tail_pre = None
    payload = encode_snapshot(kv, h.spec.n_encoder_layers, tail, h.spec.partial_order)
    assert _decode(h, kv, payload, prompt_len=POINT + 16).tail_x is None
    with pytest.raises(ValueError, match="does not reach"):
        _decode(h, kv, payload, prompt_len=POINT + 15)


def test_inconsistent_tails_are_not_encoded():
    h, kv, _, _, tail = _state(enc_start=0)
    kv.tail_x = kv.tail_x.double()
    with pytest.raises(ValueError, match="compute dtype"):
        encode_snapshot(kv, h.spec.n_encoder_layers, tail, h.spec.partial_order)
    h, kv, _, _, tail = _state(enc_start=0)
    kv.enc_start = POINT - 4  # 16 rows but only 4 positions fed since the replay start
    with pytest.raises(ValueError, match="more rows"):
        encode_snapshot(kv, h.spec.n_encoder_layers, tail, h.spec.partial_order)


def _bad_header(payload, field, value):
    fields = list(struct.unpack_from(HEADER, payload))
    fields[field] = value
    return struct.pack(HEADER, *fields) + payload[struct.calcsize(HEADER):]


@pytest.mark.parametrize("mutate, message", [
    (lambda p: p[:10], "shorter than its header"),
    (lambda p: b"XXXX" + p[4:], "not a flashtier encoder snapshot"),
    (lambda p: _bad_header(p, 1, 1), "not a flashtier encoder snapshot"),
    (lambda p: _bad_header(p, 2, POINT + 1), "geometry does not match"),
    (lambda p: _bad_header(p, 3, POINT + 5), "header out of range"),
    (lambda p: _bad_header(p, 11, 17), "does not fit"),  # more rows than the window
    (lambda p: _bad_header(p, 13, 65), "does not fit"),  # another hidden size
    (lambda p: _bad_header(p, 14, 1), "compute precision"),  # fp64 rows for an fp32 engine
    (lambda p: p[:-1], "length does not match"),
    (lambda p: p + b"\0", "length does not match"),
], ids=["short", "magic", "version", "point", "enc_start", "rows", "dim", "dtype", "truncated", "trailing"])
def test_malformed_payloads_are_value_errors(mutate, message):
    h, kv, _, payload, _ = _state()
    with pytest.raises(ValueError, match=message):
        _decode(h, kv, mutate(payload))


def test_ring_positions_at_or_past_the_point_are_refused():
    h, kv, _, payload, _ = _state()
    with pytest.raises(ValueError, match="beyond its point"):
        _decode(h, kv, _bad_header(payload, 2, POINT - 1), point=POINT - 1)


def test_older_versions_are_stale_and_garbage_is_not():
    _, _, _, payload, _ = _state()
    assert not is_stale(payload) and VERSION == 2
    assert is_stale(_bad_header(payload, 1, 1))
    assert not is_stale(b"XXXX" + payload[4:]) and not is_stale(b"FT")  # corrupt, not stale: decode says so
