"""ServeProcess: a real ``flashtier serve`` (the demo model) in its own process on a free loopback port.

Torch runs one thread (OMP_NUM_THREADS=1), the cache directory is the test's, and ``stop()`` sends SIGTERM
to exactly the process it started (SIGKILL after 60 s) and reaps it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from ..kvstore.redis_server import free_port


class ServeProcess:
    def __init__(self, cache_dir: Path, *args: str, timeout_s: float = 240.0, wait: bool = True) -> None:
        """Start the server; ``wait``: return once /health answers 200 (else call ``wait_healthy``)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "flashtier.server.cli", "serve", "--port", str(self.port), "--cache-dir",
               str(cache_dir), "--log-level", "warning", *args]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        cache_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = cache_dir / "serve.log"
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=self._log)
        if wait:
            self.wait_healthy(timeout_s)

    def wait_healthy(self, timeout_s: float = 240.0) -> "ServeProcess":
        """Block until /health answers 200; a server that exits or stays unhealthy raises (and is stopped)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"flashtier serve exited: {self.log()[-3000:]}")
            if self.health() == 200:
                return self
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"flashtier serve did not become healthy: {self.log()[-3000:]}")

    def health(self) -> int | None:
        try:
            return httpx.get(self.url + "/health", timeout=2).status_code
        except httpx.HTTPError:
            return None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    @property
    def pid(self) -> int:
        return self.proc.pid

    def complete(self, prompt: list[int], max_tokens: int = 2) -> dict:
        r = httpx.post(self.url + "/v1/completions", timeout=600, json={
            "model": "flashtier-tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True})
        assert r.status_code == 200, r.text
        return r.json()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        self._log.close()
