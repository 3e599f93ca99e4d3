"""Fault-injection harness: real `flashtier serve` processes, a real redis-server, real segment files.

Every answer is checked token for token. The model is the demo `tiny` preset in float64 (`--dtype
float64`), greedy (`temperature: 0`, `ignore_eos`), prompts are token ids (`return_token_ids`), so a
conversation resends exactly its previous prompt + output + new tokens, as an agent harness does.

What "right" means for one turn (``verify``):

- resume kind exact or cold: the tokens of the cold reference server (`--no-prefix-caching
  --no-kv-persist`, one per session) for the same prompt;
- resume kind replay (a cached prefix whose snapshot was missed: the model's bounded replay, an
  approximate window state by design): the oracle's plan (c), ``Plan.resume(R, n, T, W)``, with the
  conversation's earlier encoder restarts if it had any (see below).

The kind is ``usage.flashtier.resume.kind`` (with ``replay_from`` = R) as the server reports it. A
server that does not report it gets a derived kind: no cached token = cold; replayed tokens > W (the
encoder replayed a window besides the decoder's) = replay from R = cached_tokens; otherwise exact,
unless the conversation had an earlier replay (a resume of a replayed snapshot looks exact in the
counters: ``unknown``, length checked only).

The oracle follows a conversation's encoder restarts: a replay from R2 on top of blocks that an earlier
replay from R1 wrote is a cold run to R1, a restart at R1 - W, a restart at R2 - W (``Oracle.replay``).
A turn is ``exposed`` when it resumes exactly after a replay of its conversation, or comes after such a
turn (see below); every turn must be right, exposed or not.

Processes: every server and Redis a test starts is stopped by pid in a ``finally`` (``FaultServer.stop``
/ ``kill``, ``RedisServer.stop``); nothing listens outside 127.0.0.1. Servers run with
OMP_NUM_THREADS=1 so the suite fits two cores. ``FLASHTIER_FAULT_REPORT=path`` appends one JSON line per
scenario (the numbers in docs/reliability.md).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
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


# ---- the references: a cold server and the oracle ------------------------------------------------------


class ColdReference:
    """Answers of the cold server, memoised by prompt; ``submit`` computes them in the background so the
    cold server works while the server under test does."""

    def __init__(self, server: FaultServer) -> None:
        self.server = server
        self._memo: dict[tuple, concurrent.futures.Future] = {}
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(3, thread_name_prefix="cold")

    def _run(self, prompt: list[int], max_tokens: int) -> list[int]:
        return self.server.complete(prompt, max_tokens).tokens

    def submit(self, prompt: list[int], max_tokens: int = MAX_TOKENS) -> concurrent.futures.Future:
        key = (tuple(prompt), max_tokens)
        with self._lock:
            if key not in self._memo:
                self._memo[key] = self._pool.submit(self._run, list(prompt), max_tokens)
            return self._memo[key]

    def tokens(self, prompt: list[int], max_tokens: int = MAX_TOKENS) -> list[int]:
        return self.submit(prompt, max_tokens).result(timeout=REQUEST_TIMEOUT_S)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


class Oracle:
    """The reference forward (engine/model/reference.py) on the demo checkpoint, in float64: what a bounded
    replay from R must give. Loaded on first use (about 4 s)."""

    def __init__(self, cache_dir: Path) -> None:
        self.cache_dir = Path(cache_dir)
        self._model = None
        self._lock = threading.Lock()

    def _load(self):
        from flashtier.engine.model.loader import load_model
        from flashtier.server.engram_map import engram_token_map
        from flashtier.server.tokenizer import Tokenizer

        model = load_model(self.cache_dir / "models" / "demo-tiny-seed0", dtype=torch.float64, with_dspark=False,
                           progress=False).double()
        tok = Tokenizer()
        model.set_token_map(engram_token_map(tok, model.cfg.vocab_size, model.cfg.engram_compressed_vocab)[0])
        return model

    def replay(self, prompt: list[int], tokens: list[int], restarts: list[int]) -> list[int]:
        """Greedy tokens fed ``prompt + tokens[:-1]`` when the encoder state descends from bounded replays
        at ``restarts`` (R1 < R2 < ...): a cold encoder run up to R1, a run restarted at R1 - W keeping the
        entries below R1, ... and the decoder's replay of the last window. One restart is plan (c),
        ``Plan.resume(R, n, T, W)``; a resume from a replayed snapshot continues the same encoder run."""
        from flashtier.engine.model.reference import Plan, Turn as PlanTurn, reference_forward

        n = len(prompt)
        seq = torch.tensor(prompt + tokens[:-1])
        total = seq.numel()
        if len(restarts) == 1:
            plan = Plan.resume(restarts[0], n, total, W)
        else:
            steps = [PlanTurn(0, 0, None, restarts[0])]
            steps += [PlanTurn(r - W, r, None, nxt) for r, nxt in zip(restarts, restarts[1:])]
            steps.append(PlanTurn(restarts[-1] - W, restarts[-1], max(0, n - W), total))
            plan = Plan(tuple(steps), n - 1)
        with self._lock:
            if self._model is None:
                self._model = self._load()
            ref = reference_forward(self._model, seq, plan)
            return torch.argmax(ref.logits, -1).tolist()


# ---- conversations and verification ---------------------------------------------------------------------

# A turn is "exposed" when it resumes exactly after a replay of its conversation (or comes after such a
# turn). Before block provenance (kvstore/block_hash.fork_root) blocks computed from a replayed window state
# were registered under the exact hash chain and such turns could resume an exact snapshot over them with
# wrong tokens (tests/faults/test_replayed_blocks.py); the tallies still count them apart.


@dataclass
class Conversation:
    """One client's multi-turn conversation: each turn resends prompt + output + ``step`` new tokens."""

    cid: int
    first: int = 400
    step: int = 100
    prompt: list[int] = field(default_factory=list)
    turns: int = 0
    restarts: list[int] = field(default_factory=list)  # encoder restarts (replay points R) its state descends from
    replayed: bool = False  # some turn resumed by bounded replay: approximate blocks are in the prefix cache
    mixed: bool = False  # ... and a later turn resumed exactly or ran cold (an exposed conversation)

    def __post_init__(self) -> None:
        if not self.prompt:
            self.prompt = chunk(self.first, 7000 + self.cid)

    def advance(self, output: list[int]) -> None:
        self.turns += 1
        self.prompt = self.prompt + output + chunk(self.step, 7000 + 1000 * self.cid + self.turns)


