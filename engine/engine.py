"""The synchronous engine: ``add_request`` / ``abort`` / ``step()``.

    step():  k = spec_control.begin_step(n)                 speculative only: this step's draft length (0: none)
             drafter.propose_for(running, k)                speculative, k > 0: DSpark drafts for this step
             SchedulerOutput = scheduler.schedule()        what runs: chunks, replays, decodes (drafts <= k)
             ModelRunnerOutput = runner.execute(...)        the forward; logits per decoder row
             requests = postprocessor.process(...)          blocks, snapshots, forks, sampling
             drafter.after_step(...)                        speculative only: the drafter's rings written
             spec_control.end_step(...)                     speculative only: the step's seconds, acceptance
             -> one RequestOutput per request touched (+ the aborted ones)

Single-threaded and unit-testable: the engine-core process (engine/parallel/rank_worker.py) runs ``step()``
as its driver releases steps, and waits while ``stalled`` (nothing ran and nothing runs: only a finished tier
lookup, ``set_wake``'s callback, or a new request or abort can change anything). Text never reaches here; requests are token ids with ``SamplingParams``.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable

import torch

from flashtier.engine.client import QueueFullError
from flashtier.engine.config import EngineConfig
from flashtier.engine.runner.decode_graphs import DecodeGraphs
from flashtier.engine.engine_stats import spec_fields, tier_stats
from flashtier.engine.kv.manager import KVManager, SequenceSpec
from flashtier.engine.model.transformer import Transformer
from flashtier.engine.core.output_builder import build_output
from flashtier.engine.core.outputs import EngineStats, RequestOutput
from flashtier.engine.postprocess import Postprocessor
from flashtier.engine.core.request import Request
from flashtier.engine.core.request_state import RequestStatus
from flashtier.engine.runner.paged_runner import PagedRunner
from flashtier.engine.runner.runner import ModelRunner
from flashtier.engine.sample.sampler import Sampler
from flashtier.engine.sample.params import SamplingParams
from flashtier.engine.scheduler import Scheduler
from flashtier.engine.spec.controller import SpecController
from flashtier.engine.spec.draft_graphs import DraftGraphs
from flashtier.engine.spec.drafter import Drafter
from flashtier.engine.spec.schedule import SpecPolicy
from flashtier.engine.spec.state import check_spec_integrity
from flashtier.engine.spec.stats import SpecStats
from flashtier.engine.spec.verify import SpecVerifier
from flashtier.engine.tiers.client import TierClient
from flashtier.engine.tiers.manager import TierManager
from flashtier.engine.tenant_registry import TenantNamespaces
from flashtier.kvstore.block_hash import BlockHash, namespace_hash
from flashtier.kvstore.block_pool import BlockPool, TenantDrop
from flashtier.kvstore.tenant import tenant_tag
from flashtier.kvstore.config import KVStoreConfig
from flashtier.kvstore.layout import BlockLayout

DEFAULT_CPU_KV_BYTES = 256 << 20  # pool budget on a CPU when the KV config names none


def model_fingerprint(model: Transformer, block_size: int, extra: str = "") -> str:
    """Namespace of cached KV: config, formats, block size (+ the weights' identity given by the caller)."""
    cfg = model.cfg.to_hf_dict()
    cfg.pop("name", None)
    blob = json.dumps(cfg, sort_keys=True) + f"|fp4e4m3/16|mxfp4/32|fp8ue8m0/32|bs{block_size}|{extra}"
    return "v41:" + hashlib.sha256(blob.encode()).hexdigest()[:32]


class Engine:
    def __init__(
        self,
        model: Transformer,
        config: EngineConfig | None = None,
        kv_config: KVStoreConfig | None = None,
        tiers: TierManager | None = None,
        *,
        clock: Callable[[], float] = time.perf_counter,
    ):
        """``tiers``: SSD write-through, snapshots and resume lookups; None keeps everything in the pool.
        ``clock``: the speculative goodput controller's clock (seconds; tests pass a fake one)."""
        self.model = model
        self.tiers = tiers
        self.config = config or EngineConfig()
        self.kv_config = kv_config or KVStoreConfig()
        cfg, dev = model.cfg, model.device
        spec = SequenceSpec.from_config(cfg, model.compute_dtype, dev)
        self.layout = BlockLayout(spec.geometry, self.kv_config.block_size)
        available = None
        if self.kv_config.num_blocks is None and self.kv_config.hbm_budget_bytes is None:
            available = torch.cuda.mem_get_info(dev)[0] if dev.type == "cuda" else DEFAULT_CPU_KV_BYTES
        num_blocks = self.kv_config.pool_blocks(self.layout.block_bytes, available)
        batched = self.config.batched
        # two slots per running sequence: preempted and finishing sequences hold theirs until collected
        self.kvm = KVManager(spec, self.layout, num_blocks, enable_caching=self.kv_config.enable_prefix_caching,
                             ring_slots=2 * self.config.max_num_seqs if batched else 0)
        self.max_model_len = self.config.max_model_len or cfg.max_position_embeddings
        # exact-or-cold never shares a namespace with servers that cache approximate (replayed) state
        policy = "" if self.config.resume_policy == "replay" else f"|{self.config.resume_policy}"
        self.fingerprint = self.config.fingerprint or model_fingerprint(
            model, self.layout.block_size,
            f"{self.config.dtype}|seed{self.config.weights_seed}|{self.config.model_dir}{policy}",
        )
        self.tenant_namespaces = TenantNamespaces()  # snapshot namespaces per tenant (tenant_registry.py)
        allow_replay = self.config.resume_policy == "replay"
        depth = self.config.speculative_tokens
        if depth > cfg.dspark_block_size:
            raise ValueError(f"EngineConfig.speculative_tokens must be <= the drafter's block size "
                             f"{cfg.dspark_block_size}, got {depth}")
        self.drafter = Drafter(model, depth) if depth else None
        self.spec_stats = SpecStats(depth) if depth else None
        # owns each step's draft length (0 = plain decoding) from measured goodput (spec/controller.py)
        self.spec_control = SpecController(depth, self.spec_stats, adaptive=self.config.speculative_adaptive,
                                           clock=clock) if depth else None
        self.scheduler = Scheduler(
            self.kvm, max_num_seqs=self.config.max_num_seqs, token_budget=self.config.max_num_batched_tokens,
            tiers=TierClient(tiers, self.kvm, allow_replay=allow_replay) if tiers is not None else None,
            allow_replay=allow_replay,
            speculative=SpecPolicy(depth, self.config.speculative_min_confidence, self.max_model_len,
                                   cfg.sliding_window) if depth else None,
            spec_control=self.spec_control,
        )
        # a speculative engine replays graphs for its plain decode steps (the controller's draft length 0) and its
        # verify steps (the chunks' rows, with the draft inputs) alike, up to max_num_seqs rows
        graphs = self.config.cuda_graphs and dev.type == "cuda" and DecodeGraphs.supported(model)
        self.runner = ModelRunner(model, PagedRunner(
            model, self.kvm, graphs=graphs,
            max_graph_rows=self.config.max_num_seqs, graph_sizes=self.config.cuda_graph_sizes) if batched else None,
                                  taps=cfg.dspark_target_layer_ids if depth else ())
        decode_graphs = self.runner.paged.graphs if self.runner.paged is not None else None
        if self.drafter is not None and decode_graphs is not None and DraftGraphs.supported(model):
            # the drafter's proposals replay graphs too, one bucket per decode graph size (spec/draft_graphs.py)
            self.drafter.graphs = DraftGraphs(model, decode_graphs.sizes, depth, capture=True)
        self.postprocessor = Postprocessor(
            self.scheduler, Sampler(eos_token_id=cfg.eos_token_id), eos_token_id=cfg.eos_token_id,
            max_model_len=self.max_model_len,
            verifier=SpecVerifier(self.kvm, self.spec_stats, cfg.eos_token_id) if depth else None,
        )
        self._aborted: list[Request] = []
        self.prompt_tokens = 0
        # the last step scheduled nothing, preempted nothing and no request is running: until a tier
        # lookup finishes or a request is added or aborted, another step would do nothing either
        self.stalled = False

    @property
    def pool(self) -> BlockPool:
        return self.kvm.pool

    @property
    def requests(self) -> dict[str, Request]:
        """Every unfinished request by id (read-only use)."""
        return self.scheduler.requests

    # ---- requests ---------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams | None = None,
                    *, cache_salt: str | None = None) -> None:
        """Queue a request. ValueError for an unusable request, QueueFullError at the queue bound."""
        params = params or SamplingParams()
        if request_id in self.scheduler.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not prompt_token_ids:
            raise ValueError("the prompt must contain at least one token")
        vocab = self.model.cfg.vocab_size
        if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab:
            raise ValueError(f"prompt token ids must lie in [0, {vocab})")
        if len(prompt_token_ids) + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({len(prompt_token_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                f"context length {self.max_model_len}"
            )
        waiting = len(self.scheduler.waiting)
        if waiting >= self.config.max_waiting:
            raise QueueFullError(f"{waiting} requests are waiting (bound {self.config.max_waiting})")
        req = Request(request_id, list(prompt_token_ids), params, cache_salt=cache_salt,
                      namespace=namespace_hash(self.fingerprint, cache_salt))
        self.scheduler.add(req)
        self.tenant_namespaces.record(cache_salt, req.namespace)
        self.prompt_tokens += len(prompt_token_ids)

    def drop_tenant(self, tenant: str | None) -> tuple[TenantDrop, frozenset[BlockHash]]:
        """The engine thread's part of deleting ``tenant`` (kvstore/tenant.py): its cached blocks leave the
        HBM prefix index (``BlockPool.drop_tenant``: blocks running requests hold stay theirs, unhashed, and
        become free space when freed; no byte a request reads changes), and the snapshot namespaces it
        owns (tenant_registry.py) are returned for the tier deletion, which runs off this thread
        (``TierManager.delete_tenant``). Mutates the prefix index and forgets the tenant's recorded
        namespaces. Engine thread only; O(cached blocks). Never fails."""
        dropped = self.kvm.drop_tenant(tenant_tag(tenant))
        namespaces = self.tenant_namespaces.namespaces(self.fingerprint, tenant)
        self.tenant_namespaces.forget(tenant)
        return dropped, namespaces

    def abort(self, request_id: str) -> bool:
        """Free everything the request holds; its final output (finish_reason "abort") comes next step."""
        req = self.scheduler.abort(request_id)
        if req is None:
            return False
        self._aborted.append(req)
        return True

    def has_unfinished(self) -> bool:
        return bool(self.scheduler.requests or self._aborted)

    def set_wake(self, wake: Callable[[], None] | None) -> None:
        """``wake()`` is called, on the tier I/O thread, whenever a resume lookup started from now on
        finishes (a driver loop sleeping while ``stalled`` wakes on it). It must be thread-safe, quick
        and must not touch the engine; an exception it raises is logged by the future and ignored.
        Mutates the scheduler's hook."""
        self.scheduler.on_lookup_done = wake

    # ---- the step ---------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, execute, postprocess. Returns the outputs of every request touched."""
        control = self.spec_control
        if control is not None:
            k = control.begin_step(sum(len(r.live_seqs) for r in self.scheduler.running
                                       if r.status is RequestStatus.DECODE))
            if k > 0:
                self.drafter.propose_for(self.scheduler.running, k)
        sched = self.scheduler.schedule()
        self.stalled = sched.empty and not sched.preempted and not self.scheduler.running
        result = self.runner.execute(sched)
        touched = self.postprocessor.process(sched, result)
        if self.drafter is not None:
            self.drafter.after_step(sched, result)
        if control is not None:
            control.end_step(sched)
        outputs = [build_output(r) for r in touched + self._aborted]
        self._aborted.clear()
        return outputs

    # ---- introspection ----------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        s = self.scheduler
        return EngineStats(
            num_running=s.num_running_seqs,
            num_waiting=len(s.waiting),
            num_loading=len(s.loading),
            kv_usage=self.pool.usage,
            prefix_queries_tokens=s.stats.prefix_queries_tokens,
            prefix_hits_tokens=s.stats.prefix_hits_tokens,
            preemptions=s.stats.preemptions,
            prompt_tokens=self.prompt_tokens,
            generation_tokens=self.postprocessor.generation_tokens,
            global_kv_bytes_per_token=self.layout.bytes_per_token(),
            tiers=tier_stats(self.tiers),
            **spec_fields(self.spec_stats, self.spec_control),
        )

    def close(self) -> None:
        """Flush and close the tiers (SSD writer fsyncs what is queued)."""
        if self.tiers is not None:
            self.tiers.close()

    def check_integrity(self) -> None:
        """The scheduler's and the pool's invariants, and the speculative sequences' (RuntimeError); tests call
        it after every step."""
        self.scheduler.check_integrity()
        if self.drafter is not None:
            check_spec_integrity(self.scheduler.running, self.pool, self.layout.block_size)
