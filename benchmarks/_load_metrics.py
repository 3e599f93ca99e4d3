"""The figures of benchmarks/serve_load.py, from per-request client timings: its pure parts.

One ``RequestRecord`` per request, every time in seconds on the client's monotonic clock, relative to the start
of its rate's run (t = 0, the first arrival)::

    arrival    sent           first token chunk              last chunk   end
       |--wait--|------ TTFT ------|--ITL--|--ITL--| ... |--ITL--|------|
                |------------------------- E2E latency ------------------|

- TTFT = first token chunk - sent; E2E = end - sent (the stream closed after its usage chunk). ``wait`` is the
  time the request's arrival waited for its conversation's previous turn (not part of any latency).
- ITL = the gaps between consecutive token chunks of a request (a chunk that carries several tokens, as under
  speculative decoding, is one gap), pooled over all requests, as vLLM's benchmark_serving and SGLang's
  bench_serving pool them. TPOT = (E2E - TTFT) / (output tokens - 1) per request (0 for one token), as theirs.
- request throughput = completed / duration, output tok/s = output tokens / duration, goodput = requests that
  met every SLO given / duration; duration = the last request's end (the run starts at the first arrival).
  A request meets ``--slo-ttft-ms`` with its TTFT, ``--slo-tpot-ms`` with its TPOT, ``--slo-e2el-ms`` with its
  E2E latency (vLLM's three) and ``--slo-itl-ms`` with its LONGEST gap (the worst stall its user saw).
- percentiles: linear between order statistics (numpy's default), from _stream_itl.quantile.

``summarize`` turns one rate's records into its row; ``check_result`` lists every broken invariant of a whole
result (counts add up, percentiles ordered, TTFT <= E2E, goodput <= throughput, cached tokens on later turns).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from _stream_itl import quantile

PERCENTILES = (0.5, 0.9, 0.99)
STATS = ("ttft_ms", "itl_ms", "tpot_ms", "e2el_ms", "wait_ms")


@dataclass(slots=True)
class RequestRecord:
    """One request's client-side timeline and what the server reported (module docstring for the times)."""

    session: int
    turn: int
    arrival_s: float  # Poisson arrival
    sent_s: float = math.nan  # the create() call started (>= arrival: the previous turn may still run)
    end_s: float = math.nan  # the stream closed, or the request failed
    chunk_s: list[float] = field(default_factory=list)  # arrival of each chunk that carried tokens
    output_tokens: int = 0  # usage.completion_tokens, else the tokens counted in the chunks
    prompt_tokens: int | None = None  # usage.prompt_tokens
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens (None: not reported)
    finish_reason: str | None = None
    error: str | None = None  # its kind (http_429, timeout, connection, no_tokens, ...); None: completed
    error_detail: str | None = None

    @property
    def ttft_s(self) -> float:
        return self.chunk_s[0] - self.sent_s

    @property
    def e2el_s(self) -> float:
        return self.end_s - self.sent_s

    @property
    def itl_s(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_s, self.chunk_s[1:])]

    @property
    def tpot_s(self) -> float:
        return (self.e2el_s - self.ttft_s) / (self.output_tokens - 1) if self.output_tokens > 1 else 0.0


@dataclass(frozen=True, slots=True)
class Slo:
    """Service-level objectives in milliseconds; None: not part of goodput. All None: goodput is not computed."""

    ttft_ms: float | None = None
    itl_ms: float | None = None  # the request's longest gap
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    @property
    def any(self) -> bool:
        return any(v is not None for v in (self.ttft_ms, self.itl_ms, self.tpot_ms, self.e2el_ms))

    def met(self, r: RequestRecord) -> bool:
        """Whether a completed request met every SLO given."""
        def within(limit: float | None, seconds: float) -> bool:
            return limit is None or seconds * 1e3 <= limit

        return (within(self.ttft_ms, r.ttft_s) and within(self.itl_ms, max(r.itl_s, default=0.0))
                and within(self.tpot_ms, r.tpot_s) and within(self.e2el_ms, r.e2el_s))


def stats_ms(xs: Sequence[float]) -> dict:
    """count, mean and P50/P90/P99 of seconds ``xs`` in milliseconds (None when empty)."""
    def ms(x: float | None) -> float | None:
        return None if x is None else round(x * 1e3, 3)

    out = {"n": len(xs), "mean": ms(sum(xs) / len(xs) if xs else None)}
    out.update({f"p{round(q * 100)}": ms(quantile(xs, q)) for q in PERCENTILES})
    return out


