"""The parallel executor's driver-side pieces, without processes: ``StepPacer`` (which step the ranks may run,
with which events) and ``wire_params`` (a compiled grammar across the pipe)."""

from __future__ import annotations

import pickle
import threading

import pytest
import torch
import xgrammar as xgr

from flashtier.engine.grammar.constraint import GrammarState, OutputConstraint
from flashtier.engine.parallel.step_pacer import StepPacer
from flashtier.engine.parallel.wire_params import ParamsDecoder, ParamsEncoder
from flashtier.engine.sample.params import SamplingParams


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_events_go_into_the_next_release_in_order():
    pacer = StepPacer(lookahead=2)
    assert pacer.next_input(timeout=0) is None  # nothing to do: nothing released
    for e in ("add a", "add b", "abort a"):
        pacer.submit(e)
    first = pacer.next_input(timeout=0)
    assert (first.step, first.events, first.stop) == (0, ("add a", "add b", "abort a"), False)
    assert pacer.next_input(timeout=0) is None  # reported idle work: none; no new events
    pacer.done(0, unfinished=True)
    assert pacer.next_input(timeout=0).events == ()  # unfinished work: a step with no events


def test_at_most_lookahead_steps_in_flight_and_reports_in_order():
    pacer = StepPacer(lookahead=2)
    pacer.submit("x")
    assert pacer.next_input(timeout=0).step == 0
    pacer.submit("y")
    assert pacer.next_input(timeout=0).step == 1
    pacer.submit("z")
    assert pacer.next_input(timeout=0) is None and pacer.in_flight == 2  # the lookahead is full
    with pytest.raises(RuntimeError, match="oldest step in flight is 0"):
        pacer.done(1, unfinished=False)
    pacer.done(0, unfinished=False)
    step = pacer.next_input(timeout=0)
    assert (step.step, step.events) == (2, ("z",))


def test_stop_is_released_after_the_pending_events_and_ends_the_releases():
    pacer = StepPacer(lookahead=1)
    pacer.submit("abort a")
    pacer.request_stop()
    step = pacer.next_input(timeout=0)
    assert (step.events, step.stop) == (("abort a",), True)
    pacer.submit("late")
    pacer.done(step.step, unfinished=True)
    assert pacer.next_input(timeout=0) is None


def test_close_wakes_a_blocked_sender():
    pacer = StepPacer()
    got = []
    t = threading.Thread(target=lambda: got.append(pacer.next_input()))
    t.start()
    pacer.close()
    t.join(5)
    assert not t.is_alive() and got == [None]


def test_waited_time_counts_from_when_a_step_became_the_oldest():
    clock = Clock()
    pacer = StepPacer(lookahead=2, clock=clock)
    assert pacer.waited_s() == 0.0
    pacer.submit("a")
    pacer.next_input(timeout=0)
    pacer.submit("b")
    clock.t += 3
    pacer.next_input(timeout=0)
    clock.t += 4
    assert pacer.waited_s() == 7.0
    pacer.done(0, unfinished=False)
    clock.t += 1
    assert pacer.waited_s() == 1.0  # step 1 is waited on from step 0's report, not from its release
    pacer.done(1, unfinished=False)
    assert pacer.waited_s() == 0.0
    with pytest.raises(ValueError, match="lookahead"):
        StepPacer(lookahead=0)


VOCAB = ["a", "b", "c", "-", "0", "1", "2", "x", "</s>"]


def _constraint(regex: str) -> OutputConstraint:
    info = xgr.TokenizerInfo(VOCAB, xgr.VocabType.RAW, vocab_size=len(VOCAB), stop_token_ids=[8])
    return OutputConstraint(xgr.GrammarCompiler(info, max_threads=1).compile_regex(regex), None, "regex")


def _allowed(constraint: OutputConstraint, prefix: list[int]) -> list[int]:
    state = GrammarState(constraint)
    for tok in prefix:
        assert state.accept(tok)
    mask = torch.zeros((1, 1), dtype=torch.int32)
    state.fill(mask, 0)
    return [t for t in range(len(VOCAB)) if (int(mask[0, 0]) >> t) & 1]


def test_a_grammar_crosses_the_pipe_and_allows_the_same_tokens():
    enc, dec = ParamsEncoder(), ParamsDecoder()
    first = SamplingParams(temperature=0.0, max_tokens=8, constraint=_constraint("[ab]{2}-[0-2]"))
    second = SamplingParams(temperature=0.5, seed=3, max_tokens=8, constraint=_constraint("x+"))
    wires = [pickle.loads(pickle.dumps(enc.encode(p))) for p in (first, second, SamplingParams())]
    assert wires[0].constraint.tokenizer_json is not None
    assert wires[1].constraint.tokenizer_json is None  # the vocabulary travels once
    assert wires[2].constraint is None and wires[2].params == SamplingParams()
    got = [dec.decode(w) for w in wires]
    assert got[1] == second and got[1].constraint.label == "regex"
    for original, decoded, prefixes in ((first, got[0], ([], [0], [0, 1], [0, 1, 3])), (second, got[1], ([], [7]))):
        for prefix in prefixes:
            assert _allowed(decoded.constraint, prefix) == _allowed(original.constraint, prefix)
    assert _allowed(got[0].constraint, [0, 1]) == [3]  # the check can fail: it reads the real mask
    with pytest.raises(ValueError, match="never sent"):
        ParamsDecoder().decode(wires[1])  # a decoder that missed the first constraint


@pytest.mark.parametrize("name, bound", [("cuda", None), ("cuda:1", 1), ("cpu", None)])
def test_the_engine_core_binds_only_an_indexed_cuda_device(monkeypatch, name, bound):
    """One rank's ``--device cuda`` has no index: torch.cuda.set_device refuses it (the engine core failed to start
    on every GPU before this), so it binds nothing; ``cuda:N`` binds N. The stand-in validates as torch does."""
    from torch._utils import _get_device_index

    from flashtier.engine.parallel.rank_worker import bind_cuda_device

    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(_get_device_index(d)))
    bind_cuda_device(torch.device(name))
    assert calls == ([] if bound is None else [bound])
