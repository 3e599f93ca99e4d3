"""Tiered KV through the HTTP API with real processes: `flashtier serve` (the demo model in float64 mode),
a real redis-server, an SSD directory. The conversation uses token-id prompts (`return_token_ids`) so
each turn resends exactly the previous prompt + output, as an agent harness does with a real model.

Exact resume must give the tokens of a cold run of the same prompt on a server with caching off; a
resume by encoder bounded replay must give the oracle's plan (c).

A server start costs seconds of CPU (a float64 model, its rank process): one cold reference server serves
the module, one SIGKILL + restart serves both restart checks, and the retry and flushed-Redis tests share
one server (``tiered``). A test waits for the asynchronous writes it depends on (fsynced SSD records,
snapshot points in Redis) by polling for them, never by sleeping.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch

from flashtier.engine.model.loader import demo_checkpoint
from flashtier.kvstore.snapshot.key import SnapshotKey
from flashtier.kvstore.tenant import api_key_tenant, tenant_tag

from ..kvstore.redis_server import RedisServer, free_port
from ..kvstore.ssd_store_support import ssd_payloads

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
        """Until /health answers 200 (``complete`` calls it first on a server started with ``wait=False``). The
        deadline only bounds a hung start: on a loaded 2-core machine a start beside another took over 180 s."""
        deadline = time.monotonic() + 600
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


def _wait_until(what: str, check, timeout: float = 60.0):
    """Poll ``check()`` until it returns something truthy (an SSD fsync, an asynchronous snapshot put): a
    condition with a deadline, never a fixed sleep."""
    deadline = time.monotonic() + timeout
    while not (got := check()):
        assert time.monotonic() < deadline, f"timed out after {timeout:.0f} s waiting for {what}"
        time.sleep(0.02)
    return got


def _snapshot_tails(redis: RedisServer) -> Counter[int]:
    """How many snapshot points Redis holds per tail length (``P % BS`` of the point): the tests below give
    their points tail lengths that no other request of the same Redis has, so a count tells that a put landed."""
    return Counter(SnapshotKey.parse(raw.decode()).tail_len
                   for raw in redis.client().scan_iter(match="ft:snap:*", count=1000))


def _wait_snapshots(redis: RedisServer, want: Counter[int]) -> None:
    """Until Redis holds at least ``want[t]`` points of every tail length ``t`` (the puts are asynchronous)."""
    _wait_until(f"the snapshots {dict(want)} in Redis", lambda: _snapshot_tails(redis) >= want)


def _ssd_blocks(kv: Path, tenant: bytes) -> int:
    """Distinct KV blocks of ``tenant`` in fsynced SSD records (a block of the same tokens is the same bytes
    whatever the salt)."""
    return len(ssd_payloads(kv).get(tenant, ()))


COLD_CHECKED_TURNS = (1, 3)


@pytest.mark.slow
def test_four_turn_conversation_past_8k_tokens_resumes_exactly(cache_dir, tmp_path, redis, cold):
    """The cold references run on the cold server while the server under test answers that turn and the next
    ones (the prompts depend only on the tested server's answers), so the two processes work on the two cores
    side by side. Compared with a cold run: the first resumed turn and the last (past 8k tokens, resumed over
    every earlier turn), the two that carry the claim; the others' cold prefills (2.2k and 6.4k tokens, 40% of
    the cold work) would repeat the same check. Every turn's cache accounting is checked."""
    srv = Server(cache_dir, "--kv-dir", str(tmp_path / "kv"), "--redis-url", redis.url)
    refs, outs = {}, {}
    try:
        with ThreadPoolExecutor(2, thread_name_prefix="cold") as pool:
            prompt = _chunk(2200, seed=1)
            previous = None
            for turn in range(4):
                if turn in COLD_CHECKED_TURNS:
                    refs[turn] = pool.submit(cold.complete, prompt)
                got = srv.complete(prompt)
                choice = got["choices"][0]
                outs[turn] = choice["token_ids"]
                usage = got["usage"]
                if previous is not None:
                    # everything fed last turn is cached: prompt + output minus the last sample (never fed)
                    assert usage["prompt_tokens_details"]["cached_tokens"] == previous - 1
                    tiers = usage["flashtier"]["cached_tokens_by_tier"]
                    assert tiers["hbm"] + tiers["ssd"] + tiers["snapshot"] == previous - 1
                    assert usage["flashtier"]["computed_tokens"] == len(prompt) - (previous - 1)
                previous = len(prompt) + len(choice["token_ids"])
                prompt = prompt + choice["token_ids"] + _chunk(2100, seed=10 + turn)
            for turn, ref in refs.items():
                assert outs[turn] == ref.result()["choices"][0]["token_ids"], f"turn {turn}"
        assert previous > 8000
        assert srv.metric("flashtier_snapshot_lookup_hit") >= 3
    finally:
        srv.stop()