def summarize(records: Sequence[RequestRecord], slo: Slo, max_tokens: int) -> dict:
    """One rate's row: counts, errors by kind, latency stats, throughputs, goodput, cache hit share, per-turn
    breakdown and the per-request records. ``max_tokens``: what each request asked for (a completed request
    with fewer tokens is counted in ``short_outputs``). Mutates nothing."""
    done = [r for r in records if r.error is None]
    failed = [r for r in records if r.error is not None]
    duration = max((r.end_s for r in records), default=0.0)
    per_s = (lambda n: round(n / duration, 4)) if duration > 0 else (lambda n: None)
    out_tokens = sum(r.output_tokens for r in done)
    good = sum(slo.met(r) for r in done) if slo.any else None
    reported = [r for r in done if r.cached_tokens is not None and r.prompt_tokens]
    row = {
        "requests": len(records), "completed": len(done), "failed": len(failed),
        "errors": dict(sorted(Counter(r.error for r in failed).items())),
        "error_examples": sorted({f"{r.error}: {r.error_detail}" for r in failed})[:5],
        "duration_s": round(duration, 4),
        "request_throughput": per_s(len(done)), "output_throughput": per_s(out_tokens),
        "good": good, "goodput": None if good is None else per_s(good),
        "output_tokens": out_tokens, "short_outputs": sum(r.output_tokens < max_tokens for r in done),
        "prompt_tokens": sum(r.prompt_tokens or 0 for r in done),
        "cached_tokens": sum(r.cached_tokens for r in reported) if reported else None,
        "cached_share": _share(reported),
        "mean_in_flight": per_s(sum(r.e2el_s for r in done)),  # Little's law: E2E seconds per wall second
        "ttft_ms": stats_ms([r.ttft_s for r in done]),
        "itl_ms": stats_ms([g for r in done for g in r.itl_s]),
        "tpot_ms": stats_ms([r.tpot_s for r in done if r.output_tokens > 1]),
        "e2el_ms": stats_ms([r.e2el_s for r in done]),
        "wait_ms": stats_ms([r.sent_s - r.arrival_s for r in records]),
        "finish_reasons": dict(sorted(Counter(str(r.finish_reason) for r in done).items())),
    }
    row["turns"] = [_turn_row(t, [r for r in records if r.turn == t])
                    for t in sorted({r.turn for r in records})]
    row["per_request"] = [_request_row(r) for r in records]
    return row


def _share(rs: Sequence[RequestRecord]) -> float | None:
    prompt = sum(r.prompt_tokens or 0 for r in rs)
    return round(sum(r.cached_tokens or 0 for r in rs) / prompt, 4) if prompt else None


def _turn_row(turn: int, rs: list[RequestRecord]) -> dict:
    done = [r for r in rs if r.error is None]
    reported = [r for r in done if r.cached_tokens is not None and r.prompt_tokens]
    return {"turn": turn, "requests": len(rs), "completed": len(done),
            "prompt_tokens_mean": round(sum(r.prompt_tokens or 0 for r in done) / len(done), 1) if done else None,
            "cached_tokens": sum(r.cached_tokens for r in reported) if reported else None,
            "cached_share": _share(reported), "ttft_ms_p50": stats_ms([r.ttft_s for r in done])["p50"]}


def _request_row(r: RequestRecord) -> dict:
    ok = r.error is None
    return {"session": r.session, "turn": r.turn, "arrival_s": round(r.arrival_s, 4), "sent_s": round(r.sent_s, 4),
            "ttft_ms": round(r.ttft_s * 1e3, 3) if ok else None, "e2el_ms": round(r.e2el_s * 1e3, 3),
            "max_itl_ms": round(max(r.itl_s, default=0.0) * 1e3, 3) if ok else None,
            "output_tokens": r.output_tokens, "prompt_tokens": r.prompt_tokens, "cached_tokens": r.cached_tokens,
            "error": r.error}


def check_result(result: dict, expect_cached: bool = False) -> list[str]:
    """Every broken invariant of a serve_load result (its ``rows``), one line each; [] when all hold.
    ``expect_cached``: every completed turn after the first must report cached tokens > 0 (a prefix-caching
    server: each later turn resends the previous one). Rows without ``per_request`` (skipped rates) are left
    out. Mutates nothing."""
    bad: list[str] = []
    for row in result.get("rows", []):
        if "per_request" not in row:
            continue
        tag = f"rate {row['rate']}"

        def need(ok: bool, what: str) -> None:
            if not ok:
                bad.append(f"{tag}: {what}")

        reqs = row["per_request"]
        need(row["completed"] + row["failed"] == row["requests"] == len(reqs),
             f"completed {row['completed']} + failed {row['failed']} != requests {row['requests']} "
             f"({len(reqs)} records)")
        need(sum(row["errors"].values()) == row["failed"], f"errors {row['errors']} do not add up to {row['failed']}")
        need(row["completed"] == sum(r["error"] is None for r in reqs), "completed differs from the records")
        for name in STATS:
            s = row[name]
            qs = [s[k] for k in ("p50", "p90", "p99") if s[k] is not None]
            need(qs == sorted(qs), f"{name} percentiles out of order: {qs}")
        for r in reqs:
            who = f"session {r['session']} turn {r['turn']}"
            need(r["sent_s"] >= r["arrival_s"], f"{who} sent before it arrived")
            if r["error"] is None:
                need(0 <= r["ttft_ms"] <= r["e2el_ms"], f"{who}: TTFT {r['ttft_ms']} ms not in [0, E2E "
                     f"{r['e2el_ms']} ms]")
                need(r["cached_tokens"] is None or r["cached_tokens"] <= (r["prompt_tokens"] or 0),
                     f"{who}: {r['cached_tokens']} cached of {r['prompt_tokens']} prompt tokens")
                if expect_cached and r["turn"] > 0:
                    need((r["cached_tokens"] or 0) > 0, f"{who}: no cached tokens on a later turn")
        need(row["output_tokens"] == sum(r["output_tokens"] for r in reqs if r["error"] is None),
             "output_tokens differs from the records")
        tput, gput = row["request_throughput"], row["goodput"]
        need(gput is None or (tput is not None and gput <= tput), f"goodput {gput} above throughput {tput}")
        need(row["good"] is None or row["good"] <= row["completed"], f"good {row['good']} > completed")
    return bad
