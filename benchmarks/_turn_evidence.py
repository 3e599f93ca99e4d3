"""What a returning turn's prompt came from, read from the server: benchmarks/returning_turn_bench.py's pure parts.

``scrape`` / ``moved`` read the ``flashtier_*`` samples of /metrics before and after a turn, ``evidence`` joins
the counters the turn moved with the response's ``usage.flashtier``, ``problems`` says why a turn did not take the
path it must (cold, exact resume, bounded replay), and ``fit_prompt`` shortens a first turn to a time budget.
"""

from __future__ import annotations

import random
import re

COUNTED = ("flashtier_ssd_", "flashtier_snapshot_", "flashtier_resumes", "flashtier_prompt_tokens_",
           "flashtier_time_to_first_token_seconds_sum", "flashtier_request_queue_time_seconds_sum")
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def prompt_ids(n: int, seed: int) -> list[int]:
    """``n`` ordinary token ids (clear of the special ids at both ends of the vocabulary), fixed by ``seed``."""
    rng = random.Random(seed)
    return [rng.randrange(1000, 100_000) for _ in range(n)]


def scrape(text: str) -> dict[str, float]:
    """The ``flashtier_*`` samples of a Prometheus text as {name{label=value,...}: value}, the model label and
    histogram buckets left out. ValueError when a sample's value is not a number."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("flashtier_"):
            continue
        sample, _, value = line.rpartition(" ")
        name = sample.split("{", 1)[0]
        if name.endswith(("_bucket", "_created")):
            continue
        labels = ",".join(f"{k}={v}" for k, v in sorted(_LABEL.findall(sample)) if k != "model_name")
        out[f"{name}{{{labels}}}" if labels else name] = float(value)
    return out


def moved(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """The ``COUNTED`` samples that changed between two scrapes (after - before)."""
    return {k: round(v - before.get(k, 0.0), 6) for k, v in sorted(after.items())
            if k.startswith(COUNTED) and v != before.get(k, 0.0)}


def evidence(usage: dict, delta: dict[str, float]) -> dict:
    """Where a turn's prompt came from: the response's usage and the counters the turn moved."""
    ft = usage.get("flashtier") or {}
    tiers = ft.get("cached_tokens_by_tier") or {}
    restored = delta.get("flashtier_ssd_bytes_read_total", 0.0) + delta.get("flashtier_snapshot_bytes_read_total", 0.0)
    queue_s = delta.get("flashtier_request_queue_time_seconds_sum")
    return {"prompt_tokens": usage.get("prompt_tokens"),
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens"),
            "hbm": tiers.get("hbm"), "ssd": tiers.get("ssd"), "snapshot": tiers.get("snapshot"),
            "decoder_tokens": ft.get("decoder_tokens"), "computed_tokens": ft.get("computed_tokens"),
            "approximate_replay_tokens": ft.get("approximate_replay_tokens"),
            "resume": ft.get("resume"),
            "ssd_blocks_loaded": delta.get("flashtier_ssd_blocks_loaded_total"),
            "snapshot_lookup_hits": delta.get("flashtier_snapshot_lookup_hit_total", 0.0),
            "restored_bytes": restored, "server_ttft_s": delta.get("flashtier_time_to_first_token_seconds_sum"),
            "queue_s": queue_s, "restore_GBps": round(restored / queue_s / 1e9, 3) if restored and queue_s else None,
            "metrics_delta": delta}


def problems(turn: str, ev: dict) -> list[str]:
    """Why ``ev`` is not the path ``turn`` (cold | hit | miss) must take; [] when it is."""
    kind = (ev.get("resume") or {}).get("kind")
    want = {"cold": "cold", "hit": "exact", "miss": "replay"}[turn]
    out = [] if kind == want else [f"resume kind {kind!r}, want {want!r}"]
    if turn == "cold":
        return out + ([] if not ev.get("cached_tokens") else [f"{ev.get('cached_tokens')} cached tokens"])
    if ev.get("hbm"):
        out.append(f"{ev['hbm']} tokens from HBM (the prefix cache should be off)")
    if not ev.get("ssd") or not ev.get("ssd_blocks_loaded"):
        out.append(f"no SSD restore (ssd tokens {ev.get('ssd')}, blocks loaded {ev.get('ssd_blocks_loaded')})")
    if turn == "hit" and not ev.get("snapshot_lookup_hits"):
        out.append("no snapshot lookup hit")
    if turn == "miss" and (ev.get("snapshot_lookup_hits") or not ev.get("approximate_replay_tokens")):
        out.append(f"snapshot hits {ev.get('snapshot_lookup_hits')}, "
                   f"approximate replay {ev.get('approximate_replay_tokens')}")
    return out


def fit_prompt(requested: int, rate_tok_s: float, allowance_s: float, block_size: int, floor: int) -> int:
    """The longest prompt <= ``requested`` whose cold prefill at ``rate_tok_s`` (1.5x margin: later chunks see a
    longer context) fits ``allowance_s``, in whole blocks, never under ``floor``."""
    fits = int(rate_tok_s * max(allowance_s, 0.0) / 1.5)
    return requested if fits >= requested else max(fits // block_size * block_size, floor)
