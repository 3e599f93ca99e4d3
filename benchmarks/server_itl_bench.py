"""Server inter-token latency against engine step time at batch B, one machine, one run (the HTTP overhead).

1. engine: an in-process ``Engine`` built as ``flashtier serve`` builds it (the same serve flags, through the
   server's own settings), B chat prompts of ``--prompt`` tokens, greedy, ``ignore_eos``: the median
   ``Engine.step()`` (synchronised on CUDA) over the steps in which all B requests decode, the first left out.
   Freed (gc, empty_cache) before 2.
2. server: ``flashtier serve`` with those flags on a loopback port; the same B prompts as concurrent streaming
   chat requests (AsyncOpenAI; ``return_token_ids``, so each step's chunk carries its ids; ``ignore_eos``).
   ITL = gaps between consecutive token chunks of a stream in the steady window (_stream_itl.py: all B
   streams decoding, first chunks and the ramp left out). Cross-check: the mean of the server's own
   ``inter_token_latency_seconds`` histogram over the run (/metrics before and after; ramp included).
3. ratio = median server ITL / median engine step (the issue's target: <= 1.05).

A failed stage records its error and the run goes on; ``--json`` is always written; the server stops by pid.

    python3 -P benchmarks/server_itl_bench.py --json OUT.json                    (CUDA: flash-16e, B=64)
    OMP_NUM_THREADS=1 python3 -P benchmarks/server_itl_bench.py --device cpu --batch 4 --prompt 32 --tokens 16
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import gc
import importlib.metadata
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.request
from pathlib import Path

import torch

from flashtier.engine.factory import build_engine
from flashtier.engine.model.config import resolve
from flashtier.engine.model.loader import demo_checkpoint
from flashtier.engine.sample.params import SamplingParams
from flashtier.server.text.chat_encoding import encode_to_ids
from flashtier.server.cli import build_parser
from flashtier.server.text.engram_map import model_token_map
from flashtier.server.serving.metrics import ITL
from flashtier.server.config.settings import build_settings
from flashtier.server.text.tokenizer import Tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))  # sibling modules (run as python3 -P)
from _stream_itl import histogram_sum_count, quantile, steady_itl, summary_ms  # noqa: E402
from serve_smoke import free_port, wait_ready  # noqa: E402

FILLER = " hello"  # one token of the shipped tokenizer per repetition (make_prompts checks the total)


def make_prompts(batch: int, tokens: int) -> list[tuple[str, list[int]]]:
    """B distinct user messages whose rendered chat prompt (no thinking, no tools) is exactly ``tokens`` ids,
    with those ids. ValueError when ``tokens`` is below the template's own length."""
    tok = Tokenizer.from_model_dir(None)
    out = []
    for i in range(batch):
        text = head = f"Request {i}."
        for _ in range(4):  # the filler is one token each; a couple of rounds absorb any merge at the seam
            ids = encode_to_ids(tok, [{"role": "user", "content": text}])
            if len(ids) == tokens:
                break
            n = max(0, (len(text) - len(head)) // len(FILLER) + tokens - len(ids))
            text = head + FILLER * n
        if len(ids) != tokens:
            raise ValueError(f"--prompt {tokens}: no chat prompt of exactly that length (got {len(ids)}); the "
                             "template with a request's header takes about 8 tokens")
        out.append((text, ids))
    return out


def serve_argv(a: argparse.Namespace, port: int, cache_dir: str) -> list[str]:
    """The ``flashtier serve`` flags both stages use (the engine stage parses them with the server's parser)."""
    argv = ["serve", "--device", a.device, "--preset", a.preset, "--dtype", a.dtype, "--host", "127.0.0.1",
            "--port", str(port), "--cache-dir", cache_dir, "--no-kv-persist", "--max-num-seqs", str(a.batch),
            "--max-model-len", str(a.max_model_len), "--log-level", "warning"]
    return argv + (["--num-blocks", str(a.num_blocks)] if a.num_blocks else []) + a.serve_arg


def engine_stage(argv: list[str], prompts: list[list[int]], tokens: int) -> dict:
    """Median ``Engine.step()`` while all B requests decode. Builds and closes its own engine (tiers as the
    server's: SSD off, embedded snapshot pool); the caller frees the memory."""
    s = build_settings(build_parser().parse_args(argv), os.environ)
    config = s.engine_config()
    cuda = config.device.startswith("cuda")
    if s.is_demo and not (cuda and config.dtype != "float64"):  # as serve (cli._model_engine): from disk
        path = demo_checkpoint(os.path.join(s.cache_dir, "models"), s.effective_preset, s.weights_seed)
        config = dataclasses.replace(config, model_dir=str(path))
    token_map = model_token_map(Tokenizer.from_model_dir(None), resolve(config.model_dir, s.effective_preset))
    t = time.perf_counter()
    engine = build_engine(config, s.kvstore, token_map, tiers=True)
    built_s = time.perf_counter() - t
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    try:
        params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
        for i, ids in enumerate(prompts):
            engine.add_request(f"r{i}", ids, params)
        t = time.perf_counter()
        def prefilling() -> bool:  # chunked by --max-num-batched-tokens; stops if a request ends first
            # a request still waiting (or loading from the tiers) has no sequence yet: it is not decoding either
            return len(engine.requests) == len(prompts) and any(
                not r.seqs or any(not q.output for q in r.seqs) for r in engine.requests.values())
        while prefilling():
            engine.step()
        sync()
        prefill_s = time.perf_counter() - t
        times = []
        while len(engine.requests) == len(prompts):
            t = time.perf_counter()
            engine.step()
            sync()
            times.append(time.perf_counter() - t)
        times = times[1:]  # the first full-batch step may capture its CUDA graph
        preemptions = engine.stats().preemptions  # > 0: the pool was too small for B (raise --num-blocks)
    finally:
        engine.close()
    if not times:
        raise RuntimeError("no step decoded all B requests: raise --tokens")
    return {"step_ms": round(quantile(times, 0.5) * 1e3, 3), "step_p90_ms": round(quantile(times, 0.9) * 1e3, 3),
            "steps": len(times), "prefill_s": round(prefill_s, 2), "build_s": round(built_s, 1),
            "dtype": config.dtype, "preemptions": preemptions}


async def one_stream(client, model: str, text: str, tokens: int) -> dict:
    """One streaming chat request: arrival time and token count of every chunk that carries token ids."""
    rec: dict = {"chunks": [], "prompt_ids": None, "usage": None, "finish": None, "error": None}
    try:
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": text}], max_tokens=tokens, temperature=0,
            stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True, "return_token_ids": True})
        async for chunk in stream:
            now = time.perf_counter()
            extra = chunk.model_extra or {}
            if extra.get("prompt_token_ids") is not None:
                rec["prompt_ids"] = extra["prompt_token_ids"]
            if chunk.usage is not None:
                rec["usage"] = {"prompt": chunk.usage.prompt_tokens, "completion": chunk.usage.completion_tokens}
            for c in chunk.choices:
                ids = (c.model_extra or {}).get("token_ids")
                if ids:
                    rec["chunks"].append((now, len(ids)))
                rec["finish"] = c.finish_reason or rec["finish"]
    except Exception as exc:  # noqa: BLE001 - one failed stream is recorded, the others still count
        rec["error"] = f"{type(exc).__name__}: {exc}"[:300]
    return rec


