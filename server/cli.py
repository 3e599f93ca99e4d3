"""The ``flashtier`` command: ``inspect``, ``generate`` and (later) ``serve``."""

from __future__ import annotations

import argparse
import json
import sys

import torch


def _inspect(args: argparse.Namespace) -> int:
    from flashtier.engine.kv_accounting import kv_accounting
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


def _generate(args: argparse.Namespace) -> int:
    from flashtier.engine.generate import generate_text_ids, load_for_cli
    from flashtier.server.tokenizer import Tokenizer

    from flashtier.server.engram_map import engram_token_map

    tok = Tokenizer.from_model_dir(args.model_dir)
    model = load_for_cli(args.model_dir, args.preset, seed=args.weights_seed)
    token_map, _ = engram_token_map(tok, model.cfg.vocab_size, model.cfg.engram_compressed_vocab)
    model.set_token_map(token_map.to(model.device))
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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="flashtier", description="DeepSeek-V4.1-Flash serving daemon")
    sub = p.add_subparsers(dest="command", required=True)

    ins = sub.add_parser("inspect", help="layer roles and KV byte accounting (no weights needed)")
    ins.add_argument("model_dir", nargs="?", default=None)
    ins.add_argument("--preset", default=None, help="v4.1-flash | flash-16e | tiny (default: tiny)")
    ins.add_argument("--block-size", type=int, default=64)
    ins.add_argument("--json", action="store_true")
    ins.set_defaults(func=_inspect)

    gen = sub.add_parser("generate", help="complete a prompt with the incremental path")
    gen.add_argument("model_dir", nargs="?", default=None)
    gen.add_argument("--preset", default=None, help="preset with seeded random weights when no MODEL_DIR")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--weights-seed", type=int, default=0, help=argparse.SUPPRESS)
    gen.set_defaults(func=_generate)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "max_tokens", 1) is not None and getattr(args, "max_tokens", 1) < 1:
        parser.error("--max-tokens must be at least 1")
    try:
        return args.func(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    sys.exit(main())
