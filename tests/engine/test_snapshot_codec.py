"""Encoder snapshot payloads: encode -> decode gives back exactly what was stored (rings bit for bit,
partial groups, truncations, tail image); every malformed payload is a ValueError, never a wrong state."""

import struct

import pytest
import torch

from flashtier.engine.model.compressor import PartialGroup
from flashtier.engine.snapshot_codec import decode_snapshot, encode_snapshot

from .scheduler_harness import Harness, prompt_of

POINT = 22


def _state():
    h = Harness()
    kv = h.kvm.new_kv()
    kv.tokens = prompt_of(POINT)
    kv.enc_start, kv.write_from = 3, 20
    g = torch.Generator().manual_seed(5)
    kv.rings.data.copy_(torch.randint(0, 256, kv.rings.data.shape, generator=g, dtype=torch.uint8))
    kv.rings.pos[:] = torch.arange(POINT - kv.window, POINT)
    src = h.spec.partial_order[1]
    kv.partial[src] = PartialGroup(torch.randn(64, generator=g), torch.randn(64, generator=g), POINT - 1)
    tail = bytes(range(256)) * (h.kvm.layout.block_bytes // 256) + bytes(h.kvm.layout.block_bytes % 256)
    return h, kv, src, encode_snapshot(kv, h.spec.n_encoder_layers, tail, h.spec.partial_order), tail


def _decode(h, kv, payload, point=POINT):
    return decode_snapshot(payload, kv.rings, h.spec.n_encoder_layers, h.spec.partial_order, point,
                           h.kvm.layout.block_bytes)


def test_round_trip_is_exact():
    h, kv, src, payload, tail = _state()
    snap = _decode(h, kv, payload)
    n = h.spec.n_encoder_layers
    assert torch.equal(snap.rings_data, kv.rings.data[:n]) and torch.equal(snap.rings_pos, kv.rings.pos[:n])
    assert (snap.point, snap.enc_start, snap.write_from, snap.tail_image) == (POINT, 3, 20, tail)
    got, want = snap.partial[src], kv.partial[src]
    assert torch.equal(got.kv, want.kv) and torch.equal(got.score, want.score) and got.position == POINT - 1
    assert [s for s, g in snap.partial.items() if g is None] == [s for s in h.spec.partial_order if s != src]
    fresh = h.kvm.new_kv()
    fresh.install_snapshot(snap, prompt_of(40))
    assert fresh.tokens == prompt_of(POINT) and torch.equal(fresh.rings.data[:n], kv.rings.data[:n])


def _bad_header(payload, field, value):
    fields = list(struct.unpack_from("<4sIqqqIIIIIq", payload))
    fields[field] = value
    return struct.pack("<4sIqqqIIIIIq", *fields) + payload[struct.calcsize("<4sIqqqIIIIIq"):]


@pytest.mark.parametrize("mutate, message", [
    (lambda p: p[:10], "shorter than its header"),
    (lambda p: b"XXXX" + p[4:], "not a flashtier encoder snapshot"),
    (lambda p: _bad_header(p, 2, POINT + 1), "geometry does not match"),
    (lambda p: _bad_header(p, 3, POINT + 5), "header out of range"),
    (lambda p: p[:-1], "length does not match"),
    (lambda p: p + b"\0", "length does not match"),
], ids=["short", "magic", "point", "enc_start", "truncated", "trailing"])
def test_malformed_payloads_are_value_errors(mutate, message):
    h, kv, _, payload, _ = _state()
    with pytest.raises(ValueError, match=message):
        _decode(h, kv, mutate(payload))


def test_ring_positions_at_or_past_the_point_are_refused():
    h, kv, _, payload, _ = _state()
    with pytest.raises(ValueError, match="beyond its point"):
        _decode(h, kv, _bad_header(payload, 2, POINT - 1), point=POINT - 1)
