"""The scheduler's use of the tiers: start resume lookups, write full blocks through to SSD, put snapshots.

Every call is fire and forget or a future (``TierManager`` does the I/O on its own thread); none can
fail a request. Byte images come from the ``KVManager``, snapshot payloads from ``snapshot_codec``.
"""

from __future__ import annotations

import concurrent.futures
import logging

from flashtier.engine.kv.manager import CachedBlock, KVManager
from flashtier.engine.core.request import Request, Sequence
from flashtier.engine.tiers.resume import ResumePlan, ResumeResult
from flashtier.engine.tiers.snapshot_codec import encode_snapshot
from flashtier.engine.tiers.manager import LookupQuery, SnapshotOutcome, TierLookup, TierManager
from flashtier.kvstore.block_hash import replayed_namespace
from flashtier.kvstore.snapshot.key import SnapshotKey
from flashtier.kvstore.tenant import tag_of_salt

log = logging.getLogger("flashtier.engine.tiers.client")


class TierClient:
    def __init__(self, tiers: TierManager, kvm: KVManager, *, allow_replay: bool = True):
        """``allow_replay`` (resume policy "replay"): lookups may resume replayed window states."""
        self.tiers = tiers
        self.kvm = kvm
        self.allow_replay = allow_replay

    def start_lookup(self, req: Request) -> concurrent.futures.Future[TierLookup]:
        """Ask the tiers for SSD blocks after the request's ``hbm_blocks`` HBM hits and a snapshot (read
        into the tiers' restore buffer, pinned when the pool is on CUDA)."""
        q = LookupQuery(req.namespace, req.prompt, req.hashes, req.hbm_blocks, self.kvm.block_size,
                        replayed_namespace(req.namespace) if self.allow_replay else None, req.fork_block,
                        block_bytes=self.kvm.layout.block_bytes, pin_memory=self.kvm.spec.device.type == "cuda")
        return self.tiers.lookup(q)

    def drop_lookup(self, req: Request) -> None:
        """The request no longer waits on its lookup (aborted while LOADING): what the lookup read is given
        back as soon as it is done (``TierManager.drop_lookup``). Mutates ``req.lookup`` (None)."""
        if req.lookup is not None:
            self.tiers.drop_lookup(req.lookup)
            req.lookup = None

    def write_through(self, req: Request, blocks: list[CachedBlock]) -> None:
        """Queue the images of newly full blocks for the SSD tier; ``req.persisted`` grows as they
        become durable."""
        tenant = tag_of_salt(req.cache_salt)  # the record carries its tenant (kvstore/tenant.py)
        for blk in blocks:
            self.tiers.write_block(blk.block_hash, self.kvm.image(blk.block_id), req.persisted.add, tenant)

    def snapshot(self, req: Request, seq: Sequence) -> None:
        """Put an encoder snapshot at P = len(tokens fed), replay tail included, into the snapshot pool
        (fire and forget; a state the codec refuses is logged and not put).

        Needs every full block below P hashed (``KVManager.cache_full_blocks`` ran). A replayed
        (approximate) window state goes under ``replayed_namespace``: it never replaces, and is never
        found as, an exact snapshot of the same point.
        """
        kv = seq.kv
        if not kv.tokens or not len(kv.table):
            return
        bs, p = self.kvm.block_size, len(kv.tokens)
        b = p // bs
        if len(seq.hashes) < b:
            return  # a full block is not hashed yet (cannot happen after cache_full_blocks)
        parent = seq.hashes[b - 1] if b else req.namespace
        tail = self.kvm.image(kv.table.ids[b]) if p % bs else b""
        spec = self.kvm.spec
        try:
            payload = encode_snapshot(kv, spec.n_encoder_layers, tail, spec.partial_order)
        except ValueError as exc:  # an inconsistent replay tail: no snapshot beats a wrong one
            log.warning("not snapshotting %s at %d: %s", req.request_id, p, exc)
            return
        namespace = req.namespace if kv.replayed_from is None else replayed_namespace(req.namespace)
        key = SnapshotKey.for_tail(namespace, parent, kv.tokens[b * bs : p])
        self.tiers.put_snapshot(key, payload, req.persisted.add)

    def count_resume(self, plan: ResumePlan, result: ResumeResult) -> None:
        stats = self.tiers.stats
        stats.snapshot_lookups[plan.outcome] += 1
        if result.snapshot_invalid:
            stats.snapshot_lookups[SnapshotOutcome.ERROR] += 1
        stats.ssd_blocks_loaded += result.ssd_blocks_loaded
