"""What the engine hands back to its callers (the server, the offline ``LLM``): small frozen dataclasses.

A ``RequestOutput`` is emitted for a request in every step that produced tokens for it (and once at
the end); its choices carry the *new* tokens since the previous output (deltas), so a streaming
caller forwards them as they come and a non-streaming caller concatenates them.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A sampled token's logprob (raw model distribution) and the top alternatives, best first."""

    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class ChoiceDelta:
    """New tokens of one choice (index < n) since the previous output."""

    index: int
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] | None = None
    finish_reason: str | None = None  # "stop" (EOS / stop token) | "length" | "abort"
    stop_token_id: int | None = None  # the stop token that ended the choice (not in token_ids)


@dataclass(frozen=True, slots=True)
class CacheUsage:
    """Where the prompt's tokens came from (DESIGN §5): cached tokens by tier, the decoder's tokens, the
    encoder tokens of an (approximate) bounded replay, computed tokens, durable bytes."""

    cached_tokens: int = 0  # prompt tokens not computed from scratch (hbm + ssd + snapshot)
    hbm_tokens: int = 0  # full blocks found in the runtime pool
    ssd_tokens: int = 0  # full blocks loaded from the SSD tier
    snapshot_tokens: int = 0  # tokens covered by an exact snapshot resume
    # the decoder's pass over the prompt's last min(window, n) tokens (CED: only those run through the decoder
    # layers): part of every prefill, exact by design; cold, exact and replay alike
    decoder_tokens: int = 0
    # encoder tokens this request re-fed in an encoder bounded replay from R > window (the approximate
    # window state, DESIGN §5): 0 unless the resume kind is "replay"
    approximate_replay_tokens: int = 0
    computed_tokens: int = 0  # prompt tokens run through the encoder
    persisted_bytes: int = 0  # bytes of this request confirmed durable so far (fsynced SSD blocks, Redis snapshots)


@dataclass(frozen=True, slots=True)
class ResumeInfo:
    """How the prompt's window state was made (provenance, DESIGN §5)."""

    kind: str = "cold"  # "exact" (a snapshot or the full history) | "replay" (bounded replay) | "cold"
    replay_from: int | None = None  # "replay": the position R the approximate window state starts from


@dataclass(frozen=True, slots=True)
class RequestTimes:
    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None


@dataclass(frozen=True, slots=True)
class RequestOutput:
    request_id: str
    num_prompt_tokens: int
    choices: tuple[ChoiceDelta, ...]
    finished: bool
    cache: CacheUsage = field(default_factory=CacheUsage)
    times: RequestTimes | None = None
    resume: ResumeInfo = field(default_factory=ResumeInfo)


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A snapshot of the engine's gauges and counters (for /metrics; counters only ever increase)."""

    num_running: int = 0
    num_waiting: int = 0
    num_loading: int = 0
    kv_usage: float = 0.0  # fraction of pool blocks in use
    prefix_queries_tokens: int = 0
    prefix_hits_tokens: int = 0
    preemptions: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    global_kv_bytes_per_token: float = 0.0
    tiers: dict[str, float] = field(default_factory=dict)  # tier counters/gauges, flat (see TierManager)
    # speculative decoding (engine/spec/stats.py): VERIFY works with drafts, drafts verified, drafts accepted,
    # and per accepted count k = 0 .. depth the works that accepted k (empty when speculation is off)
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_acceptance_lengths: tuple[int, ...] = ()
    # per draft position j = 0 .. depth - 1: works that accepted draft j + 1 (drafts 1 .. j + 1 all accepted)
    spec_accepted_by_position: tuple[int, ...] = ()
    # the goodput controller (engine/spec/controller.py): the current draft length (0: plain decoding) and, per
    # draft length k = 0 .. depth, the steps with decode work that ran it
    spec_draft_length: int = 0
    spec_steps_by_draft_length: tuple[int, ...] = ()
