"""The fault suites' server process (``FaultServer``: a real `flashtier serve` on a loopback port, started,
stopped and killed by pid, answers parsed into ``Reply``), the parameters every server here shares, and the
prompt chunks. The harness around it (references, conversations, verification, fixtures): conftest.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import torch
from prometheus_client.parser import text_string_to_metric_families

from ..kvstore.redis_server import free_port

BS = 16  # --block-size of every server here
W = 16  # the tiny preset's window
MAX_TOKENS = 4
MODEL = "flashtier-tiny"
START_TIMEOUT_S = 180
REQUEST_TIMEOUT_S = 300


def chunk(n: int, seed: int) -> list[int]:
    """``n`` token ids, a pure function of ``seed`` (the same ids as tests/server/test_api_tiers.py)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 128000, (n,), generator=g).tolist()


# ---- a server process ---------------------------------------------------------------------------------


@dataclass
class Reply:
    """One POST /v1/completions: the HTTP status and body, or no answer at all (status None)."""

    status: int | None
    body: dict | None = None
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.status == 200

    @property
    def tokens(self) -> list[int]:
        return self.body["choices"][0]["token_ids"]

    @property
    def usage(self) -> dict:
        return self.body["usage"]


class FaultServer:
    """`python -m flashtier.server.cli serve` on a free loopback port; ``start()`` again after a kill
    starts a new process with the same arguments (same --kv-dir, same Redis), on a new port. Each
    process's stderr goes to its own file (``log_text()`` reads the current one)."""

    def __init__(self, cache_dir: Path, log_dir: Path, name: str, *args: str) -> None:
        self.cache_dir, self.log_dir, self.name, self.args = Path(cache_dir), Path(log_dir), name, args
        self.proc: subprocess.Popen | None = None
        self.port = 0
        self.starts = 0
        self.log_path: Path | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> FaultServer:
        assert self.proc is None or self.proc.poll() is not None, "already running"
        self.starts += 1
        self.port = free_port()
        self.log_path = self.log_dir / f"{self.name}.{self.starts}.stderr"
        cmd = [sys.executable, "-m", "flashtier.server.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port),
               "--dtype", "float64", "--block-size", str(BS), "--num-blocks", "600", "--cache-dir",
               str(self.cache_dir), "--max-num-batched-tokens", "1024", "--log-level", "warning", *self.args]
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
                   TRITON_INTERPRET=os.environ.get("TRITON_INTERPRET", "1"))
        with open(self.log_path, "wb") as err:
            self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=err,
                                         stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}: {self.log_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.kill()
        raise RuntimeError(f"{self.name} did not become healthy: {self.log_text()[-3000:]}")

    def warm(self) -> None:
        """One short request of its own (its lookup opens the snapshot pool's Redis connection), so that the
        first lookup that matters does not pay the connection set-up inside the pool's 0.25 s timeout."""
        self.complete(chunk(40, 99), max_tokens=1)

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path and self.log_path.exists() else ""

    def post(self, prompt: list[int], max_tokens: int = MAX_TOKENS, client: httpx.Client | None = None,
             url: str | None = None) -> Reply:
        """Never raises for a missing answer (refused, reset, timed out): that is ``Reply(None)``."""
        body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True}
        try:
            if client is None:
                r = httpx.post((url or self.url) + "/v1/completions", json=body, timeout=REQUEST_TIMEOUT_S)
            else:
                r = client.post((url or self.url) + "/v1/completions", json=body, timeout=REQUEST_TIMEOUT_S)
        except httpx.TransportError as exc:
            return Reply(None, None, f"{type(exc).__name__}: {exc}")
        try:
            data = r.json()
        except ValueError:
            data = {"text": r.text[:500]}
        return Reply(r.status_code, data)

    def complete(self, prompt: list[int], max_tokens: int = MAX_TOKENS) -> Reply:
        reply = self.post(prompt, max_tokens)
        assert reply.ok, (reply.status, reply.body, reply.error)
        return reply

    def metrics(self) -> list[tuple[str, dict[str, str], float]]:
        text = httpx.get(self.url + "/metrics", timeout=30).text
        return [(s.name, s.labels, s.value) for fam in text_string_to_metric_families(text) for s in fam.samples]

    def metric(self, name: str, **labels: str) -> float:
        """The sum of the samples named ``name`` whose labels include ``labels``."""
        return sum(v for n, lab, v in self.metrics() if n == name and all(lab.get(k) == x for k, x in labels.items()))

    def metric_map(self, needle: str) -> dict[str, float]:
        """Samples whose name contains ``needle``, keyed ``name{labels}`` (model_name left out)."""
        out = {}
        for n, lab, v in self.metrics():
            if needle in n:
                extra = ",".join(f"{k}={x}" for k, x in sorted(lab.items()) if k != "model_name")
                out[n + (f"{{{extra}}}" if extra else "")] = v
        return out

    def kill(self) -> None:
        """SIGKILL the process this object started (by pid) and reap it."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        """SIGTERM (the server drains and flushes), SIGKILL after 30 s."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()
