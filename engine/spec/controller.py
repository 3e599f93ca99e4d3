"""The goodput controller: how many drafts (0 = none, plain decoding) the decoding sequences verify in each
step, chosen from measured step times and measured acceptance, so that speculation runs only where it pays.

    Engine.step():  k = controller.begin_step(n)        n sequences decode: this step's draft length (clock read)
                    drafter proposes k drafts (k > 0); schedule (drafts capped at k); forward; postprocess;
                    drafter writes its rings
                    controller.end_step(sched)          the step's seconds (clock read) and SpecStats' counters

TRT-LLM turns speculation off over a rolling acceptance window and vLLM sets the draft length by batch size;
this controller measures both sides of the trade instead. For the batch bucket b of n (1, 2-3, 4-7, 8-15, ...)
and each draft length k in 0 .. depth, the goodput (accepted output tokens per sequence and second) is

    G(b, k) = E(k) / T(b, k)
    E(k)     = 1 + p_1 + ... + p_k: tokens a sequence emits per step, p_j the share of VERIFY works verifying
               draft j that accepted drafts 1..j (counts decayed with a half-life of HALF_LIFE works; shared by
               all buckets: acceptance does not depend on the batch); a p_j never measured counts 0
    T(b, k)  = the median of the last WINDOW clean steps' seconds at draft length k in bucket b. Clean: decode
               work only (no prefill chunk, no replay, nothing preempted) and, at k = 0, no VERIFY work

Every step runs its bucket's choice, the measured k of the highest G; another k replaces the choice only when
it is better by MARGIN (a switch costs a transition step). Measuring (``_Bucket.probe``, PROBE_STEPS clean
steps per k; a probe that gets no clean step in PROBE_STEPS x 4 steps is dropped):

    cold start   a bucket's first decode step starts measuring k = 0 then k = 1; the choice meanwhile is 0
    hopeless     a probe of k ends at its first clean step when even full acceptance, (1 + k) / T(b, k), would
                 not beat the choice by MARGIN: at zero acceptance a drafting step costs several plain ones, so
                 every such step saved counts (a cold start then costs 2 drafting steps, not 4)
    exploration  after each probe, the smallest unmeasured k whose optimistic goodput (an unmeasured p_j taken
                 as p_{j-1}, T(b, k) as the largest measured T(b, k') of k' < k) beats the choice by MARGIN is
                 measured next: at zero acceptance only 0 and 1 are ever run, at high acceptance 2, 3, ... follow
    re-probe     each clean step at the choice adds PROBE_BUDGET x its seconds to the bucket's credit; when the
                 credit covers what measuring the least recently measured other k is estimated to lose
                 (PROBE_STEPS + 2 steps at its goodput instead of the choice's, at least PROBE_STEPS steps of the
                 choice), that k is measured again and the credit spent: re-probing costs at most PROBE_BUDGET
                 of the decode time, so the controller can switch back when acceptance or timing changes

A plain (k = 0) step returns no draft inputs (it can then replay a CUDA graph), so the drafter's rings miss
the positions decoded without speculation. The first k > 0 step after a k = 0 step drafts from such rings: it is
not clean and its acceptance is not counted (from the next step on the rings hold the newest positions again).

``adaptive=False`` runs k = depth in every step and measures nothing (the fixed behaviour).

Mutates only itself (it reads ``SpecStats``). Deterministic given its inputs: time comes from the injected
``clock`` (tests drive a fake one); nothing is random. Not thread-safe: the engine thread owns it.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from flashtier.engine.core.scheduler_output import DecoderKind, SchedulerOutput
from flashtier.engine.spec.stats import SpecStats

WINDOW = 5  # step times kept per (bucket, k); the median ignores one or two outliers (a graph capture, a compile)
PROBE_STEPS = 3  # clean steps measured per probe
MARGIN = 0.05  # a k replaces the choice only when its goodput is this much higher
PROBE_BUDGET = 0.02  # re-probing spends at most this share of the decode time
HALF_LIFE = 256.0  # VERIFY works over which the acceptance counts halve


def bucket_of(n: int) -> int:
    """The batch bucket of ``n`` decoding sequences: 1 -> 1, 2-3 -> 2, 4-7 -> 3, 8-15 -> 4, ..."""
    return max(n, 1).bit_length()


def is_clean(sched: SchedulerOutput, draft_length: int) -> bool:
    """Whether a step's seconds measure draft length ``draft_length``: decode work only (one encoder work per
    decoder work, no replay), nothing preempted, and at draft length 0 no VERIFY work (a sequence catching up
    after speculation feeds two tokens eagerly). Reads only."""
    dec = sched.decoder
    if not dec or sched.preempted or len(sched.encoder) != len(dec):
        return False
    if any(w.kind is DecoderKind.REPLAY for w in dec):
        return False
    return draft_length > 0 or all(w.kind is DecoderKind.DECODE for w in dec)


@dataclass
class _Bucket:
    """One batch bucket's measurements and decision."""

    bucket: int  # bucket_of's value
    times: dict[int, deque[float]] = field(default_factory=dict)  # k -> the last WINDOW clean seconds
    measured_at: dict[int, int] = field(default_factory=dict)  # k -> the controller step of its last clean sample
    choice: int = 0  # the k this bucket runs when not probing
    probe: deque[int] = field(default_factory=lambda: deque((0, 1)))  # ks to measure, head first
    probe_clean: int = 0  # clean steps the head has had
    probe_steps: int = 0  # steps the head has run (clean or not)
    credit: float = 0.0  # seconds of re-probing earned


