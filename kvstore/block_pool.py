"""BlockPool: ref-counted HBM block ids, the prefix-cache hash index and LRU reuse of free blocks.

The pool hands out ids only; the bytes live in one tensor indexed by ``block_id``
(``BlockLayout.allocate``), owned elsewhere. Every block is in exactly one state::

    null      block 0 only: never allocated, never freed, never cached (see below)
    in use    ref_cnt > 0, not in the free queue, hash optional (a cached block shared by requests)
    free      ref_cnt == 0, in the free queue exactly once; with a hash it is still a prefix-cache hit
              ("cached free"), without one it is plain free space

    ──allocate()──▶ in use ──free(), ref reaches 0──▶ free ──allocate() pops the LRU front──▶ in use
                      ▲                                 │   (a cached block leaves the index first)
                      └── touch(): prefix hit on a cached free block, O(1) unlink ──┘

Null block: block 0 is reserved. Padded batches (CUDA-graph capture sizes, padded block tables) need a
block id whose contents nobody reads, so their scratch writes can never clobber a real block. ``touch``
and ``free`` skip it, so block tables may contain it as padding. Usable capacity is ``num_blocks - 1``.

Not thread-safe: the engine thread owns the pool; every method runs under the caller's serialisation.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from flashtier.kvstore.block_hash import BlockHash
from flashtier.kvstore.free_queue import FreeBlockQueue

NULL_BLOCK_ID = 0


@dataclass(slots=True, eq=False)
class KVBlock:
    """One HBM block id plus its bookkeeping. Identity-compared; only the pool mutates it."""

    block_id: int
    ref_cnt: int = 0  # requests currently using the block
    block_hash: BlockHash | None = None  # set while the block is registered in the hash index
    tenant: bytes | None = None  # tag of the tenant it was cached for (kvstore/tenant.py); None: unknown / uncached
    prev_free: KVBlock | None = field(default=None, repr=False)  # free-queue links (None: not queued)
    next_free: KVBlock | None = field(default=None, repr=False)

    @property
    def is_null(self) -> bool:
        return self.block_id == NULL_BLOCK_ID


@dataclass(slots=True)
class PoolStats:
    """Monotonic counters, in blocks, for metrics (export deltas; never reset by the pool)."""

    queries: int = 0  # block hashes looked up by match_prefix(count=True)
    hits: int = 0  # of which matched (leading run only)
    evictions: int = 0  # cached blocks whose hash was dropped (reuse by allocate, or evict_cached)
    tenant_drops: int = 0  # cached blocks dropped by drop_tenant (not counted as evictions)


@dataclass(frozen=True, slots=True)
class TenantDrop:
    """What one ``BlockPool.drop_tenant`` removed from the hash index."""

    free_blocks: int  # cached free blocks: now plain free space
    in_use_blocks: int  # blocks running requests hold: unhashed now, plain free space once freed


class BlockPool:
    """All KVBlocks of one HBM pool: allocate / touch / free, and the hash → block prefix index."""

    def __init__(self, num_blocks: int, *, enable_caching: bool = True) -> None:
        """``num_blocks`` ids, 0 being the null block; ValueError below 2 (no usable block)."""
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is the reserved null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[NULL_BLOCK_ID]
        self._free = FreeBlockQueue(self.blocks[1:])
        self._index: dict[BlockHash, KVBlock] = {}
        self.stats = PoolStats()

    # ---- sizes -------------------------------------------------------------------------------------
    @property
    def num_usable(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free(self) -> int:
        """Blocks an ``allocate`` could return now (plain free + cached free)."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_usable - len(self._free)

    @property
    def num_cached(self) -> int:
        """Blocks in the hash index (in use or free)."""
        return len(self._index)

    @property
    def usage(self) -> float:
        """Fraction of usable blocks in use (ref_cnt > 0); cached free blocks count as free."""
        return self.num_used / self.num_usable

    # ---- allocation --------------------------------------------------------------------------------
    def allocate(self, n: int) -> list[KVBlock] | None:
        """Pop ``n`` blocks from the LRU front, each with ref_cnt 1 and no hash.

        Mutates: the free queue; a popped block that still carries a hash is first dropped from the hash
        index (its prefix-cache entry is evicted, counted in ``stats.evictions``).
        Failure: None, with nothing changed, when fewer than ``n`` blocks are free ("not now": the
        scheduler preempts or waits). ValueError for ``n < 0``.
        """
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        if n > len(self._free):
            return None
        out = self._free.popleft_n(n)
        for block in out:
            assert block.ref_cnt == 0, f"free-queue block {block.block_id} has ref_cnt {block.ref_cnt}"
            self._drop_hash(block)
            block.ref_cnt = 1
        return out

    def touch(self, blocks: Sequence[KVBlock]) -> None:
        """Take one more reference on each block (a prefix hit); the null block is skipped.

        Mutates: ref counts; a cached free block (ref 0) leaves the free queue in O(1).
        Failure: ValueError, before any change, for a block of another pool or a free block without a
        hash (its contents may be overwritten at any time, so it cannot be shared).
        """
        for block in blocks:
            self._check_owned(block)
            if block.ref_cnt == 0 and not block.is_null and block.block_hash is None:
                raise ValueError(f"block {block.block_id} is free and uncached; only cached blocks can be touched")
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_cnt == 0:
                self._free.remove(block)
            block.ref_cnt += 1

    def free(self, blocks: Sequence[KVBlock]) -> None:
        """Drop one reference per occurrence; blocks reaching 0 go to the free-queue back.

        ``blocks`` is a request's block table in request order (head first). Blocks reaching 0 are
        appended tail first, so the queue evicts a request's tail before its head: a later request
        shares the head of a prefix more often than its tail, and an unhashed partial tail goes first.
        The null block is skipped. Failure: ValueError, before any change, if a block would drop below 0
        (double free) or belongs to another pool.
        """
        drops: Counter[int] = Counter()
        for block in blocks:
            self._check_owned(block)
            if not block.is_null:
                drops[block.block_id] += 1
        for block_id, k in drops.items():
            if self.blocks[block_id].ref_cnt < k:
                raise ValueError(
                    f"block {block_id} freed {k} time(s) with ref_cnt {self.blocks[block_id].ref_cnt} (double free?)"
                )
        for block in reversed(blocks):
            if block.is_null:
                continue
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free.append(block)

    # ---- prefix cache ------------------------------------------------------------------------------
    def cache_full_block(self, block: KVBlock, block_hash: BlockHash, tenant: bytes | None = None) -> bool:
        """Register an in-use, completely written block under ``block_hash``; True if it is now indexed.

        ``tenant``: the tag of the tenant whose request computed it (kvstore/tenant.py), recorded on the block
        while it is indexed so ``drop_tenant`` finds it; None (unknown) is never dropped by tenant.

        A hash already indexed keeps its existing block: this block stays unhashed, a private duplicate
        that is recycled like plain free space once freed (block tables are append-only, so the caller
        keeps using it). Re-caching a block under its own hash is a no-op returning True. With caching
        disabled nothing is indexed (False).
        Failure: ValueError for the null block, a free block, or a block already cached under another hash.
        """
        self._check_owned(block)
        if block.is_null:
            raise ValueError("the null block cannot be cached")
        if block.ref_cnt == 0:
            raise ValueError(f"block {block.block_id} is free; cache a block while a request holds it")
        if block.block_hash is not None:
            if block.block_hash == block_hash:
                return True
            raise ValueError(f"block {block.block_id} is already cached as {block.block_hash!r}, not {block_hash!r}")
        if not self.enable_caching or block_hash in self._index:
            return False
        block.block_hash = block_hash
        block.tenant = tenant
        self._index[block_hash] = block
        return True

    def get_cached_block(self, block_hash: BlockHash) -> KVBlock | None:
        """The block indexed under ``block_hash``, or None; changes nothing."""
        return self._index.get(block_hash)

    def match_prefix(self, block_hashes: Sequence[BlockHash], *, count: bool = True) -> list[KVBlock]:
        """The blocks of the longest run of leading hashes that are all indexed (in use or cached free).

        Does not touch ref counts or LRU order: the caller calls ``touch`` on what it keeps, before any
        ``allocate`` could evict them. ``count`` adds to ``stats.queries`` / ``stats.hits``; pass False
        when re-asking for the same request (e.g. a retry after a failed allocation).
        """
        out: list[KVBlock] = []
        for h in block_hashes:
            block = self._index.get(h)
            if block is None:
                break
            out.append(block)
        if count:
            self.stats.queries += len(block_hashes)
            self.stats.hits += len(out)
        return out

    def evict_cached(self, n: int) -> list[BlockHash]:
        """Drop the hashes of up to ``n`` cached free blocks, least recently freed first; returns them.

        The blocks stay in the free queue at their place (plain free space now). Blocks in use are never
        evicted. Cost: a walk from the queue front, O(n + uncached free blocks passed over).
        """
        if n < 0:
            raise ValueError(f"cannot evict a negative number of blocks ({n})")
        victims = []
        for block in self._free:
            if len(victims) == n:
                break
            if block.block_hash is not None:
                victims.append(block)
        hashes = [b.block_hash for b in victims]
        for block in victims:
            self._drop_hash(block)
        return hashes

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; only when no block is in use (False, nothing changed, otherwise).

        Running requests hold hashes they will later re-register or free; wiping them mid-flight would
        leave their bookkeeping pointing at hashes the index no longer has, so this waits for an idle
        pool (as vLLM does). Free-queue order is kept. Not counted as evictions.
        """
        if self.num_used:
            return False
        for block in self._index.values():
            block.block_hash = None
            block.tenant = None
        self._index.clear()
        return True

    def drop_tenant(self, tenant: bytes) -> TenantDrop:
        """Drop every indexed block cached for ``tenant`` (its tag) from the hash index: no later lookup hits it.

        A cached free block becomes plain free space where it is in the free queue (its bytes are overwritten
        when it is next allocated). A block in use keeps its ref count, its bytes and its place in the
        requests' block tables; only its hash goes, so it is a private block of those requests (as a
        duplicate is, see ``cache_full_block``) and plain free space once they free it. Nothing a running
        request reads changes. Not counted as evictions (``stats.tenant_drops``).

        Mutates: the hash index, the blocks' ``block_hash`` / ``tenant``. Caller: the pool's owner (the
        engine thread). Cost: one pass over the index, O(cached blocks). Never fails for a valid tag;
        ValueError for a tag that is not bytes.
        """
        if not isinstance(tenant, bytes):
            raise ValueError(f"a tenant tag is bytes, got {type(tenant).__name__}")
        free = in_use = 0
        for block in [b for b in self._index.values() if b.tenant == tenant]:
            del self._index[block.block_hash]
            block.block_hash = None
            block.tenant = None
            if block.ref_cnt:
                in_use += 1
            else:
                free += 1
        self.stats.tenant_drops += free + in_use
        return TenantDrop(free, in_use)

    def free_block_ids(self) -> list[int]:
        """Free-queue ids, next to be allocated first (O(num_free); for tests and debugging)."""
        return [b.block_id for b in self._free]

    # ---- internals ---------------------------------------------------------------------------------
    def _drop_hash(self, block: KVBlock) -> None:
        if block.block_hash is None:
            return
        assert self._index.get(block.block_hash) is block, f"block {block.block_id} hash not indexed to itself"
        del self._index[block.block_hash]
        block.block_hash = None
        block.tenant = None
        self.stats.evictions += 1

    def _owns(self, block: KVBlock) -> bool:
        return 0 <= block.block_id < self.num_blocks and self.blocks[block.block_id] is block

    def _check_owned(self, block: KVBlock) -> None:
        if not self._owns(block):
            raise ValueError(f"{block!r} does not belong to this pool")

    def check_integrity(self) -> None:
        """O(num_blocks) audit of every invariant; RuntimeError with a precise message on the first break.

        Checks: ids match positions; the null block is idle (ref 0, no hash, unlinked); the free queue's
        links are consistent both ways with the right length; every other block is either in use
        (ref > 0, unlinked) or free (ref == 0, queued exactly once); the index maps each hash to a block
        of this pool carrying that hash, and every hashed block is indexed (so no hash is on two blocks);
        num_free + num_used == num_blocks - 1.
        """
        for i, block in enumerate(self.blocks):
            if block.block_id != i:
                raise RuntimeError(f"blocks[{i}] has block_id {block.block_id}")
        null = self.null_block
        if null.ref_cnt != 0 or null.block_hash is not None or null.prev_free is not None or null.next_free is not None:
            raise RuntimeError(f"null block is not idle: ref_cnt={null.ref_cnt} hash={null.block_hash!r} or linked")
        self._free.check_integrity()
        queued: set[int] = set()
        for block in self._free:
            if block.is_null or not self._owns(block):
                raise RuntimeError(f"free queue holds {block!r}, which is the null block or not from this pool")
            if block.block_id in queued:
                raise RuntimeError(f"block {block.block_id} is in the free queue twice")
            queued.add(block.block_id)
        n_zero = 0
        for block in self.blocks[1:]:
            if block.ref_cnt < 0:
                raise RuntimeError(f"block {block.block_id} has negative ref_cnt {block.ref_cnt}")
            if block.ref_cnt == 0:
                n_zero += 1
                if block.block_id not in queued:
                    raise RuntimeError(f"block {block.block_id} has ref_cnt 0 but is not in the free queue (leak)")
            elif block.block_id in queued or block.prev_free is not None or block.next_free is not None:
                raise RuntimeError(
                    f"block {block.block_id} has ref_cnt {block.ref_cnt} but is linked in the free queue"
                )
        if n_zero != len(self._free):
            raise RuntimeError(f"free queue length {len(self._free)} != {n_zero} blocks with ref_cnt 0")
        n_used = sum(1 for b in self.blocks[1:] if b.ref_cnt > 0)
        if self.num_free + n_used != self.num_usable:
            raise RuntimeError(f"num_free {self.num_free} + {n_used} blocks in use != usable {self.num_usable}")
        for h, block in self._index.items():
            if not self._owns(block):
                raise RuntimeError(f"hash index entry {h!r} maps to a block not in this pool")
            if block.block_hash != h:
                raise RuntimeError(
                    f"hash index maps {h!r} to block {block.block_id}, which carries {block.block_hash!r}"
                )
        hashed = [b for b in self.blocks if b.block_hash is not None]
        for block in self.blocks:
            if block.block_hash is None and block.tenant is not None:
                raise RuntimeError(f"block {block.block_id} is not cached but carries a tenant tag")
        for block in hashed:
            if self._index.get(block.block_hash) is not block:
                raise RuntimeError(
                    f"block {block.block_id} carries {block.block_hash!r} but the index does not map it there"
                )
        if len(hashed) != len(self._index):
            raise RuntimeError(f"{len(hashed)} hashed blocks but {len(self._index)} index entries")
        if not self.enable_caching and self._index:
            raise RuntimeError(f"caching is disabled but the index holds {len(self._index)} entries")
