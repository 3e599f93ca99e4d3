"""A 20 MB request never blocks the server: a real ``flashtier serve`` process (scripted engine) gets a 20 MB
prompt on /v1/completions and on /v1/chat/completions while /health is probed; every probe during the
request must answer within 100 ms, and afterwards the process's RSS (VmRSS) must come back near its
baseline. A /tokenize body over --max-tokenize-bytes is refused at once, from its Content-Length alone.

Before the front end moved off the event loop, such a prompt held every request, /health included, for
about a minute (``json.loads`` and ``tokenizers``' ``encode`` hold the GIL), and the process stayed at its
peak (glibc keeps freed heap pages until ``malloc_trim``).

The big request is sent by a separate process, so that uploading it does not take the GIL from the probing
thread; that process starts and reads the body before the probing begins (on two busy cores its start-up
alone delayed probes). The probes use one keep-alive connection.
"""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from .scripted_engine import SCRIPTED_SERVE_ARGV

# ~1 min: two 20 MB prompts are tokenized (4M tokens each); serial: the 100 ms probe limit needs an otherwise idle
# machine (another busy process on the 2 cores delays probes past it)
pytestmark = [pytest.mark.slow, pytest.mark.serial]

BIG_BYTES = 20_000_000
PROBES = 50
PROBE_LIMIT_S = 0.100
RSS_RETURN = 0.25  # after - baseline, as a fraction of peak - baseline