def test_restart_after_sigkill_resumes_exactly_and_tenants_share_no_cache(cache_dir, tmp_path, cold):
    """One SIGKILL + restart (a server start costs seconds of CPU) serves two checks, with `--cache-isolation
    per-key`:

    - a 700-token turn (key A) resumes after the restart from the SSD blocks and its snapshot: ``exact``, the
      tokens of the cold server;
    - tenant B (its own key) gets no cached token for A's prompt in HBM, on the SSD or from the snapshot pool,
      even sending A's very salt; a second salt within A's key is its own namespace too (cache_salt isolation);
      A's repeat is served from HBM, and after the restart from SSD + the snapshot pool, so every zero below
      could have been a hit.

    The kill waits for what the second server must find (the blocks fsynced, the generation-end snapshots in
    Redis), polled, never slept for."""
    kv = tmp_path / "kv"
    a, b = {"authorization": "Bearer key-a"}, {"authorization": "Bearer key-b"}
    tag_a = tenant_tag(api_key_tenant("key-a"))

    def tiers(got: dict) -> tuple[int, int, int, int]:
        usage = got["usage"]
        t = usage["flashtier"]["cached_tokens_by_tier"]
        return usage["prompt_tokens_details"]["cached_tokens"], t["hbm"], t["ssd"], t["snapshot"]

    with RedisServer() as redis:  # its own: the waits count its snapshot points
        args = ("--kv-dir", str(kv), "--redis-url", redis.url, "--api-key", "key-a,key-b",
                "--cache-isolation", "per-key")
        srv = Server(cache_dir, *args)
        restart, hbm_prompt, prompt = _chunk(700, seed=2), _chunk(200, seed=20), _chunk(300, seed=21)
        try:
            assert tiers(srv.complete(hbm_prompt, max_tokens=1, headers=a, cache_salt="s"))[0] == 0
            assert tiers(srv.complete(hbm_prompt, max_tokens=1, headers=b, cache_salt="s")) == (0, 0, 0, 0)
            assert tiers(srv.complete(hbm_prompt, max_tokens=1, headers=a, cache_salt="t")) == (0, 0, 0, 0)
            cached, hbm, _, snapshot = tiers(srv.complete(hbm_prompt, max_tokens=1, headers=a, cache_salt="s"))
            # A's own repeat: its HBM blocks, plus its prompt-end snapshot (P = n) once the async put landed
            assert hbm == len(hbm_prompt) // BS * BS and cached == hbm + snapshot and snapshot in (0, len(hbm_prompt) % BS)
            first = srv.complete(prompt, headers=a, cache_salt="s")["choices"][0]["token_ids"]
            restart_first = srv.complete(restart, headers=a)["choices"][0]["token_ids"]
            fed = {"tenants": len(prompt) + len(first) - 1, "restart": len(restart) + len(restart_first) - 1}
            assert fed["tenants"] % BS != fed["restart"] % BS  # the two points are told apart by tail length
            _wait_snapshots(redis, Counter(n % BS for n in fed.values()))
            blocks = len(hbm_prompt) // BS + sum(n // BS for n in fed.values())  # key A's, by distinct bytes
            _wait_until(f"{blocks} SSD blocks of key A", lambda: _ssd_blocks(kv, tag_a) >= blocks)
        finally:
            srv.kill()
        srv = Server(cache_dir, *args)
        try:
            # the SIGKILLed server's turn: its blocks from the SSD, its window from the snapshot, exact
            prompt_r = restart + restart_first + _chunk(100, seed=3)
            got = srv.complete(prompt_r, headers=a)
            usage = got["usage"]
            by_tier = usage["flashtier"]["cached_tokens_by_tier"]
            assert usage["prompt_tokens_details"]["cached_tokens"] == fed["restart"]
            assert by_tier["hbm"] == 0 and by_tier["ssd"] == fed["restart"] // BS * BS
            assert by_tier["snapshot"] == fed["restart"] % BS
            assert usage["flashtier"]["resume"] == {"kind": "exact", "replay_from": None, "approximate": False}
            assert (usage["flashtier"]["decoder_tokens"], usage["flashtier"]["approximate_replay_tokens"]) == (W, 0)
            assert got["choices"][0]["token_ids"] == cold.complete(prompt_r)["choices"][0]["token_ids"]
            # the tenants after the restart
            prompt = prompt + first + _chunk(50, seed=22)
            assert tiers(srv.complete(prompt, max_tokens=1, headers=b, cache_salt="s")) == (0, 0, 0, 0)
            assert tiers(srv.complete(prompt, max_tokens=1, headers=a, cache_salt="t")) == (0, 0, 0, 0)
            cached, hbm, ssd, snapshot = tiers(srv.complete(prompt, max_tokens=1, headers=a, cache_salt="s"))
            assert hbm == 0 and ssd > 0 and snapshot > 0 and cached == ssd + snapshot == 300 + len(first) - 1
        finally:
            srv.stop()


