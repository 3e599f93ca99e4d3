"""Serving under load: TTFT, ITL, TPOT, E2E latency, throughput and goodput of a RUNNING OpenAI-compatible
server over a sweep of request rates, with agent-shaped traffic (flashtier issue 27).

Traffic. N conversations (``--sessions``) of T turns (``--turns``), as a coding agent sends them: one long
system prompt with four tool definitions, shared by every conversation, a short task, then per turn the
previous turn's tool call and its tool output (``--tool-words``)::

    turn 0:  [system + tools (shared)][task s]
    turn 1:  [system + tools (shared)][task s][call 0][output 0]                    <- resends turn 0
    turn 2:  [system + tools (shared)][task s][call 0][output 0][call 1][output 1]  <- resends turn 1

The history is scripted (seeded text, not the model's answers), so the prompts are the same on every server
and every run; each rate gets its own conversations of the same shape (a tag in the task), so one rate's
turns never hit another's cache, while the shared system prompt is cached by one warm-up request first.
Requests arrive as a Poisson process at each ``--rates`` value (``inf``: all at once), taken in order turn 0
of sessions 0..N-1, turn 1 of sessions 0..N-1, ...; a turn whose previous turn is still running waits for
it (``wait_ms``), so at most N are in flight: past the server's capacity the conversations run closed-loop.
Every request streams (AsyncOpenAI) with ``max_tokens`` = ``--output-tokens``, greedy, ``ignore_eos`` and
``return_token_ids`` (vLLM's extensions: fixed output lengths, and each step's tokens arrive even when it shows
no text; ``--no-ignore-eos`` / ``--no-token-ids`` for servers without them). The figures are defined in
_load_metrics.py (vLLM's benchmark_serving / SGLang's bench_serving definitions; goodput per ``--slo-*``).

Timing is the client's only: ``time.perf_counter`` (monotonic), read first thing when a chunk arrives. One
process, one event loop, no work per chunk but a timestamp and a token count; the garbage collector is off
while a rate runs. The openai SDK parses each chunk (httpx, SSE, pydantic): ~150 us of CPU per chunk on a
2-core cloud VM (about 6,500 chunks/s at a full core). A chunk that lands while the loop parses another is
stamped late, so keep ``client_cpu_share`` (the client's CPU seconds per wall second, in every row; a warning
above 0.3) low: ~2,000 chunks/s for one process, e.g. 64 streams at >= 30 ms per token. For more, split the
sessions over several processes.

Server. ``--base-url URL`` measures a server already running; ``--serve "ARGS"`` starts ``flashtier serve
ARGS`` on a free loopback port (a temporary --cache-dir unless ARGS name one), waits for /health 200 and stops
that pid at the end (_serve_child.py). Prints one line per rate; ``--json`` writes the rows, the command, the
server's model, preset, device and card, and the client; the run checks its own invariants (_load_metrics
``check_result``) and exits 1 when one breaks, a rate completes nothing, or the set-up fails.

    OMP_NUM_THREADS=1 python3 -P benchmarks/serve_load.py --serve "--device cpu --preset tiny --no-kv-persist" \\
        --sessions 4 --turns 3 --output-tokens 16 --rates 0.5,1,inf --json OUT.json
    python3 -P benchmarks/serve_load.py --serve "--device cuda --preset flash-16e" --rates 1,2,4,8,inf --json OUT.json
    python3 -P benchmarks/serve_load.py --base-url http://127.0.0.1:8000 --card H100 --rates 1,2,inf
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import importlib.metadata
import json
import math
import os
import platform
import random
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # sibling modules (run as python3 -P)
from _load_metrics import RequestRecord, Slo, check_result, summarize  # noqa: E402
from _serve_child import ServeChild  # noqa: E402
from agent_session import TOOLS  # noqa: E402

CPU_SHARE_WARN = 0.3  # client CPU seconds per wall second above which chunk stamps may queue (docstring)
_OPEN = urllib.request.build_opener(urllib.request.ProxyHandler({})).open  # loopback: never through a proxy

# seeded text: words of code and of an agent's instructions, real text for any tokenizer
_WORDS = ("the", "a", "file", "function", "test", "value", "return", "error", "config", "request", "cache",
          "block", "token", "session", "client", "server", "module", "import", "class", "self", "data", "path",
          "check", "update", "before", "after", "when", "always", "never", "only", "each", "every", "with",
          "without", "result", "output", "input", "list", "dict", "string", "number", "call", "tool", "read",
          "write", "change", "keep", "small", "clear", "short", "first", "last", "line", "lines", "repository")
_IDENTS = ("config", "cache", "block", "token", "request", "session", "value", "result", "handle", "index",
           "offset", "count", "limit", "buffer", "table", "entry", "state", "queue", "worker", "reader")


@dataclass(frozen=True, slots=True)
class Workload:
    """The traffic of every rate (module docstring); sizes in words, the server reports tokens."""

    sessions: int
    turns: int
    system_words: int
    task_words: int
    tool_words: int
    output_tokens: int
    seed: int
    ignore_eos: bool
    token_ids: bool


def _sentence(rng: random.Random, n: int) -> str:
    words = [rng.choice(_WORDS) for _ in range(n)]
    return " ".join(words).capitalize() + "."


def _code(rng: random.Random, words: int) -> str:
    """Python-looking lines of about ``words`` words: a tool's output (a file read, a grep, a test run)."""
    lines, n = [], 0
    while n < words:
        a, b, c = (rng.choice(_IDENTS) for _ in range(3))
        kind = rng.randrange(4)
        line = (f"def {a}_{b}(self, {c}):" if kind == 0 else f"    {a} = self.{b}.get({c}, None)" if kind == 1
                else f"    if {a} is None or {b} > {c}:" if kind == 2 else f"        return {a}[{b}:{c}]")
        lines.append(line)
        n += len(line.split())
    return "\n".join(lines)


