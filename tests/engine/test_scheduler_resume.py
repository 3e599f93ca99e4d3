"""LOADING and resume from the tiers, scheduler alone (no model): lookups settled by hand with SSD images
and snapshots; exact block ids, loaded bytes, positions and states. Block size 4, window 16."""

import torch

from flashtier.engine.core.request_state import RequestStatus
from flashtier.engine.tiers.resume import ResumeKind
from flashtier.engine.tiers.snapshot_codec import encode_snapshot
from flashtier.engine.tiers.manager import SnapshotOutcome, TierLookup

from .scheduler_harness import Harness, prompt_of, settle, warm_tier_harness, work

S = RequestStatus


def _images(h: Harness, n: int, first: int = 100) -> tuple[bytes, ...]:
    return tuple(bytes([first + j]) * h.kvm.layout.block_bytes for j in range(n))


def _snapshot(h: Harness, prompt: list[int], point: int, tail: bytes) -> tuple[bytes, torch.Tensor]:
    """A real payload at ``point``: encoder rings filled with a pattern, no partial group."""
    kv = h.kvm.new_kv()
    kv.tokens = prompt[:point]
    kv.enc_start, kv.write_from = 0, point
    g = torch.Generator().manual_seed(3)
    kv.rings.data.copy_(torch.randint(0, 256, kv.rings.data.shape, generator=g, dtype=torch.uint8))
    kv.rings.pos[:] = torch.arange(point - kv.window, point)  # any positions below the point validate
    return encode_snapshot(kv, h.spec.n_encoder_layers, tail, h.spec.partial_order), kv.rings.data.clone()


def test_loading_never_blocks_the_step_and_a_miss_is_a_cold_prefill():
    h = Harness(budget=32, tiers=True)
    other = h.add("other", prompt_of(8, base=900), max_tokens=1)
    req = h.add("l", prompt_of(26), max_tokens=1)
    s1 = h.step()
    assert req.status is S.LOADING and other.status is S.LOADING and work(s1) == ([], [])
    settle(h, "other")
    s2 = h.step()  # "l" is still loading: the other request runs
    assert req.status is S.LOADING and work(s2) == ([("other", 8)], [("other", "replay")])
    settle(h, "l")
    h.step()
    assert req.status_history == [S.LOADING, S.PREFILL, S.REPLAY] and req.prefilled == 26 and req.cached_tokens == 0
    assert [r.kind for r in h.tiers.resumes] == [ResumeKind.COLD, ResumeKind.COLD]


def test_ssd_blocks_resume_by_bounded_replay():
    h = Harness(budget=8, tiers=True)
    req = h.add("l", prompt_of(26), max_tokens=1)
    h.step()
    images = _images(h, 5)
    settle(h, "l", TierLookup(images, outcome=SnapshotOutcome.NONE))
    s = h.step()
    kv = req.seqs[0].kv
    assert kv.table.ids == [1, 2, 3, 4, 5] and [h.kvm.image(i) for i in kv.table.ids] == list(images)
    assert (req.cached_tokens, req.ssd_tokens, req.hbm_tokens, kv.enc_start, kv.write_from) == (20, 20, 0, 4, 20)
    assert work(s) == ([("l", 8)], []) and req.prefilled == 12 and kv.tokens[:4] == prompt_of(4)
    assert (req.resume.kind, req.resume.replay_from) == ("replay", 20)
    assert [h.kvm.pool.blocks[i].block_hash for i in kv.table.ids] == req.hashes[:5]