@dataclass
class Turn:
    """One attempt of one conversation turn and what was concluded about it."""

    cid: int
    phase: str
    prompt: list[int]
    reply: Reply
    kind: str = ""  # exact | cold | replay | unknown ("" for a request without an answer)
    kind_source: str = ""  # reported (usage.flashtier.resume) | derived (usage counters)
    replay_from: int | None = None
    restarts: list[int] = field(default_factory=list)  # replay: the encoder restarts the oracle must make
    checked: str = ""  # cold | oracle | length
    exposed: bool = False  # an exact resume after a replay, or any resume after that
    wrong: bool = False
    detail: str = ""


def classify(conv: Conversation, usage: dict) -> tuple[str, str, int | None]:
    """(kind, source, replay_from) of one answered turn (see the module doc)."""
    ft = usage.get("flashtier", {})
    resume = ft.get("resume")
    if isinstance(resume, dict) and "kind" in resume:
        return resume["kind"], "reported", resume.get("replay_from")
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    if cached == 0:
        return "cold", "derived", None
    if ft.get("replayed_tokens", 0) > W:
        return "replay", "derived", cached
    return ("unknown" if conv.restarts else "exact"), "derived", None


def record(conv: Conversation, phase: str, prompt: list[int], reply: Reply, cold: ColdReference | None,
           max_tokens: int = MAX_TOKENS) -> Turn:
    """Classify an answered turn, track the conversation's encoder restarts, and start its cold reference
    (in the background). Call in the conversation's turn order."""
    turn = Turn(conv.cid, phase, list(prompt), reply)
    if not reply.ok:
        return turn
    turn.kind, turn.kind_source, turn.replay_from = classify(conv, reply.usage)
    turn.exposed = conv.mixed or (turn.kind == "exact" and conv.replayed)
    if turn.kind == "replay":
        conv.replayed = True
    elif turn.kind in ("exact", "cold") and conv.replayed:
        conv.mixed = True
    r = turn.replay_from
    if turn.kind == "replay" and r is not None:
        # the approximate state descends from every earlier restart below R (their blocks are in the prefix)
        conv.restarts = conv.restarts[: conv.restarts.index(r) + 1] if r in conv.restarts else (
            [x for x in conv.restarts if x < r] + [r])
        turn.restarts = list(conv.restarts)
    elif turn.kind in ("exact", "cold"):
        conv.restarts = []  # recomputed from the full history (or a snapshot of an exact state)
    if cold is not None and (turn.kind in ("exact", "cold") or os.environ.get("FLASHTIER_FAULT_TRACE")):
        cold.submit(prompt, max_tokens)
    return turn


