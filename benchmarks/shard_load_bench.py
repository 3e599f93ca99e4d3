"""Host memory and read rate of sharded loading on the CPU (gloo), 2 and 4 ranks: byte ranges vs whole-then-shard.

The checkpoint: ``tiny`` cut to three layers (test_geometry_slice's slice) at width 256 with 64 routed experts
of 512, 4 output groups, an 8192-token vocabulary and one Engram table of ~0.9 M rows x 64 (~60 MB stored),
written by the project's writer (``write_checkpoint``) from random values. Per rank count, two loads, each
rank a fresh spawned process (its baseline: the interpreter with torch and flashtier imported):

    byte_range   rank_engine.load_rank_model(formats=True, host_engram=True): the rank's slices read by byte
                 range into their stored formats, the Engram table mapped from the file (the CUDA path, run on
                 the CPU)
    whole        today's path before this change: load_model (the whole checkpoint, float) -> shard_model_
                 -> place_in_formats_(host_engram=True): the table copied into each rank's memory

Per rank: load seconds (the Engram table's pages touched once included); bytes read (byte_range: what the
reader's preads return, the mapped table not counted; whole: every stored byte, which safetensors reads); peak
RSS during the load (VmHWM, reset before it through /proc/self/clear_refs); RSS and PSS after it
(/proc/self/smaps_rollup; PSS splits a page shared by n processes n ways); the PSS of the checkpoint's
file mappings (the Engram table). ``projection_8`` extrapolates per-rank PSS to 8 ranks: the private part
measured at 4 ranks plus the table / 8, and the real model's Engram tables (model.md: ~196 GB) per host,
one copy vs one per rank. The checkpoint sits in the page cache (just written): the read rate is the
loader's, not a disk's.

Usage: python3 -P benchmarks/shard_load_bench.py [--ranks 2 4] [--json docs/perf/shard_load_cpu.json]
(flashtier importable; no GPU needed)
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import shlex
import socket
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.multiprocessing as mp

REAL_ENGRAM_GB = 196.0  # the real model's two Engram tables as stored (model.md)
GEOMETRY = {
    "num_hidden_layers": 3, "compress_ratios": (2, 1, 1), "kv_source_layer_ids": (0, 1),
    "index_source_layer_ids": (0, 1, 2), "candidate_source_layer_id": 1, "engram_layer_ids": (1,),
    "dspark_target_layer_ids": (0, 1, 2), "n_routed_experts": 64, "o_groups": 4, "vocab_size": 8192,
    "hidden_size": 256, "moe_intermediate_size": 512, "engram_head_dim": 64, "engram_vocab_size": 150000,
    "name": "tiny-slice3-64e-w256",
}


def write_bench_checkpoint(directory: Path) -> dict:
    """The bench checkpoint in ``directory`` (random normal values x 0.02, quantised by the writer)."""
    from flashtier.engine.model.checkpoint import write_checkpoint
    from flashtier.engine.model.config import preset
    from flashtier.engine.model.transformer import Transformer, weight_formats

    cfg = preset("tiny").replace(**GEOMETRY)
    with torch.device("meta"):
        meta = Transformer(cfg, with_dspark=False)
    gen = torch.Generator().manual_seed(0)
    tensors = {n: torch.randn(p.shape, generator=gen, dtype=torch.float32) * 0.02 for n, p in meta.named_parameters()}
    hf = cfg.to_hf_dict()
    write_checkpoint(directory, tensors, weight_formats(meta), hf)
    files = [p for p in directory.iterdir() if p.suffix == ".safetensors"]
    table = [n for n in tensors if n.endswith("engram.embed.weight")]
    return {"geometry": {k: list(v) if isinstance(v, tuple) else v for k, v in GEOMETRY.items()},
            "bytes": sum(p.stat().st_size for p in files), "files": len(files),
            "engram_table_stored_bytes": sum(tensors[n].numel() * (1 + 1 / 32) for n in table)}


def stored_bytes(ckpt: str | Path) -> int:
    """Bytes of every stored tensor of the checkpoint (the shard files less their headers)."""
    from flashtier.engine.model.checkpoint import CheckpointReader
    from flashtier.engine.model.sharded_reader import STORED_DTYPES

    reader = CheckpointReader(ckpt)
    return sum(max(1, math.prod(i.shape)) * STORED_DTYPES[i.dtype].itemsize for i in reader.tensors.values())


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


class _CountedReads:
    """Counts the bytes ``os.preadv`` returns in this process (the sharded reader's reads; bench children only)."""

    def __init__(self):
        self.nbytes, inner = 0, os.preadv

        def counted(fd, buffers, offset):
            got = inner(fd, buffers, offset)
            self.nbytes += got
            return got

        os.preadv = counted


def _rollup_kb() -> dict[str, int]:
    with open("/proc/self/smaps_rollup") as f:
        return {p[0].rstrip(":"): int(p[1]) for p in (line.split() for line in f) if len(p) >= 3 and p[2] == "kB"}


def _file_mappings_pss_kb(suffix: str = ".safetensors") -> int:
    """PSS of this process's mappings of files ending in ``suffix``."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5:
                inside = len(head) >= 6 and head[-1].endswith(suffix)
            elif inside and head[0] == "Pss:":
                total += int(head[1])
    return total


def _rank(rank: int, world: int, ckpt: str, path: str, port: int, out_dir: str) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    try:
        from flashtier.engine.model.device_loader import place_in_formats_
        from flashtier.engine.model.loader import load_model
        from flashtier.engine.parallel import ParallelConfig, init_distributed, shard_model_, shutdown_distributed
        from flashtier.engine.parallel.rank_engine import load_rank_model

        parallel = ParallelConfig(tensor_parallel_size=world, expert_parallel=True)
        groups = init_distributed(parallel, rank, init_method=f"tcp://127.0.0.1:{port}", timeout_s=600)
        try:
            base_rss = _status_kb("VmRSS")
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current RSS: the peak below is this load's
            counter, t0 = _CountedReads(), time.perf_counter()
            with torch.no_grad():
                if path == "byte_range":
                    model = load_rank_model(ckpt, groups, torch.device("cpu"), dtype=torch.bfloat16, formats=True,
                                            host_engram=True, progress=rank == 0)
                    nread = counter.nbytes
                else:  # safetensors reads through its own mapping: every stored byte of the checkpoint
                    whole = load_model(ckpt, dtype=torch.bfloat16, with_dspark=False, progress=False)
                    model = place_in_formats_(shard_model_(whole, groups), "cpu", host_engram=True)
                    del whole
                    nread = stored_bytes(ckpt)
                # every table page read once: what cudaHostRegister does at load on CUDA, and serving over time
                host = next(b.engram.host for b in model.layers if b.engram is not None)
                touched = sum(int(t.data.max()) for t in host.tables.values())  # max: no widened copy
            seconds = time.perf_counter() - t0
            torch.distributed.barrier()  # every rank holds its model: the PSS split below is the steady state
            roll = _rollup_kb()
            row = {"rank": rank, "seconds": round(seconds, 3), "bytes_read": nread,
                   "read_GBps": round(nread / seconds / 1e9, 4), "table_max_code": touched, "baseline_rss_MB": round(base_rss / 1024, 1),
                   "peak_rss_MB": round(_status_kb("VmHWM") / 1024, 1),
                   "rss_MB": round(roll["Rss"] / 1024, 1), "pss_MB": round(roll["Pss"] / 1024, 1),
                   "checkpoint_mapping_pss_MB": round(_file_mappings_pss_kb() / 1024, 1),
                   "params_and_buffers_MB": round(sum(t.nbytes for t in [*model.parameters(), *model.buffers()])
                                                  / 2**20, 1)}
            torch.distributed.barrier()  # nobody unmaps before every rank has measured
            (Path(out_dir) / f"{path}_{world}_{rank}.json").write_text(json.dumps(row))
        finally:
            shutdown_distributed()
    except BaseException:
        (Path(out_dir) / f"{path}_{world}_{rank}.err").write_text(traceback.format_exc())
        raise


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(world: int, ckpt: Path, path: str, out_dir: Path) -> list[dict]:
    mp.start_processes(_rank, args=(world, str(ckpt), path, _free_port(), str(out_dir)), nprocs=world,
                       start_method="spawn", join=True)
    return [json.loads((out_dir / f"{path}_{world}_{r}.json").read_text()) for r in range(world)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--checkpoint", type=Path, default=None, help="reuse (or create) the bench checkpoint here")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = args.checkpoint or Path(tmp) / "ckpt"
        t0 = time.perf_counter()
        info = write_bench_checkpoint(ckpt) if not (ckpt / "config.json").is_file() else None
        if info is None:  # reused: describe what is there
            files = [p for p in ckpt.iterdir() if p.suffix == ".safetensors"]
            info = {"geometry": GEOMETRY, "bytes": sum(p.stat().st_size for p in files), "files": len(files)}
        info["write_seconds"] = round(time.perf_counter() - t0, 1)
        print(f"checkpoint: {info['bytes'] / 1e6:.1f} MB in {info['files']} file(s)")
        runs = []
        for world in args.ranks:
            for path in ("byte_range", "whole"):
                rows = run(world, ckpt, path, Path(tmp))
                runs.append({"ranks": world, "path": path, "per_rank": rows})
                for r in rows:
                    print(f"{path:>10} x{world} rank {r['rank']}: {r['seconds']:6.2f} s  read {r['bytes_read'] / 1e6:7.1f}"
                          f" MB ({r['read_GBps']:.3f} GB/s)  peak RSS {r['peak_rss_MB']:7.1f} MB (baseline "
                          f"{r['baseline_rss_MB']:.1f})  PSS {r['pss_MB']:7.1f} MB  file-mapping PSS "
                          f"{r['checkpoint_mapping_pss_MB']:.1f} MB")
    table_mb = info.get("engram_table_stored_bytes", 0) / 2**20
    projection = {}
    four = next((r for r in runs if r["ranks"] == max(args.ranks) and r["path"] == "byte_range"), None)
    if four is not None and table_mb:
        private = max(r["pss_MB"] - r["checkpoint_mapping_pss_MB"] for r in four["per_rank"])
        projection = {
            "ranks": 8, "private_pss_MB_per_rank (measured at %d)" % four["ranks"]: round(private, 1),
            "engram_table_MB": round(table_mb, 1), "pss_MB_per_rank": round(private + table_mb / 8, 1),
            "host_engram_MB_one_copy": round(table_mb, 1), "host_engram_MB_copy_per_rank": round(8 * table_mb, 1),
            "real_model_engram_GB_per_host": {"one_copy": REAL_ENGRAM_GB, "copy_per_rank": 8 * REAL_ENGRAM_GB},
        }
    result = {
        "date": datetime.date.today().isoformat(),
        "device": f"CPU ({platform.machine()}, {os.cpu_count()} cores), torch {torch.__version__}, gloo",
        "command": "python3 -P " + " ".join(shlex.quote(a) for a in sys.argv),
        "meaning": ("per rank: load seconds, bytes read (byte_range: the reader's preads, the mapped table not counted), peak RSS of the "
                    "load (VmHWM reset before it), RSS / PSS after it and the PSS of the checkpoint's file mappings "
                    "(the Engram table), every rank holding its model; byte_range = load_rank_model (stored "
                    "formats, table mapped), whole = load_model -> shard_model_ -> place_in_formats_"),
        "checkpoint": info, "runs": runs, "projection_8": projection,
    }
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