_SENDER = """
import pathlib, sys, time, httpx
body = pathlib.Path(sys.argv[2]).read_bytes()
print("ready", flush=True)
sys.stdin.readline()
t0 = time.perf_counter()
r = httpx.post(sys.argv[1], content=body, headers={"content-type": "application/json"}, timeout=600)
sys.stdout.write(f"{r.status_code} {time.perf_counter() - t0:.2f}\\n" + r.text[:2000])
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def _prompt_text(n: int) -> str:
    """~n characters of text with newlines, punctuation, accents, CJK and escaped quotes."""
    rng = random.Random(0)
    words = ["hello", "world", "the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "agent", "tool",
             "café", "数据", "\n", '"quoted"', "x\\y", "42,"]
    return " ".join(rng.choice(words) for _ in range(n // 5))[:n]


@pytest.fixture(scope="module")
def serve(tmp_path_factory):
    """`flashtier serve` in front of the scripted engine, as a process; yields (url, pid)."""
    tmp = tmp_path_factory.mktemp("load")
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLASHTIER_")}
    env.update(FLASHTIER_CACHE_DIR=str(tmp / "cache"), OMP_NUM_THREADS="1")
    argv = [*SCRIPTED_SERVE_ARGV, "--port", str(port), "--no-kv-persist", "--log-level",
            "warning"]
    proc = subprocess.Popen(argv, cwd=tmp, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, "the server died"
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.2)
        yield url, proc.pid
    finally:
        proc.terminate()
        proc.wait(30)


def _warm(url: str) -> None:
    """One small request of each kind, so the baseline holds what every request loads once."""
    with httpx.Client(base_url=url, timeout=60) as http:
        assert http.post("/tokenize", json={"prompt": "hi " * 3000}).status_code == 200
        assert http.post("/v1/completions", json={"prompt": "hi " * 30_000, "max_tokens": 2}).status_code == 400
        assert http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                       "max_tokens": 2}).status_code == 200


def _settled_rss(pid: int, baseline: float, peak: float, timeout_s: float = 10.0) -> float:
    """VmRSS once it has come down near the baseline, or after `timeout_s` (the trim runs on a worker)."""
    deadline = time.monotonic() + timeout_s
    rss = _rss_mb(pid)
    while rss > baseline + RSS_RETURN * (peak - baseline) and time.monotonic() < deadline:
        time.sleep(0.2)
        rss = _rss_mb(pid)
    return rss


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_20mb_prompt_leaves_health_fast_and_memory_returns(serve, path, tmp_path):
    url, pid = serve
    _warm(url)
    time.sleep(1.0)
    baseline = _rss_mb(pid)
    text = _prompt_text(BIG_BYTES)
    body = {"prompt": text, "max_tokens": 4} if path == "/v1/completions" else \
        {"messages": [{"role": "user", "content": text}], "max_tokens": 4}
    raw = json.dumps(body).encode()
    assert len(raw) > BIG_BYTES
    (tmp_path / "body.json").write_bytes(raw)
    sender = subprocess.Popen([sys.executable, "-c", _SENDER, url + path, str(tmp_path / "body.json")],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert sender.stdout.readline() == b"ready\n"
    sender.stdin.write(b"go\n")
    sender.stdin.close()
    latencies, offsets, peak, start = [], [], baseline, time.perf_counter()
    with httpx.Client(base_url=url, timeout=30) as http:
        while sender.poll() is None:
            t0 = time.perf_counter()
            r = http.get("/health")
            latencies.append(time.perf_counter() - t0)
            offsets.append(t0 - start)
            assert r.status_code == 200
            peak = max(peak, _rss_mb(pid))
            time.sleep(0.02)
    status, elapsed, answer = _sender_result(sender)
    after = _settled_rss(pid, baseline, peak)
    worst = max(latencies)
    print(f"\n{path}: {len(raw) / 1e6:.1f} MB answered {status} in {elapsed:.1f} s; {len(latencies)} probes, slowest "
          f"{worst * 1000:.0f} ms; RSS baseline {baseline:.0f} MB, peak {peak:.0f} MB, after {after:.0f} MB")
    # the prompt was tokenized to the end: the context check counts all of its 4M+ tokens
    assert status == 400 and answer["error"]["code"] == "context_length_exceeded"
    counted = int(answer["error"]["message"].split("you requested ")[1].split(" tokens")[0])
    assert counted > 4_000_000
    assert len(latencies) >= PROBES, f"only {len(latencies)} probes while the request ran {elapsed:.1f} s"
    slow = [f"{t * 1000:.0f} ms at {at:.2f} s" for t, at in zip(latencies, offsets, strict=True) if t >= PROBE_LIMIT_S]
    assert not slow, f"probes over {PROBE_LIMIT_S * 1000:.0f} ms: {slow} of {len(latencies)} in {elapsed:.1f} s"
    assert peak > baseline + 50  # the request did hold its memory while it ran
    # near the baseline: a quarter of the way from it to the peak at most (measured: <= 0.15 with malloc_trim,
    # >= 0.34 without it)
    assert after <= baseline + RSS_RETURN * (peak - baseline), (baseline, peak, after)


def _sender_result(sender: subprocess.Popen) -> tuple[int, float, dict]:
    out = sender.stdout.read().decode()
    sender.wait(30)
    head, _, text = out.partition("\n")
    status, elapsed = head.split()
    return int(status), float(elapsed), json.loads(text)


def test_too_big_tokenize_is_refused_from_its_content_length(serve):
    """The 413 comes before a byte of the body is read: the client sends only the headers."""
    url, _ = serve
    port = int(url.rsplit(":", 1)[1])
    latencies = []
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        t0 = time.perf_counter()
        sock.sendall(b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % BIG_BYTES)
        reply = b""
        while b"\r\n\r\n" not in reply:
            reply += sock.recv(4096)
        latencies.append(time.perf_counter() - t0)
    assert reply.startswith(b"HTTP/1.1 413"), reply[:100]
    assert latencies[0] < 1.0
    with httpx.Client(base_url=url, timeout=30) as http:  # the same size is fine for chat (--max-request-bytes)
        r = http.post("/tokenize", json={"prompt": "x" * (9 << 20)})
        assert r.status_code == 413 and "8388608 bytes" in r.json()["error"]["message"]
        assert http.get("/health").status_code == 200