def verify(turns: list[Turn], cold: ColdReference, oracle: Oracle | None, max_tokens: int = MAX_TOKENS) -> None:
    """Fill ``checked`` / ``wrong`` of every answered turn (see the module doc)."""
    for t in turns:
        if not t.reply.ok:
            continue
        toks = t.reply.tokens
        if len(toks) != max_tokens or t.reply.usage["completion_tokens"] != max_tokens:
            t.checked, t.wrong, t.detail = "length", True, f"{len(toks)} tokens, wanted {max_tokens}"
            continue
        if t.kind in ("exact", "cold"):
            want = cold.tokens(t.prompt, max_tokens)
            t.checked, t.wrong = "cold", toks != want
            t.detail = f"got {toks}, cold {want}" if t.wrong else ""
        elif t.kind == "replay" and t.restarts and oracle is not None and not t.exposed:
            want = oracle.replay(t.prompt, toks, t.restarts)
            t.checked, t.wrong = "oracle", toks != want
            t.detail = f"got {toks}, the oracle with encoder restarts at {t.restarts}: {want}" if t.wrong else ""
        else:
            t.checked = "length"


@dataclass
class Tally:
    """What a scenario measured (one row of docs/reliability.md)."""

    scenario: str
    sent: int = 0  # HTTP requests sent (retries included)
    completed: int = 0  # answered 200
    no_answer: int = 0  # connection refused / reset (the server was killed under them)
    http_errors: int = 0  # any other status
    server_errors: int = 0  # 5xx
    wrong: int = 0
    wrong_exposed: int = 0  # of ``wrong``: turns exposed (see above)
    kinds: dict[str, int] = field(default_factory=dict)  # answered turns by resume kind
    checked: dict[str, int] = field(default_factory=dict)  # answered turns by reference (cold / oracle / length)
    observed: dict[str, float] = field(default_factory=dict)  # metrics / log lines
    seconds: float = 0.0

    def add(self, turns: list[Turn]) -> None:
        for t in turns:
            self.sent += 1
            if t.reply.status is None:
                self.no_answer += 1
            elif t.reply.ok:
                self.completed += 1
                self.kinds[t.kind] = self.kinds.get(t.kind, 0) + 1
                self.checked[t.checked] = self.checked.get(t.checked, 0) + 1
                self.wrong += t.wrong
                self.wrong_exposed += t.wrong and t.exposed
            else:
                self.http_errors += 1
                self.server_errors += t.reply.status >= 500

    def report(self) -> None:
        line = json.dumps(self.__dict__, sort_keys=True)
        print(f"\nfault tally: {line}")
        path = os.environ.get("FLASHTIER_FAULT_REPORT")
        if path:
            with open(path, "a") as f:
                f.write(line + "\n")


_COLD_MEMO: dict = {}


def cold_of(t: Turn) -> list[int] | None:
    """The cold reference's tokens for this turn's prompt, if they were computed (tracing)."""
    fut = _COLD_MEMO.get((tuple(t.prompt), len(t.reply.tokens))) if t.reply.ok else None
    return fut.result() if fut is not None and fut.done() and not fut.exception() else None


def dump_trace(name: str, turns: list[Turn], cold: ColdReference | None = None) -> None:
    """``FLASHTIER_FAULT_TRACE=dir``: every turn of a scenario as JSON lines in dir/name.jsonl (debugging)."""
    folder = os.environ.get("FLASHTIER_FAULT_TRACE")
    if not folder:
        return
    if cold is not None:
        for t in turns:
            if t.reply.ok:
                cold.tokens(t.prompt, len(t.reply.tokens))
        _COLD_MEMO.update(cold._memo)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, f"{name}.jsonl"), "w") as f:
        for t in turns:
            usage = t.reply.usage if t.reply.ok else None
            f.write(json.dumps({"cid": t.cid, "phase": t.phase, "n": len(t.prompt), "status": t.reply.status,
                                "error": t.reply.error, "kind": t.kind, "source": t.kind_source,
                                "replay_from": t.replay_from, "restarts": t.restarts, "checked": t.checked,
                                "wrong": t.wrong, "tokens": t.reply.tokens if t.reply.ok else None,
                                "detail": t.detail, "usage": usage, "cold": cold_of(t)}) + "\n")


