"""Provenance of global-KV blocks: a block holding entries computed from a replayed (approximate) window
state is hashed on the replayed fork (``fork_root``), never under the exact chain, so an exact lookup
never finds it; a later turn of the same conversation follows the fork where the exact chain ends and
resumes over those blocks as a replay. Scheduler + real Postprocessor, no model."""

from flashtier.kvstore.block_hash import fork_chain, hash_blocks

from .scheduler_harness import NAMESPACE, Harness, prompt_of

BS = 4


def _run(h: Harness, rid: str, prompt: list[int]):
    req = h.add(rid, prompt, max_tokens=1)
    while h.scheduler.requests:
        h.step()
    return req


def test_blocks_after_a_bounded_replay_live_on_the_fork_and_later_turns_follow_it():
    h = Harness(budget=64)
    a = _run(h, "a", prompt_of(20))  # cold: 5 exact blocks
    assert a.resume.kind == "cold"
    b = _run(h, "b", prompt_of(32))  # 20 cached tokens > window 16: bounded replay from R = 20
    assert b.resume.kind == "replay" and b.resume.replay_from == 20
    exact = hash_blocks(NAMESPACE, prompt_of(40), BS)
    forked = fork_chain(exact, NAMESPACE, prompt_of(40), BS, 5)
    assert len(h.kvm.match_prefix(exact)) == 5  # the exact chain stops where the replay began
    assert len(h.kvm.match_prefix(forked)) == 8  # b's blocks 5..7 are on the fork
    assert forked[5] != exact[5] and forked[:5] == exact[:5]

    c = _run(h, "c", prompt_of(40))  # the conversation goes on: it follows the fork to 32 tokens
    assert c.fork_block == 5 and c.hbm_tokens == 32
    assert c.resume.kind == "replay" and c.resume.replay_from == 32  # approximate, and said so
    assert len(h.kvm.match_prefix(forked)) == 10  # c's blocks continue the same fork (no second fork)
    assert len(h.kvm.match_prefix(exact)) == 5


def test_an_exact_conversation_never_forks():
    h = Harness(budget=64)
    _run(h, "a", prompt_of(12))  # below the window: the next turn cannot replay from it
    d = _run(h, "d", prompt_of(32))
    assert d.resume.kind == "cold" and d.fork_block is None
    assert len(h.kvm.match_prefix(hash_blocks(NAMESPACE, prompt_of(32), BS))) == 8


def test_exact_or_cold_policy_never_uses_forked_blocks():
    h = Harness(budget=64, allow_replay=False)
    _run(h, "a", prompt_of(20))
    b = _run(h, "b", prompt_of(32))
    assert b.resume.kind == "cold"  # a 20-token hit would need a replay, which this policy refuses
    exact = hash_blocks(NAMESPACE, prompt_of(32), BS)
    assert len(h.kvm.match_prefix(exact)) == 8  # computed cold: exact blocks, registered as such
