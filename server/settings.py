"""ServerSettings: every knob of the daemon, read once from CLI flags and ``FLASHTIER_*`` variables.

This module is the only place in flashtier that reads the environment or the command line; the
other packages receive frozen config objects built here: ``ServerSettings.kvstore`` is the
``KVStoreConfig`` and ``ServerSettings.engine_config()`` the ``EngineConfig``.

Each option is declared once in ``OPTIONS``: its flag, its environment variable (``FLASHTIER_`` +
the flag in upper case, dashes as underscores: ``--api-key`` <-> ``FLASHTIER_API_KEY``,
``--prefix-caching`` <-> ``FLASHTIER_PREFIX_CACHING``), how its text is parsed and its default.
MODEL_DIR is ``FLASHTIER_MODEL_DIR``. Precedence: a flag given on the command line, else the environment
variable, else the default. List options take several values after the flag, or a comma-separated
list in the variable (``FLASHTIER_API_KEY=k1,k2``). Booleans take ``--x`` / ``--no-x``, or
``1/true/yes/on`` and ``0/false/no/off`` in the variable.

A bad value raises ``ValueError`` naming the flag or the variable; argparse turns the flag case
into its usual usage error.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flashtier.engine.config import EngineConfig
from flashtier.kvstore.config import GiB, KVStoreConfig

__all__ = ["ENV_PREFIX", "OPTIONS", "ServerSettings", "add_serve_arguments", "build_settings"]

ENV_PREFIX = "FLASHTIER_"
DEMO_PRESET = "tiny"
DEMO_NOTE = (
    "demo model: the 'tiny' preset with seeded random weights; its text is not meaningful "
    "(pass a MODEL_DIR to serve a real checkpoint)"
)


def _parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected a boolean (1/0, true/false, yes/no, on/off), got {text!r}")


def _parse_port(text: str) -> int:
    port = int(text)
    if not 0 <= port <= 65535:
        raise ValueError(f"a port must be in [0, 65535], got {port}")
    return port


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise ValueError(f"must be a positive integer, got {value}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise ValueError(f"must be a number >= 0, got {text!r}")
    return value


def _fraction(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise ValueError(f"must be in (0, 1], got {text!r}")
    return value


def _log_level(text: str) -> str:
    value = text.strip().lower()
    if value not in ("critical", "error", "warning", "info", "debug", "trace"):
        raise ValueError(f"unknown log level {text!r}; use critical|error|warning|info|debug|trace")
    return value


def _dtype(text: str) -> str:
    if text not in ("auto", "float32", "bfloat16", "float64"):
        raise ValueError(f"dtype must be auto, float32, bfloat16 or float64, got {text!r}")
    return text


_SIZE_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 1000**2,
               "mib": 1 << 20, "g": 1 << 30, "gb": 1000**3, "gib": 1 << 30, "t": 1 << 40, "tb": 1000**4,
               "tib": 1 << 40}
_TIME_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "d": 86400.0}


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


def _duration(text: str) -> float:
    """Seconds with an optional unit: 300, 300s, 5m, 72h, 3d."""
    value, unit = _split_unit(text)
    if unit not in _TIME_UNITS or value <= 0:
        raise ValueError(f"{text!r} is not a positive duration (units: s, m, h, d)")
    return value * _TIME_UNITS[unit]


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
    Option("api_key", "--api-key", str, (), "API key(s) required as `Authorization: Bearer KEY` on /v1/*",
           kind="list"),
    Option("max_request_bytes", "--max-request-bytes", _positive_int, 64 << 20, "largest request body "
           "accepted (HTTP 413 above it)"),
    Option("max_n", "--max-n", _positive_int, 16, "largest `n` (choices per request) accepted"),
    Option("drain_timeout_s", "--drain-timeout", _non_negative_float, 30.0, "seconds SIGTERM waits for "
           "in-flight requests before aborting them"),
    Option("log_level", "--log-level", _log_level, "info", "log level"),
    # -- engine
    Option("max_num_seqs", "--max-num-seqs", _positive_int, 64, "most sequences decoded in one step"),
    Option("max_num_batched_tokens", "--max-num-batched-tokens", _positive_int, 512, "token budget of one "
           "engine step (prefill chunk + replay + decode tokens)"),
    Option("max_waiting_requests", "--max-waiting-requests", _positive_int, 1024, "bound of the waiting "
           "queue; a request beyond it is answered 429"),
    Option("device", "--device", str, None, "torch device (default: cuda when available, else cpu)"),
    Option("dtype", "--dtype", _dtype, "auto", "auto | float32 | bfloat16 | float64 (auto: bfloat16 on "
           "cuda, float32 on cpu)"),
    Option("weights_seed", "--weights-seed", int, 0, "seed of the demo preset's random weights",
           hidden=True),
    # -- kvstore
    Option("block_size", "--block-size", _positive_int, 64, "tokens per KV block (a multiple of 8)"),
    Option("num_blocks", "--num-blocks", _positive_int, None, "HBM pool size in blocks (overrides "
           "--hbm-utilization)"),
    Option("hbm_utilization", "--hbm-utilization", _fraction, 0.9, "fraction of free device memory for KV"),
    Option("enable_prefix_caching", "--prefix-caching", _parse_bool, True, "keep freed full blocks for "
           "prefix reuse", kind="bool"),
    Option("cache_dir", "--cache-dir", str, None, "directory of the demo checkpoint and the default "
           "--kv-dir (default: $XDG_CACHE_HOME/flashtier)"),
    Option("kv_dir", "--kv-dir", str, None, "directory of the SSD tier (global KV, guaranteed lifetime); "
           "default: CACHE_DIR/kv/<model>"),
    Option("kv_persist", "--kv-persist", _parse_bool, True, "write global KV through to the SSD tier "
           "(--no-kv-persist: HBM prefix cache and snapshots only)", kind="bool"),
    Option("kv_disk_budget", "--kv-disk-budget", _size, 512 * GiB, "disk budget of the SSD tier (e.g. 100G); "
           "full of entries inside their lifetime => new writes are refused, serving goes on"),
    Option("kv_lifetime_s", "--kv-lifetime", _duration, 72 * 3600.0, "guaranteed lifetime of an SSD entry "
           "after its last write (e.g. 72h)"),
    Option("redis_url", "--redis-url", str, None, "Redis URL of the snapshot pool (redis://, rediss://, "
           "redis+cluster://); unset: an embedded in-process pool"),
    Option("snapshot_ttl_s", "--snapshot-ttl", _duration, 300.0, "TTL of SWA snapshots (e.g. 5m)"),
)
_BY_DEST = {o.dest: o for o in OPTIONS}


@dataclass(frozen=True)
class ServerSettings:
    """Frozen daemon settings. Build with ``build_settings`` (CLI + env) or directly in tests."""

    model_dir: str | None = None
    preset: str | None = None
    served_model_name: tuple[str, ...] = ()
    tokenizer: str | None = None
    max_model_len: int | None = None
    default_thinking: bool = False
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: tuple[str, ...] = ()
    max_request_bytes: int = 64 << 20
    max_n: int = 16
    drain_timeout_s: float = 30.0
    log_level: str = "info"
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_waiting_requests: int = 1024
    device: str | None = None
    dtype: str = "auto"
    weights_seed: int = 0
    kvstore: KVStoreConfig = field(default_factory=KVStoreConfig)
    cache_dir: str = field(default_factory=default_cache_dir)

    def __post_init__(self) -> None:
        if self.model_dir is not None and not Path(self.model_dir).is_dir():
            raise ValueError(f"MODEL_DIR {self.model_dir!r} is not a directory")
        for name in self.served_model_name:
            if not name or name != name.strip():
                raise ValueError(f"--served-model-name: invalid name {name!r}")
        for key in self.api_key:
            if not key or key != key.strip():
                raise ValueError("--api-key: an API key must be non-empty and without surrounding spaces")
        if self.max_request_bytes < 1024:
            raise ValueError(f"--max-request-bytes must be at least 1024, got {self.max_request_bytes}")

    @property
    def is_demo(self) -> bool:
        """No checkpoint: the demo preset with random weights (its text is not meaningful)."""
        return self.model_dir is None

    @property
    def effective_preset(self) -> str | None:
        return self.preset if self.preset is not None or self.model_dir is not None else DEMO_PRESET

    @property
    def model_names(self) -> tuple[str, ...]:
        """Names accepted in a request's `model`; the first is the one /v1/models lists first."""
        if self.served_model_name:
            return self.served_model_name
        if self.model_dir is not None:
            return (Path(self.model_dir).resolve().name or "model",)
        return (f"flashtier-{self.effective_preset}",)

    @property
    def model_name(self) -> str:
        return self.model_names[0]

    def engine_config(self) -> EngineConfig:
        """The engine's config; resolves device (cuda when available) and dtype "auto" now."""
        device = self.device
        if device is None or self.dtype == "auto":
            import torch

            device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        dtype = self.dtype if self.dtype != "auto" else ("bfloat16" if device.startswith("cuda") else "float32")
        return EngineConfig(
            model_dir=self.model_dir,
            preset=self.effective_preset or "tiny",
            weights_seed=self.weights_seed,
            dtype=dtype,
            device=device,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            max_waiting=self.max_waiting_requests,
        )


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Register MODEL_DIR and every option on `parser` (defaults None, so unset flags fall to the env)."""
    parser.add_argument("model_dir", nargs="?", default=None, metavar="MODEL_DIR",
                        help="checkpoint directory (config.json, safetensors, tokenizer.json); "
                             "default: $FLASHTIER_MODEL_DIR, else the demo 'tiny' preset")
    for opt in OPTIONS:
        help_text = argparse.SUPPRESS if opt.hidden else f"{opt.help} [env {opt.env}]"
        if opt.kind == "bool":
            parser.add_argument(opt.flag, dest=opt.dest, action=argparse.BooleanOptionalAction, default=None,
                                help=help_text)
        elif opt.kind == "list":
            parser.add_argument(opt.flag, dest=opt.dest, nargs="+", type=_arg_type(opt), default=None,
                                help=help_text)
        else:
            parser.add_argument(opt.flag, dest=opt.dest, type=_arg_type(opt), default=None, help=help_text)


def _arg_type(opt: Option) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            return opt.parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    parse.__name__ = opt.dest  # argparse names the type in its error message
    return parse


def _from_env(opt: Option, environ: Mapping[str, str]) -> Any:
    text = environ.get(opt.env)
    if text is None or text == "":
        return None
    try:
        if opt.kind == "list":
            return tuple(opt.parse(part.strip()) for part in text.split(",") if part.strip())
        return opt.parse(text)
    except ValueError as exc:
        raise ValueError(f"{opt.env}={text!r}: {exc}") from None


def build_settings(argv_namespace: argparse.Namespace | None, environ: Mapping[str, str] | None = None,
                   **overrides: Any) -> ServerSettings:
    """Settings from parsed flags (``add_serve_arguments``), then `environ`, then defaults.

    `overrides` (keyword = option dest) win over both; tests use them. Raises ValueError on a bad
    environment value or an inconsistent combination.
    """
    environ = os.environ if environ is None else environ
    ns = argv_namespace if argv_namespace is not None else argparse.Namespace()
    values: dict[str, Any] = {}
    for opt in OPTIONS:
        value = getattr(ns, opt.dest, None)
        if opt.kind == "list" and value is not None:
            value = tuple(value)
        if value is None:
            value = _from_env(opt, environ)
        values[opt.dest] = opt.default if value is None else value
    model_dir = getattr(ns, "model_dir", None) or environ.get(ENV_PREFIX + "MODEL_DIR") or None
    values["model_dir"] = model_dir
    unknown = set(overrides) - set(values)
    if unknown:
        raise ValueError(f"unknown settings: {sorted(unknown)}")
    values.update(overrides)
    if values["model_dir"] is not None:
        values["model_dir"] = os.fspath(values["model_dir"])
    cache_dir = values.pop("cache_dir") or default_cache_dir(environ)
    kv_dir = values.pop("kv_dir")
    if values.pop("kv_persist"):
        if kv_dir is None:
            label = Path(values["model_dir"]).resolve().name if values["model_dir"] else "demo-tiny"
            kv_dir = os.path.join(cache_dir, "kv", label)
    else:
        kv_dir = None
    lifetime = values.pop("kv_lifetime_s")
    budget = values.pop("kv_disk_budget")
    kvstore = KVStoreConfig(
        block_size=values.pop("block_size"),
        num_blocks=values.pop("num_blocks"),
        hbm_utilization=values.pop("hbm_utilization"),
        enable_prefix_caching=values.pop("enable_prefix_caching"),
        ssd_dir=kv_dir,
        ssd_budget_bytes=budget,
        ssd_lifetime_s=lifetime,
        ssd_refresh_age_s=lifetime / 3,  # a hit on an entry older than a third of its lifetime re-appends it
        ssd_segment_bytes=min(KVStoreConfig.ssd_segment_bytes, max(1 << 20, budget // 8)),
        redis_url=values.pop("redis_url"),
        snapshot_ttl_s=values.pop("snapshot_ttl_s"),
    )
    return ServerSettings(**values, kvstore=kvstore, cache_dir=cache_dir)
