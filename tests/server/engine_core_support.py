"""The real engine for API tests, as ``flashtier serve`` runs it: in its own engine-core process.

    client = tiny_engine_core(EngineConfig(max_num_batched_tokens=256), KVStoreConfig(block_size=16, num_blocks=400))
    with run_server(tokenizer, client) as server: ...        # the lifespan shuts the client down

One rank, one torch thread, a fixed sampling seed; the tiny preset's seeded random weights (the same model
``random_model(preset("tiny"), seed=0)`` builds in this process). Starting one costs a spawned interpreter
and the model build (~3-5 s on one core): tests share one per module where they can.
"""

from __future__ import annotations

from flashtier.engine.config import EngineConfig
from flashtier.engine.parallel import ParallelConfig
from flashtier.engine.parallel.executor import EngineCoreClient, start_engine_core
from flashtier.kvstore.config import KVStoreConfig

START_TIMEOUT_S = 300.0  # a loaded 2-core machine spawning several interpreters at once


def tiny_engine_core(config: EngineConfig, kv: KVStoreConfig, *, tiers: bool = False, seed: int = 0,
                     **kwargs) -> EngineCoreClient:
    """A started engine-core client over ``config`` (its preset's seeded weights) and ``kv``."""
    return start_engine_core(ParallelConfig(), config, kv, seed=seed, tiers=tiers, threads=1,
                             start_timeout_s=START_TIMEOUT_S, **kwargs)
