"""Tier restore into the pool, per agent turn (1,563 blocks of the real 56,960 B image = 100K tokens): the
bytes path the engine had (``get_many``, then ``GlobalKVPool.load_image`` per block) against the restore
buffer (``get_many_into`` a reused buffer, then one ``RestoredRun.install``), page cache warm, so the rows
measure the CPU and copy cost of the path, not the disk (benchmarks/tier_restore_bench.py does the disk).

    bytes_path         get_many of a turn's keys, then load_image per block (a bytes -> tensor copy each)
    buffer_path        RestoreBuffer.acquire + get_many_into + install into scattered fresh block ids
    install_scattered  install alone from a filled buffer: one host-to-device copy, then index_copy_
    install_range      install alone into a contiguous range of blocks: one copy straight into the rows
    h2d_ceiling        (CUDA) pool[a:b].copy_(pinned buffer, non_blocking) of the same bytes: the copy rate

Every row is timed to completion (the device synchronised) and checked against the images written.
GB/s counts image bytes; on CUDA ``x_ceiling`` is a row's rate over h2d_ceiling (the "tier restore /
pinned H2D" target of docs/performance.md is install_* >= 0.8). Medians over ``--turns`` turns.

    python3 -P benchmarks/restore_install_bench.py --device cuda --out docs/perf/restore_install_cuda.json
    python3 -P benchmarks/restore_install_bench.py --device cpu --turns 2
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from flashtier.engine.tiers.restore_buffer import RestoreBuffer
from flashtier.engine.tiers.restored_run import RestoredRun
from flashtier.kvstore.kv_pool import GlobalKVPool
from flashtier.kvstore.layout import BlockLayout, KVGeometry

sys.path.insert(0, str(Path(__file__).resolve().parent))  # sibling modules (run as python3 -P)
from tier_restore_bench import PAYLOAD, TURN_KEYS, Spent, device, key, payload, write_store  # noqa: E402

# the real geometry: 3 ratio-2 streams and 1 ratio-1 stream of 64-token blocks = 160 entries x 356 B
LAYOUT = BlockLayout(KVGeometry(512, 128, (2, 2, 2, 1), window=128, n_window_layers=1, n_encoder_window_layers=1), 64)


def synced(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def check(pool: GlobalKVPool, ids: list[int], turn: list[int]) -> None:
    for bid, i in zip(ids[:: max(1, len(ids) // 16)], turn[:: max(1, len(ids) // 16)]):
        if pool.image(bid) != payload(i):
            raise RuntimeError(f"block {bid} does not hold record {i}")


def measure(store, pool: GlobalKVPool, buf: RestoreBuffer, turn: list[int], ids: list[int]) -> dict[str, Spent]:
    """One turn through every row (each row's result checked outside its timing)."""
    dev, keys, nbytes = pool.data.device, [key(i) for i in turn], len(turn) * PAYLOAD
    out = {name: Spent(nbytes=nbytes) for name in ("bytes_path", "buffer_path", "install_scattered", "install_range")}

    def bytes_path() -> None:
        for bid, image in zip(ids, store.get_many(keys), strict=True):
            pool.load_image(bid, image)
        synced(dev)

    def buffer_path() -> None:
        lease = buf.acquire(len(keys))
        if not all(store.get_many_into(keys, lease.writable(), PAYLOAD)):
            raise RuntimeError("a miss in a warm store")
        RestoredRun(lease, len(keys)).install(pool.data, ids)
        synced(dev)

    def install(name: str, targets: list[int]) -> None:
        lease = buf.acquire(len(keys))
        if not all(store.get_many_into(keys, lease.writable(), PAYLOAD)):
            raise RuntimeError("a miss in a warm store")
        synced(dev)
        out[name].time(lambda: (RestoredRun(lease, len(keys)).install(pool.data, targets), synced(dev)))
        check(pool, targets, turn)

    for name, fn in (("bytes_path", bytes_path), ("buffer_path", buffer_path)):
        pool.data.zero_()
        out[name].time(fn)
        check(pool, ids, turn)
    install("install_scattered", ids)
    install("install_range", list(range(1, 1 + len(ids))))
    if dev.type == "cuda":
        host = torch.empty(len(ids), PAYLOAD, dtype=torch.uint8, pin_memory=True)
        out["h2d_ceiling"] = Spent(nbytes=nbytes)
        out["h2d_ceiling"].time(lambda: (pool.data[1 : 1 + len(ids)].copy_(host, non_blocking=True), synced(dev)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--turns", type=int, default=5, help="turns measured (medians reported; one more warms up)")
    ap.add_argument("--dir", default=None, help="parent directory of the store (default: the system temp dir)")
    ap.add_argument("--out", default=None, help="write the JSON result here")
    args = ap.parse_args()
    dev = torch.device(args.device)
    if LAYOUT.block_bytes != PAYLOAD:
        raise RuntimeError(f"layout gives {LAYOUT.block_bytes} B blocks, the store holds {PAYLOAD} B")
    n = TURN_KEYS * (args.turns + 1)
    root = Path(tempfile.mkdtemp(prefix="restore_install_", dir=args.dir))
    try:
        store = write_store(root / "ssd", n)
        pool = GlobalKVPool(LAYOUT, 2 * TURN_KEYS + 1, dev)
        buf = RestoreBuffer(PAYLOAD, max_bytes=TURN_KEYS * PAYLOAD, pinned=dev.type == "cuda")
        fresh = list(range(1, 2 * TURN_KEYS + 1))
        runs: dict[str, list[Spent]] = {}
        for t in range(args.turns + 1):
            ids = random.Random(t).sample(fresh, TURN_KEYS)  # fresh blocks after churn: scattered
            got = measure(store, pool, buf, list(range(t * TURN_KEYS, (t + 1) * TURN_KEYS)), ids)
            for name, spent in got.items():
                if t:  # turn 0 warms up the buffers, the allocator and the page cache
                    runs.setdefault(name, []).append(spent)
        store.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    rate = {name: statistics.median(s.rate for s in spent) for name, spent in runs.items()}
    ceiling = rate.get("h2d_ceiling")
    rows = [{"name": name, "gb_s": round(r / 1e9, 3), "ms_per_turn": round(TURN_KEYS * PAYLOAD / r * 1e3, 2),
             "cpu_s_per_gb": round(statistics.median(s.cpu / s.nbytes * 1e9 for s in runs[name]), 3),
             **({"x_ceiling": round(r / ceiling, 3)} if ceiling else {})} for name, r in rate.items()]  # fmt: skip
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "no accelerator"
    command = "benchmarks/restore_install_bench.py " + " ".join(sys.argv[1:])
    result = {"device": f"{name}; {device()}", "command": command,
              "blocks_per_turn": TURN_KEYS, "block_bytes": PAYLOAD, "turns": args.turns, "page_cache": "warm",
              "restore_buffer": {"capacities": buf.capacities, "grown": buf.stats.grown}, "rows": rows}  # fmt: skip
    print(f"{result['device']}: {TURN_KEYS} blocks of {PAYLOAD} B per turn, {args.turns} turns, page cache warm")
    print(f"{'row':<20}{'GB/s':>8}{'ms/turn':>10}{'cpu s/GB':>10}{'x ceiling':>11}")
    for r in rows:
        print(f"{r['name']:<20}{r['gb_s']:>8.3f}{r['ms_per_turn']:>10.2f}{r['cpu_s_per_gb']:>10.3f}"
              f"{r.get('x_ceiling', '-'):>11}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
