"""Conversations of the fault suites and their verification: turns recorded with the resume kind the server
reported (or one derived from the counters), checked against the cold reference or the oracle's plan (c),
tallied by kind, dumped as a trace when wrong. See conftest.py for what "right" means."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field



from .fault_server import MAX_TOKENS, W, Reply, chunk
from .references import ColdReference, Oracle


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
    if ft.get("approximate_replay_tokens", 0) > 0:
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
