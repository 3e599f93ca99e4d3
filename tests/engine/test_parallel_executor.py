"""The parallel executor (engine/parallel/executor.py) with tensor parallel 2 on gloo, driven directly.

Two spawned rank processes each run a whole ``Engine`` on their half of the float64 ``tiny`` model (seeded
random weights, as ``flashtier serve --dtype float64`` builds it) and step in lockstep. Claims:

- greedy and seeded-sampled completions (with logprobs) of ragged prompts, and a seeded completion under a
  regex grammar (compiled in this process, rebuilt on each rank from xgrammar's JSON), submitted
  concurrently, equal the single-process engine's exactly: the same tokens and the same logprob floats
  (TP logits are bit-identical in float64, test_parallel_forward.py). The comparison can fail: the
  single-process run of a prompt one token off gives other tokens.
- a request cancelled mid-generation (the client's iteration closed) is aborted on every rank: the ranks
  stay in step and serve the next request exactly; an unusable request is refused with ValueError.
- a rank killed with SIGKILL turns the client unhealthy within seconds, new requests fail with
  ``EngineDeadError``, and ``shutdown`` reaps the other rank promptly.

The module's one client is shared (spawning two ranks costs ~20 s on 2 cores); the kill test runs last.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time

import pytest

from flashtier.engine.client import EngineDeadError
from flashtier.engine.config import EngineConfig
from flashtier.engine.engine import Engine
from flashtier.engine.factory import build_model
from flashtier.engine.model.transformer import Transformer
from flashtier.engine.parallel import ParallelConfig
from flashtier.engine.parallel.executor import EngineCoreClient, start_engine_core
from flashtier.engine.grammar.compiler import GrammarCompiler
from flashtier.engine.grammar.constraint import ConstraintKind, ConstraintSpec, OutputConstraint
from flashtier.engine.sample.params import SamplingParams
from flashtier.kvstore.config import KVStoreConfig
from flashtier.server.grammar.service import grammar_vocab
from flashtier.server.text.tokenizer import Tokenizer

from .conftest import random_prompt

CONFIG = EngineConfig(dtype="float64", max_num_batched_tokens=256)
KV = KVStoreConfig(block_size=16, num_blocks=128)
PROMPT_LENGTHS = (21, 34, 47)  # past tiny's 16-token window: compressed entries, top-k and replay all run
MAX_TOKENS = 5
REGEX = r"[a-c]{2,4}-\d{3}"
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=2)


def sampled(seed: int) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, top_p=0.95, seed=seed, ignore_eos=True,
                          logprobs=2)


def jobs(constraint: OutputConstraint) -> dict[str, tuple[list[int], SamplingParams]]:
    prompts = [random_prompt(n, seed=60 + i) for i, n in enumerate(PROMPT_LENGTHS)]
    out = {f"greedy{i}": (p, GREEDY) for i, p in enumerate(prompts)}
    out.update({f"sampled{i}": (p, sampled(100 + i)) for i, p in enumerate(prompts)})
    out["grammar"] = (prompts[1], SamplingParams(max_tokens=12, temperature=1.0, seed=9, constraint=constraint))
    return out


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer()


@pytest.fixture(scope="module")
def regex(tok) -> OutputConstraint:
    compiler = GrammarCompiler(grammar_vocab(tok, tok.vocab_size, (tok.eos_id,)), threads=1)
    return compiler.compile(ConstraintSpec(ConstraintKind.REGEX, REGEX, "regex"))


def answer(outputs) -> tuple[list[int], list[tuple]]:
    """(tokens, logprob entries) of a request's single choice, from its RequestOutput deltas."""
    tokens, logprobs = [], []
    for out in outputs:
        for c in out.choices:
            tokens.extend(c.token_ids)
            logprobs.extend((lp.token_id, lp.logprob, lp.top) for lp in c.logprobs or ())
    return tokens, logprobs


