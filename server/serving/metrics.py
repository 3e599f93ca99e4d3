"""Prometheus metrics of the server, named ``flashtier_*`` with vLLM's semantics and units.

Two sources:

- per-request observations made by the routes through a ``RequestTracker`` (one per API request):
  TTFT and end-to-end latency measured from the moment the server received the request (before
  tokenization, as vLLM does), inter-token latency per engine output that carried new tokens,
  queue time from the engine's ``RequestTimes``, prompt/generation lengths, finished sequences by
  reason, and cached/replayed prompt tokens by tier from ``RequestOutput.cache``;
- the engine's own gauges and counters, read from ``EngineClient.stats()`` at scrape time
  (running/waiting/loading, KV usage, prefix-cache queries/hits in tokens, preemptions, prompt and
  generation tokens, global-KV bytes per token; with speculative decoding on, drafts verified and
  accepted, accepted drafts by position, the acceptance-length histogram, the goodput controller's
  current draft length and its steps by draft length), and the tier counters of ``EngineStats.tiers``,
  each exported as ``flashtier_<key>`` (a counter, ``_total``; ``TIER_GAUGES`` are gauges; a key
  ending in ``_s`` ends in ``_seconds``; keys ``name{label=value}`` form one labelled family, e.g.
  ``flashtier_ssd_write_errors_total{cause="disk_full"}``, see engine/engine_stats.py). Tier metrics
  appear once the engine reports them.

Every metric carries the label ``model_name``. Each app owns its ``CollectorRegistry`` (several
apps can live in one test process). The names are module constants, so dashboards and tests
refer to the same strings.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterable, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from flashtier.engine.engine_stats import split_tier_key
from flashtier.engine.core.outputs import CacheUsage, EngineStats, RequestOutput, ResumeInfo

PREFIX = "flashtier_"

# per-request (server side)
TTFT = PREFIX + "time_to_first_token_seconds"
ITL = PREFIX + "inter_token_latency_seconds"
E2E = PREFIX + "e2e_request_latency_seconds"
QUEUE_TIME = PREFIX + "request_queue_time_seconds"
REQUEST_PROMPT_TOKENS = PREFIX + "request_prompt_tokens"
REQUEST_GENERATION_TOKENS = PREFIX + "request_generation_tokens"
REQUEST_MAX_TOKENS = PREFIX + "request_params_max_tokens"
REQUEST_N = PREFIX + "request_params_n"
REQUEST_SUCCESS = PREFIX + "request_success"  # counter: exported as ..._total{finished_reason}
PROMPT_TOKENS_CACHED = PREFIX + "prompt_tokens_cached"  # counter {tier}
PROMPT_TOKENS_REPLAYED = PREFIX + "prompt_tokens_replayed"  # counter
RESUMES = PREFIX + "resumes"  # counter by kind: exact | replay | cold (provenance of the window state)
RESUME_KINDS = ("exact", "replay", "cold")
PROMPT_TOKENS_COMPUTED = PREFIX + "prompt_tokens_computed"  # counter
REQUEST_PERSISTED_BYTES = PREFIX + "request_persisted_bytes"  # histogram: bytes persisted per turn
HTTP_REQUESTS = PREFIX + "http_requests"  # counter {method, route, status}
SERVER_INFO = PREFIX + "server_info"
# engine (scrape time)
NUM_RUNNING = PREFIX + "num_requests_running"
NUM_WAITING = PREFIX + "num_requests_waiting"
NUM_LOADING = PREFIX + "num_requests_loading"
KV_USAGE = PREFIX + "kv_cache_usage_perc"
PREFIX_QUERIES = PREFIX + "prefix_cache_queries"  # counter, tokens
PREFIX_HITS = PREFIX + "prefix_cache_hits"  # counter, tokens
PREEMPTIONS = PREFIX + "num_preemptions"  # counter
PROMPT_TOKENS = PREFIX + "prompt_tokens"  # counter
GENERATION_TOKENS = PREFIX + "generation_tokens"  # counter
GLOBAL_KV_BYTES_PER_TOKEN = PREFIX + "global_kv_bytes_per_token"
ENGINE_READY = PREFIX + "engine_ready"
ENGINE_STARTING = PREFIX + "engine_starting"
STARTING_PHASES = ("loading", "warming up")  # ServerState.phase before "ready"
# speculative decoding (vLLM's spec_decode_* names), exported while the engine speculates
SPEC_DRAFTS = PREFIX + "spec_decode_num_drafts"  # counter: sequence-steps that verified drafts
SPEC_DRAFT_TOKENS = PREFIX + "spec_decode_num_draft_tokens"  # counter: drafts verified
SPEC_ACCEPTED_TOKENS = PREFIX + "spec_decode_num_accepted_tokens"  # counter: drafts accepted
SPEC_ACCEPTANCE_LENGTH = PREFIX + "spec_decode_acceptance_length"  # histogram: drafts accepted per verify
SPEC_ACCEPTED_PER_POS = PREFIX + "spec_decode_num_accepted_tokens_per_pos"  # counter {position}: 0-based draft
SPEC_DRAFT_LENGTH = PREFIX + "spec_decode_draft_length"  # gauge: the goodput controller's current draft length
SPEC_STEPS = PREFIX + "spec_decode_steps"  # counter {draft_length}: decode steps by the draft length they ran

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
LATENCY_BUCKETS = (0.01, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
BYTES_BUCKETS = (0.0, 1e3, 1e4, 1e5, 1e6, 1e7, 1e8, 1e9, 1e10)
FINISH_REASONS = ("stop", "length", "abort")
# EngineStats.tiers keys (names, labels aside) that are levels, not running totals
TIER_GAUGES = frozenset({"ssd_bytes", "ssd_entries", "ssd_segments", "ssd_oldest_entry_age_s", "snapshot_redis_down",
                         "ssd_budget_bytes", "ssd_lifetime_s"})
# HELP texts of the tier metrics that have one (the others get a generic line)
TIER_DOCS = {
    "ssd_write_errors": "SSD writes (appends, fsyncs) that failed, by cause; those blocks are not persisted.",
    "ssd_admission_refusals": "SSD writes refused because the budget is full of records inside their lifetime.",
    "ssd_writer_dropped": "SSD writes dropped because the write-behind queue was over its byte bound.",
    "ssd_read_errors": "SSD reads that failed with an I/O error (the blocks were cache misses).",
    "ssd_torn_bytes": "Bytes of torn segment tails dropped by the start-up scan.",
    "ssd_compactions": "SSD segments compacted (live records copied out, the segment deleted).",
    "ssd_refreshes": "Hot SSD records re-appended so that their lifetime restarts.",
    "snapshot_redis_op_errors": "Redis calls of the snapshot pool that failed (timeouts apart), by operation.",
    "snapshot_redis_op_timeouts": "Redis calls of the snapshot pool that exceeded the timeout, by operation.",
    "snapshot_redis_skipped": "Snapshot pool calls answered as a miss without calling Redis (breaker open).",
    "snapshot_redis_breaker_opens": "Times the snapshot pool found Redis down (its circuit breaker opened).",
    "snapshot_redis_down": "1 while the snapshot pool's circuit breaker is open (Redis considered down).",
    "snapshot_redis_calls": "Redis round trips the snapshot pool sent (skipped calls excluded).",
    "snapshot_redis_call_s": "Summed duration of the snapshot pool's Redis round trips (mean latency: / calls).",
    "ssd_budget_bytes": "The SSD tier's disk budget (--kv-disk-budget).",
    "ssd_lifetime_s": "The SSD tier's guaranteed lifetime after the last write (--kv-lifetime).",
    "snapshot_restored": "Snapshots the embedded pool loaded at start-up from the file a clean shutdown saved.",
    "snapshot_restore_corrupt": "Embedded snapshot pool files found damaged or truncated at start-up (misses).",
}
_NOT_NAME = re.compile(r"[^a-zA-Z0-9_]")


def tier_metric_name(key: str) -> str:
    """`flashtier_<key>` for an EngineStats.tiers key (`_s` -> `_seconds`); counters get `_total` on export."""
    name = _NOT_NAME.sub("_", key)
    if name.endswith("_s"):
        name = name[:-2] + "_seconds"
    return PREFIX + name
CACHE_TIERS = ("hbm", "ssd", "snapshot")


def token_buckets(max_len: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `max_len` (vLLM's 1-2-5 series for length histograms)."""
    out: list[float] = []
    base = 1
    while True:
        for m in (1, 2, 5):
            value = m * base
            if value > max_len:
                return tuple(out) if out else (1.0,)
            out.append(float(value))
        base *= 10


