"""The synchronous engine: ``add_request`` / ``abort`` / ``step()`` (schedule -> run -> update).

Single-threaded and unit-testable: ``AsyncEngine`` runs ``step()`` on its own thread. Text never
reaches here; requests are token ids with ``SamplingParams``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time

import torch

from flashtier.kvstore.block_hash import namespace_hash
from flashtier.kvstore.block_pool import BlockPool
from flashtier.kvstore.config import KVStoreConfig
from flashtier.kvstore.kv_pool import GlobalKVPool
from flashtier.kvstore.layout import BlockLayout
from flashtier.kvstore.snapshot import SnapshotKey

from .client import QueueFullError
from .config import EngineConfig
from .kv_accounting import kv_geometry
from .model.transformer import Transformer

log = logging.getLogger("flashtier.engine")
from .outputs import CacheUsage, ChoiceDelta, EngineStats, RequestOutput, RequestTimes, TokenLogprob
from .paged_kv import BlockTable, PagedEntries, PagedSequence, WindowRings
from .request import Request, RequestStatus, Sequence
from .runner import ModelRunner
from .sampler import Sampler, SamplerRow
from .sampling_params import SamplingParams
from .scheduler import Scheduler
from .snapshot_codec import decode_snapshot, encode_snapshot
from .tiers import LookupQuery, TierManager

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
    ):
        """``tiers``: SSD write-through, snapshots and resume lookups; None keeps everything in the pool."""
        self.model = model
        self.tiers = tiers
        self.config = config or EngineConfig()
        self.kv_config = kv_config or KVStoreConfig()
        cfg = model.cfg
        self.block_size = self.kv_config.block_size
        self.layout = BlockLayout(kv_geometry(cfg), self.block_size)
        dev = model.device
        available = None
        if self.kv_config.num_blocks is None and self.kv_config.hbm_budget_bytes is None:
            available = torch.cuda.mem_get_info(dev)[0] if dev.type == "cuda" else DEFAULT_CPU_KV_BYTES
        num_blocks = self.kv_config.pool_blocks(self.layout.block_bytes, available)
        self.pool = BlockPool(num_blocks, enable_caching=self.kv_config.enable_prefix_caching)
        self.kv = GlobalKVPool(self.layout, num_blocks, dev)
        self.max_model_len = self.config.max_model_len or cfg.max_position_embeddings
        self.fingerprint = self.config.fingerprint or model_fingerprint(
            model, self.block_size, f"{self.config.dtype}|seed{self.config.weights_seed}|{self.config.model_dir}"
        )
        self.runner = ModelRunner(model)
        self.sampler = Sampler(eos_token_id=cfg.eos_token_id)
        self.scheduler = Scheduler(
            self.pool, block_size=self.block_size, window=cfg.sliding_window,
            max_num_seqs=self.config.max_num_seqs, token_budget=self.config.max_num_batched_tokens,
            new_sequence=self._new_sequence, swap_out=self._swap_out, swap_in=self._swap_in,
            start_lookup=self._start_lookup if tiers else None, apply_lookup=self._apply_lookup if tiers else None,
        )
        self._partial_order = [s for s in cfg.kv_source_layer_ids if cfg.compress_ratios[s] == 2]
        self.requests: dict[str, Request] = {}
        self._aborted: list[Request] = []
        self.prompt_tokens = 0
        self.generation_tokens = 0

    # ---- requests -------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams | None = None,
                    *, cache_salt: str | None = None) -> None:
        """Queue a request. ValueError for an unusable request, QueueFullError at the queue bound."""
        params = params or SamplingParams()
        if request_id in self.requests:
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
        if len(self.scheduler.waiting) >= self.config.max_waiting:
            raise QueueFullError(f"{len(self.scheduler.waiting)} requests are waiting (bound {self.config.max_waiting})")
        req = Request(request_id, list(prompt_token_ids), params, cache_salt=cache_salt)
        req.namespace = namespace_hash(self.fingerprint, cache_salt)
        self.requests[request_id] = req
        self.scheduler.add(req)
        self.prompt_tokens += len(prompt_token_ids)

    def abort(self, request_id: str) -> bool:
        """Free everything the request holds; its final output (finish_reason "abort") comes next step."""
        req = self.requests.get(request_id)
        if req is None or req.status is RequestStatus.FINISHED:
            return False
        for seq in req.seqs:
            if not seq.finished:
                seq.finish_reason = "abort"
            if len(seq.kv.table):
                self.scheduler.free_seq(seq)
        self._finish(req)
        self._aborted.append(req)
        return True

    def has_unfinished(self) -> bool:
        s = self.scheduler
        return bool(s.waiting or s.running or s.loading or self._aborted)

    # ---- sequences ------------------------------------------------------------------------------
    def _new_sequence(self, req: Request, index: int) -> Sequence:
        cfg = self.model.cfg
        dev, cdt = self.model.device, self.model.compute_dtype
        table = BlockTable(device=dev)
        per_block = self.layout.entries_per_block
        stores = {
            src: PagedEntries(self.kv, s, per_block[s], table, cfg.head_dim, cfg.index_head_dim, cdt)
            for s, src in enumerate(cfg.kv_source_layer_ids)
        }
        kv = PagedSequence(
            table=table, stores=stores,
            rings=WindowRings(cfg.num_hidden_layers, cfg.sliding_window, cfg.head_dim, cdt, dev),
            partial={src: None for src in cfg.kv_source_layer_ids if cfg.compress_ratios[src] == 2},
        )
        gen = None
        if req.params.seed is not None:
            gen = torch.Generator(device=dev).manual_seed(req.params.seed + index)
        return Sequence(index, kv, gen)

    def _fork(self, req: Request) -> None:
        """n > 1: copy the prompt's private state to n - 1 more sequences; full blocks are shared."""
        parent = req.seqs[0]
        state = parent.kv.private_state()
        bs = self.block_size
        n_full = len(parent.kv.tokens) // bs
        for i in range(1, req.params.n):
            child = self._new_sequence(req, i)
            child.kv.restore_private_state(state)
            shared = [self.pool.blocks[b] for b in parent.kv.table.ids[:n_full]]
            self.pool.touch(shared)
            ids = [b.block_id for b in shared]
            if len(parent.kv.table) > n_full:  # the partial tail block is private: copy it
                new = self.pool.allocate(1)
                if new is None:
                    self.pool.free(shared)
                    child.finish_reason = "abort"
                    req.seqs.append(child)
                    continue
                self.kv.copy_block(parent.kv.table.ids[n_full], new[0].block_id)
                ids.append(new[0].block_id)
            child.kv.table.replace(ids)
            child.hashes = list(parent.hashes)
            req.seqs.append(child)

    def _swap_out(self, req: Request) -> None:
        for seq in req.live_seqs:
            self._snapshot(req, seq)
            seq.swapped = {
                "private": seq.kv.private_state(),
                "images": [self.kv.image(b) for b in seq.kv.table.ids],
            }
            self.scheduler.free_seq(seq)
        req.resume_status = req.status
        req.status = RequestStatus.PREEMPTED

    def _swap_in(self, req: Request) -> bool:
        need = sum(len(s.swapped["images"]) for s in req.live_seqs)
        if self.pool.num_free < need:
            return False
        for seq in req.live_seqs:
            images = seq.swapped["images"]
            blocks = self.pool.allocate(len(images)) if images else []
            for b, img in zip(blocks, images):
                self.kv.load_image(b.block_id, img)
            seq.kv.table.replace([b.block_id for b in blocks])
            seq.kv.restore_private_state(seq.swapped["private"])
            for b, h in zip(blocks, seq.hashes):
                self.pool.cache_full_block(b, h)
            seq.swapped = None
        req.status = req.resume_status
        return True

    # ---- tiers ------------------------------------------------------------------------------------
    def _snapshot(self, req: Request, seq: Sequence) -> None:
        """Put an encoder snapshot at P = len(tokens fed) into the snapshot pool (fire and forget)."""
        if self.tiers is None or not seq.kv.tokens or not len(seq.kv.table):
            return
        bs = self.block_size
        p = len(seq.kv.tokens)
        b = p // bs
        if len(seq.hashes) < b:
            return  # a full block is not hashed yet (cannot happen after cache_new_full_blocks)
        parent = seq.hashes[b - 1] if b else req.namespace
        tail = self.kv.image(seq.kv.table.ids[b]) if p % bs else b""
        payload = encode_snapshot(seq.kv, self.model.cfg.n_encoder_layers, tail, self._partial_order)
        self.tiers.put_snapshot(SnapshotKey.for_tail(req.namespace, parent, seq.kv.tokens[b * bs : p]), payload)
        req.persisted_bytes += len(payload)

    def _start_lookup(self, req: Request):
        cfg = self.model.cfg
        return self.tiers.lookup(LookupQuery(req.namespace, req.prompt, req.hashes, req.hbm_blocks,
                                             self.block_size, cfg.sliding_window))

    def _apply_lookup(self, req: Request) -> bool:
        """LOADING -> ready: install SSD blocks and the snapshot (or set up encoder replay, or cold).

        Returns False (the request stays LOADING and retries next step) when the pool is short.
        """
        res = req.lookup.result()
        seq = req.seqs[0]
        bs = self.block_size
        k_hbm = req.hbm_blocks
        images = res.ssd_images
        point = res.snapshot_point
        if point is not None:
            b = point // bs
            images = images[: max(0, b - k_hbm)]
        need = len(images) + (1 if point is not None and point % bs else 0)
        fresh = self.pool.allocate(need) if need else []
        if fresh is None:
            return False
        self.tiers.stats.snapshot_lookups[res.snapshot_result] += 1
        hbm_ids = seq.kv.table.ids
        for j, (blk, image) in enumerate(zip(fresh, images)):
            self.kv.load_image(blk.block_id, image)
            self.pool.cache_full_block(blk, req.hashes[k_hbm + j])
        self.tiers.stats.ssd_blocks_loaded += len(images)
        loaded = [blk.block_id for blk in fresh[: len(images)]]
        if point is not None:
            b = point // bs
            keep = hbm_ids[: min(k_hbm, b)]
            self.pool.free([self.pool.blocks[i] for i in hbm_ids[len(keep):]])
            table = keep + loaded
            try:
                if point % bs:
                    table.append(fresh[-1].block_id)
                seq.kv.table.replace(table)
                tail = decode_snapshot(res.snapshot_payload, seq.kv, self.model.cfg.n_encoder_layers,
                                       self._partial_order, point, self.layout.block_bytes)
                if point % bs:
                    self.kv.load_image(fresh[-1].block_id, tail)
            except ValueError:
                log.warning("snapshot for request %s failed validation; falling back", req.request_id)
                self.tiers.stats.snapshot_lookups["error"] += 1
                if point % bs:
                    self.pool.free([fresh[-1]])
                    table.pop()
                seq.kv.table.replace(table)
                seq.kv.rings.clear(range(0, self.model.cfg.num_hidden_layers))
                seq.kv.partial = {s: None for s in self._partial_order}
                seq.kv.enc_start = seq.kv.write_from = 0
                return self._finish_replay_setup(req, seq, len(table), k_hbm)
            seq.kv.tokens = list(req.prompt[:point])
            for store in seq.kv.stores.values():
                store.count = point // (bs // store.per_block)
            seq.hashes = list(req.hashes[:b])
            req.prefilled = point
            req.cached_tokens = point
            req.hbm_tokens = len(keep) * bs
            req.ssd_tokens = len(loaded) * bs
            req.snapshot_tokens = point - b * bs
            self.scheduler.prefix_hits_tokens += point
            return True
        seq.kv.table.replace(hbm_ids + loaded)
        return self._finish_replay_setup(req, seq, len(seq.kv.table), k_hbm)

    def _finish_replay_setup(self, req: Request, seq: Sequence, n_blocks: int, k_hbm: int) -> bool:
        """Without a snapshot: encoder bounded replay from the block-aligned hit, or a cold start."""
        bs, w = self.block_size, self.model.cfg.sliding_window
        if n_blocks * bs < w:
            self.scheduler.free_seq(seq)
            seq.hashes = []
            return True
        seq.hashes = list(req.hashes[:n_blocks])
        self.scheduler.setup_replay(req, seq, n_blocks * bs)
        req.hbm_tokens = min(k_hbm, n_blocks) * bs
        req.ssd_tokens = (n_blocks - min(k_hbm, n_blocks)) * bs
        return True

    # ---- the step -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run the model, sample, update. Returns the outputs of every request touched."""
        batch = self.scheduler.schedule()
        touched: dict[str, Request] = {}
        now = time.monotonic()
        for w in batch.encoder:
            if w.request.first_scheduled is None:
                w.request.first_scheduled = now
        logits = self.runner.execute(batch) if not batch.empty else None
        for w in batch.encoder:
            for block_id, h in self.scheduler.cache_new_full_blocks(w.seq, w.request.namespace):
                if self.tiers is not None:
                    self.tiers.write_block(h, self.kv.image(block_id))
                    w.request.persisted_bytes += self.layout.block_bytes
            if w.request.status is RequestStatus.REPLAY and len(w.seq.kv.tokens) == len(w.request.prompt):
                self._snapshot(w.request, w.seq)  # prompt end
        if logits is not None:
            rows: list[tuple[Request, Sequence, int]] = []
            for i, w in enumerate(batch.decoder):
                req = w.request
                if w.kind == "replay":
                    req.status = RequestStatus.DECODE
                    if req.params.n > 1:
                        self._fork(req)
                    rows.extend((req, s, i) for s in req.live_seqs)
                else:
                    rows.append((req, w.seq, i))
            self._sample(rows, logits)
            for req, _, _ in rows:
                touched[req.request_id] = req
        outputs = [self._output(r) for r in touched.values()]
        outputs += [self._output(r) for r in self._aborted]
        self._aborted.clear()
        return outputs

    def _sample(self, rows: list[tuple[Request, Sequence, int]], logits: torch.Tensor) -> None:
        if not rows:
            return
        sampler_rows = [SamplerRow(r.params, s.output, r.prompt, s.generator) for r, s, _ in rows]
        out = self.sampler(logits[[i for _, _, i in rows]], sampler_rows)
        tokens = out.token_ids.tolist()
        now = time.monotonic()
        for j, ((req, seq, _), tok) in enumerate(zip(rows, tokens)):
            if req.first_token is None:
                req.first_token = now
            p = req.params
            if p.logprobs is not None:
                k = p.logprobs
                seq.logprobs.append(TokenLogprob(
                    tok, float(out.logprobs[j]), int(out.ranks[j]),
                    tuple(zip(out.top_logprob_ids[j, :k].tolist(), out.top_logprobs[j, :k].tolist())),
                ))
            self.generation_tokens += 1
            if (tok == self.model.cfg.eos_token_id and not p.ignore_eos) or tok in p.stop_token_ids:
                seq.finish_reason, seq.stop_token_id = "stop", tok
                if p.logprobs is not None:
                    seq.logprobs.pop()
            else:
                seq.output.append(tok)
                if len(seq.output) >= p.max_tokens or len(req.prompt) + len(seq.output) >= self.max_model_len:
                    seq.finish_reason = "length"
            if seq.finished:
                self._snapshot(req, seq)  # generation end
                self.scheduler.free_seq(seq)
        for req in {id(r): r for r, _, _ in rows}.values():
            if not req.live_seqs:
                self._finish(req)

    def _finish(self, req: Request) -> None:
        req.status = RequestStatus.FINISHED
        req.finished_at = time.monotonic()
        self.scheduler.remove(req)
        self.requests.pop(req.request_id, None)

    def _output(self, req: Request) -> RequestOutput:
        choices = []
        for seq in req.seqs:
            new = tuple(seq.output[seq.emitted :])
            lps = tuple(seq.logprobs[seq.emitted :]) if req.params.logprobs is not None else None
            seq.emitted = len(seq.output)
            if new or seq.finish_reason is not None:
                choices.append(ChoiceDelta(seq.index, new, lps, seq.finish_reason, seq.stop_token_id))
        finished = req.status is RequestStatus.FINISHED
        cache = CacheUsage(
            cached_tokens=req.cached_tokens, hbm_tokens=req.hbm_tokens, ssd_tokens=req.ssd_tokens,
            snapshot_tokens=req.snapshot_tokens, replayed_tokens=req.replayed_tokens,
            computed_tokens=req.computed_tokens, persisted_bytes=req.persisted_bytes,
        )
        times = RequestTimes(req.arrival, req.first_scheduled, req.first_token, req.finished_at)
        return RequestOutput(req.request_id, len(req.prompt), tuple(choices), finished, cache, times)

    # ---- introspection --------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        s = self.scheduler
        return EngineStats(
            num_running=s.num_running_seqs,
            num_waiting=len(s.waiting),
            num_loading=0,
            kv_usage=self.pool.usage,
            prefix_queries_tokens=s.prefix_queries_tokens,
            prefix_hits_tokens=s.prefix_hits_tokens,
            preemptions=s.num_preemptions,
            prompt_tokens=self.prompt_tokens,
            generation_tokens=self.generation_tokens,
            global_kv_bytes_per_token=self.layout.bytes_per_token(),
            tiers=self._tier_stats(),
        )

    def _tier_stats(self) -> dict[str, float]:
        if self.tiers is None:
            return {}
        t = self.tiers.stats
        out: dict[str, float] = {
            "ssd_blocks_written": t.ssd_blocks_written, "ssd_bytes_written": t.ssd_bytes_written,
            "ssd_write_refused": t.ssd_write_refused, "ssd_blocks_loaded": t.ssd_blocks_loaded,
            "snapshot_puts": t.snapshot_puts, "snapshot_bytes_written": t.snapshot_bytes_written,
        }
        for k, v in t.snapshot_lookups.items():
            out[f"snapshot_lookup_{k}"] = v
        if self.tiers.ssd is not None:
            s = self.tiers.ssd.stats()
            for name in ("bytes", "entries", "oldest_entry_age_s", "admission_refusals", "expirations",
                         "corrupt_records", "bytes_read", "bytes_written", "hits", "misses"):
                out[f"ssd_{name}"] = getattr(s, name)
        ps = self.tiers.snapshots.stats()
        for name in ("hits", "misses", "errors", "corrupt", "bytes_written", "bytes_read", "redis_errors"):
            out[f"snapshot_{name}"] = getattr(ps, name)
        return out

    def close(self) -> None:
        """Flush and close the tiers (SSD writer fsyncs what is queued)."""
        if self.tiers is not None:
            self.tiers.close()

    def check_integrity(self) -> None:
        """Pool invariants plus: every running sequence's blocks are referenced, no block owned twice
        by sequences that are not sharing it through the prefix cache. Raises RuntimeError."""
        self.pool.check_integrity()
        owners: dict[int, int] = {}
        for req in self.scheduler.running + self.scheduler.loading:
            for seq in req.live_seqs:
                for b in seq.kv.table.ids:
                    owners[b] = owners.get(b, 0) + 1
        for b, n in owners.items():
            ref = self.pool.blocks[b].ref_cnt
            if ref < n:
                raise RuntimeError(f"block {b} is in {n} block tables but has ref count {ref}")
        held = sum(1 for b in self.pool.blocks if b.ref_cnt > 0 and not b.is_null)
        if held != len(owners):
            raise RuntimeError(f"{held} blocks are referenced but running sequences hold {len(owners)}")
