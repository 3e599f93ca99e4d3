"""The ``flashtier`` command: ``inspect``, ``plan``, ``generate``, ``serve`` and ``kv`` (the SSD tier's tools,
kv_admin/command.py). ``plan`` takes serve's command line and prints the memory plan (engine/plan) instead of
serving; it exits 0 when the plan fits, 1 when it does not.

A bad command line or setting ends the command with one line on stderr, ``flashtier: error: ...``
(for a setting: ``--flag VALUE: what is wrong; how to fix``), and exit status 2, never a traceback.
``serve`` checks its settings (settings.py) and what they point at (config/checks.py: the SSD
directory, the model config, Redis) before it loads the model, then holds KV_DIR/SERVER.LOCK for its
lifetime (kv_dir_lock.py: a second server on the same directory stops with one line). Every log line,
uvicorn's access and error logs included, has one format: ``LOG_FORMAT``, with a timestamp.
An engine that cannot be built ends ``serve`` with one line, ``the engine could not be started: <cause>``, and
exit status 2 as well. SIGTERM or SIGINT drains (--drain-timeout, serving/drain.py) and exits with status 0.
``flashtier --version`` and ``flashtier serve --version`` print the version.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from typing import TYPE_CHECKING, NoReturn

PROG = "flashtier"
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_LOG_HANDLER = "flashtier"  # the name of the root handler configure_logging installs (once)

from collections.abc import Callable

if TYPE_CHECKING:
    import torch

    from flashtier.engine.client import EngineClient
    from flashtier.engine.config import EngineConfig
    from flashtier.server.app import EngineClientFactory
    from flashtier.server.config.settings import ServerSettings


def _inspect(args: argparse.Namespace) -> int:
    from flashtier.engine.kv.accounting import kv_accounting
    from flashtier.engine.model.config import resolve

    cfg = resolve(args.model_dir, args.preset)
    layers = [
        {"index": r.index, "part": r.part, "role": r.role, "ratio": r.ratio} for r in cfg.layer_roles()
    ]
    kv = kv_accounting(cfg, block_size=args.block_size).to_dict()
    if args.json:
        print(json.dumps({"model": cfg.name, "layers": layers, "kv": kv}, indent=2))
        return 0
    print(f"model: {cfg.name}  hidden {cfg.hidden_size}  layers {cfg.num_hidden_layers}  "
          f"window {cfg.sliding_window}  index top-k {cfg.index_topk}")
    print(f"{'layer':>5}  {'part':<8} {'role':<8} {'ratio':>5}")
    for row in layers:
        print(f"{row['index']:>5}  {row['part']:<8} {row['role']:<8} {row['ratio']:>5}")
    print()
    for key, value in kv.items():
        print(f"{key:<24} {value:>12,}")
    return 0


def _plan(args: argparse.Namespace) -> int:
    """The memory plan of a serve command line: per GPU and per host, checked against --gpu-memory /
    --host-memory when given, else against this machine's cards and available memory."""
    from flashtier.engine.plan.report import plan_dict, plan_table
    from flashtier.server.config.plan_check import evaluate, gpu_memory, host_available, plan_settings
    from flashtier.server.config.settings import build_settings

    settings = plan_settings(build_settings(args, os.environ), args.gpu_memory)
    if args.gpu_memory is not None:
        cards = (args.gpu_memory,) * settings.tensor_parallel_size
        if not settings.engine_config().device.startswith("cuda"):
            cards = ()
    else:
        cards = gpu_memory(settings)
    host = args.host_memory if args.host_memory is not None else host_available()
    plan, _, misfit = evaluate(settings, cards, host)
    if args.json:
        print(json.dumps(plan_dict(plan, misfit, host), indent=2))
    else:
        print(plan_table(plan, misfit, host))
    return 0 if misfit is None else 1


def _generate(args: argparse.Namespace) -> int:
    from flashtier.engine.generate import generate_text_ids, load_for_cli
    from flashtier.server.text.engram_map import install_token_map
    from flashtier.server.text.tokenizer import Tokenizer

    tok = Tokenizer.from_model_dir(args.model_dir)
    model = load_for_cli(args.model_dir, args.preset, seed=args.weights_seed)
    install_token_map(model, tok)
    if args.model_dir is None:
        print(f"note: preset {model.cfg.name!r} with seeded random weights: its text is not meaningful",
              file=sys.stderr)
    ids = tok.encode(args.prompt)
    if not ids:
        print("error: the prompt encodes to no tokens", file=sys.stderr)
        return 2
    out = generate_text_ids(model, ids, max_tokens=args.max_tokens, temperature=args.temperature,
                            seed=args.seed, stop_ids={tok.eos_id})
    print(tok.decode(out))
    return 0


