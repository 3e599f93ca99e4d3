"""The scheduler alone: a small pool (block size 4, tiny geometry: window 16), no model.

Exact block ids, token budgets per step, preemption victims and state sequences. ``TokenRunner``
feeds the scheduled tokens and makes every sampled token 7; the real Postprocessor and Sampler run.
Pool invariants and "every referenced block is in a live table" are checked after every step.
"""

import pytest

from flashtier.engine.core.request_state import InvalidTransition, RequestStatus, transition

from .scheduler_harness import NEXT_TOKEN, Harness, prompt_of, warm_tier_harness, work

S = RequestStatus


def test_chunked_prefill_then_replay_then_decode():
    h = Harness(budget=8)
    a = h.add("a", prompt_of(20), max_tokens=3)
    s1 = h.step()
    table = a.seqs[0].kv.table
    assert work(s1) == ([("a", 8)], []) and s1.num_tokens == 8 and table.ids == [1, 2]
    s2 = h.step()
    assert work(s2) == ([("a", 8)], []) and s2.num_tokens == 8 and table.ids == [1, 2, 3, 4]
    s3 = h.step()  # the last 4 prompt tokens; the 16-token replay does not fit the 4 left: next step
    assert work(s3) == ([("a", 4)], []) and s3.num_tokens == 4 and table.ids == [1, 2, 3, 4, 5]
    assert a.status is S.REPLAY
    s4 = h.step()  # a replay longer than the budget runs alone
    assert work(s4) == ([], [("a", "replay")]) and s4.num_tokens == 16
    assert h.runner.replay_starts == [4] and a.seqs[0].output == [NEXT_TOKEN]
    s5 = h.step()
    assert work(s5) == ([("a", 1)], [("a", "decode")]) and s5.num_tokens == 1 and table.ids == [1, 2, 3, 4, 5, 6]
    h.step()
    assert a.seqs[0].output == [NEXT_TOKEN] * 3 and a.seqs[0].finish_reason.value == "length"
    assert a.status_history == [S.PREFILL, S.REPLAY, S.DECODE, S.FINISHED] and a.resume.kind == "cold"
    assert h.kvm.pool.num_used == 0 and h.kvm.pool.num_cached == 5  # 22 tokens fed: 5 full blocks
    assert not h.scheduler.requests


def test_prefix_hit_replays_the_window_and_allocates_only_the_suffix():
    h = Harness(budget=8)
    h.add("a", prompt_of(20), max_tokens=3)
    while h.scheduler.requests:
        h.step()
    b = h.add("b", prompt_of(26), max_tokens=1)
    s1 = h.step()
    kv = b.seqs[0].kv
    # 5 cached blocks (20 tokens >= window 16): re-encode [4, 20) with the window truncated at 4
    assert (b.cached_tokens, b.hbm_tokens, b.prefilled, kv.enc_start, kv.write_from) == (20, 20, 12, 4, 20)
    assert (b.resume.kind, b.resume.replay_from, kv.replayed_from) == ("replay", 20, 20)
    assert work(s1) == ([("b", 8)], []) and kv.table.ids == [1, 2, 3, 4, 5]
    s2 = h.step()
    assert work(s2) == ([("b", 8)], []) and kv.table.ids == [1, 2, 3, 4, 5]
    s3 = h.step()  # the 6 new tokens need 2 blocks: the queue front (7, 8: never used yet)
    assert work(s3) == ([("b", 6)], []) and kv.table.ids == [1, 2, 3, 4, 5, 7, 8]
    s4 = h.step()
    assert work(s4) == ([], [("b", "replay")]) and s4.num_tokens == 16 and h.runner.replay_starts[-1] == 10
    assert b.computed_tokens == 26 - 4 and (b.decoder_tokens, b.approximate_replay_tokens) == (16, 16)
    assert h.scheduler.stats.prefix_hits_tokens == 20 and h.scheduler.stats.prefix_queries_tokens == 46


def test_decode_shortage_preempts_the_newest_and_resumes_it_exactly():
    h = Harness(budget=32, num_blocks=8)  # 7 usable blocks
    a = h.add("a", prompt_of(12), max_tokens=8)
    b = h.add("b", prompt_of(12, base=500), max_tokens=8)
    s1 = h.step()
    assert work(s1) == ([("a", 12), ("b", 8)], [("a", "replay")]) and s1.num_tokens == 32
    s2 = h.step()
    assert work(s2) == ([("a", 1), ("b", 4)], [("a", "decode"), ("b", "replay")]) and s2.num_tokens == 17
    assert a.seqs[0].kv.table.ids == [1, 2, 3, 6] and b.seqs[0].kv.table.ids == [4, 5, 7]
    before = a.seqs[0].kv.private_state()
    s3 = h.step()  # b needs a 4th block, none is free: the newest other request (a) is swapped out
    assert s3.preempted == ["a"] and work(s3) == ([("b", 1)], [("b", "decode")]) and s3.num_tokens == 1
    assert a.status is S.PREEMPTED and a.resume_status is S.DECODE and a.seqs[0].kv.table.ids == []
    images = a.seqs[0].swapped.images
    assert len(images) == 4 and b.seqs[0].kv.table.ids == [4, 5, 7, 6]  # a's unhashed tail went first
    assert list(h.scheduler.waiting) == [a]
    while a.status is S.PREEMPTED:
        h.step()
    kv = a.seqs[0].kv
    assert [h.kvm.image(i) for i in kv.table.ids] == list(images)
    assert kv.tokens == list(before.tokens) and kv.enc_start == before.enc_start
    while h.scheduler.requests:
        h.step()
    assert a.status_history == [S.PREFILL, S.REPLAY, S.DECODE, S.PREEMPTED, S.DECODE, S.FINISHED]
    assert b.status_history == [S.PREFILL, S.REPLAY, S.DECODE, S.FINISHED]
    assert a.seqs[0].output == b.seqs[0].output == [NEXT_TOKEN] * 8
    assert h.scheduler.stats.preemptions == 1 and h.kvm.pool.num_used == 0


