"""/metrics during a slow tier lookup: the request counts as loading, not running.

The snapshot pool is a real redis-server stopped with SIGSTOP: the resume lookup's one round trip
waits out its timeout (0.25 s), so the second turn sits in LOADING for that long while /metrics is
scraped in a tight loop. SIGCONT lets it finish normally.
"""

from __future__ import annotations

import signal
import threading
import time

import httpx
import pytest

from ..kvstore.redis_server import RedisServer
from .test_api_tiers import Server, _chunk


def _gauges(srv: Server) -> tuple[float, float]:
    """Both gauges from ONE scrape: two scrapes can straddle the LOADING -> RUNNING transition and read (1, 1)."""
    values = {"flashtier_num_requests_loading": 0.0, "flashtier_num_requests_running": 0.0}
    for line in httpx.get(srv.url + "/metrics", timeout=10).text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in values:
            values[name] += float(line.rsplit(" ", 1)[1])
    return values["flashtier_num_requests_loading"], values["flashtier_num_requests_running"]


@pytest.mark.slow
@pytest.mark.serial  # the LOADING window is one 0.25 s Redis timeout: a busy second core makes the scrapes miss it
def test_a_request_in_a_slow_lookup_is_loading_not_running(tmp_path):
    redis = RedisServer().start()
    srv = Server(tmp_path, "--kv-dir", str(tmp_path / "kv"), "--redis-url", redis.url, "--block-size", "16")
    try:
        prompt = _chunk(320, seed=7)  # 20 blocks: the lookup is one Redis round trip whatever the prompt's length
        first = srv.complete(prompt, max_tokens=2)["choices"][0]["token_ids"]
        assert _gauges(srv) == (0, 0)
        redis.proc.send_signal(signal.SIGSTOP)
        answer: dict = {}
        turn = threading.Thread(target=lambda: answer.update(srv.complete(prompt + first + _chunk(40, seed=8), 2)))
        turn.start()
        seen = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and (1, 0) not in seen:
            seen.append(_gauges(srv))  # no sleep: the LOADING window is one Redis timeout long
        redis.proc.send_signal(signal.SIGCONT)
        turn.join(timeout=120)
        assert (1, 0) in seen, f"never saw loading=1, running=0 in {seen[-5:]}"
        assert all(loading + running <= 1 for loading, running in seen)
        assert len(answer["choices"][0]["token_ids"]) == 2
        assert _gauges(srv) == (0, 0)
    finally:
        if redis.proc is not None:
            redis.proc.send_signal(signal.SIGCONT)
        srv.stop()
        redis.stop()
