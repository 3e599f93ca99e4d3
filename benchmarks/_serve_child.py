"""ServeChild: a ``flashtier serve`` process on a free loopback port that a benchmark starts, streams one
completion at a time to, scrapes, and stops by its own pid (SIGTERM, SIGKILL after 60 s).

Torch threads of the server are capped (``OMP_NUM_THREADS``); its output goes to a log file in the work
directory, whose tail ``log()`` returns for an error report.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from _turn_evidence import scrape

_OPEN = urllib.request.build_opener(urllib.request.ProxyHandler({})).open  # loopback: never through a proxy


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServeChild:
    """``flashtier serve`` in its own process on a free loopback port; ``stop()`` signals only that pid."""

    def __init__(self, argv: list[str], work: Path, threads: int, timeout_s: float) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.argv = [*argv, "--port", str(self.port)]
        self.log_path = work / f"serve-{self.port}.log"
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
        t0 = time.monotonic()
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen([sys.executable, "-P", "-m", "flashtier.server.cli", *self.argv], env=env,
                                         stdout=log, stderr=subprocess.STDOUT)
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"serve exited with {self.proc.returncode}: {self.log()}")
            try:
                with _OPEN(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:  # refused while starting; HTTPError (503) while the engine loads
                pass
            if time.monotonic() - t0 > timeout_s:
                self.stop()
                raise RuntimeError(f"serve not healthy after {timeout_s:.0f} s: {self.log()}")
            time.sleep(0.25)
        self.ready_s = round(time.monotonic() - t0, 2)
        self.model = json.loads(self._get("/v1/models"))["data"][0]["id"]

    def _get(self, path: str) -> str:
        with _OPEN(self.url + path, timeout=30) as r:
            return r.read().decode()

    def log(self) -> str:
        """The last 3,000 characters of the server's output."""
        return self.log_path.read_text(errors="replace")[-3000:]

    def metrics(self) -> dict[str, float]:
        return scrape(self._get("/metrics"))

    def turn(self, ids: list[int], salt: str | None, timeout_s: float) -> tuple[float, dict]:
        """One streamed completion (max_tokens 1): (client TTFT seconds, usage). Raises HTTPError on an error
        status, TimeoutError past ``timeout_s`` without a byte, RuntimeError on a stream without a token."""
        body = {"model": self.model, "prompt": ids, "max_tokens": 1, "temperature": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}, **({"cache_salt": salt} if salt else {})}
        req = urllib.request.Request(self.url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        t0, ttft, usage = time.perf_counter(), None, {}
        # the timeout bounds each socket wait: a prefill that outlasts it raises, and closing the stream aborts it
        with _OPEN(req, timeout=max(timeout_s, 5.0)) as r:
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                usage = chunk.get("usage") or usage
                if ttft is None and any(c.get("text") or c.get("finish_reason") for c in chunk.get("choices", [])):
                    ttft = time.perf_counter() - t0
        if ttft is None:
            raise RuntimeError(f"no token streamed; usage {usage}")
        return ttft, usage

    def stop(self) -> int | None:
        """SIGTERM to this server's pid (SIGKILL after 60 s), reaped; its exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        return self.proc.returncode
