"""The byte floor of one decode step of the engine, shared by gpu_step_bench.py and decode_floor_bench.py.

    floor = (weight bytes the step reads + KV bytes it reads) / copy rate
    weight bytes = every parameter as stored on the device, except: routed experts only those the step's routing
                   chose (counted per layer), the embedding and Engram tables only the rows looked up (left out)
    KV bytes     = per layer and row: window slots (528 B) + selected global entries (288 B, top-k) + index keys
                   scored (68 B each): a Full layer scores every visible entry of its source (layer 20: N keys,
                   layers 2 / 8 / 14: N / 2), a Reindex layer only layer 20's candidate pool (2048 x 8 entries)
    copy rate    = bytes read + written by a device-to-device copy, measured in the same run

The benchmarks add ``benchmarks/`` to ``sys.path`` to import this module (they run as ``python3 -P``).
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from unittest import mock

import torch

from flashtier.engine.engine import Engine
from flashtier.engine.model.config import ModelConfig, preset
from flashtier.engine.model.init import random_model, random_model_on_device
from flashtier.engine.model.moe import MoE


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def copy_rate(device: torch.device) -> float:
    """Bytes read + written per second by a copy on ``device`` (2 GiB on CUDA, 64 MiB on the CPU, best of 5)."""
    if device.type == "cuda":
        from triton.testing import do_bench

        src = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        ms = do_bench(lambda: dst.copy_(src), warmup=5, rep=50)
        return 2 * src.numel() / (ms * 1e-3)
    src = torch.ones(64 << 20, dtype=torch.uint8)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return 2 * src.numel() / best


def make_model(name: str, device: torch.device, formats: str = "checkpoint"):
    """The preset with seeded random weights: on CUDA made on the device in bf16 (``formats="checkpoint"``: FP8
    linears with e8m0 32x32 scales, routed experts MXFP4, shared expert FP8); on the CPU in float32."""
    cfg = preset(name)
    if device.type != "cuda":
        return random_model(cfg, seed=0, dtype=torch.float32, with_dspark=False)
    model = random_model_on_device(cfg, "cuda", dtype=torch.bfloat16, with_dspark=False)
    if formats == "checkpoint":
        from flashtier.engine.model.moe_convert import convert_experts_
        from flashtier.engine.model.placement import quantize_linears_

        quantize_linears_(model, "cuda")
        convert_experts_(model, "cuda")
    torch.cuda.synchronize()
    return model


def routed_experts_chosen(engine: Engine) -> dict[int, int]:
    """Run one ``engine.step()`` with the MoE routing recorded: distinct experts chosen per MoE module (by id).
    The step runs eagerly (the recording reads indices on the host, which a CUDA-graph capture cannot)."""
    chosen: dict[int, set[int]] = defaultdict(set)
    paged = engine.runner.paged
    graphs = paged.graphs if paged is not None else None
    originals = {}
    for mod in engine.model.modules():
        if isinstance(mod, MoE):
            originals[mod] = mod.route

            def route(x, mod=mod, real=mod.route):
                idx, w = real(x)
                chosen[id(mod)].update(idx.flatten().tolist())
                return idx, w

            mod.route = route
    try:
        if paged is not None:
            paged.graphs = None
        engine.step()
    finally:
        for mod, real in originals.items():
            mod.route = real
        if paged is not None:
            paged.graphs = graphs
    return {k: len(v) for k, v in chosen.items()}


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def weight_bytes(model, chosen: dict[int, int]) -> int:
    """Bytes of the weights as resident (parameters and the quantised buffers), routed experts scaled by the
    fraction of experts the step's routing chose in each layer."""
    total = 0
    for mod in model.modules():
        if isinstance(mod, MoE):
            n = mod.gate.weight.shape[0]
            routed = _nbytes(mod.experts.parameters()) + _nbytes(mod.experts.buffers())
            total += routed * chosen.get(id(mod), n) // n
            if mod.shared_experts is not None:
                total += _nbytes(mod.shared_experts.parameters()) + _nbytes(mod.shared_experts.buffers())
    named = [*model.named_parameters(), *model.named_buffers()]
    for name, t in named:
        if ".experts." in name or ".shared_experts." in name or name == "token_map":
            continue
        if name == "embed.weight" or "engram.embed" in name:
            continue  # rows gathered: negligible
        total += t.numel() * t.element_size()
    return total