def single_process(requests: dict[str, tuple[list[int], SamplingParams]], config: EngineConfig = CONFIG,
                   model: Transformer | None = None) -> dict[str, tuple]:
    """Each request's (tokens, logprobs) from one ``Engine`` in this process (on ``model``, else the model
    ``config`` builds), all added before the first step. The engine keeps its KV outside the model."""
    engine = Engine(model if model is not None else build_model(config), config, KV)
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    outs: dict[str, list] = {rid: [] for rid in requests}
    while engine.has_unfinished():
        for out in engine.step():
            outs[out.request_id].append(out)
    return {rid: answer(o) for rid, o in outs.items()}


async def collect(client: EngineCoreClient, rid: str, prompt: list[int], params: SamplingParams) -> tuple:
    return answer([out async for out in client.generate(rid, prompt, params)])


def run(coro):
    return asyncio.run(coro)


@pytest.fixture(scope="module")
def model() -> Transformer:
    return build_model(CONFIG)


@pytest.fixture(scope="module")
def client():
    c = start_engine_core(ParallelConfig(tensor_parallel_size=2), CONFIG, KV, seed=5, start_timeout_s=300)
    yield c
    run(c.shutdown(5.0))


def test_tp2_equals_the_single_process_engine(client, model, regex, tok):
    requests = jobs(regex)

    async def all_of_them():
        return await asyncio.gather(*(collect(client, rid, p, sp) for rid, (p, sp) in requests.items()))

    t0 = time.monotonic()
    got = dict(zip(requests, run(all_of_them())))
    tp_s = time.monotonic() - t0
    off = dict(requests, greedy0=(requests["greedy0"][0][:-1] + [requests["greedy0"][0][-1] + 1], GREEDY))
    want = single_process({**requests, "off_by_one": off["greedy0"]}, model=model)
    for rid in requests:
        assert got[rid][0] == want[rid][0], f"{rid}: tokens {got[rid][0]} != single-process {want[rid][0]}"
        assert got[rid][1] == want[rid][1], f"{rid}: logprobs differ"
        assert len(got[rid][0]) == MAX_TOKENS or rid == "grammar"
    assert re.fullmatch(REGEX, tok.decode(got["grammar"][0]))  # the grammar ran on the ranks
    assert want["off_by_one"][0] != got["greedy0"][0]  # the comparison sees a one-token change of the prompt
    assert got["sampled0"][0] != got["greedy0"][0]
    print(f"TP 2: {len(requests)} requests x {MAX_TOKENS} tokens in {tp_s:.1f} s")


def test_abort_keeps_the_ranks_in_step(client, model):
    prompt = random_prompt(30, seed=77)
    long = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)

    async def cancel_after_two():
        got = 0
        gen = client.generate("long", prompt, long)
        async for out in gen:
            got += sum(len(c.token_ids) for c in out.choices)
            if got >= 2:
                break
        await gen.aclose()  # closing the iteration aborts the request on every rank
        assert got < 40
        for _ in range(200):  # the abort lands within a step or two
            if client.stats().num_running == 0 and client.stats().num_waiting == 0:
                break
            await asyncio.sleep(0.05)
        assert client.stats().num_running == 0
        with pytest.raises(ValueError, match="prompt token ids"):
            await collect(client, "bad", [client.vocab_size + 5], GREEDY)
        return await collect(client, "after", prompt, GREEDY)

    after = run(cancel_after_two())
    assert after[0] == single_process({"after": (prompt, GREEDY)}, model=model)["after"][0]


def test_a_killed_rank_turns_the_client_unhealthy(client):
    assert client.is_ready()
    victim = client.worker_pids[1]
    os.kill(victim, signal.SIGKILL)
    t0 = time.monotonic()
    while client.is_ready() and time.monotonic() - t0 < 10:
        time.sleep(0.05)
    assert not client.is_ready(), "the client still reports ready 10 s after a rank died"
    print(f"unhealthy {time.monotonic() - t0:.2f} s after SIGKILL: {client.error}")
    assert "rank 1" in client.error and "SIGKILL" in client.error

    async def new_request():
        with pytest.raises(EngineDeadError, match="unavailable"):
            await collect(client, "late", [1, 2, 3], GREEDY)
        t1 = time.monotonic()
        await client.shutdown(5.0)
        return time.monotonic() - t1

    assert run(new_request()) < 15
    assert all(p.exitcode is not None for p in client.ranks.procs)