def system_prompt(w: Workload) -> str:
    """The shared system prompt: instructions of about ``system_words`` words, the same for every session."""
    rng = random.Random(f"{w.seed}:system")
    parts, n = ["You are a coding agent working in a repository. Use the tools to read, search, test and edit."], 0
    while n < w.system_words:
        k = rng.randrange(6, 16)
        parts.append(_sentence(rng, k))
        n += k
    return " ".join(parts)


def conversation(w: Workload, system: str, tag: str, session: int) -> list[list[dict]]:
    """The messages of each turn of one session (list index = turn); ``tag`` makes its task unique to a rate.
    Content depends on (seed, session) only, so every rate's session s has the same shape."""
    rng = random.Random(f"{w.seed}:session:{session}")
    messages = [{"role": "system", "content": system},
                {"role": "user", "content": f"Task {tag}. " + _sentence(rng, w.task_words)}]
    turns = []
    for turn in range(w.turns):
        turns.append(list(messages))
        tool = TOOLS[rng.randrange(len(TOOLS))]["function"]["name"]
        args = {"path": f"src/{rng.choice(_IDENTS)}/{rng.choice(_IDENTS)}.py", "query": rng.choice(_IDENTS)}
        call_id = f"call_{session}_{turn}"
        messages.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": tool, "arguments": json.dumps(args)}}]})
        messages.append({"role": "tool", "tool_call_id": call_id, "content": _code(rng, w.tool_words)})
    return turns


def arrivals(n: int, rate: float, rng: random.Random) -> list[float]:
    """n Poisson arrival times (seconds from the run's start, the first at 0) at ``rate`` per second; all 0
    for an infinite rate."""
    out, t = [], 0.0
    for _ in range(n):
        out.append(t)
        if not math.isinf(rate):
            t += rng.expovariate(rate)
    return out


