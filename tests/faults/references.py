"""The fault suites' references: a cold server per session (``ColdReference``: the tokens an uncached run gives)
and the oracle (``Oracle``: the model's plan (c) for replayed turns, following a conversation's encoder
restarts). See conftest.py for what "right" means."""

from __future__ import annotations

import concurrent.futures
import threading
from pathlib import Path

import torch


from .fault_server import MAX_TOKENS, REQUEST_TIMEOUT_S, W, FaultServer


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
        from flashtier.server.text.engram_map import engram_token_map
        from flashtier.server.text.tokenizer import Tokenizer

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
