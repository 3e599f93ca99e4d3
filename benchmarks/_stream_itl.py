"""Inter-token latency of recorded token streams, and a histogram's sum and count read from Prometheus text.

A stream is the list of its token chunks, ``(arrival seconds, tokens in the chunk)``, in arrival order. The
steady window is where every stream that produced tokens is decoding: from the last stream's second token chunk
(its first is a prefill step; the step after it is the batch's first full decode step, which the engine-side
timing leaves out too, as it may capture a CUDA graph) to the first stream's last chunk (after it the batch
shrinks). A sample is the gap between two consecutive chunks of one stream that both lie inside the window, so a
stream's first chunk (its time to first token) never starts one.

server_itl_bench.py uses this module (benchmarks/ is put on ``sys.path``; they run as ``python3 -P``).
"""

from __future__ import annotations

from collections.abc import Sequence

Chunks = Sequence[tuple[float, int]]


def quantile(xs: Sequence[float], q: float) -> float | None:
    """The q-quantile (q in [0, 1]) of xs, linear between order statistics; None when xs is empty.
    ValueError for q outside [0, 1]."""
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q must be in [0, 1], got {q}")
    if not xs:
        return None
    s = sorted(xs)
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def steady_itl(streams: Sequence[Chunks]) -> dict:
    """Samples (seconds) of the steady window and its bookkeeping: window_s, tokens_in_window (tokens of the
    chunks that end a sample), multi_token_chunks (such chunks carrying more than one token). Streams with
    fewer than two chunks are left out of the window."""
    live = [c for c in streams if len(c) >= 2]
    if not live:
        return {"samples": [], "window_s": 0.0, "tokens_in_window": 0, "multi_token_chunks": 0}
    start, end = max(c[1][0] for c in live), min(c[-1][0] for c in live)
    gaps, tokens, multi = [], 0, 0
    for chunks in live:
        for k in range(2, len(chunks)):  # never from the first chunk, even at equal arrival times
            (t0, _), (t1, n) = chunks[k - 1], chunks[k]
            if t0 >= start and t1 <= end:
                gaps.append(t1 - t0)
                tokens += n
                multi += n > 1
    return {"samples": gaps, "window_s": max(end - start, 0.0), "tokens_in_window": tokens,
            "multi_token_chunks": multi}


def summary_ms(samples: Sequence[float]) -> dict:
    """Median, p90 and mean of samples in milliseconds (None when there are none) and their count."""
    def ms(x: float | None) -> float | None:
        return None if x is None else round(x * 1e3, 3)

    mean = sum(samples) / len(samples) if samples else None
    return {"itl_ms": ms(quantile(samples, 0.5)), "itl_p90_ms": ms(quantile(samples, 0.9)), "itl_mean_ms": ms(mean),
            "itl_samples": len(samples)}


def histogram_sum_count(text: str, name: str) -> tuple[float, float]:
    """(sum, count) of histogram ``name`` in Prometheus exposition ``text``, added over every label set
    (0, 0 when absent). ValueError when a matching sample's value is not a number."""
    total = {f"{name}_sum": 0.0, f"{name}_count": 0.0}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        metric = line.split("{", 1)[0].split(" ", 1)[0]
        if metric in total:  # the value follows the labels (which may hold spaces); a timestamp may follow it
            rest = line[line.rindex("}") + 1:] if "{" in line else line[len(metric):]
            total[metric] += float(rest.split()[0])
    return total[f"{name}_sum"], total[f"{name}_count"]