def test_hbm_hits_plus_snapshot_resume_exactly_at_the_point():
    h = warm_tier_harness()  # blocks 1..5 cache prompt_of(20)
    prompt = prompt_of(40)
    tail = bytes([77]) * h.kvm.layout.block_bytes
    payload, rings = _snapshot(h, prompt, 22, tail)  # P = 22: 5 full blocks + 2 tokens in a tail block
    req = h.add("s", prompt, max_tokens=1)
    h.step()
    assert req.status is S.LOADING and req.seqs[0].kv.table.ids == [1, 2, 3, 4, 5]  # pinned
    settle(h, "s", TierLookup((), 22, payload, SnapshotOutcome.HIT))
    s = h.step()
    kv = req.seqs[0].kv
    assert kv.table.ids == [1, 2, 3, 4, 5, 7, 8, 9] and h.kvm.image(7) == tail  # 7: the queue front
    assert torch.equal(kv.rings.data[: h.spec.n_encoder_layers], rings[: h.spec.n_encoder_layers])
    assert (req.cached_tokens, req.hbm_tokens, req.snapshot_tokens, req.ssd_tokens) == (22, 20, 2, 0)
    assert kv.tokens[:22] == prompt[:22] and (kv.enc_start, kv.write_from) == (0, 22)
    assert [st.count for st in kv.stores.values()] == [11, 11, 11, 22]  # 22 // ratio (2, 2, 2, 1)
    assert work(s) == ([("s", 8)], []) and req.prefilled == 30
    assert h.tiers.resumes[-1].kind is ResumeKind.EXACT and req.resume.kind == "exact"


def test_a_snapshot_that_does_not_validate_falls_back_and_is_reported():
    h = Harness(budget=8, tiers=True)
    prompt = prompt_of(40)
    payload, _ = _snapshot(h, prompt, 22, bytes(h.kvm.layout.block_bytes))
    req = h.add("s", prompt, max_tokens=1)
    h.step()
    bad = payload[:-1]  # one byte short: the length check fails
    settle(h, "s", TierLookup(_images(h, 5), 22, bad, SnapshotOutcome.HIT))
    h.step()
    res = h.tiers.resumes[-1]
    assert res.snapshot_invalid and res.kind is ResumeKind.REPLAY and res.cached_tokens == 20
    kv = req.seqs[0].kv
    assert kv.table.ids[:5] == [1, 2, 3, 4, 5] and h.kvm.pool.num_used == 5  # the tail block went back
    assert (kv.enc_start, kv.write_from, req.snapshot_tokens) == (4, 20, 0)


def test_a_short_ssd_hit_without_snapshot_is_released_for_a_cold_start():
    h = Harness(budget=8, tiers=True)
    req = h.add("c", prompt_of(26), max_tokens=1)
    h.step()
    settle(h, "c", TierLookup(_images(h, 3), outcome=SnapshotOutcome.MISS))  # 12 tokens < window
    s = h.step()
    assert h.tiers.resumes[-1].kind is ResumeKind.COLD and req.cached_tokens == 0
    assert work(s) == ([("c", 8)], []) and req.seqs[0].kv.table.ids == [4, 5]  # loaded blocks stay cached


def test_a_replayed_snapshot_resumes_as_what_it_is():
    """A payload whose state descends from a bounded replay (enc_start > 0) is reported as a replay from R."""
    h = Harness(budget=8, tiers=True)
    prompt = prompt_of(40)
    kv = h.kvm.new_kv()
    kv.tokens, kv.enc_start, kv.write_from = prompt[:22], 4, 20  # replayed from R = 20
    payload = encode_snapshot(kv, h.spec.n_encoder_layers, bytes(h.kvm.layout.block_bytes), h.spec.partial_order)
    req = h.add("s", prompt, max_tokens=1)
    h.step()
    settle(h, "s", TierLookup(_images(h, 5), 22, payload, SnapshotOutcome.HIT))
    h.step()
    assert req.snapshot_tokens == 2 and (req.resume.kind, req.resume.replay_from) == ("replay", 20)


def test_exact_or_cold_turns_an_ssd_hit_without_snapshot_into_a_cold_start():
    h = Harness(budget=8, tiers=True, allow_replay=False)
    req = h.add("c", prompt_of(26), max_tokens=1)
    h.step()
    settle(h, "c", TierLookup(_images(h, 5), outcome=SnapshotOutcome.NONE))  # 20 tokens, no snapshot
    h.step()
    assert h.tiers.resumes[-1].kind is ResumeKind.COLD and (req.cached_tokens, req.resume.kind) == (0, "cold")
    assert req.seqs[0].kv.table.ids == [6, 7]  # the loaded blocks were released (and stay cached)
