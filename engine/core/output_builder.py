"""A request's state -> the ``RequestOutput`` handed to callers: the new tokens of each choice since
the previous output (deltas), its cache usage and its times."""

from __future__ import annotations

from flashtier.engine.core.outputs import CacheUsage, ChoiceDelta, RequestOutput, RequestTimes
from flashtier.engine.core.request import Request
from flashtier.engine.core.request_state import RequestStatus


def build_output(req: Request) -> RequestOutput:
    """Mutates ``seq.emitted`` of every choice (the next output starts after these tokens)."""
    choices = []
    for seq in req.seqs:
        new = tuple(seq.output[seq.emitted :])
        lps = tuple(seq.logprobs[seq.emitted :]) if req.params.logprobs is not None else None
        seq.emitted = len(seq.output)
        if new or seq.finish_reason is not None:
            reason = None if seq.finish_reason is None else seq.finish_reason.value
            choices.append(ChoiceDelta(seq.index, new, lps, reason, seq.stop_token_id))
    cache = CacheUsage(
        cached_tokens=req.cached_tokens, hbm_tokens=req.hbm_tokens, ssd_tokens=req.ssd_tokens,
        snapshot_tokens=req.snapshot_tokens, decoder_tokens=req.decoder_tokens,
        approximate_replay_tokens=req.approximate_replay_tokens,
        computed_tokens=req.computed_tokens, persisted_bytes=req.persisted.value,
    )
    times = RequestTimes(req.arrival, req.first_scheduled, req.first_token, req.finished_at)
    return RequestOutput(req.request_id, len(req.prompt), tuple(choices), req.status is RequestStatus.FINISHED,
                         cache, times, req.resume)