async def one_request(client, model: str, messages: list[dict], w: Workload, rec: RequestRecord,
                      t0: float) -> None:
    """Send one streaming chat request and fill ``rec`` (times, tokens, usage; the error kind on failure).
    Never raises but for cancellation."""
    import openai

    extra = {**({"ignore_eos": True} if w.ignore_eos else {}), **({"return_token_ids": True} if w.token_ids else {})}
    clock = time.perf_counter
    rec.sent_s = clock() - t0
    try:
        stream = await client.chat.completions.create(
            model=model, messages=messages, tools=TOOLS, max_tokens=w.output_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body=extra)
        counted = 0
        async with stream:
            async for chunk in stream:
                now = clock() - t0  # before any work of ours (the SDK's parse of this chunk is in it)
                for c in chunk.choices:
                    ids = (c.model_extra or {}).get("token_ids") if w.token_ids else None
                    d = c.delta
                    n = len(ids) if ids else int(bool(d and (d.content or d.tool_calls
                                                            or (d.model_extra or {}).get("reasoning_content"))))
                    if n:
                        rec.chunk_s.append(now)
                        counted += n
                    rec.finish_reason = c.finish_reason or rec.finish_reason
                if chunk.usage is not None:
                    u = chunk.usage
                    rec.output_tokens, rec.prompt_tokens = u.completion_tokens, u.prompt_tokens
                    details = u.prompt_tokens_details
                    rec.cached_tokens = details.cached_tokens if details is not None else None
        rec.output_tokens = rec.output_tokens or counted
        if not rec.chunk_s:
            rec.error, rec.error_detail = "no_tokens", f"finish_reason {rec.finish_reason}"
    except openai.APIStatusError as exc:
        rec.error, rec.error_detail = f"http_{exc.status_code}", str(exc)[:200]
    except openai.APITimeoutError as exc:
        rec.error, rec.error_detail = "timeout", str(exc)[:200]
    except openai.APIConnectionError as exc:
        rec.error, rec.error_detail = "connection", str(exc)[:200]
    except openai.APIError as exc:  # an error event inside the stream
        rec.error, rec.error_detail = "stream_error", str(exc)[:200]
    except Exception as exc:  # noqa: BLE001 - counted by kind; the other requests go on
        rec.error, rec.error_detail = type(exc).__name__, str(exc)[:200]
    rec.end_s = clock() - t0