def kv_bytes(cfg: ModelConfig, batch: int, context: int) -> int:
    """KV bytes one decode step reads for ``batch`` rows with ``context`` tokens of context (module docstring)."""
    slot = cfg.head_dim + cfg.head_dim // 32  # FP8 window record
    entry = cfg.head_dim // 2 + cfg.head_dim // 16  # FP4 main-KV record
    key = cfg.index_head_dim // 2 + cfg.index_head_dim // 32  # MXFP4 index-K record
    pool = cfg.candidate_topk_blocks * cfg.candidate_block_size
    per_row = 0
    for role in cfg.layer_roles():
        per_row += min(context, cfg.sliding_window) * slot
        if role.ratio:
            n = context // role.ratio
            per_row += min(n, cfg.index_topk) * entry
            if role.role == "full":
                per_row += n * key
            elif role.role == "reindex":
                per_row += min(n, pool) * key
    return per_row * batch


def profile_ops(engine: Engine, device: torch.device) -> dict[str, float]:
    """Run one ``engine.step()`` under torch.profiler: the sum over all ops ("(all ops)") and the 15 ops with the
    most self time (ms, device time on CUDA, CPU time otherwise). A profiler that cannot start returns
    {"profiler failed": reason}."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    try:
        with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
            engine.step()
            sync(device)
    except Exception as exc:  # noqa: BLE001 - a profiler that cannot start must not lose the timings
        return {"profiler failed": str(exc)[:80]}
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    ops = sorted(((e.key, getattr(e, key) / 1e3) for e in prof.key_averages()), key=lambda kv: -kv[1])
    # "(all ops)": the step's whole device time; the step's wall time less this is host time the GPU waited on
    return {"(all ops)": round(sum(v for _, v in ops), 3)} | {k[:60]: round(v, 3) for k, v in ops[:15]}


def profile_by_weight(engine: Engine, device: torch.device, rate: float) -> dict[str, dict]:
    """One step run eagerly (the decode graphs set aside: their kernels, launched one by one) under torch.profiler,
    with a labelled range around every FP8 linear and grouped wo_a (by weight shape), every MoE layer and every
    invariant linear (the heads, by weight shape). Per label: device ms in the step (CPU ms on the CPU), calls,
    weight bytes per call, and the ratio of the mean call to its own byte floor at ``rate``. The per-shape
    benchmarks time one shape alone; this says what each costs inside a real step. A profiler that cannot start
    returns {"profiler failed": {"reason": ...}}."""
    from torch.profiler import ProfilerActivity, profile, record_function

    from flashtier.engine.model import fp8_linear, numerics

    nbytes: dict[str, int] = {}

    def labelled(fn, label_of):
        def wrapped(*args, **kwargs):
            label, size = label_of(*args)
            nbytes[label] = size
            with record_function(label):
                return fn(*args, **kwargs)
        return wrapped

    def fp8_label(kind):
        return lambda m, *_: (f"fp8{kind} {m.out_features}x{m.in_features}",
                              m.weight_q.numel() * m.weight_q.element_size() + m.weight_scale.numel())

    saved = (fp8_linear.Fp8Linear.forward, fp8_linear.Fp8Linear.grouped, MoE.forward, numerics.invariant_linear)
    fp8_linear.Fp8Linear.forward = labelled(saved[0], fp8_label(""))
    fp8_linear.Fp8Linear.grouped = labelled(saved[1], fp8_label(" grouped"))
    MoE.forward = labelled(saved[2], lambda m, *_: ("moe layer", 0))
    numerics.invariant_linear = labelled(saved[3], lambda x, w, *_: (f"linear {w.shape[0]}x{w.shape[1]}",
                                                                     w.numel() * w.element_size()))
    paged = engine.runner.paged
    graphs = paged.graphs if paged is not None else None
    cuda = device.type == "cuda"
    try:
        if paged is not None:
            paged.graphs = None
        with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
            engine.step()
            sync(device)
    except Exception as exc:  # noqa: BLE001 - a profiler that cannot start must not lose the timings
        return {"profiler failed": {"reason": str(exc)[:80]}}
    finally:
        fp8_linear.Fp8Linear.forward, fp8_linear.Fp8Linear.grouped, MoE.forward, numerics.invariant_linear = saved
        if paged is not None:
            paged.graphs = graphs
    out = {}
    for e in prof.key_averages():
        if e.key not in nbytes:
            continue
        ms = (getattr(e, "device_time_total", 0) if cuda else e.cpu_time_total) / 1e3
        row = {"ms": round(ms, 3), "calls": e.count, "weight_bytes": nbytes[e.key]}
        if nbytes[e.key]:
            row["ratio"] = round(ms / e.count / (nbytes[e.key] / rate * 1e3), 2)
        out[e.key] = row
    return dict(sorted(out.items(), key=lambda kv: -kv[1]["ms"]))


def step_phases(engine: Engine, device: torch.device, steps: int) -> dict[str, float]:
    """Where a graph-replayed decode step's wall time goes: ``steps`` more ``engine.step()`` calls, each timed on
    the host at the replay's edges, and the replay itself timed on the device (CUDA events around
    ``CUDAGraph.replay``; on the CPU, where the padded program runs eagerly, the program on the host). Medians in
    ms over the steps that replayed once:

        before_load   step start -> the static inputs' load (scheduling, building the DecodeStep)
        load          the load: row copies into the bucket, the Engram host gather
        launch        the host's replay call
        after         replay call returned -> the step returned, device drained (logits copies, sampling and its
                      host wait, install, postprocess)
        replay_device the replay's device time
        step          the whole step; ``step - replay_device`` is time the device was not running the graph

    Returns {"skipped": reason} for an engine without decode graphs. Restores what it patches."""
    paged = engine.runner.paged
    graphs = paged.graphs if paged is not None else None
    if graphs is None:
        return {"skipped": "no decode graphs"}
    cuda = device.type == "cuda"
    marks: dict[str, float] = {}
    events: list = []

    def timed(name, fn, device_events=False):
        def wrapped(*args, **kwargs):
            marks[name + "0"] = time.perf_counter()
            if device_events:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                out = fn(*args, **kwargs)
                end.record()
                events.append((start, end))
            else:
                out = fn(*args, **kwargs)
            marks[name + "1"] = time.perf_counter()
            return out
        return wrapped

    rows: dict[str, list[float]] = defaultdict(list)
    with contextlib.ExitStack() as patches:  # every patch undone on exit (an inherited attribute deleted again)
        patches.enter_context(mock.patch.object(graphs, "_load", timed("load", graphs._load)))
        if cuda:
            replay = torch.cuda.CUDAGraph.replay
            patches.enter_context(mock.patch.object(torch.cuda.CUDAGraph, "replay", timed("run", replay, True)))
        else:
            patches.enter_context(mock.patch.object(graphs, "_program", timed("run", graphs._program)))
        for _ in range(steps):
            marks.clear()
            events.clear()
            t0 = time.perf_counter()
            engine.step()
            sync(device)
            t1 = time.perf_counter()
            if "run1" not in marks or "load0" not in marks or len(events) > 1:
                continue
            rows["before_load"].append(marks["load0"] - t0)
            rows["load"].append(marks["load1"] - marks["load0"])
            rows["launch"].append(marks["run1"] - marks["run0"])
            rows["after"].append(t1 - marks["run1"])
            rows["step"].append(t1 - t0)
            rows["replay_device"].append(events[0][0].elapsed_time(events[0][1]) / 1e3 if cuda
                                         else marks["run1"] - marks["run0"])
    if not rows:
        return {"skipped": "no step replayed a graph"}
    out = {k: round(sorted(v)[len(v) // 2] * 1e3, 3) for k, v in rows.items()}
    out["steps"] = len(rows["step"])
    return out