def test_n_choices_fork_after_the_replay_and_share_full_blocks():
    h = Harness(budget=32)
    r = h.add("n", prompt_of(10), max_tokens=2, n=3)
    h.step()  # prefill 10 + replay 10 -> first token of each choice
    tables = [s.kv.table.ids for s in r.seqs]
    assert tables == [[1, 2, 3], [1, 2, 4], [1, 2, 5]]  # full blocks shared, the partial tail copied
    assert [h.kvm.pool.blocks[i].ref_cnt for i in (1, 2, 3, 4, 5)] == [3, 3, 1, 1, 1]
    while h.scheduler.requests:
        h.step()
    assert [s.output for s in r.seqs] == [[NEXT_TOKEN] * 2] * 3 and h.kvm.pool.num_used == 0


def _to_state(state):
    """A harness with request "x" in ``state`` (plus whatever else that needs)."""
    if state is S.LOADING:  # pinning the 5 HBM hits a finished request left behind
        h = warm_tier_harness()
        req = h.add("x", prompt_of(26), max_tokens=2)
        h.step()
        assert req.seqs[0].kv.table.ids == [1, 2, 3, 4, 5] and h.kvm.pool.num_used == 5
        return h, req
    h = Harness(budget=8, num_blocks=8, max_seqs=1)
    if state is S.WAITING:
        h.add("first", prompt_of(4), max_tokens=50)
        req = h.add("x", prompt_of(8), max_tokens=50)
        h.step()
        return h, req
    if state is S.PREEMPTED:
        h = Harness(budget=32, num_blocks=8)
        req = h.add("x", prompt_of(12), max_tokens=8)
        h.add("y", prompt_of(12, base=500), max_tokens=8)
        for _ in range(3):
            h.step()
        return h, req
    req = h.add("x", prompt_of(20), max_tokens=50)
    while req.status is not state:
        h.step()
    return h, req


@pytest.mark.parametrize("state", [S.WAITING, S.LOADING, S.PREFILL, S.REPLAY, S.DECODE, S.PREEMPTED],
                         ids=lambda s: s.value)
def test_abort_in_every_state_frees_everything(state):
    h, req = _to_state(state)
    assert req.status is state
    assert h.scheduler.abort("x") is req and h.scheduler.abort("x") is None
    assert req.status is S.FINISHED and all(s.finish_reason.value == "abort" for s in req.seqs)
    # a lookup in flight is handed back to the tiers (which release what it read), never left to the collector
    assert req.lookup is None and (h.tiers.dropped if h.tiers else []) == (["x"] if state is S.LOADING else [])
    h.check()
    for rid in list(h.scheduler.requests):
        h.scheduler.abort(rid)
    assert h.kvm.pool.num_used == 0 and not h.scheduler.waiting and not h.scheduler.running
    h.check()


def test_transitions_outside_the_table_raise():
    h = Harness()
    req = h.add("t", prompt_of(4))
    with pytest.raises(InvalidTransition, match="waiting -> decode"):
        transition(req, S.DECODE)
    transition(req, S.PREFILL)
    transition(req, S.PREEMPTED)
    with pytest.raises(InvalidTransition, match="preempted in prefill, cannot resume in decode"):
        transition(req, S.DECODE)
    assert req.status is S.PREEMPTED and req.status_history == [S.PREFILL, S.PREEMPTED]


def test_exact_or_cold_recomputes_a_prefix_hit_instead_of_replaying():
    h = Harness(budget=8, allow_replay=False)
    h.add("a", prompt_of(20), max_tokens=3)
    while h.scheduler.requests:
        h.step()
    b = h.add("b", prompt_of(26), max_tokens=1)
    s1 = h.step()
    assert (b.cached_tokens, b.prefilled, b.resume.kind) == (0, 8, "cold") and work(s1) == ([("b", 8)], [])
    assert b.seqs[0].kv.table.ids == [7, 8]  # the cached blocks 1..5 were not pinned