class _EngineStatsCollector(Collector):
    """Reads ``EngineStats`` when Prometheus scrapes; zeros while the engine is not up."""

    def __init__(self, model_name: str, stats: Callable[[], EngineStats | None],
                 ready: Callable[[], bool], phase: Callable[[], str]) -> None:
        self._model = model_name
        self._stats = stats
        self._ready = ready
        self._phase = phase

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, doc, labels=["model_name"])
        g.add_metric([self._model], value)
        return g

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        c = CounterMetricFamily(name, doc, labels=["model_name"])
        c.add_metric([self._model], value)
        return c

    def collect(self) -> Iterable[Metric]:
        try:
            stats = self._stats() or EngineStats()
        except Exception:  # a failing engine must not break /metrics
            stats = EngineStats()
        yield self._gauge(NUM_RUNNING, "Requests in the running batch.", stats.num_running)
        yield self._gauge(NUM_WAITING, "Requests waiting to be scheduled.", stats.num_waiting)
        yield self._gauge(NUM_LOADING, "Requests waiting on KV tier loads.", stats.num_loading)
        yield self._gauge(KV_USAGE, "Fraction of the HBM KV block pool in use (0-1).", stats.kv_usage)
        yield self._gauge(GLOBAL_KV_BYTES_PER_TOKEN, "Bytes of global KV stored per token.",
                          stats.global_kv_bytes_per_token)
        yield self._gauge(ENGINE_READY, "1 when the engine accepts requests.", 1.0 if self._ready() else 0.0)
        yield self._gauge(ENGINE_STARTING, "1 while the engine loads or warms up (not ready, not failed).",
                          1.0 if self._phase() in STARTING_PHASES else 0.0)
        yield self._counter(PREFIX_QUERIES, "Prompt tokens looked up in the prefix cache.",
                            stats.prefix_queries_tokens)
        yield self._counter(PREFIX_HITS, "Prompt tokens found in the prefix cache.", stats.prefix_hits_tokens)
        yield self._counter(PREEMPTIONS, "Requests preempted by the scheduler.", stats.preemptions)
        yield self._counter(PROMPT_TOKENS, "Prompt tokens processed by the engine.", stats.prompt_tokens)
        yield self._counter(GENERATION_TOKENS, "Tokens generated by the engine.", stats.generation_tokens)
        if stats.spec_acceptance_lengths:
            yield from self._speculative(stats)
        yield from tier_families(self._model, stats.tiers or {})

    def _speculative(self, stats: EngineStats) -> Iterable[Metric]:
        yield self._counter(SPEC_DRAFTS, "Sequence steps that verified at least one DSpark draft.", stats.spec_drafts)
        yield self._counter(SPEC_DRAFT_TOKENS, "DSpark drafts verified.", stats.spec_draft_tokens)
        yield self._counter(SPEC_ACCEPTED_TOKENS, "DSpark drafts accepted.", stats.spec_accepted_tokens)
        h = HistogramMetricFamily(SPEC_ACCEPTANCE_LENGTH, "Drafts accepted per sequence step that verified drafts.",
                                  labels=["model_name"])
        cumulative, buckets = 0, []
        for k, n in enumerate(stats.spec_acceptance_lengths):
            cumulative += n
            buckets.append((str(float(k)), cumulative))
        buckets.append(("+Inf", cumulative))
        h.add_metric([self._model], buckets, sum_value=stats.spec_accepted_tokens)
        yield h
        per_pos = CounterMetricFamily(SPEC_ACCEPTED_PER_POS, "DSpark drafts accepted, by draft position "
                                      "(0: the first draft).", labels=["model_name", "position"])
        for j, n in enumerate(stats.spec_accepted_by_position):
            per_pos.add_metric([self._model, str(j)], n)
        yield per_pos
        yield self._gauge(SPEC_DRAFT_LENGTH, "Drafts per sequence the goodput controller verifies in the current "
                          "step (0: plain decoding).", stats.spec_draft_length)
        steps = CounterMetricFamily(SPEC_STEPS, "Decode steps by the draft length the goodput controller ran them "
                                    "with (0: plain decoding).", labels=["model_name", "draft_length"])
        for k, n in enumerate(stats.spec_steps_by_draft_length):
            steps.add_metric([self._model, str(k)], n)
        yield steps