@dataclass
class Tiered:
    """The shared tiered server and the redis-server of its snapshot pool."""

    server: Server
    redis: RedisServer


@pytest.fixture(scope="module")
def tiered(cache_dir, tmp_path_factory):
    """One server with an SSD directory and its own redis-server, shared by the retry and the flushed-Redis
    tests (each saves a server start): each test's prompts are its own, and each waits for its own
    snapshot points by their tail lengths, which the other's never have."""
    with RedisServer() as redis:
        srv = Server(cache_dir, "--kv-dir", str(tmp_path_factory.mktemp("tiered") / "kv"), "--redis-url", redis.url,
                     wait=False)
        try:
            yield Tiered(srv, redis)
        finally:
            srv.stop()


def test_a_retried_request_resumes_exactly(tiered, cold):
    """The issue's reproduction: /v1/completions with a 150- and a 1,000-token prompt, the same cache_salt,
    sent twice (greedy; then at temperature 0.8 with a seed). The second answer resumes from the first's
    prompt-end snapshot (P = n): ``exact``, nothing approximate, the same tokens (before: ``replay`` from
    128 / 960 with all 8 tokens different). A next turn over the first answer is exact too and equals cold."""
    srv, redis = tiered.server, tiered.redis
    redis.client().flushall()
    snapshots: Counter[int] = Counter()
    for n, extra in ((150, {}), (1000, {}), (150, {"temperature": 0.8, "seed": 7})):
        a = _chunk(n, seed=n + len(extra))
        first = srv.complete(a, cache_salt="retry", **extra)
        assert first["usage"]["flashtier"]["resume"]["kind"] == "cold"
        fed = n + len(first["choices"][0]["token_ids"]) - 1
        snapshots.update([n % BS, fed % BS])  # prompt end, generation end
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


def test_flushed_redis_falls_back_to_encoder_replay_matching_plan_c(cache_dir, tiered):
    from flashtier.engine.model.loader import load_model
    from flashtier.engine.model.reference import Plan, reference_forward
    from flashtier.server.text.engram_map import engram_token_map
    from flashtier.server.text.tokenizer import Tokenizer

    srv, redis = tiered.server, tiered.redis
    replays = 'flashtier_resumes_total{kind="replay",model_name="flashtier-tiny"}'
    prompt = _chunk(300, seed=4)
    first = srv.complete(prompt)["choices"][0]["token_ids"]
    # both of its points (prompt end, generation end) are in Redis before the flush: a late put would be found
    _wait_snapshots(redis, Counter([len(prompt) % BS, (len(prompt) + len(first) - 1) % BS]))
    misses_before = srv.metric("flashtier_snapshot_lookup_none") + srv.metric("flashtier_snapshot_lookup_miss")
    replays_before, replayed_before = srv.metric(replays), srv.metric("flashtier_prompt_tokens_replayed")
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
    assert srv.metric(replays) == replays_before + 1  # the server is shared: counted from before this turn
    misses = srv.metric("flashtier_snapshot_lookup_none") + srv.metric("flashtier_snapshot_lookup_miss")
    assert misses > misses_before
    assert srv.metric("flashtier_prompt_tokens_replayed") > replayed_before
    model = load_model(cache_dir / "models" / "demo-tiny-seed0", dtype=torch.float64, with_dspark=False,
                       progress=False).double()
    tok = Tokenizer()
    model.set_token_map(engram_token_map(tok, model.cfg.vocab_size, model.cfg.engram_compressed_vocab)[0])
    seq = torch.tensor(prompt + toks[:-1])
    ref = reference_forward(model, seq, Plan.resume(r, len(prompt), seq.numel(), W))
    assert torch.argmax(ref.logits, -1).tolist() == toks