def configure_logging(level: str) -> None:
    """One stderr handler with ``LOG_FORMAT`` on the root logger, at `level` (trace: DEBUG); uvicorn's loggers
    propagate to it (``serve`` passes uvicorn no log config). Replaces the handler a previous call installed,
    leaves other handlers (a test's capture) alone."""
    import logging

    root = logging.getLogger()
    for handler in [h for h in root.handlers if h.get_name() == _LOG_HANDLER]:
        root.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
    handler.set_name(_LOG_HANDLER)
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    root.addHandler(handler)
    root.setLevel("DEBUG" if level == "trace" else level.upper())


def _serve_seed(settings: ServerSettings) -> None:
    """vLLM's --seed: ``torch.manual_seed`` (every device's default generator), so the draws of requests
    without their own seed repeat from start-up. Without --seed the generators are left alone."""
    if settings.seed is not None:
        import torch  # imported by the commands that need it: `flashtier kv` starts without it

        torch.manual_seed(settings.seed)


def _serve(args: argparse.Namespace, engine_factory: EngineClientFactory | None = None) -> int:
    import logging

    from flashtier.server.config.kv_dir_lock import KVDirLock
    from flashtier.server.config.settings import build_settings
    from flashtier.server.config.checks import preflight

    # settings first, the app (torch, the tokenizer stack: ~3 s of imports) only once they pass: a bad flag
    # is one line within a fraction of a second
    settings = build_settings(args, os.environ)
    configure_logging(settings.log_level)
    for warning in preflight(settings):  # SettingsError (a ValueError) ends main() with one line
        logging.getLogger("flashtier.server.config.settings").warning("%s", warning)
    kv_dir = settings.kvstore.ssd_dir
    kv_lock = KVDirLock.acquire(os.path.abspath(os.path.expanduser(kv_dir))) if kv_dir else None  # KVDirInUse: 2
    try:
        import uvicorn

        from flashtier.server.app import create_app
        from flashtier.server.serving.drain import UVICORN_MARGIN_S, DrainingServer

        _serve_seed(settings)
        _keep_compiled_kernels(settings)
        failed = []

        def stop_on_failure() -> None:  # the engine could not be built (app.py logged why): exit status 2
            failed.append(True)
            server.should_exit = True

        app = create_app(settings, engine_factory or _model_engine, on_fatal=stop_on_failure)
        # SIGTERM / SIGINT: the app drains (serving/drain.py) and ends what is left at --drain-timeout, in each
        # API's shape; uvicorn waits a little longer, so its own cancellation is only the backstop. Exit 0.
        config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                                log_config=None, timeout_graceful_shutdown=settings.drain_timeout_s + UVICORN_MARGIN_S)
        server = DrainingServer(config, app.state.flashtier.drain, settings.drain_timeout_s)
        server.run()
    finally:
        if kv_lock is not None:
            kv_lock.release()
    return 2 if failed else 0


def _keep_compiled_kernels(settings: ServerSettings) -> None:
    """Triton's compiled kernels in CACHE_DIR/triton (unless TRITON_CACHE_DIR says otherwise), so a restart
    with the same cache directory loads them instead of compiling (the container keeps /var/cache/flashtier)."""
    os.environ.setdefault("TRITON_CACHE_DIR", os.path.join(settings.cache_dir, "triton"))


def _model_engine(s: ServerSettings, *, phase: Callable[[str], None] | None = None) -> EngineClient:
    """The engine ``serve`` runs: the checkpoint in MODEL_DIR, else the demo checkpoint, in the engine-core
    process(es) (engine/parallel/executor.py): one child process with one rank (the KV tiers beside it), one
    per rank with --tensor-parallel-size N (SPMD, tiers off: their lookups complete on I/O threads at times the
    ranks do not share). Warmed up before it serves when the settings say so (``phase`` hears "warming up").
    Runs on the app's loader thread, blocking until the engine core is ready."""
    import dataclasses
    import logging

    from flashtier.engine.model.config import resolve
    from flashtier.engine.model.loader import demo_checkpoint
    from flashtier.engine.parallel.executor import start_engine_core
    from flashtier.server.text.engram_map import model_token_map
    from flashtier.server.text.tokenizer import Tokenizer

    config = s.engine_config()
    # The demo checkpoint (seeded random weights) in the cache directory. On a GPU in bf16/fp32 the engine makes
    # the random weights on the device in their formats instead: writing flash-16e's checkpoint from the CPU
    # needs ~120 GB of host memory and minutes, the device takes seconds.
    on_device = config.device.startswith("cuda") and config.dtype != "float64"
    if s.is_demo and not on_device:
        path = demo_checkpoint(os.path.join(s.cache_dir, "models"), s.effective_preset, s.weights_seed)
        config = dataclasses.replace(config, model_dir=str(path))
    cfg = resolve(config.model_dir, s.effective_preset)
    tok = Tokenizer(s.tokenizer) if s.tokenizer else Tokenizer.from_model_dir(s.model_dir)
    if s.tensor_parallel_size > 1:
        logging.getLogger("flashtier.server.config.settings").warning(
            "--tensor-parallel-size %d: the SSD tier and the snapshot pool are off (tiers are single-rank for "
            "now); each rank keeps its HBM prefix cache", s.tensor_parallel_size)
    return start_engine_core(s.parallel_config(), config, s.kvstore, model_token_map(tok, cfg), seed=s.seed,
                             tiers=s.tensor_parallel_size == 1, log_level=s.log_level, log_format=LOG_FORMAT,
                             pg_timeout_s=s.distributed_timeout_s, phase=phase,
                             step_timeout_s=s.engine_step_timeout_s)