async def client_stage(url: str, texts: list[str], tokens: int, timeout: float) -> list[dict]:
    import openai

    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", timeout=timeout, max_retries=0) as client:
        model = (await client.models.list()).data[0].id
        return await asyncio.gather(*(one_stream(client, model, t, tokens) for t in texts))


def scrape_itl(url: str, errors: dict) -> tuple[float, float] | None:
    """(sum seconds, count) of the server's ITL histogram; None (and errors["metrics"]) when unreadable."""
    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
            return histogram_sum_count(r.read().decode(), ITL)
    except (OSError, ValueError) as exc:
        errors["metrics"] = f"{type(exc).__name__}: {exc}"
        return None


def stop(proc: subprocess.Popen) -> int | None:
    """SIGTERM the server we started, SIGKILL after 60 s; its exit status."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)
    return proc.returncode


def run(a: argparse.Namespace, out: dict) -> None:
    """Stages 1-3 into ``out``; each stage's failure lands in out["errors"][stage]."""
    errors = out["errors"]
    prompts = make_prompts(a.batch, a.prompt)
    cache_dir = tempfile.mkdtemp(prefix="flashtier-itl-")
    port = free_port()
    argv = serve_argv(a, port, cache_dir)
    out["server_command"] = "flashtier " + " ".join(argv)
    try:
        try:
            out["engine"] = engine_stage(argv, [ids for _, ids in prompts], a.tokens)
        except (Exception, SystemExit):  # noqa: BLE001 - the server stage still runs (argparse exits)
            errors["engine"] = traceback.format_exc()[-2000:]
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
            out["cuda_after_free_mb"] = {"allocated": round(torch.cuda.memory_allocated() / 2**20, 1),
                                         "reserved": round(torch.cuda.memory_reserved() / 2**20, 1)}
        url = f"http://127.0.0.1:{port}"
        env = {**os.environ, "OMP_NUM_THREADS": str(a.threads), "PYTHONUNBUFFERED": "1"}
        log_path = os.path.join(cache_dir, "serve.log")
        with open(log_path, "wb") as log:
            proc = subprocess.Popen([sys.executable, "-P", "-m", "flashtier.server.cli", *argv], env=env,
                                    stdout=log, stderr=subprocess.STDOUT)
        try:
            server = out["server"] = {"ready_s": round(wait_ready(url, proc, a.ready_timeout), 1)}
            before, t, cpu = scrape_itl(url, errors), time.perf_counter(), time.process_time()
            recs = asyncio.run(client_stage(url, [text for text, _ in prompts], a.tokens, a.client_timeout))
            # client CPU close to its wall time: the client, not the server, may set the chunk rate
            server.update(client_s=round(time.perf_counter() - t, 2), client_cpu_s=round(time.process_time() - cpu, 2))
            after = scrape_itl(url, errors)
            itl = steady_itl([r["chunks"] for r in recs])
            server.update({**summary_ms(itl.pop("samples")), **itl, "window_s": round(itl["window_s"], 3),
                "tokens_counted": sum(n for r in recs for _, n in r["chunks"]),
                "usage_completion_tokens": sum((r["usage"] or {}).get("completion", 0) for r in recs),
                "streams_ok": sum(r["error"] is None and bool(r["chunks"]) for r in recs),
                "prompts_match": all(r["prompt_ids"] == ids for r, (_, ids) in zip(recs, prompts)),
                "finish_reasons": sorted({str(r["finish"]) for r in recs}),
                "stream_errors": sorted({r["error"] for r in recs if r["error"]})[:5]})
            if before and after:
                dsum, dcount = after[0] - before[0], after[1] - before[1]
                out["metrics"] = {"itl_mean_ms": round(dsum / dcount * 1e3, 3) if dcount else None,
                                  "observations": int(dcount)}
        except Exception:  # noqa: BLE001 - recorded with the server's log tail
            errors["server"] = traceback.format_exc()[-2000:]
            out["server_log_tail"] = Path(log_path).read_text(errors="replace")[-3000:]
        finally:
            out["server_exit"] = stop(proc)
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)
    step, itl = out.get("engine", {}).get("step_ms"), out.get("server", {}).get("itl_ms")
    out["ratio"] = round(itl / step, 3) if step and itl else None


