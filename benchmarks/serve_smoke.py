"""Smoke test of `flashtier serve` on a GPU: the official openai SDK against a real server process.

Starts ``flashtier serve --device cuda --preset flash-16e`` (random weights made on the GPU in their checkpoint
formats) on a loopback port, then: a chat completion, a streamed one, a forced tool call
(``tool_choice="required"``: the grammar holds the model to a DSML calls block matching the schema), and a
second turn of the first conversation, which must report ``cached_tokens > 0``. Prints one JSON line per check
and exits non-zero when one fails.

    python3 -P benchmarks/serve_smoke.py [--preset flash-16e] [--json OUT]   (flashtier importable, a CUDA GPU)
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import openai

SYSTEM = "You are a careful assistant for a long-running coding session. " * 24  # > 2 blocks of 64 tokens
TOOL = {"type": "function", "function": {"name": "read_file", "description": "Read a file",
        "parameters": {"type": "object", "properties": {"path": {"type": "string", "enum": ["main.py", "README.md"]}}, "required": ["path"]}}}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return time.monotonic() - t0
        except OSError:
            pass
        time.sleep(1)
    raise RuntimeError("the server was not ready in time")


class _Rows(list):
    """Rows printed as they come (a run cut short by a time limit still shows how far it got)."""

    def append(self, row: dict) -> None:
        print(json.dumps(row), flush=True)
        super().append(row)


def checks(client: openai.OpenAI) -> list[dict]:
    out = _Rows()
    model = client.models.list().data[0].id
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Say hello."}]
    t = time.monotonic()
    r = client.chat.completions.create(model=model, messages=msgs, max_tokens=12, temperature=0)
    out.append({"check": "chat", "ok": bool(r.choices[0].message.content is not None),
                "completion_tokens": r.usage.completion_tokens, "s": round(time.monotonic() - t, 2)})
    t = time.monotonic()
    chunks = list(client.chat.completions.create(model=model, messages=msgs, max_tokens=12, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    out.append({"check": "stream", "ok": len(chunks) > 2, "chunks": len(chunks), "chars": len(text),
                "s": round(time.monotonic() - t, 2)})
    t = time.monotonic()
    r2 = client.chat.completions.create(model=model, messages=msgs, max_tokens=96, temperature=0,
                                        tools=[TOOL], tool_choice="required")
    calls = r2.choices[0].message.tool_calls or []
    args_ok = bool(calls) and isinstance(json.loads(calls[0].function.arguments).get("path"), str)
    out.append({"check": "tool_call", "ok": args_ok, "finish_reason": r2.choices[0].finish_reason,
                "calls": [c.function.name for c in calls], "s": round(time.monotonic() - t, 2)})
    t = time.monotonic()
    turn2 = msgs + [{"role": "assistant", "content": r.choices[0].message.content or ""},
                    {"role": "user", "content": "Now say goodbye."}]
    r3 = client.chat.completions.create(model=model, messages=turn2, max_tokens=8, temperature=0)
    details = r3.usage.prompt_tokens_details
    cached = details.cached_tokens if details else 0
    out.append({"check": "second_turn_cached", "ok": cached > 0, "prompt_tokens": r3.usage.prompt_tokens,
                "cached_tokens": cached, "s": round(time.monotonic() - t, 2)})
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="flash-16e")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--json")
    ap.add_argument("--ready-timeout", type=float, default=240)
    args = ap.parse_args()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-P", "-m", "flashtier.server.cli", "serve", "--device", args.device, "--preset", args.preset,
           "--port", str(port), "--no-kv-persist", "--max-model-len", "8192", "--max-num-seqs", "8"]
    proc = subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": "4"})
    try:
        ready_s = wait_ready(url, proc, args.ready_timeout)
        print(json.dumps({"ready_s": round(ready_s, 1)}), flush=True)
        rows = checks(openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120))
    finally:
        proc.terminate()
        proc.wait(30)
    result = {"command": " ".join(sys.argv), "server": " ".join(cmd[2:]), "ready_s": round(ready_s, 1), "checks": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