def _size_arg(parse: Callable[[str], int]) -> Callable[[str], int]:
    def size(text: str) -> int:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return size


class OneLineParser(argparse.ArgumentParser):
    """argparse, except that a usage error is one line, ``flashtier: error: --flag: message``, exit 2
    (the full usage of ``serve`` is long; ``--help`` prints it)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{PROG}: error: {message.removeprefix('argument ')}\n")


def build_parser(engine_factory: EngineClientFactory | None = None) -> argparse.ArgumentParser:
    """The command line; `engine_factory` replaces the engine ``serve`` builds (see ``main``)."""
    from flashtier import __version__

    p = OneLineParser(prog=PROG, description="DeepSeek-V4.1-Flash serving daemon")
    p.add_argument("--version", action="version", version=__version__)
    sub = p.add_subparsers(dest="command", required=True)

    ins = sub.add_parser("inspect", help="layer roles and KV byte accounting (no weights needed)")
    ins.add_argument("model_dir", nargs="?", default=None)
    ins.add_argument("--preset", default=None, help="v4.1-flash | flash-16e | tiny (default: tiny)")
    ins.add_argument("--block-size", type=int, default=64)
    ins.add_argument("--json", action="store_true")
    ins.set_defaults(func=_inspect)

    from flashtier.server.config.options import parse_size
    from flashtier.server.config.settings import add_serve_arguments

    pln = sub.add_parser("plan", help="the memory plan of a serve command line (per GPU, per host); exit 1 when "
                         "it does not fit")
    add_serve_arguments(pln)
    pln.add_argument("--gpu-memory", type=_size_arg(parse_size), default=None, metavar="SIZE",
                     help="plan for GPUs of this size (e.g. 80GiB, 141GB; implies --device cuda); default: this "
                          "machine's cards")
    pln.add_argument("--host-memory", type=_size_arg(parse_size), default=None, metavar="SIZE",
                     help="plan for a host with this much memory available; default: this host's MemAvailable")
    pln.add_argument("--json", action="store_true", help="every rank's rows as JSON")
    pln.set_defaults(func=_plan)

    gen = sub.add_parser("generate", help="complete a prompt with the incremental path")
    gen.add_argument("model_dir", nargs="?", default=None)
    gen.add_argument("--preset", default=None, help="preset with seeded random weights when no MODEL_DIR")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--weights-seed", type=int, default=0, help=argparse.SUPPRESS)
    gen.set_defaults(func=_generate)

    srv = sub.add_parser("serve", help="the OpenAI-compatible HTTP server (no MODEL_DIR: the demo 'tiny' model)")
    srv.add_argument("--version", action="version", version=__version__)
    add_serve_arguments(srv)
    srv.set_defaults(func=functools.partial(_serve, engine_factory=engine_factory))

    from flashtier.server.kv_admin.command import add_kv_parser

    add_kv_parser(sub)  # kv stats | verify | wipe: the SSD tier's operator tools (kv_admin/command.py)
    return p


def main(argv: list[str] | None = None, *, engine_factory: EngineClientFactory | None = None) -> int:
    """Run the command in `argv`. `engine_factory` (settings -> an ``EngineClient``) replaces the model
    engine of ``serve``: the API in front of another engine client, as the tests run it."""
    parser = build_parser(engine_factory)
    args = parser.parse_args(argv)
    if getattr(args, "max_tokens", 1) is not None and getattr(args, "max_tokens", 1) < 1:
        parser.error("--max-tokens must be at least 1")
    try:
        return args.func(args)
    except ValueError as exc:  # a bad setting (SettingsError) or argument: one line, no traceback
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # as the console script: the runners run without autograd (torch.no_grad)
    sys.exit(main())
