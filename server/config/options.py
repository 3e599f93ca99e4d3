"""The option table of ``flashtier serve``: each setting's flag, variable, parser and default, declared once.

settings.py turns this table into argparse arguments and reads the ``FLASHTIER_*`` variables with it.
A parser takes the text of one value and returns it, or raises ``ValueError`` with a message that says
what is wrong and what is accepted (argparse prefixes the flag, settings.py the variable).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from flashtier.engine.config import RESUME_POLICIES
from flashtier.kvstore.config import GiB, MIN_SSD_BUDGET_BYTES

__all__ = ["CACHE_ISOLATION_MODES", "ENV_PREFIX", "OPTIONS", "Option", "default_cache_dir", "format_size",
           "parse_size"]

ENV_PREFIX = "FLASHTIER_"
CACHE_ISOLATION_MODES = ("shared", "per-key")
# the drafter is the model's own DSpark stages; vLLM names DeepSeek's MTP drafters mtp / deepseek_mtp
SPECULATIVE_METHODS = ("dspark", "mtp", "deepseek_mtp")
SPECULATIVE_MAX_TOKENS = 5  # V4.1's dspark_block_size (the engine checks the loaded model's)


def _parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected a boolean (1/0, true/false, yes/no, on/off), got {text!r}")


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"expected an integer, got {text!r}") from None


def _graph_sizes(text: str) -> tuple[int, ...]:
    """``1,8,64`` -> (1, 8, 64): positive, strictly increasing."""
    try:
        sizes = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ValueError(f"expected comma-separated batch sizes such as 1,8,64, got {text!r}") from None
    if not sizes or min(sizes) < 1 or list(sizes) != sorted(set(sizes)):
        raise ValueError(f"batch sizes must be positive and increasing, got {text!r}")
    return sizes


def _parse_port(text: str) -> int:
    port = _int(text)
    if not 0 <= port <= 65535:
        raise ValueError(f"a port must be in [0, 65535], got {port}")
    return port


def _int_at_least(low: int, expected: str) -> Callable[[str], int]:
    """A parser of integers >= `low`; a smaller one is refused with "must be <expected>, got <value>"."""

    def parse(text: str) -> int:
        value = _int(text)
        if value < low:
            raise ValueError(f"must be {expected}, got {value}")
        return value

    return parse


_positive_int = _int_at_least(1, "a positive integer")
_non_negative_int = _int_at_least(0, "an integer >= 0")
_num_blocks = _int_at_least(2, "at least 2 (block 0 is the reserved null block)")


def _block_size(text: str) -> int:
    value = _int(text)
    if value <= 0 or value % 8:
        raise ValueError(f"must be a positive multiple of 8 (e.g. 64), got {value}")
    return value


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"expected a number, got {text!r}") from None


def _non_negative_float(text: str) -> float:
    value = _float(text)
    if not value >= 0:
        raise ValueError(f"must be a number >= 0, got {text!r}")
    return value


def _fraction(text: str) -> float:
    value = _float(text)
    if not 0 < value <= 1:
        raise ValueError(f"must be in (0, 1], got {text!r}")
    return value


def _choice(*choices: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        value = text.strip().lower()
        if value not in choices:
            raise ValueError(f"{text!r} is not one of {' | '.join(choices)}")
        return value

    return parse


def _dtype(text: str) -> str:
    """auto | float32 | bfloat16 | float64; vLLM's ``float`` is float32. float16 is refused (the model's
    activations overflow it)."""
    value = "float32" if text == "float" else text
    if value in ("half", "float16"):
        raise ValueError(f"{text!r} is not supported (no float16 kernels); use bfloat16, float32 or auto")
    if value not in ("auto", "float32", "bfloat16", "float64"):
        raise ValueError(f"dtype must be auto, float32, bfloat16 or float64, got {text!r}")
    return value


def _data_parallel_size(text: str) -> int:
    value = _positive_int(text)
    if value != 1:
        raise ValueError(f"{value} is not supported: data parallel serving is not implemented; split the model "
                         "with --tensor-parallel-size (and --expert-parallel) instead")
    return value


_SIZE_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 1000**2,
               "mib": 1 << 20, "g": 1 << 30, "gb": 1000**3, "gib": 1 << 30, "t": 1 << 40, "tb": 1000**4,
               "tib": 1 << 40}
_TIME_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "d": 86400.0}


def _speculative(text: str) -> int:
    """Drafts verified per step: N, on (the most), off / 0, or vLLM's JSON
    ``{"method": "dspark", "num_speculative_tokens": N}``."""
    value = text.strip()
    if value.startswith("{"):
        try:
            cfg = json.loads(value)
        except ValueError:
            raise ValueError(f"expected a JSON object, got {text!r}") from None
        unknown = sorted(set(cfg) - {"method", "num_speculative_tokens"})
        if unknown:
            raise ValueError(f"unsupported key(s) {unknown}; only method and num_speculative_tokens are read")
        method = cfg.get("method", "dspark")
        if method not in SPECULATIVE_METHODS:
            raise ValueError(f"method {method!r} is not supported: the drafter is the model's DSpark stages "
                             f"({' | '.join(SPECULATIVE_METHODS)})")
        n = cfg.get("num_speculative_tokens")
        if isinstance(n, bool) or not isinstance(n, int):
            raise ValueError(f"num_speculative_tokens must be an integer, got {n!r}")
    elif value.lower() in ("off", "false", "no"):
        n = 0
    elif value.lower() in ("on", "true", "yes"):
        n = SPECULATIVE_MAX_TOKENS
    else:
        n = _int(value)
    if not 0 <= n <= SPECULATIVE_MAX_TOKENS:
        raise ValueError(f"the number of speculative tokens must be in [0, {SPECULATIVE_MAX_TOKENS}] (the DSpark "
                         f"block size), got {n}")
    return n


def _confidence(text: str) -> float:
    value = _float(text)
    if not 0 <= value < 1:
        raise ValueError(f"must be in [0, 1), got {text!r}")
    return value


def _split_unit(text: str) -> tuple[float, str]:
    t = text.strip().lower()
    i = len(t)
    while i and not (t[i - 1].isdigit() or t[i - 1] == "."):
        i -= 1
    try:
        return float(t[:i]), t[i:].strip()
    except ValueError:
        raise ValueError(f"{text!r} is not a number with an optional unit") from None


def _size(text: str) -> int:
    """Bytes with an optional unit: 1000000, 512M, 100GiB, 2T (K/M/G/T are binary; KB/MB/GB/TB decimal)."""
    value, unit = _split_unit(text)
    if unit not in _SIZE_UNITS or value <= 0:
        raise ValueError(f"{text!r} is not a positive size (units: {', '.join(k for k in _SIZE_UNITS if k)})")
    return int(value * _SIZE_UNITS[unit])


parse_size = _size  # for the commands beside serve that take a size (``flashtier plan --gpu-memory``)


def format_size(n: int) -> str:
    """``n`` bytes in the largest binary unit that keeps it whole, as --kv-disk-budget accepts it: 1M, 56K."""
    for unit, scale in (("T", 1 << 40), ("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)


def _disk_budget(text: str) -> int:
    value = _size(text)
    if value < MIN_SSD_BUDGET_BYTES:
        low = format_size(MIN_SSD_BUDGET_BYTES)
        raise ValueError(f"{text!r} is below the smallest SSD budget, {low} (one SSD segment); raise it to "
                         f"at least {low}, or run without the SSD tier: --no-kv-persist")
    return value


def _duration(text: str) -> float:
    """Seconds with an optional unit: 300, 300s, 5m, 72h, 3d."""
    value, unit = _split_unit(text)
    if unit not in _TIME_UNITS or value <= 0:
        raise ValueError(f"{text!r} is not a positive duration (units: s, m, h, d)")
    return value * _TIME_UNITS[unit]


def _redis_url(text: str) -> str:
    """A URL ``parse_redis_url`` accepts (the snapshot pool's own parser; imported here only when used)."""
    from flashtier.kvstore.snapshot.redis_pool import parse_redis_url

    try:
        parse_redis_url(text)
    except ValueError as exc:
        problem = str(exc).removeprefix("redis_url ")
        raise ValueError(f"{problem}; use redis://HOST:PORT/DB, rediss:// (TLS), unix:///path/to/socket or "
                         "redis+cluster://HOST:PORT, or leave it unset for the embedded pool") from None
    return text


def default_cache_dir(environ: Mapping[str, str] | None = None) -> str:
    """Where the demo checkpoint and the default KV directory live: $FLASHTIER_CACHE_DIR,
    else $XDG_CACHE_HOME/flashtier, else ~/.cache/flashtier."""
    env = os.environ if environ is None else environ
    if env.get(ENV_PREFIX + "CACHE_DIR"):
        return env[ENV_PREFIX + "CACHE_DIR"]
    base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "flashtier")


