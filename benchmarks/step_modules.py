"""How many distinct flashtier modules one decode ``Engine.step()`` runs code in (the demo model, CPU).

    python3 -P benchmarks/step_modules.py [--batch 4] [--json OUT]

Builds the tiny demo engine, admits ``--batch`` greedy requests, steps until every one decodes, then records
with ``sys.setprofile`` (Python calls only) the module of every function called during one more step. Prints
the count and the modules by package.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter

from flashtier.engine.config import EngineConfig
from flashtier.engine.factory import build_engine
from flashtier.engine.sample.params import SamplingParams
from flashtier.kvstore.config import KVStoreConfig


def modules_of_one_decode_step(batch: int) -> list[str]:
    engine = build_engine(EngineConfig(preset="tiny", weights_seed=0), KVStoreConfig(block_size=64))
    for i in range(batch):
        engine.add_request(f"r{i}", [10 + i + j for j in range(40)],
                           SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    for _ in range(4):  # prefill, then decode steps (graphs off on the CPU)
        engine.step()
    seen: set[str] = set()

    def profile(frame, event, arg):
        if event == "call":
            name = frame.f_globals.get("__name__", "")
            if name.startswith("flashtier."):
                seen.add(name)

    sys.setprofile(profile)
    try:
        engine.step()
    finally:
        sys.setprofile(None)
    return sorted(seen)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    mods = modules_of_one_decode_step(args.batch)
    by_pkg = Counter(m.rsplit(".", 1)[0] for m in mods)
    print(f"{len(mods)} flashtier modules in one decode step (batch {args.batch})")
    for pkg, n in sorted(by_pkg.items()):
        print(f"  {pkg}: {n}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": "python3 -P benchmarks/step_modules.py " + " ".join(argv or sys.argv[1:]),
                       "modules": mods, "count": len(mods)}, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
