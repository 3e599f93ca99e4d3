"""Resume from the tiers: turn a finished ``TierLookup`` into a plan, then install it into a sequence.

At admission a request pins its HBM hits (the leading ``hbm_blocks`` of its table) and asks the tiers
for more. The lookup yields SSD images of the blocks after those hits and the best snapshot point P::

    blocks   [ HBM hits (pinned) | SSD images ............... ]
    exact    [ keep P // bs      | load up to P // bs ][ tail ]   snapshot installed: continue at P (any P <= n;
                                                                  its replay tail feeds the decoder replay below P)
    replay   [ HBM hits          | every SSD image    ]           encoder bounded replay from r = blocks * bs
    cold     r < window: every block released, prefill from 0

``plan_resume`` is pure arithmetic; ``install_resume`` mutates the sequence and the pool and reports
what it did as a ``ResumeResult`` (the scheduler does the request's accounting and state change). The
SSD images arrive as a ``RestoredRun`` (slots of the tiers' restore buffer): the install copies the run
to the pool in one transfer and gives the buffer back (restored_run.py).
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass

from flashtier.engine.kv.manager import KVManager
from flashtier.engine.core.request import Sequence
from flashtier.engine.tiers.restored_run import RestoredRun
from flashtier.engine.tiers.snapshot_codec import decode_snapshot
from flashtier.engine.tiers.manager import SnapshotOutcome, TierLookup
from flashtier.kvstore.block_hash import BlockHash
from flashtier.kvstore.block_pool import KVBlock

log = logging.getLogger("flashtier.engine.tiers.resume")


class ResumeKind(enum.Enum):
    EXACT = "exact"  # a snapshot: continue at its point P
    REPLAY = "replay"  # encoder bounded replay from a block-aligned hit r >= window
    COLD = "cold"  # less than a window cached: prefill from 0


@dataclass(frozen=True)
class ResumePlan:
    """What to install (derived from a lookup; no I/O)."""

    block_size: int
    hbm_blocks: int  # pinned HBM hits, the leading blocks of the table
    ssd_images: RestoredRun  # images of blocks hbm_blocks.. to load (trimmed to the snapshot)
    point: int | None  # snapshot point P
    payload: bytes | None
    outcome: SnapshotOutcome

    @property
    def tail(self) -> bool:
        """The snapshot carries a partial tail block (P not block-aligned)."""
        return self.point is not None and self.point % self.block_size != 0

    @property
    def keep_hbm(self) -> int:
        """HBM hits kept: all of them, or those below the snapshot point."""
        return self.hbm_blocks if self.point is None else min(self.hbm_blocks, self.point // self.block_size)

    @property
    def num_new_blocks(self) -> int:
        return len(self.ssd_images) + int(self.tail)


def plan_resume(lookup: TierLookup, hbm_blocks: int, block_size: int) -> ResumePlan:
    """The install ``lookup`` calls for (no I/O; the plan's run shares the lookup's restore lease)."""
    images = lookup.ssd_images
    if lookup.snapshot_point is not None:
        images = images.prefix(lookup.snapshot_point // block_size - hbm_blocks)
    return ResumePlan(block_size, hbm_blocks, images, lookup.snapshot_point, lookup.snapshot_payload,
                      lookup.outcome)


@dataclass(frozen=True)
class ResumeResult:
    kind: ResumeKind
    cached_tokens: int  # P (exact), r (replay), 0 (cold)
    hbm_tokens: int
    ssd_tokens: int
    snapshot_tokens: int
    ssd_blocks_loaded: int
    snapshot_invalid: bool  # the payload failed validation (fell back to replay / cold)


def install_resume(
    kvm: KVManager, seq: Sequence, prompt: list[int], hashes: list[BlockHash], plan: ResumePlan,
    fresh: list[KVBlock], *, allow_replay: bool = True, fork_block: int | None = None,
) -> ResumeResult:
    """Install ``plan`` into ``seq`` (its table holds the pinned HBM hits) using ``fresh`` blocks.
    Without ``allow_replay`` (policy exact-or-cold) a hit with no exact snapshot is a cold start.
    ``hashes[fork_block:]`` lie on a replayed fork (the lookup followed it; the state resumed is then
    approximate: a replayed snapshot, or a bounded replay over those blocks).

    Mutates: the pool (loads, registrations, releases), ``seq.kv`` and ``seq.hashes``; gives the plan's
    restore lease back. For REPLAY the caller still rewinds the sequence (``PagedSequence.rewind``).
    Failure: a snapshot that does not validate is logged and the sequence falls back to replay / cold
    (``snapshot_invalid``); a run whose images are not this pool's block size raises ValueError.
    """
    bs, spec = kvm.block_size, kvm.spec
    hbm_ids = list(seq.kv.table.ids)
    loaded = [blk.block_id for blk in fresh[: len(plan.ssd_images)]]
    load_run(kvm, plan.ssd_images, loaded, hashes[plan.hbm_blocks : plan.hbm_blocks + len(loaded)], seq.tenant)
    if plan.point is None:
        return _replay_or_cold(kvm, seq, hashes, hbm_ids + loaded, plan, invalid=False, allow_replay=allow_replay,
                               fork_block=fork_block)
    try:
        snap = decode_snapshot(plan.payload, seq.kv.rings, spec, point=plan.point, prompt_len=len(prompt),
                               tail_bytes=kvm.layout.block_bytes)
    except ValueError as exc:
        log.warning("a snapshot failed validation (%s); falling back to bounded replay", exc)
        if plan.tail:
            kvm.release([fresh[-1].block_id])
        # every HBM hit still counts (loaded SSD blocks follow them only when none lies beyond P)
        return _replay_or_cold(kvm, seq, hashes, hbm_ids + loaded, plan, invalid=True, allow_replay=allow_replay,
                               fork_block=fork_block)
    keep = hbm_ids[: plan.keep_hbm]
    kvm.release(hbm_ids[plan.keep_hbm :])
    b = plan.point // bs
    table = keep + loaded + ([fresh[-1].block_id] if plan.tail else [])
    seq.kv.table.replace(table)
    seq.kv.install_snapshot(snap, prompt)
    if plan.tail:
        kvm.load_image(fresh[-1].block_id, snap.tail_image)
    seq.take_hashes(hashes, b, fork_block)
    return ResumeResult(ResumeKind.EXACT, plan.point, len(keep) * bs, len(loaded) * bs, plan.point - b * bs,
                        len(loaded), snapshot_invalid=False)


def load_run(kvm: KVManager, run: RestoredRun, block_ids: list[int], hashes: list[BlockHash],
             tenant: bytes | None = None) -> None:
    """Fill fresh blocks ``block_ids`` with ``run``'s images in one copy and register their ``hashes`` for
    ``tenant`` (the tag of the request's tenant, kvstore/tenant.py).
    Mutates the pool's bytes and prefix index; gives the run's lease back. ValueError (nothing loaded,
    the lease kept) when ``block_ids`` and the run differ in length or its images are not block images."""
    if len(run) and run.slot_bytes != kvm.layout.block_bytes:
        raise ValueError(f"block image has {run.slot_bytes} bytes, expected {kvm.layout.block_bytes}")
    run.install(kvm.kv.data, block_ids)
    for block_id, block_hash in zip(block_ids, hashes):
        kvm.pool.cache_full_block(kvm.pool.blocks[block_id], block_hash, tenant)


def _replay_or_cold(
    kvm: KVManager, seq: Sequence, hashes: list[BlockHash], table: list[int], plan: ResumePlan, *, invalid: bool,
    allow_replay: bool, fork_block: int | None,
) -> ResumeResult:
    """Without a snapshot: bounded replay from the block-aligned hit, or a cold start (below the window,
    or a replay the policy does not allow: replaying from exactly R = window is exact, so it stays)."""
    bs, w = kvm.block_size, kvm.spec.window
    n_blocks = len(table)
    seq.kv.table.replace(table)
    loaded = len(plan.ssd_images)
    if n_blocks * bs < w or (not allow_replay and n_blocks * bs > w):
        kvm.free(seq.kv)
        seq.take_hashes(hashes, 0, None)
        return ResumeResult(ResumeKind.COLD, 0, 0, 0, 0, loaded, invalid)
    seq.take_hashes(hashes, n_blocks, fork_block)
    hbm = min(plan.hbm_blocks, n_blocks)
    return ResumeResult(ResumeKind.REPLAY, n_blocks * bs, hbm * bs, (n_blocks - hbm) * bs, 0, loaded, invalid)