@dataclass(frozen=True)
class Option:
    """One setting: CLI flag, environment variable and parser, declared together."""

    dest: str
    flag: str
    parse: Callable[[str], Any]
    default: Any
    help: str
    kind: str = "value"  # value | bool | list
    hidden: bool = False
    aliases: tuple[str, ...] = ()  # other flags for the same setting (vLLM's names); the env var is the flag's

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.flag.lstrip("-").upper().replace("-", "_")


OPTIONS: tuple[Option, ...] = (
    # -- what to serve
    Option("preset", "--preset", str, None, "model preset (v4.1-flash | flash-16e | tiny); without MODEL_DIR "
           "the demo 'tiny' preset with random weights is served"),
    Option("served_model_name", "--served-model-name", str, (), "name(s) the API accepts in `model` "
           "(the first is listed first); default: the model directory's name or the preset", kind="list"),
    Option("tokenizer", "--tokenizer", str, None, "tokenizer.json (or a directory holding one); default: "
           "the model directory's, else the shipped DeepSeek V4 tokenizer"),
    Option("max_model_len", "--max-model-len", _positive_int, None, "context length in tokens (prompt + "
           "completion); default: the model's"),
    Option("default_thinking", "--default-thinking", _parse_bool, False, "thinking mode when a request says "
           "neither reasoning_effort nor chat_template_kwargs.thinking", kind="bool"),
    # -- HTTP
    Option("host", "--host", str, "127.0.0.1", "address to listen on"),
    Option("port", "--port", _parse_port, 8000, "TCP port"),
    Option("api_key", "--api-key", str, (), "API key(s) accepted as `Authorization: Bearer KEY` on /v1/*: "
           "repeat the flag, list several after it, or separate them with commas", kind="list"),
    Option("admin_api_key", "--admin-api-key", str, None, "key of the admin routes (/admin/v1/*: "
           "POST /admin/v1/tenants/delete), sent as `Authorization: Bearer KEY`; unset: the admin routes "
           "answer 404"),
    Option("cache_isolation", "--cache-isolation", _choice(*CACHE_ISOLATION_MODES), "shared", "shared: "
           "requests share cached prefixes (cache_salt separates them); per-key: each API key is its own "
           "tenant in every tier (HBM, SSD, snapshots), and cache_salt applies within a key"),
    Option("max_request_bytes", "--max-request-bytes", _size, 64 << 20, "largest request body accepted by "
           "the generating routes (HTTP 413 above it; e.g. 64M)"),
    Option("max_tokenize_bytes", "--max-tokenize-bytes", _size, 8 << 20, "largest request body of /tokenize "
           "and /detokenize (HTTP 413 above it): 8M holds a full 1M-token context as text or as ids"),
    Option("frontend_workers", "--frontend-workers", _positive_int, None, "threads that tokenize, render "
           "chat prompts, detokenize and parse large bodies off the event loop (default: min(4, CPUs))"),
    Option("max_tokens_default", "--max-tokens-default", _non_negative_int, 32768, "max_tokens of a request "
           "that sets none (capped by the context left); 32768 fits a thinking-mode answer and bounds a "
           "runaway generation; 0: the rest of the context (vLLM's default)"),
    Option("allowed_origins", "--allowed-origins", str, (), "CORS: origins browsers may call from (`*` for "
           "any; a JSON list as vLLM takes it also works); default: none, no CORS headers", kind="list"),
    Option("allowed_methods", "--allowed-methods", str, ("*",), "CORS: allowed methods (with "
           "--allowed-origins)", kind="list"),
    Option("allowed_headers", "--allowed-headers", str, ("*",), "CORS: allowed request headers (with "
           "--allowed-origins)", kind="list"),
    Option("allow_credentials", "--allow-credentials", _parse_bool, False, "CORS: allow credentials (with "
           "--allowed-origins)", kind="bool"),
    Option("max_n", "--max-n", _positive_int, 16, "largest `n` (choices per request) accepted"),
    Option("drain_timeout_s", "--drain-timeout", _non_negative_float, 30.0, "seconds SIGTERM waits for "
           "in-flight requests before aborting them"),
    Option("log_level", "--log-level", _choice("critical", "error", "warning", "info", "debug", "trace"),
           "info", "log level"),
    # -- engine
    Option("max_num_seqs", "--max-num-seqs", _positive_int, 64, "most sequences decoded in one step"),
    Option("max_num_batched_tokens", "--max-num-batched-tokens", _positive_int, 512, "token budget of one "
           "engine step (prefill chunk + replay + decode tokens)"),
    Option("max_waiting_requests", "--max-waiting-requests", _positive_int, 1024, "bound of the waiting "
           "queue; a request beyond it is answered 429"),
    Option("device", "--device", str, None, "torch device (default: cuda when available, else cpu)"),
    Option("dtype", "--dtype", _dtype, "auto", "auto | float32 | bfloat16 | float64 (auto: bfloat16 on "
           "cuda, float32 on cpu; vLLM's `float` is float32)"),
    Option("seed", "--seed", _int, None, "seed of the random draws of requests without their own `seed` "
           "(torch.manual_seed at start, as vLLM's --seed); default: unseeded"),
    Option("tensor_parallel_size", "--tensor-parallel-size", _positive_int, 1, "ranks the model is split over, "
           "one process each (GPU r on CUDA, gloo on the CPU): attention heads, vocabulary and experts; it must "
           "divide the heads' output groups; the SSD tier and the snapshot pool are off above 1", aliases=("-tp",)),
    Option("expert_parallel", "--expert-parallel", _parse_bool, False, "with --tensor-parallel-size N: split the "
           "routed experts over the N ranks (all-to-all) instead of splitting every expert's width",
           kind="bool", aliases=("--enable-expert-parallel",)),
    Option("engine_step_timeout_s", "--engine-step-timeout", _duration, 900.0, "a step of the engine core taking "
           "longer than this ends it: /health turns 503 and in-flight requests fail with a 503 (the first steps "
           "may compile kernels; 300, 5m, 1h)"),
    Option("distributed_timeout_s", "--distributed-timeout", _duration, 600.0, "with --tensor-parallel-size N: "
           "a collective waiting longer for a peer rank raises, and the engine ends (torch.distributed's "
           "process-group timeout)"),
    Option("data_parallel_size", "--data-parallel-size", _data_parallel_size, 1, "vLLM's flag; only 1 (data "
           "parallel serving is not implemented)", aliases=("-dp",)),
    Option("trust_remote_code", "--trust-remote-code", _parse_bool, False, "vLLM's flag, accepted with no "
           "effect: flashtier runs no code from the checkpoint", kind="bool"),
    Option("weights_seed", "--weights-seed", _int, 0, "seed of the demo preset's random weights",
           hidden=True),
    Option("speculative", "--speculative", _speculative, 0, "speculative decoding with the model's DSpark "
           "drafter: N (1-5) drafts verified per step at most, on (5) or off (the default); vLLM's "
           "--speculative-config '{\"method\": \"dspark\", \"num_speculative_tokens\": N}' sets the same",
           aliases=("--speculative-config",)),
    Option("speculative_min_confidence", "--speculative-min-confidence", _confidence, 0.1, "verify a draft only "
           "while the drafter's confidence that it and every draft before it are accepted stays >= this"),
    Option("speculative_adaptive", "--speculative-adaptive", _parse_bool, True, "with --speculative N: pick each "
           "step's draft length (0 = none) up to N from measured step times and acceptance, so that speculation "
           "runs only where it raises the tokens per second; --no-speculative-adaptive verifies up to N drafts "
           "in every step", kind="bool"),
    Option("enforce_eager", "--enforce-eager", _parse_bool, False, "run every step eagerly (no CUDA graphs for "
           "the decoder part of decode steps)", kind="bool"),
    Option("warmup", "--warmup", _parse_bool, None, "before /health reports ready, run throwaway batches at every "
           "CUDA-graph size so kernels compile and graphs capture off the request path (default: on with CUDA, "
           "off on the CPU and under TRITON_INTERPRET); --no-warmup turns it off", kind="bool"),
    Option("cuda_graph_sizes", "--cuda-graph-sizes", _graph_sizes, None, "decode batch sizes captured as CUDA "
           "graphs and warmed up, comma-separated (default: 1,2,4,8,16,24,32,48,64,96,128,192,256 up to "
           "--max-num-seqs); a batch between two sizes runs padded to the larger"),
    # -- kvstore
    Option("block_size", "--block-size", _block_size, 64, "tokens per KV block (a multiple of 8)"),
    Option("num_blocks", "--num-blocks", _num_blocks, None, "HBM pool size in blocks (overrides "
           "--hbm-utilization)", aliases=("--num-gpu-blocks-override",)),
    Option("hbm_utilization", "--hbm-utilization", _fraction, 0.9, "fraction of free device memory for KV",
           aliases=("--gpu-memory-utilization",)),
    Option("enable_prefix_caching", "--prefix-caching", _parse_bool, True, "keep freed full blocks for "
           "prefix reuse: on by default; --no-prefix-caching (vLLM: --no-enable-prefix-caching) turns the HBM "
           "prefix cache off", kind="bool",
           aliases=("--enable-prefix-caching",)),
    Option("cache_dir", "--cache-dir", str, None, "directory of the demo checkpoint and the default "
           "--kv-dir (default: $XDG_CACHE_HOME/flashtier)"),
    Option("kv_dir", "--kv-dir", str, None, "directory of the SSD tier (global KV, guaranteed lifetime); "
           "default: CACHE_DIR/kv/<model>. One server per directory: it holds KV_DIR/SERVER.LOCK from start-up, "
           "and a second one stops with the first's pid"),
    Option("kv_persist", "--kv-persist", _parse_bool, True, "write global KV through to the SSD tier "
           "(--no-kv-persist: HBM prefix cache and snapshots only)", kind="bool"),
    Option("kv_disk_budget", "--kv-disk-budget", _disk_budget, 512 * GiB, "disk budget of the SSD tier (e.g. "
           "100G, at least 1M; segments are budget/8 within [1M, 256M]); full of entries inside their "
           "lifetime => new writes are refused, serving goes on"),
    Option("kv_lifetime_s", "--kv-lifetime", _duration, 72 * 3600.0, "guaranteed lifetime of an SSD entry "
           "after its last write (e.g. 72h)"),
    Option("redis_url", "--redis-url", _redis_url, None, "Redis URL of the snapshot pool (redis://, "
           "rediss://, unix://, redis+cluster://); unset: an embedded in-process pool"),
    Option("snapshot_ttl_s", "--snapshot-ttl", _duration, 300.0, "TTL of SWA snapshots (e.g. 5m)"),
    Option("response_store_ttl_s", "--response-store-ttl", _duration, 24 * 3600.0, "how long a stored "
           "/v1/responses response (previous_response_id, GET) is kept: in Redis with --redis-url, else in "
           "KV_DIR/responses (in memory with --no-kv-persist); e.g. 24h"),
    Option("resume_policy", "--resume-policy", _choice(*RESUME_POLICIES), "replay", "replay: a cached "
           "prefix without a snapshot resumes by the model's bounded replay (approximate window, reported "
           "as usage.flashtier.resume = replay); exact-or-cold: recompute instead (cold answers only)"),
)