async def run_rate(client, model: str, w: Workload, turns: list[list[list[dict]]], rate: float,
                   seed: int) -> list[RequestRecord]:
    """All sessions' turns at ``rate``: one coroutine per session sleeps until its next turn's arrival (or
    sends it late, once its previous turn ended). Records in request order (turn-major)."""
    n = w.sessions
    times = arrivals(n * w.turns, rate, random.Random(f"{seed}:arrivals:{rate}"))
    records = [RequestRecord(session=i % n, turn=i // n, arrival_s=t) for i, t in enumerate(times)]
    t0 = time.perf_counter()

    async def session(s: int) -> None:
        for k in range(w.turns):
            rec = records[k * n + s]
            delay = t0 + rec.arrival_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            await one_request(client, model, turns[s][k], w, rec, t0)

    await asyncio.gather(*(session(s) for s in range(n)))
    return records


def parse_rates(text: str) -> list[float]:
    """``0.5,1,inf`` -> [0.5, 1.0, inf]; ValueError for a rate that is not positive."""
    rates = [float(x) for x in text.split(",") if x.strip()]
    if not rates or any(not r > 0 for r in rates):
        raise ValueError(f"--rates {text!r}: need positive numbers or inf, comma-separated")
    return rates


def rate_label(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def _get_json(url: str) -> dict:
    with _OPEN(url, timeout=30) as r:
        return json.loads(r.read().decode())


def server_info(url: str, serve_args: list[str] | None, card: str | None) -> dict:
    """Model, preset, version and device of the server at ``url``: the model card's ``root`` names the preset
    (``preset:NAME``) or the checkpoint; the device is --serve's ``--device`` (the server does not report it),
    the card --card, else the GPU's name (nvidia-smi) or CPU."""
    cards = _get_json(url + "/v1/models")["data"]
    first = cards[0]
    root = str(first.get("root") or "")
    info = {"url": url, "model": first["id"], "models": [c["id"] for c in cards], "root": root,
            "preset": root.removeprefix("preset:") if root.startswith("preset:") else None,
            "max_model_len": first.get("max_model_len"), "demo": (first.get("flashtier") or {}).get("demo")}
    with contextlib.suppress(OSError, ValueError):
        info["version"] = _get_json(url + "/version").get("version")
    device = None
    if serve_args is not None:
        ap = argparse.ArgumentParser(add_help=False)
        ap.add_argument("--device")
        device = ap.parse_known_args(serve_args)[0].device or "default (cuda when available)"
    info["device"] = device
    info["card"] = card or _card(device)
    return info


def _card(device: str | None) -> str:
    if device is None:
        return "unknown (pass --card)"
    if device == "cpu":
        return "CPU"
    index = device.split(":", 1)[1] if ":" in device else "0"
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", "-i", index],
                             capture_output=True, text=True, timeout=30)
        return out.stdout.strip() or f"unknown ({device})"
    except (OSError, subprocess.TimeoutExpired):
        return f"unknown ({device})"


def versions() -> dict:
    out = {"python": platform.python_version()}
    for dist in ("flashtier", "openai", "httpx"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            out[dist] = importlib.metadata.version(dist)
    return out


async def sweep(a: argparse.Namespace, w: Workload, slo: Slo, url: str, out: dict, deadline: float | None) -> None:
    """Warm-up, then every rate into out["rows"] (printed as it ends); a rate not started by ``deadline``
    (monotonic seconds) is recorded as skipped."""
    import openai

    system = system_prompt(w)
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=a.api_key, timeout=a.request_timeout,
                                  max_retries=0) as client:
        model = a.model or out["server"]["model"]
        warm = RequestRecord(session=-1, turn=0, arrival_s=0.0)
        t0 = time.perf_counter()
        await one_request(client, model, conversation(w, system, "warmup", 0)[0], w, warm, t0)
        out["warmup"] = {"ttft_ms": round(warm.ttft_s * 1e3, 1) if warm.chunk_s else None,
                         "prompt_tokens": warm.prompt_tokens, "error": warm.error, "detail": warm.error_detail}
        for i, rate in enumerate(a.rates):
            head = {"rate": rate_label(rate), "rate_rps": None if math.isinf(rate) else rate}
            if deadline is not None and time.monotonic() > deadline:
                out["rows"].append({**head, "skipped": "--budget-s spent"})
                continue
            turns = [conversation(w, system, f"{i}.{s}", s) for s in range(w.sessions)]
            gc.collect()
            gc.disable()  # a collection pause would stamp the chunks behind it late
            cpu = time.process_time()
            try:
                records = await run_rate(client, model, w, turns, rate, w.seed)
            finally:
                gc.enable()
            cpu = time.process_time() - cpu
            row = {**head, **summarize(records, slo, w.output_tokens)}
            row["client_cpu_s"] = round(cpu, 3)
            row["client_cpu_share"] = round(cpu / row["duration_s"], 3) if row["duration_s"] else None
            out["rows"].append(row)
            print_row(row)


HEADER = (f"{'rate':>6} {'done':>5} {'err':>4} {'req/s':>7} {'good/s':>7} {'tok/s':>8} {'TTFT p50':>9} "
          f"{'p90':>8} {'p99':>8} {'ITL p50':>8} {'p99':>8} {'TPOT p50':>9} {'E2E p50':>9} {'p99':>8} "
          f"{'cached':>7} {'cpu':>5}")


def print_row(row: dict) -> None:
    if "skipped" in row:
        print(f"{row['rate']:>6} skipped: {row['skipped']}", flush=True)
        return

    def f(x, spec: str = ".1f") -> str:
        return "-" if x is None else format(x, spec)

    t, i, p, e = row["ttft_ms"], row["itl_ms"], row["tpot_ms"], row["e2el_ms"]
    share = row["cached_share"]
    print(f"{row['rate']:>6} {row['completed']:>5} {row['failed']:>4} {f(row['request_throughput'], '.3f'):>7} "
          f"{f(row['goodput'], '.3f'):>7} {f(row['output_throughput']):>8} {f(t['p50']):>9} {f(t['p90']):>8} "
          f"{f(t['p99']):>8} {f(i['p50']):>8} {f(i['p99']):>8} {f(p['p50']):>9} {f(e['p50']):>9} {f(e['p99']):>8} "
          f"{'-' if share is None else f'{share:.0%}':>7} {f(row['client_cpu_share'], '.2f'):>5}", flush=True)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--base-url", help="a running server's root URL (http://HOST:PORT)")
    where.add_argument("--serve", metavar="ARGS", help='start `flashtier serve ARGS` (e.g. "--device cpu --preset '
                       'tiny"; write --serve="--flag" for a single flag)')
    ap.add_argument("--rates", type=parse_rates, default=parse_rates("1,2,4,8,inf"),
                    help="request rates per second, comma-separated; inf: all at once (default 1,2,4,8,inf)")
    ap.add_argument("--sessions", type=int, default=16, help="concurrent conversations (the most in flight)")
    ap.add_argument("--turns", type=int, default=4, help="turns per conversation")
    ap.add_argument("--system-words", type=int, default=1500, help="words of the shared system prompt")
    ap.add_argument("--task-words", type=int, default=24, help="words of each session's task")
    ap.add_argument("--tool-words", type=int, default=200, help="words of each tool output (a turn's new text)")
    ap.add_argument("--output-tokens", type=int, default=64, help="max_tokens of every request")
    ap.add_argument("--seed", type=int, default=0, help="seed of the texts and the arrival times")
    ap.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--token-ids", action=argparse.BooleanOptionalAction, default=True,
                    help="ask for return_token_ids (exact tokens per chunk); off: count text chunks")
    ap.add_argument("--slo-ttft-ms", type=float, help="goodput: TTFT at most this")
    ap.add_argument("--slo-itl-ms", type=float, help="goodput: the request's longest token gap at most this")
    ap.add_argument("--slo-tpot-ms", type=float, help="goodput: TPOT at most this")
    ap.add_argument("--slo-e2el-ms", type=float, help="goodput: end-to-end latency at most this")
    ap.add_argument("--model", help="model name to send (default: the server's first)")
    ap.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY") or "unused")
    ap.add_argument("--card", help="the hardware the server runs on, recorded (default: from --serve's --device)")
    ap.add_argument("--threads", type=int, default=None,
                    help="--serve: the server's torch threads (default: $OMP_NUM_THREADS, else 4 on cuda, 1 on cpu)")
    ap.add_argument("--ready-timeout", type=float, default=900, help="--serve: seconds to wait for /health 200")
    ap.add_argument("--request-timeout", type=float, default=600, help="seconds a request may wait for a byte")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="skip the rates not started within this many seconds of the start")
    ap.add_argument("--json", help="write the result here")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    a = ap.parse_args(argv)
    if min(a.sessions, a.turns, a.output_tokens) < 1 or min(a.system_words, a.task_words, a.tool_words) < 0:
        ap.error("--sessions, --turns and --output-tokens need >= 1; word counts >= 0")
    t_start = time.monotonic()
    deadline = None if a.budget_s is None else t_start + a.budget_s
    w = Workload(a.sessions, a.turns, a.system_words, a.task_words, a.tool_words, a.output_tokens, a.seed,
                 a.ignore_eos, a.token_ids)
    slo = Slo(a.slo_ttft_ms, a.slo_itl_ms, a.slo_tpot_ms, a.slo_e2el_ms)
    script = sys.argv[0] if argv is None else "benchmarks/serve_load.py"
    out: dict = {"command": "python3 -P " + shlex.join([script, *(sys.argv[1:] if argv is None else argv)]),
                 "client": {"machine": platform.machine(), "cpus": os.cpu_count(), "versions": versions(),
                            "loadavg_start": [round(x, 2) for x in os.getloadavg()]},
                 "workload": asdict(w), "rates": [rate_label(r) for r in a.rates],
                 "slo_ms": {k: v for k, v in asdict(slo).items() if v is not None}, "rows": [], "errors": {}}
    work = Path(tempfile.mkdtemp(prefix="flashtier-load-"))
    child: ServeChild | None = None
    serve_args = shlex.split(a.serve) if a.serve is not None else None
    try:
        if serve_args is not None:
            argv_serve = ["serve", *serve_args]
            for flag, value in (("--host", "127.0.0.1"), ("--cache-dir", str(work / "cache")),
                                ("--log-level", "warning")):
                if not any(x == flag or x.startswith(flag + "=") for x in serve_args):
                    argv_serve += [flag, value]
            device = argparse.ArgumentParser(add_help=False)
            device.add_argument("--device", default="")
            cuda = device.parse_known_args(serve_args)[0].device.startswith("cuda")
            threads = a.threads or int(os.environ.get("OMP_NUM_THREADS") or (4 if cuda else 1))
            # the temporary directory and port are this run's own: named, not spelled out
            shown = [x.replace(str(work / "cache"), "TMPDIR") for x in argv_serve]
            out["serve_command"] = "flashtier " + shlex.join(shown) + " --port PORT"
            out["serve_threads"] = threads
            child = ServeChild(argv_serve, work, threads, a.ready_timeout)
            url = child.url
            out["ready_s"] = child.ready_s
        else:
            url = a.base_url.rstrip("/")
            with _OPEN(url + "/health", timeout=30) as r:
                if r.status != 200:
                    raise RuntimeError(f"{url}/health answered {r.status}")
        out["server"] = server_info(url, serve_args, a.card)
        print(f"server: {out['server']['model']} ({out['server']['root']}) on {out['server']['card']}; "
              f"{w.sessions} sessions x {w.turns} turns, {w.output_tokens} output tokens", flush=True)
        print(HEADER, flush=True)
        asyncio.run(sweep(a, w, slo, url, out, deadline))
    except (Exception, KeyboardInterrupt):  # noqa: BLE001 - the JSON is still written, with the log tail
        out["errors"]["setup"] = traceback.format_exc()[-3000:]
        if child is not None:
            out["server_log_tail"] = child.log()
    finally:
        if child is not None:
            out["server_exit"] = child.stop()
        shutil.rmtree(work, ignore_errors=True)
    out["problems"] = check_result(out)
    out["wall_s"] = round(time.monotonic() - t_start, 1)
    out["client"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]  # others' load on a shared machine
    for row in out["rows"]:
        if (row.get("client_cpu_share") or 0) > CPU_SHARE_WARN:
            print(f"warning: rate {row['rate']}: the client used {row['client_cpu_share']:.0%} of a core; "
                  "chunk stamps may be late (split the sessions over several processes)", file=sys.stderr)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    for line in out["problems"]:
        print(f"invariant broken: {line}", file=sys.stderr)
    for stage, err in out["errors"].items():
        print(f"{stage} failed:\n{err}", file=sys.stderr)
    ran = [r for r in out["rows"] if "skipped" not in r]
    return 1 if out["errors"] or out["problems"] or not ran or any(r["completed"] == 0 for r in ran) else 0


if __name__ == "__main__":
    sys.exit(main())
