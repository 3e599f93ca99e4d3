"""Tiered KV through the HTTP API with real processes: `flashtier serve` (the demo model in float64 mode),
a real redis-server, an SSD directory. The conversation uses token-id prompts (`return_token_ids`) so
each turn resends exactly the previous prompt + output, as an agent harness does with a real model.

Exact resume must give the tokens of a cold run of the same prompt on a server with caching off; a
resume by encoder bounded replay must give the oracle's plan (c).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from flashtier.engine.model.loader import demo_checkpoint

from ..kvstore.redis_server import RedisServer, free_port

BS = 64
W = 16  # the tiny preset's window


class Server:
    """`python -m flashtier.server.cli serve` on a free loopback port; torch on one thread (OMP_NUM_THREADS=1:
    two servers share the 2 CI cores, and a second intra-op thread per process only spins). ``wait=False``
    returns at once (call ``wait_healthy``), so that two servers start side by side."""

    def __init__(self, cache_dir, *args: str, wait: bool = True, budget: int = 1024):
        self.port = free_port()
        cmd = [sys.executable, "-m", "flashtier.server.cli", "serve", "--port", str(self.port), "--dtype",
               "float64", "--block-size", str(BS), "--num-blocks", "600", "--cache-dir", str(cache_dir),
               "--max-num-batched-tokens", str(budget), "--log-level", "warning", *args]
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self.url = f"http://127.0.0.1:{self.port}"
        self.healthy = False
        if wait:
            self.wait_healthy()

    def wait_healthy(self) -> Server:
        """Until /health answers 200 (``complete`` calls it first on a server started with ``wait=False``)."""
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.proc.stderr.read().decode()[-2000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    self.healthy = True
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.kill()
        raise RuntimeError("server did not become healthy")

    def complete(self, prompt: list[int], max_tokens: int = 8, headers: dict | None = None, **extra) -> dict:
        if not self.healthy:
            self.wait_healthy()
        r = httpx.post(self.url + "/v1/completions", timeout=600, headers=headers, json={
            "model": "flashtier-tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, **extra})
        assert r.status_code == 200, r.text
        return r.json()

    def metric(self, name: str) -> float:
        total = 0.0
        for line in httpx.get(self.url + "/metrics", timeout=10).text.splitlines():
            if line.startswith(name) and not line.startswith("#"):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()


def _chunk(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 128000, (n,), generator=g).tolist()


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """One --cache-dir for every server of the module: the demo checkpoint is written once (seconds of CPU
    per server otherwise). Each test keeps its own --kv-dir."""
    path = tmp_path_factory.mktemp("tiers-cache")
    demo_checkpoint(path / "models")  # before any server starts: two starting side by side would both write it
    return path


@pytest.fixture(scope="module")
def redis():
    server = RedisServer().start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def cold(cache_dir):
    """The reference: a server with prefix caching and persistence off; not waited for here (its start-up
    overlaps the tested server's, its first request waits for it). It prefills in chunks of 256 tokens: a
    cold run's tokens do not depend on the chunking (tests/engine/test_engine.py checks chunked = unchunked),
    and on the CPU a 1024-token chunk over a long prompt costs twice the time of four 256-token ones."""
    server = Server(cache_dir, "--no-prefix-caching", "--no-kv-persist", wait=False, budget=256)
    yield server
    server.stop()


def _wait_persisted(server: Server) -> None:
    time.sleep(1.5)  # the SSD writer fsyncs each batch as soon as it is queued; snapshots are async puts


@pytest.mark.slow
def test_four_turn_conversation_past_8k_tokens_resumes_exactly(cache_dir, tmp_path, redis, cold):
    """Each turn's cold reference runs on the cold server while the server under test answers that turn and
    the next ones (the prompts depend only on the tested server's answers), so the two processes work on
    the two cores side by side; every turn's tokens are still compared with its cold run."""
    srv = Server(cache_dir, "--kv-dir", str(tmp_path / "kv"), "--redis-url", redis.url)
    refs, outs = [], []
    try:
        with ThreadPoolExecutor(4, thread_name_prefix="cold") as pool:
            prompt = _chunk(2200, seed=1)
            previous = None
            for turn in range(4):
                refs.append(pool.submit(cold.complete, prompt))
                got = srv.complete(prompt)
                choice = got["choices"][0]
                outs.append(choice["token_ids"])
                usage = got["usage"]
                if previous is not None:
                    # everything fed last turn is cached: prompt + output minus the last sample (never fed)
                    assert usage["prompt_tokens_details"]["cached_tokens"] == previous - 1
                    tiers = usage["flashtier"]["cached_tokens_by_tier"]
                    assert tiers["hbm"] + tiers["ssd"] + tiers["snapshot"] == previous - 1
                    assert usage["flashtier"]["computed_tokens"] == len(prompt) - (previous - 1)
                previous = len(prompt) + len(choice["token_ids"])
                prompt = prompt + choice["token_ids"] + _chunk(2100, seed=10 + turn)
            for turn, (ref, out) in enumerate(zip(refs, outs)):
                assert out == ref.result()["choices"][0]["token_ids"], f"turn {turn}"
        assert previous > 8000
        assert srv.metric("flashtier_snapshot_lookup_hit") >= 3
    finally:
        srv.stop()


def test_restart_after_sigkill_resumes_from_ssd_and_snapshot(cache_dir, tmp_path, redis, cold):
    kv = str(tmp_path / "kv")
    srv = Server(cache_dir, "--kv-dir", kv, "--redis-url", redis.url)
    prompt = _chunk(700, seed=2)
    first = srv.complete(prompt)["choices"][0]["token_ids"]
    _wait_persisted(srv)
    srv.kill()
    prompt = prompt + first + _chunk(100, seed=3)
    srv = Server(cache_dir, "--kv-dir", kv, "--redis-url", redis.url)
    try:
        got = srv.complete(prompt)
        usage = got["usage"]
        tiers = usage["flashtier"]["cached_tokens_by_tier"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == 700 + len(first) - 1
        assert tiers["hbm"] == 0 and tiers["ssd"] == (700 + len(first) - 1) // BS * BS
        assert tiers["snapshot"] == (700 + len(first) - 1) % BS
        assert usage["flashtier"]["resume"] == {"kind": "exact", "replay_from": None, "approximate": False}
        assert (usage["flashtier"]["decoder_tokens"], usage["flashtier"]["approximate_replay_tokens"]) == (W, 0)
        assert got["choices"][0]["token_ids"] == cold.complete(prompt)["choices"][0]["token_ids"]
    finally:
        srv.stop()


def test_tenants_share_no_cache_in_any_tier(cache_dir, tmp_path, redis):
    """`--cache-isolation per-key`: tenant B (its own key) gets no cached token for tenant A's prompt in HBM,
    on the SSD or from the snapshot pool, even sending A's very salt; a second salt within A's key is its own
    namespace too (cache_salt isolation); A's repeat is served from HBM, and after a restart from SSD + the
    snapshot pool, so every zero below could have been a hit."""
    kv = str(tmp_path / "kv")
    a, b = {"authorization": "Bearer key-a"}, {"authorization": "Bearer key-b"}

    def tiers(got: dict) -> tuple[int, int, int, int]:
        usage = got["usage"]
        t = usage["flashtier"]["cached_tokens_by_tier"]
        return usage["prompt_tokens_details"]["cached_tokens"], t["hbm"], t["ssd"], t["snapshot"]

    args = ("--kv-dir", kv, "--redis-url", redis.url, "--api-key", "key-a,key-b", "--cache-isolation", "per-key")
    srv = Server(cache_dir, *args)
    hbm_prompt, prompt = _chunk(200, seed=20), _chunk(300, seed=21)
    try:
        assert tiers(srv.complete(hbm_prompt, max_tokens=1, headers=a, cache_salt="s"))[0] == 0
        assert tiers(srv.complete(hbm_prompt, max_tokens=1, headers=b, cache_salt="s")) == (0, 0, 0, 0)
        assert tiers(srv.complete(hbm_prompt, max_tokens=1, headers=a, cache_salt="t")) == (0, 0, 0, 0)
        cached, hbm, _, snapshot = tiers(srv.complete(hbm_prompt, max_tokens=1, headers=a, cache_salt="s"))
        # A's own repeat: its HBM blocks, plus its prompt-end snapshot (P = n) once the async put landed
        assert hbm == len(hbm_prompt) // BS * BS and cached == hbm + snapshot and snapshot in (0, len(hbm_prompt) % BS)
        first = srv.complete(prompt, headers=a, cache_salt="s")["choices"][0]["token_ids"]
        _wait_persisted(srv)
    finally:
        srv.kill()
    prompt = prompt + first + _chunk(50, seed=22)
    srv = Server(cache_dir, *args)
    try:
        assert tiers(srv.complete(prompt, max_tokens=1, headers=b, cache_salt="s")) == (0, 0, 0, 0)
        assert tiers(srv.complete(prompt, max_tokens=1, headers=a, cache_salt="t")) == (0, 0, 0, 0)
        cached, hbm, ssd, snapshot = tiers(srv.complete(prompt, max_tokens=1, headers=a, cache_salt="s"))
        assert hbm == 0 and ssd > 0 and snapshot > 0 and cached == ssd + snapshot == 300 + len(first) - 1
    finally:
        srv.stop()


def test_flushed_redis_falls_back_to_encoder_replay_matching_plan_c(cache_dir, tmp_path, redis):
    from flashtier.engine.model.loader import load_model
    from flashtier.engine.model.reference import Plan, reference_forward
    from flashtier.server.text.engram_map import engram_token_map
    from flashtier.server.text.tokenizer import Tokenizer

    srv = Server(cache_dir, "--kv-dir", str(tmp_path / "kv"), "--redis-url", redis.url)
    try:
        prompt = _chunk(300, seed=4)
        first = srv.complete(prompt)["choices"][0]["token_ids"]
        _wait_persisted(srv)
        misses_before = srv.metric("flashtier_snapshot_lookup_none") + srv.metric("flashtier_snapshot_lookup_miss")
        redis.client().flushall()
        prompt = prompt + first + _chunk(60, seed=5)
        got = srv.complete(prompt)
        toks = got["choices"][0]["token_ids"]
        usage = got["usage"]
        r = (300 + len(first) - 1) // BS * BS
        assert usage["prompt_tokens_details"]["cached_tokens"] == r
        assert usage["flashtier"]["cached_tokens_by_tier"]["snapshot"] == 0
        assert (usage["flashtier"]["approximate_replay_tokens"], usage["flashtier"]["decoder_tokens"]) == (W, W)
        assert usage["flashtier"]["resume"] == {"kind": "replay", "replay_from": r, "approximate": True}
        assert srv.metric('flashtier_resumes_total{kind="replay",model_name="flashtier-tiny"}') == 1
        misses = srv.metric("flashtier_snapshot_lookup_none") + srv.metric("flashtier_snapshot_lookup_miss")
        assert misses > misses_before
        assert srv.metric("flashtier_prompt_tokens_replayed") > 0
    finally:
        srv.stop()
    model = load_model(cache_dir / "models" / "demo-tiny-seed0", dtype=torch.float64, with_dspark=False,
                       progress=False).double()
    tok = Tokenizer()
    model.set_token_map(engram_token_map(tok, model.cfg.vocab_size, model.cfg.engram_compressed_vocab)[0])
    seq = torch.tensor(prompt + toks[:-1])
    ref = reference_forward(model, seq, Plan.resume(r, len(prompt), seq.numel(), W))
    assert torch.argmax(ref.logits, -1).tolist() == toks


def _wait_snapshots(redis: RedisServer, count: int) -> None:
    """Until Redis holds ``count`` snapshot values (the server's puts are asynchronous): a condition polled
    with a deadline, not a fixed sleep."""
    client, deadline = redis.client(), time.monotonic() + 60
    while len(client.keys("ft:snap:*")) < count:
        assert time.monotonic() < deadline, f"fewer than {count} snapshots in Redis after 60 s"
        time.sleep(0.01)


def test_a_retried_request_resumes_exactly(cache_dir, tmp_path, redis, cold):
    """The issue's reproduction: /v1/completions with a 150- and a 1,000-token prompt, the same cache_salt,
    sent twice (greedy; then at temperature 0.8 with a seed). The second answer resumes from the first's
    prompt-end snapshot (P = n): ``exact``, nothing approximate, the same tokens (before: ``replay`` from
    128 / 960 with all 8 tokens different). A next turn over the first answer is exact too and equals cold."""
    redis.client().flushall()
    srv = Server(cache_dir, "--kv-dir", str(tmp_path / "kv"), "--redis-url", redis.url)
    try:
        snapshots = 0
        for n, extra in ((150, {}), (1000, {}), (150, {"temperature": 0.8, "seed": 7})):
            a = _chunk(n, seed=n + len(extra))
            first = srv.complete(a, cache_salt="retry", **extra)
            assert first["usage"]["flashtier"]["resume"]["kind"] == "cold"
            snapshots += 2  # prompt end, generation end
            _wait_snapshots(redis, snapshots)
            again = srv.complete(a, cache_salt="retry", **extra)
            ft = again["usage"]["flashtier"]
            assert ft["resume"] == {"kind": "exact", "replay_from": None, "approximate": False}, (n, ft)
            assert (ft["approximate_replay_tokens"], ft["computed_tokens"], ft["decoder_tokens"]) == (0, 0, W)
            assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == n
            assert ft["cached_tokens_by_tier"] == {"hbm": n // BS * BS, "ssd": 0, "snapshot": n % BS}
            assert again["choices"][0]["token_ids"] == first["choices"][0]["token_ids"], n
        b = a + first["choices"][0]["token_ids"] + _chunk(40, seed=21)
        got = srv.complete(b, cache_salt="retry")
        assert got["usage"]["flashtier"]["resume"]["kind"] == "exact"
        assert got["choices"][0]["token_ids"] == cold.complete(b, cache_salt="retry")["choices"][0]["token_ids"]
    finally:
        srv.stop()