def tier_families(model_name: str, tiers: dict[str, float]) -> list[Metric]:
    """One family per tier metric name: ``name{label=value}`` keys (engine_stats.tier_key) become samples
    of one labelled family. A family has one label set: a key whose labels differ from the first key of
    its name is left out."""
    grouped: dict[str, tuple[str, tuple[str, ...], list[tuple[list[str], float]]]] = {}
    for key, value in sorted(tiers.items()):
        base, labels = split_tier_key(key)
        names = tuple(label for label, _ in labels)
        _, first, samples = grouped.setdefault(tier_metric_name(base), (base, names, []))
        if names == first:
            samples.append(([v for _, v in labels], value))
    out: list[Metric] = []
    for name, (base, names, samples) in grouped.items():
        doc = TIER_DOCS.get(base, f"KV tier statistic {base!r} reported by the engine.")
        kind = GaugeMetricFamily if base in TIER_GAUGES else CounterMetricFamily
        family = kind(name, doc, labels=["model_name", *names])
        for values, value in samples:
            family.add_metric([model_name, *values], value)
        out.append(family)
    return out


class ServerMetrics:
    """The app's registry and collectors; ``tracker()`` starts the observations of one request."""

    def __init__(self, model_name: str, *, max_model_len: int = 1 << 20,
                 stats: Callable[[], EngineStats | None] = lambda: None,
                 ready: Callable[[], bool] = lambda: False, phase: Callable[[], str] = lambda: "loading",
                 version: str = "", demo: bool = False) -> None:
        self.model_name = model_name
        # No `*_created` series (process-wide switch, as vLLM sets it): they double the exposition and
        # dashboards never use them.
        disable_created_metrics()
        self.registry = CollectorRegistry(auto_describe=True)
        reg, lab = self.registry, ["model_name"]
        self.ttft = Histogram(TTFT, "Time to first token (server receipt to first token).", lab,
                              buckets=TTFT_BUCKETS, registry=reg).labels(model_name)
        self.itl = Histogram(ITL, "Time between consecutive engine outputs of a request.", lab,
                             buckets=ITL_BUCKETS, registry=reg).labels(model_name)
        self.e2e = Histogram(E2E, "End-to-end request latency.", lab, buckets=LATENCY_BUCKETS,
                             registry=reg).labels(model_name)
        self.queue_time = Histogram(QUEUE_TIME, "Time a request waited before it was first scheduled.", lab,
                                    buckets=LATENCY_BUCKETS, registry=reg).labels(model_name)
        len_buckets = token_buckets(max_model_len)
        self.prompt_len = Histogram(REQUEST_PROMPT_TOKENS, "Prompt tokens per request.", lab,
                                    buckets=len_buckets, registry=reg).labels(model_name)
        self.generation_len = Histogram(REQUEST_GENERATION_TOKENS, "Generated tokens per request (all choices).",
                                        lab, buckets=len_buckets, registry=reg).labels(model_name)
        self.max_tokens = Histogram(REQUEST_MAX_TOKENS, "max_tokens requested.", lab, buckets=len_buckets,
                                    registry=reg).labels(model_name)
        self.n = Histogram(REQUEST_N, "n requested.", lab, buckets=(1, 2, 4, 8, 16, 32, 64, 128),
                           registry=reg).labels(model_name)
        success = Counter(REQUEST_SUCCESS, "Finished sequences by reason (stop | length | abort).",
                          ["model_name", "finished_reason"], registry=reg)
        self.success = {r: success.labels(model_name, r) for r in FINISH_REASONS}
        cached = Counter(PROMPT_TOKENS_CACHED, "Prompt tokens served from a cache tier.", ["model_name", "tier"],
                         registry=reg)
        self.cached = {t: cached.labels(model_name, t) for t in CACHE_TIERS}
        self.persisted = Histogram(REQUEST_PERSISTED_BYTES, "Bytes a request wrote to the persistent tiers.",
                                   lab, buckets=BYTES_BUCKETS, registry=reg).labels(model_name)
        self.replayed = Counter(PROMPT_TOKENS_REPLAYED, "Prompt tokens re-run by an encoder bounded "
                                "replay (an approximate window state; the decoder's exact pass is not counted).", lab,
                                registry=reg).labels(model_name)
        self.computed = Counter(PROMPT_TOKENS_COMPUTED, "Prompt tokens computed from scratch.", lab,
                                registry=reg).labels(model_name)
        resumes = Counter(RESUMES, "Prompts by how their window state was made: exact (snapshot or full "
                          "history), replay (approximate, bounded replay), cold.", ["model_name", "kind"],
                          registry=reg)
        self.resumes = {k: resumes.labels(model_name, k) for k in RESUME_KINDS}
        self.http = Counter(HTTP_REQUESTS, "HTTP requests by route and status.", ["method", "route", "status"],
                            registry=reg)
        info = Gauge(SERVER_INFO, "Constant 1; labels describe the server.", ["model_name", "version", "demo"],
                     registry=reg)
        info.labels(model_name, version, "true" if demo else "false").set(1)
        reg.register(_EngineStatsCollector(model_name, stats, ready, phase))

    def tracker(self) -> RequestTracker:
        return RequestTracker(self)


