"""RedisServer: a real ``redis-server`` process on a free 127.0.0.1 port, for tests.

Started with ``--save "" --appendonly no`` (nothing on disk but a temporary working directory), bound to
loopback only, DEBUG allowed from local connections. ``stop()`` ends exactly the process it started, by
pid; ``restart()`` brings a fresh (empty) server back on the same port. A missing binary fails with an
install hint instead of skipping, so the Redis tests cannot silently disappear.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time

import redis

BINARY = "redis-server"


def free_port() -> int:
    """A loopback TCP port nobody listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """One ``redis-server`` child process; use as a context manager or call start()/stop()."""

    def __init__(self, *extra_args: str) -> None:
        self.binary = shutil.which(BINARY)
        if self.binary is None:
            raise RuntimeError(f"{BINARY} not found on PATH: install it (Debian/Ubuntu: apt-get install redis-server)")
        self.extra_args = extra_args
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self._dir = tempfile.TemporaryDirectory(prefix="flashtier-redis-")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        """A synchronous admin client (FLUSHALL, CONFIG SET, CLIENT PAUSE, PTTL ...)."""
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5)

    def start(self, port: int | None = None, timeout_s: float = 10.0) -> RedisServer:
        assert self.proc is None, "already running"
        for _ in range(5):  # a free port can be taken between free_port() and the bind: try another
            self.port = port or free_port()
            self.proc = subprocess.Popen(
                [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                 "--dir", self._dir.name, "--enable-debug-command", "local", "--loglevel", "warning",
                 *self.extra_args],
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            )  # fmt: skip
            if self._wait_ready(timeout_s):
                return self
            self.stop()
            if port is not None:
                break
        raise RuntimeError(f"redis-server did not start on 127.0.0.1:{self.port}")

    def _wait_ready(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                return False
            try:
                with redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=0.5) as c:
                    if c.ping():
                        return True
            except redis.ConnectionError:
                time.sleep(0.01)
        return False

    def stop(self) -> None:
        """Terminate the process this object started (SIGTERM, then SIGKILL after 5 s) and reap it."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        if proc.stderr is not None:
            proc.stderr.close()

    def restart(self) -> RedisServer:
        """Stop, then start an empty server on the same port."""
        port = self.port
        self.stop()
        return self.start(port=port)

    def close(self) -> None:
        self.stop()
        self._dir.cleanup()

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