def versions() -> dict:
    out = {"python": platform.python_version(), "torch": torch.__version__}
    for dist in ("flashtier", "openai", "triton"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            out[dist] = importlib.metadata.version(dist)
    return out


def main() -> int:
    cuda = torch.cuda.is_available()
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if cuda else "cpu")
    ap.add_argument("--preset", default=None, help="default: flash-16e on cuda, tiny on the cpu")
    ap.add_argument("--dtype", default="auto", help="as serve's --dtype (auto: bfloat16 on cuda, float32 on cpu)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=256, help="prompt tokens (the rendered chat prompt)")
    ap.add_argument("--tokens", type=int, default=256, help="tokens decoded per request")
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--num-blocks", type=int, default=None,
                    help="KV pool blocks of both stages (default: twice what B requests need; 0: --hbm-utilization)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads of both stages (default: $OMP_NUM_THREADS, else 4 on cuda, 1 on cpu)")
    ap.add_argument("--serve-arg", action="append", default=[], help="one more serve flag for both stages "
                    "(e.g. --serve-arg=--enforce-eager); repeatable")
    ap.add_argument("--ready-timeout", type=float, default=600)
    ap.add_argument("--client-timeout", type=float, default=900)
    ap.add_argument("--json")
    a = ap.parse_args()
    if min(a.batch, a.prompt, a.tokens - 2) < 1:
        ap.error(f"--batch {a.batch} / --prompt {a.prompt} / --tokens {a.tokens}: need >= 1, >= 1, >= 3")
    a.preset = a.preset or ("flash-16e" if a.device.startswith("cuda") else "tiny")
    a.threads = a.threads or int(os.environ.get("OMP_NUM_THREADS") or (4 if a.device.startswith("cuda") else 1))
    if a.num_blocks is None:
        a.num_blocks = 2 * a.batch * (-(-(a.prompt + a.tokens + 8) // 64) + 1) + 16
    torch.set_num_threads(a.threads)  # the engine stage runs with the server's thread count
    on_gpu = cuda and a.device.startswith("cuda")
    out: dict = {"device": torch.cuda.get_device_name() if on_gpu else platform.processor() or "cpu",
                 "cpus": os.cpu_count(), "versions": versions(), "command": " ".join(sys.argv),
                 "preset": a.preset, "batch": a.batch, "prompt_tokens": a.prompt, "tokens": a.tokens,
                 "threads": a.threads, "num_blocks": a.num_blocks, "target_ratio": 1.05, "errors": {}}
    try:
        run(a, out)
    except (Exception, SystemExit):  # noqa: BLE001 - e.g. the prompts: still write the JSON
        out["errors"]["setup"] = traceback.format_exc()[-2000:]
    finally:
        if a.json:
            with open(a.json, "w") as f:
                json.dump(out, f, indent=1)
    eng, srv, met = out.get("engine", {}), out.get("server", {}), out.get("metrics", {})
    print(f"{'B':>4} {'step ms':>9} {'ITL ms':>9} {'ITL p90':>9} {'/metrics':>9} {'ratio':>7} {'samples':>8}")
    print(f"{a.batch:>4} {eng.get('step_ms')!s:>9} {srv.get('itl_ms')!s:>9} {srv.get('itl_p90_ms')!s:>9} "
          f"{met.get('itl_mean_ms')!s:>9} {out.get('ratio')!s:>7} {srv.get('itl_samples')!s:>8}")
    for stage, err in out["errors"].items():
        print(f"{stage} failed:\n{err}", file=sys.stderr)
    return 1 if out["errors"] or out.get("ratio") is None else 0


if __name__ == "__main__":
    sys.exit(main())