class RequestTracker:
    """Observations of one API request (which may hold several engine requests: completions batches).

    Call ``on_output`` for every ``RequestOutput`` and ``finish`` once at the end; ``finish`` is
    idempotent so error paths can call it unconditionally.
    """

    def __init__(self, metrics: ServerMetrics) -> None:
        self._m = metrics
        self.arrival = time.monotonic()
        self._first_token: float | None = None
        self._last_token: float | None = None
        self._queue_observed: set[str] = set()
        self._cache: dict[str, CacheUsage] = {}
        self._resume: dict[str, ResumeInfo] = {}
        self._prompt_tokens: dict[str, int] = {}
        self._done = False

    def on_output(self, out: RequestOutput) -> None:
        now = time.monotonic()
        self._prompt_tokens[out.request_id] = out.num_prompt_tokens
        if out.cache != CacheUsage() or out.request_id not in self._cache:
            self._cache[out.request_id] = out.cache
            self._resume[out.request_id] = out.resume
        times = out.times
        if times is not None and times.first_scheduled is not None and out.request_id not in self._queue_observed:
            self._queue_observed.add(out.request_id)
            self._m.queue_time.observe(max(0.0, times.first_scheduled - times.arrival))
        if not any(c.token_ids for c in out.choices):
            return
        if self._first_token is None:
            self._first_token = now
            self._m.ttft.observe(now - self.arrival)
        elif self._last_token is not None:
            self._m.itl.observe(now - self._last_token)
        self._last_token = now

    def prompt_tokens(self, request_id: str) -> int:
        """The prompt length the engine reported for one engine request (0 before its first output)."""
        return self._prompt_tokens.get(request_id, 0)

    @property
    def resumes(self) -> list[ResumeInfo]:
        """How each engine request's window state was made (provenance)."""
        return list(self._resume.values())

    @property
    def caches(self) -> list[CacheUsage]:
        """The latest cache usage reported for each engine request (they are summed into usage, too)."""
        return list(self._cache.values())

    def finish(self, *, completion_tokens: int, finish_reasons: Sequence[str | None], max_tokens: int | None,
               n: int) -> None:
        """Record the request's totals; `finish_reasons` holds one engine-level reason per sequence."""
        if self._done:
            return
        self._done = True
        m = self._m
        m.e2e.observe(time.monotonic() - self.arrival)
        m.prompt_len.observe(sum(self._prompt_tokens.values()))
        m.generation_len.observe(completion_tokens)
        if max_tokens is not None:
            m.max_tokens.observe(max_tokens)
        m.n.observe(n)
        for reason in finish_reasons:
            m.success[reason if reason in ("stop", "length") else "abort"].inc()
        m.persisted.observe(sum(c.persisted_bytes for c in self._cache.values()))
        for cache in self._cache.values():
            m.cached["hbm"].inc(cache.hbm_tokens)
            m.cached["ssd"].inc(cache.ssd_tokens)
            m.cached["snapshot"].inc(cache.snapshot_tokens)
            m.replayed.inc(cache.approximate_replay_tokens)
            m.computed.inc(cache.computed_tokens)
        for resume in self._resume.values():
            m.resumes[resume.kind].inc()
