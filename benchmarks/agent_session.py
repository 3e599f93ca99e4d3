"""A synthetic agent session through the HTTP API: what the tiers save per turn.

A long system prompt with tools, then turns that each append a tool output and a short user message
(the assistant's previous reply is echoed back, as harnesses do), with idle gaps between turns. Per
turn: prompt tokens, cached tokens by tier, TTFT with the cache and TTFT of the same prompt cold (a fresh
`cache_salt` forces a miss on the same server), and the bytes written to SSD. Ratios:

    TTFT(hit) / TTFT(cold)
    SSD bytes per turn / a V4-style baseline that also persists every layer's full window at each turn

Starts its own `flashtier serve` (demo model unless --model-dir) unless --url is given.

    python benchmarks/agent_session.py --turns 6 --out docs/perf/agent_session_tiny_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time

import httpx

TOOLS = [
    {"type": "function", "function": {
        "name": name, "description": desc,
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "query": {"type": "string"}},
                       "required": ["path"]}}}
    for name, desc in [("read_file", "Read a file of the repository."), ("grep", "Search the repository."),
                       ("run_tests", "Run the test suite and return its output."),
                       ("edit_file", "Replace a span of a file.")]
]


def _words(rng: random.Random, n: int) -> str:
    vocab = ["def", "return", "self", "import", "class", "value", "config", "request", "block", "token",
             "cache", "error", "test", "assert", "None", "True", "for", "in", "if", "else", "with", "as"]
    return " ".join(rng.choice(vocab) for _ in range(n))


def _metric(url: str, name: str) -> float:
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _stream_chat(url: str, model: str, messages: list, salt: str | None, max_tokens: int) -> tuple[float, dict, str]:
    body = {"model": model, "messages": messages, "tools": TOOLS, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    if salt:
        body["cache_salt"] = salt
    t0 = time.perf_counter()
    ttft, usage, text = None, {}, []
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for c in chunk.get("choices", []):
                delta = c.get("delta", {})
                piece = delta.get("content") or delta.get("reasoning_content") or ""
                if (piece or delta.get("tool_calls")) and ttft is None:
                    ttft = time.perf_counter() - t0
                text.append(piece)
    return ttft if ttft is not None else time.perf_counter() - t0, usage, "".join(text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default=None)
    ap.add_argument("--model-dir", default=None)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--system-words", type=int, default=1500)
    ap.add_argument("--tool-output-words", type=int, default=400)
    ap.add_argument("--idle-s", type=float, default=2.0)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    rng = random.Random(0)
    proc = None
    work = tempfile.mkdtemp(prefix="flashtier-bench-")
    url = args.url
    if url is None:
        port = 18000 + os.getpid() % 1000
        cmd = [sys.executable, "-m", "flashtier.server.cli", "serve", "--port", str(port), "--cache-dir", work,
               "--log-level", "warning"] + ([args.model_dir] if args.model_dir else [])
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{port}"
        for _ in range(600):
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
    try:
        model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        info = json.loads(subprocess.run([sys.executable, "-m", "flashtier.server.cli", "inspect", "--json"]
                                         + ([args.model_dir] if args.model_dir else ["--preset", "tiny"]),
                                         capture_output=True, text=True, check=True).stdout)
        kv = info["kv"]
        window_bytes_all_layers = kv["swa_bytes_per_sequence"]  # every layer's full window, one turn
        messages = [{"role": "system", "content": "You are a coding agent. " + _words(rng, args.system_words)},
                    {"role": "user", "content": "Fix the failing test in the cache module."}]
        rows = []
        for turn in range(args.turns):
            ssd_before = _metric(url, "flashtier_ssd_bytes_written_total")
            ttft, usage, reply = _stream_chat(url, model, messages, None, args.max_tokens)
            time.sleep(0.5)  # let write-through land before reading the counter
            ssd_bytes = _metric(url, "flashtier_ssd_bytes_written_total") - ssd_before
            ttft_cold, _, _ = _stream_chat(url, model, messages, f"cold-{turn}-{rng.random()}", args.max_tokens)
            ft = usage.get("flashtier", {})
            tiers = ft.get("cached_tokens_by_tier", {})
            baseline = ssd_bytes + window_bytes_all_layers
            # the same turn in the real geometry: 890 B of global KV per new token vs + 40 x 128 x 528 B
            new_tokens = (usage.get("prompt_tokens") or 0) - (usage.get("prompt_tokens_details", {})
                                                               .get("cached_tokens") or 0)
            real_ratio = new_tokens * 890 / (new_tokens * 890 + 40 * 128 * 528) if new_tokens else 0.0
            rows.append({
                "turn": turn, "prompt_tokens": usage.get("prompt_tokens"),
                "cached_tokens": usage.get("prompt_tokens_details", {}).get("cached_tokens"),
                "hbm": tiers.get("hbm"), "ssd": tiers.get("ssd"), "snapshot": tiers.get("snapshot"),
                "approximate_replay": ft.get("approximate_replay_tokens"), "ttft_s": ttft, "ttft_cold_s": ttft_cold,
                "ttft_ratio": ttft / ttft_cold if ttft_cold else None,
                "ssd_bytes": ssd_bytes, "v4_baseline_bytes": baseline,
                "bytes_ratio": ssd_bytes / baseline if baseline else None,
                "real_geometry_bytes_ratio": real_ratio,
            })
            messages.append({"role": "assistant", "content": reply})
            messages.append({"role": "tool", "tool_call_id": f"call_{turn}", "content": _words(rng, args.tool_output_words)})
            messages.append({"role": "user", "content": "Continue."})
            time.sleep(args.idle_s)
        hdr = f"{'turn':>4} {'prompt':>7} {'cached':>7} {'hbm':>6} {'ssd':>6} {'snap':>5} {'TTFT ms':>8} " \
              f"{'cold ms':>8} {'ratio':>6} {'SSD B':>8} {'V4 B':>9} {'ratio':>6} {'real':>6}"
        print(hdr)
        for r in rows:
            print(f"{r['turn']:>4} {r['prompt_tokens']:>7} {r['cached_tokens']:>7} {r['hbm']:>6} {r['ssd']:>6} "
                  f"{r['snapshot']:>5} {1000 * r['ttft_s']:>8.0f} {1000 * r['ttft_cold_s']:>8.0f} "
                  f"{r['ttft_ratio']:>6.2f} {r['ssd_bytes']:>8.0f} {r['v4_baseline_bytes']:>9.0f} "
                  f"{r['bytes_ratio']:>6.2f} {r['real_geometry_bytes_ratio']:>6.2f}")
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"command": "python benchmarks/agent_session.py "
                           + " ".join(argv if argv is not None else sys.argv[1:]),
                           "model": model, "kv": kv, "rows": rows}, f, indent=2)
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
