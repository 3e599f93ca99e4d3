"""ServerSettings: every knob of the daemon, read once from CLI flags and ``FLASHTIER_*`` variables.

This module is the only place in flashtier that reads the environment or the command line; the
other packages receive frozen config objects built here: ``ServerSettings.kvstore`` is the
``KVStoreConfig`` and ``ServerSettings.engine_config()`` the ``EngineConfig``.

Each option is declared once in ``OPTIONS`` (config/options.py): its flag, its environment variable
(``FLASHTIER_`` + the flag in upper case, dashes as underscores: ``--api-key`` <-> ``FLASHTIER_API_KEY``,
``--prefix-caching`` <-> ``FLASHTIER_PREFIX_CACHING``), how its text is parsed and its default.
MODEL_DIR is ``FLASHTIER_MODEL_DIR``. Precedence: a flag given on the command line, else the environment
variable, else the default. List options take several values after the flag, a repeated flag, or
comma-separated values (``--api-key k1,k2``, ``--api-key k1 --api-key k2``, ``FLASHTIER_API_KEY=k1,k2``).
Booleans take ``--x`` / ``--no-x``, or ``1/true/yes/on`` and ``0/false/no/off`` in the variable.
A list may also be one JSON list (``--allowed-origins '["https://a.example"]'``, as vLLM takes it). An
option's ``aliases`` are vLLM's flags for the same setting (``--gpu-memory-utilization`` sets
``--hbm-utilization``); the table is in docs/settings.md, "vLLM's flags".

A bad value raises ``ValueError`` naming the flag or the variable (the CLI prints it as one line and
exits 2). What needs the file system or the network (the SSD directory, Redis) is checked by
config/checks.py before the model loads.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flashtier.engine.config import EngineConfig
from flashtier.kvstore.config import KVStoreConfig, ssd_segment_bytes_for
from flashtier.server.config.options import (
    CACHE_ISOLATION_MODES,
    ENV_PREFIX,
    OPTIONS,
    Option,
    default_cache_dir,
)

if TYPE_CHECKING:
    from flashtier.engine.parallel.parallel_config import ParallelConfig

__all__ = ["ENV_PREFIX", "OPTIONS", "ServerSettings", "add_serve_arguments", "build_settings",
           "default_cache_dir"]

DEMO_PRESET = "tiny"


def default_kv_dir(cache_dir: str, model_dir: str | None, preset: str | None = None) -> str:
    """Where ``serve`` keeps the SSD tier without --kv-dir: CACHE_DIR/kv/<the model directory's name> (a demo:
    CACHE_DIR/kv/demo-<preset>, so two presets never share one). The ``kv`` tools default to the same directory."""
    label = Path(model_dir).resolve().name if model_dir else f"demo-{preset or DEMO_PRESET}"
    return os.path.join(cache_dir, "kv", label)


def demo_note(preset: str) -> str:
    """What the start-up log and /v1/models say about a demo model: the preset actually served."""
    return (f"demo model: the '{preset}' preset with seeded random weights; its text is not meaningful "
            "(pass a MODEL_DIR to serve a real checkpoint)")


DEMO_NOTE = demo_note(DEMO_PRESET)


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
    admin_api_key: str | None = None  # /admin/v1/* (server/routes_admin.py); None: those routes answer 404
    cache_isolation: str = "shared"  # shared | per-key (CACHE_ISOLATION_MODES)
    max_request_bytes: int = 64 << 20
    max_tokenize_bytes: int = 8 << 20  # /tokenize, /detokenize (app.py)
    frontend_workers: int | None = None  # None: min(4, CPUs) (frontend_pool.py)
    max_tokens_default: int = 32768  # 0: the rest of the context
    allowed_origins: tuple[str, ...] = ()  # CORS off when empty
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    seed: int | None = None  # torch.manual_seed at start (cli.py)
    max_n: int = 16
    drain_timeout_s: float = 30.0
    log_level: str = "info"
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_waiting_requests: int = 1024
    resume_policy: str = "replay"  # replay | exact-or-cold (engine.config.RESUME_POLICIES)
    device: str | None = None
    dtype: str = "auto"
    weights_seed: int = 0
    speculative: int = 0  # drafts verified per step (0: off), --speculative / --speculative-config
    speculative_min_confidence: float = 0.1
    speculative_adaptive: bool = True  # the goodput controller picks each step's draft length (engine/spec/controller.py)
    enforce_eager: bool = False  # no CUDA graphs (vLLM's --enforce-eager)
    warmup: bool | None = None  # None: on with CUDA unless TRITON_INTERPRET (engine_config)
    cuda_graph_sizes: tuple[int, ...] | None = None  # None: the engine's CAPTURE_SIZES up to max_num_seqs
    tensor_parallel_size: int = 1  # > 1: one rank process each (engine/parallel/executor.py), tiers off
    expert_parallel: bool = False
    engine_step_timeout_s: float = 900.0  # a longer engine step ends the engine (EngineCoreClient)
    distributed_timeout_s: float = 600.0  # torch.distributed's process-group timeout (TP > 1)
    response_store_ttl_s: float = 24 * 3600.0  # --response-store-ttl (server/response_store/store.py)
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
        if self.admin_api_key is not None:
            if not self.admin_api_key or self.admin_api_key != self.admin_api_key.strip():
                raise ValueError("--admin-api-key: the admin key must be non-empty and without surrounding spaces")
            if self.admin_api_key in self.api_key:
                raise ValueError("--admin-api-key: the admin key is also an --api-key; give the admin its own key")
        if self.cache_isolation not in CACHE_ISOLATION_MODES:
            modes = " | ".join(CACHE_ISOLATION_MODES)
            raise ValueError(f"--cache-isolation {self.cache_isolation!r}: not a mode; use {modes}")
        for flag, value in (("--max-request-bytes", self.max_request_bytes),
                            ("--max-tokenize-bytes", self.max_tokenize_bytes)):
            if value < 1024:
                raise ValueError(f"{flag} must be at least 1024, got {value}")
        if isinstance(self.tensor_parallel_size, bool) or not isinstance(self.tensor_parallel_size, int) or (
                self.tensor_parallel_size < 1):
            raise ValueError(f"--tensor-parallel-size must be a positive integer, got {self.tensor_parallel_size!r}")
        if self.max_tokens_default < 0:
            raise ValueError(f"--max-tokens-default must be >= 0, got {self.max_tokens_default}")

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

    def parallel_config(self) -> ParallelConfig:
        """The model's split over ranks (ValueError naming the flag for a bad size)."""
        from flashtier.engine.parallel.parallel_config import ParallelConfig  # torch.distributed: only when used

        return ParallelConfig(tensor_parallel_size=self.tensor_parallel_size, expert_parallel=self.expert_parallel)

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
            resume_policy=self.resume_policy,
            speculative_tokens=self.speculative,
            speculative_min_confidence=self.speculative_min_confidence,
            speculative_adaptive=self.speculative_adaptive,
            cuda_graphs=not self.enforce_eager,
            cuda_graph_sizes=self.cuda_graph_sizes or (),
            warmup=self.warmup if self.warmup is not None else (
                device.startswith("cuda") and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")),
        )


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Register MODEL_DIR and every option on `parser` (defaults None, so unset flags fall to the env)."""
    parser.add_argument("model_dir", nargs="?", default=None, metavar="MODEL_DIR",
                        help="checkpoint directory (config.json, safetensors, tokenizer.json); "
                             "default: $FLASHTIER_MODEL_DIR, else the demo 'tiny' preset")
    for opt in OPTIONS:
        help_text = argparse.SUPPRESS if opt.hidden else f"{opt.help} [env {opt.env}]"
        flags = (opt.flag, *opt.aliases)
        if opt.kind == "bool":  # each flag gets its --no- form (--no-enable-prefix-caching too)
            parser.add_argument(*flags, dest=opt.dest, action=argparse.BooleanOptionalAction, default=None,
                                help=help_text)
        elif opt.kind == "list":  # several values, a repeated flag, or commas (split in build_settings)
            parser.add_argument(*flags, dest=opt.dest, nargs="+", action="extend", type=_arg_type(opt),
                                default=None, help=help_text)
        else:
            parser.add_argument(*flags, dest=opt.dest, type=_arg_type(opt), default=None, help=help_text)


def _split_list(opt: Option, text: str) -> tuple[Any, ...]:
    """A list option's comma-separated values, each parsed (empty items are skipped, but not all of them:
    ``--api-key "$KEY"`` with KEY unset must not start an open server)."""
    if text.lstrip().startswith("["):  # vLLM's form: one JSON list of strings
        try:
            items = json.loads(text)
        except ValueError:
            raise ValueError(f"expected a JSON list of strings or comma-separated values, got {text!r}") from None
        if not isinstance(items, list) or not all(isinstance(item, str) for item in items):
            raise ValueError(f"expected a JSON list of strings, got {text!r}")
        text = ",".join(items)
    values = tuple(opt.parse(part.strip()) for part in text.split(",") if part.strip())
    if not values:
        raise ValueError(f"expected one or more comma-separated values, got {text!r}")
    return values


def _arg_type(opt: Option) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            return _split_list(opt, text) if opt.kind == "list" else opt.parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    parse.__name__ = opt.dest  # argparse names the type in its error message
    return parse


def _from_env(opt: Option, environ: Mapping[str, str]) -> Any:
    text = environ.get(opt.env)
    if text is None or text == "":
        return None
    try:
        return _split_list(opt, text) if opt.kind == "list" else opt.parse(text)
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
        if opt.kind == "list" and value is not None:  # argparse gives one tuple per value after the flag
            value = tuple(dict.fromkeys(v for part in value for v in part))
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
            kv_dir = default_kv_dir(cache_dir, values["model_dir"], values["preset"])
    else:
        kv_dir = None
    values.pop("data_parallel_size")  # vLLM's flags: the parser accepts only 1, and the other has no effect
    values.pop("trust_remote_code")
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
        ssd_segment_bytes=ssd_segment_bytes_for(budget),
        redis_url=values.pop("redis_url"),
        snapshot_ttl_s=values.pop("snapshot_ttl_s"),
    )
    return ServerSettings(**values, kvstore=kvstore, cache_dir=cache_dir)