@dataclass
class _OpenStep:
    """The step between ``begin_step`` and ``end_step``."""

    bucket: int
    draft_length: int
    start: float
    cold_rings: bool  # the first k > 0 step after a k = 0 step


class SpecController:
    """Chooses each step's draft length by measured goodput (module docstring: the rule, cold start, probes)."""

    def __init__(self, depth: int, stats: SpecStats, *, adaptive: bool = True,
                 clock: Callable[[], float] = time.perf_counter):
        """``depth``: the largest draft length; ``stats``: the verifier's counters (read, never written);
        ``clock``: seconds, monotonic (tests: a fake clock)."""
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self.depth, self.stats, self.adaptive, self.clock = depth, stats, adaptive, clock
        self.draft_length = 0 if adaptive else depth  # the current step's (or the last step's) decision
        self.steps_by_length = [0] * (depth + 1)  # steps with decode work, by their draft length (monotonic)
        self.buckets: dict[int, _Bucket] = {}
        self._verified = [0.0] * depth  # decayed counts of works verifying draft j + 1
        self._accepted = [0.0] * depth  # ... and accepting drafts 1 .. j + 1
        self._seen = (list(stats.verified_by_position), list(stats.accepted_by_position))
        self._step = 0
        self._prev = self.draft_length  # the draft length of the last step that had decode work
        self._open: _OpenStep | None = None

    # ---- the two calls of a step ---------------------------------------------------------------------------
    def begin_step(self, decoding: int) -> int:
        """Start a step in which ``decoding`` sequences decode; returns its draft length (also
        ``draft_length``). Mutates the decision, the open step (clock read) and, for a new bucket, the buckets."""
        k = self.draft_length
        bucket = bucket_of(decoding)
        if self.adaptive and decoding > 0:
            b = self.buckets.setdefault(bucket, _Bucket(bucket))
            k = b.probe[0] if b.probe else b.choice
        self.draft_length = k
        self._open = _OpenStep(bucket, k, self.clock(), cold_rings=k > 0 and self._prev == 0)
        return k

    def end_step(self, sched: SchedulerOutput) -> None:
        """Close the step ``sched`` ran: its seconds (clock read), the acceptance counters since the last step.
        Mutates the estimates, the bucket's measurements, probes, credit and choice. A step without
        ``begin_step`` is ignored."""
        step, self._open = self._open, None
        if step is None:
            return
        now = self.clock()
        self._step += 1
        self._read_acceptance(count=not step.cold_rings)
        if not sched.decoder or not any(w.kind is not DecoderKind.REPLAY for w in sched.decoder):
            return
        k = step.draft_length
        self.steps_by_length[k] += 1
        self._prev = k
        if not self.adaptive:
            return
        b = self.buckets.get(step.bucket)
        if b is None:
            return
        clean = not step.cold_rings and is_clean(sched, k) and bucket_of(len(sched.decoder)) == step.bucket
        seconds = now - step.start
        if clean:
            b.times.setdefault(k, deque(maxlen=WINDOW)).append(seconds)
            b.measured_at[k] = self._step
        if b.probe and b.probe[0] == k:
            b.probe_steps += 1
            b.probe_clean += clean
            if b.probe_clean >= PROBE_STEPS or b.probe_steps >= 4 * PROBE_STEPS or (clean and self._hopeless(b, k)):
                b.probe.popleft()
                b.probe_clean = b.probe_steps = 0
                self._settle(b)
                if not b.probe:
                    self._explore(b)
            return
        if clean and k == b.choice:
            self._settle(b)
            if b.choice == k:
                b.credit += PROBE_BUDGET * seconds
                self._explore(b)
                if not b.probe:
                    self._reprobe(b)

    def _read_acceptance(self, count: bool) -> None:
        """Fold the counters' growth since the last step into the decayed counts (``count`` False: skip it)."""
        verified, accepted = self.stats.verified_by_position, self.stats.accepted_by_position
        dv = [now - seen for now, seen in zip(verified, self._seen[0])]
        da = [now - seen for now, seen in zip(accepted, self._seen[1])]
        self._seen = (list(verified), list(accepted))
        if not count or not dv or dv[0] <= 0:
            return
        decay = 0.5 ** (dv[0] / HALF_LIFE)
        for j in range(self.depth):
            self._verified[j] = self._verified[j] * decay + dv[j]
            self._accepted[j] = self._accepted[j] * decay + da[j]

    # ---- estimates -----------------------------------------------------------------------------------------
    def acceptance(self, j: int) -> float | None:
        """p_j (1 <= j <= depth): the decayed share of works verifying draft j that accepted drafts 1..j; None
        before any work verified draft j."""
        v = self._verified[j - 1]
        return self._accepted[j - 1] / v if v > 0 else None

    def expected_tokens(self, k: int, optimistic: bool = False) -> float:
        """E(k) = 1 + p_1 + ... + p_k; an unmeasured p_j counts 0, or p_{j-1} (1 for j = 1) when ``optimistic``."""
        total, prev = 1.0, 1.0
        for j in range(1, k + 1):
            p = self.acceptance(j)
            if p is None:
                p = prev if optimistic else 0.0
            p = min(p, prev)  # accepting drafts 1..j implies accepting 1..j-1
            total, prev = total + p, p
        return total

    def step_seconds(self, bucket: int, k: int) -> float | None:
        """T(bucket, k): the median of the kept clean steps' seconds, None before any."""
        b = self.buckets.get(bucket)
        times = b.times.get(k) if b is not None else None
        return statistics.median(times) if times else None

    def goodput(self, bucket: int, k: int) -> float | None:
        """G(bucket, k) = E(k) / T(bucket, k) tokens per sequence and second; None while T is unmeasured."""
        t = self.step_seconds(bucket, k)
        return None if t is None else self.expected_tokens(k) / max(t, 1e-12)

    # ---- decisions -----------------------------------------------------------------------------------------
    def _settle(self, b: _Bucket) -> None:
        """The choice: the measured k of the highest goodput, kept unless another beats it by MARGIN."""
        bid = b.bucket
        rated = {k: self.goodput(bid, k) for k in b.times}
        rated = {k: g for k, g in rated.items() if g is not None}
        if not rated:
            return
        best = max(sorted(rated), key=lambda k: rated[k])  # ties: the smallest k
        current = rated.get(b.choice)
        if current is None or rated[best] > current * (1 + MARGIN):
            b.choice = best

    def _explore(self, b: _Bucket) -> None:
        """Queue the smallest unmeasured k whose optimistic goodput beats the choice's by MARGIN."""
        bid = b.bucket
        floor = self.goodput(bid, b.choice)
        if floor is None:
            return
        for k in range(1, self.depth + 1):
            if k in b.times:
                continue
            below = [self.step_seconds(bid, j) for j in range(k) if j in b.times]
            if not below:
                return
            bound = self.expected_tokens(k, optimistic=True) / max(max(below), 1e-12)
            if bound > floor * (1 + MARGIN):
                b.probe.append(k)
            return

    def _hopeless(self, b: _Bucket, k: int) -> bool:
        """Whether draft length ``k`` (not the choice) cannot beat the choice by MARGIN even if every draft were
        accepted: (1 + k) / T(b, k) against G(b, choice). Such a probe ends at its first clean step (at zero
        acceptance a drafting step costs several plain ones: measured ~8x on an H100 at random weights)."""
        if k == 0 or k == b.choice:
            return False
        g, t = self.goodput(b.bucket, b.choice), self.step_seconds(b.bucket, k)
        return g is not None and t is not None and (1 + k) / max(t, 1e-12) * (1 + MARGIN) < g

    def _reprobe(self, b: _Bucket) -> None:
        """Measure the least recently measured other k again once the credit covers its estimated loss."""
        others = [k for k in b.times if k != b.choice]
        if not others:
            return
        bid = b.bucket
        k = min(others, key=lambda j: (b.measured_at.get(j, -1), j))
        t_choice = self.step_seconds(bid, b.choice)
        g_choice = self.goodput(bid, b.choice)
        t_k = self.step_seconds(bid, k)
        if t_choice is None or g_choice is None or t_k is None:
            return
        # + the cold-rings step and the transition step back; a hopeless k ends at its first clean step
        steps = (1 if self._hopeless(b, k) else PROBE_STEPS) + 2
        lost = steps * (t_k - self.expected_tokens(k) / g_choice)
        cost = max(lost, PROBE_STEPS * t_choice)
        if math.isfinite(cost) and b.credit >= cost:
            b.credit -= cost
            b.probe.append(k)