def wrong_turns(turns: list[Turn], exposed: bool | None = None) -> list[str]:
    """Descriptions of the wrong turns (only those with ``exposed`` equal to the argument, unless None)."""
    return [f"conv {t.cid} [{t.phase}] n={len(t.prompt)} kind={t.kind}/{t.kind_source} "
            f"cached={t.reply.usage['prompt_tokens_details']['cached_tokens']} "
            f"flashtier={t.reply.usage['flashtier']}: {t.detail}"
            for t in turns if t.wrong and (exposed is None or t.exposed == exposed)]


# ---- fixtures -----------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def fault_cache(tmp_path_factory) -> Path:
    """One cache directory for every server of the suite (the demo checkpoint is written once)."""
    return tmp_path_factory.mktemp("fault-cache")


@pytest.fixture(scope="session")
def cold(fault_cache, tmp_path_factory):
    server = FaultServer(fault_cache, tmp_path_factory.mktemp("cold-logs"), "cold", "--no-prefix-caching",
                         "--no-kv-persist")
    ref = ColdReference(server)
    try:
        server.start()
        yield ref
    finally:
        ref.close()
        server.stop()


@pytest.fixture(scope="session")
def oracle(fault_cache, cold) -> Oracle:
    return Oracle(fault_cache)  # the cold server wrote the demo checkpoint into fault_cache


class Load:
    """Concurrent clients: one thread per conversation, each running its turns back to back against
    ``server`` (its URL is read at every attempt, so a restart on a new port is followed).

    A request without an answer (the server was killed under it) waits for the next server (``restarted``)
    and is sent again; with ``restarts=False`` it ends the run instead, as does any HTTP error status.
    """

    def __init__(self, server: FaultServer, convs: list[Conversation], cold: ColdReference | None,
                 restarts: bool = False, max_tokens: int = MAX_TOKENS) -> None:
        self.server, self.convs, self.cold, self.restarts, self.max_tokens = server, convs, cold, restarts, max_tokens
        self.turns: list[Turn] = []
        self.cond = threading.Condition()
        self.epoch = 0
        self.serving = True
        self.stopped = False
        self.in_flight = 0
        self.phase = "start"
        self.done = {c.cid: 0 for c in convs}  # answered turns in the current phase
        self.failure = ""
        self._threads = [threading.Thread(target=self._client, args=(c,), name=f"client-{c.cid}", daemon=True)
                         for c in convs]

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _client(self, conv: Conversation) -> None:
        with httpx.Client() as http:
            while True:
                with self.cond:
                    while not self.serving and not self.stopped:
                        self.cond.wait()
                    if self.stopped:
                        return
                    epoch, url, phase = self.epoch, self.server.url, self.phase
                    self.in_flight += 1
                prompt = conv.prompt
                reply = self.server.post(prompt, self.max_tokens, client=http, url=url)
                with self.cond:
                    self.in_flight -= 1
                    self.turns.append(record(conv, phase, prompt, reply, self.cold, self.max_tokens))
                    if reply.ok:
                        conv.advance(reply.tokens)
                        self.done[conv.cid] += 1
                    elif reply.status is None and self.restarts:
                        while self.epoch == epoch and not self.stopped:
                            self.cond.wait()
                    else:
                        self.failure = self.failure or f"conv {conv.cid}: {reply.status} {reply.body} {reply.error}"
                        self.stopped = True
                    self.cond.notify_all()

    def set_phase(self, name: str) -> None:
        with self.cond:
            self.phase = name
            self.done = dict.fromkeys(self.done, 0)

    def wait_turns(self, k: int, timeout_s: float = 240) -> None:
        """Until every conversation answered ``k`` turns in the current phase (or the run failed)."""
        deadline = time.monotonic() + timeout_s
        with self.cond:
            while not self.stopped and min(self.done.values()) < k:
                left = deadline - time.monotonic()
                assert left > 0, f"timed out waiting for {k} turns per conversation: {self.done}"
                self.cond.wait(left)
        assert not self.failure, self.failure

    def wait_in_flight(self, timeout_s: float = 60) -> int:
        deadline = time.monotonic() + timeout_s
        with self.cond:
            while self.in_flight == 0 and not self.stopped and time.monotonic() < deadline:
                self.cond.wait(0.05)
            return self.in_flight

    def hold(self) -> None:
        """New attempts wait (those in flight go on) until ``restarted``."""
        with self.cond:
            self.serving = False

    def restarted(self, phase: str) -> None:
        with self.cond:
            self.epoch += 1
            self.serving = True
            self.phase = phase
            self.done = dict.fromkeys(self.done, 0)
            self.cond.notify_all()

    def stop(self) -> None:
        with self.cond:
            self.stopped = True
            self.cond.notify_all()
        for t in self._threads:
            t.join(timeout=REQUEST_TIMEOUT_S)
