"""A decoding sequence that the engine believes holds N tokens of context, built without prefilling them.

Long-context decode benchmarks need sequences with 128K-1M tokens of KV, and a prefill of that many tokens costs
minutes per sequence. ``SyntheticContext.extend`` takes a request that the engine prefilled from a short real
prompt and that has just produced its first token (DECODE, one choice, one output token) and grows its state to
``context`` tokens, as if the prompt had been that long::

    positions  0 ........ n0 ............................................ context-W ....... context
               [real prompt][ filler tokens: random-but-valid global entries   ][ random window records ]
               the next decode step feeds the first output token at position ``context``

Invariants established (``check_context`` verifies each and raises RuntimeError naming the first broken one):

- tokens: ``kv.tokens == req.prompt`` (the real prompt, then filler tokens), ``context`` long;
  ``req.prefilled == context``.
- blocks: the table holds exactly ceil(context / block_size) pool blocks (fresh ones, ref count 1), and every
  full block is hashed and registered in the prefix index, as the postprocessor registers them (``seq.hashes``).
- entries: each KV source of ratio r has ``count == context // r``; entries from the real prompt's count up hold
  FP4 main-KV (288 B) and MXFP4 index-K (68 B) records made by kernels/quant_fp4 and kernels/quant_mxfp4 from
  random vectors, so codes and scales are valid. With ``distinct`` set, each stream draws that many records once
  and every sequence tiles them from its own random offset (bytes move like real ones; ties in the indexer's
  scores are possible and harmless to timing).
- ratio-2 groups: a source's partial group is open (random kv and score, position ``context - 1``) iff
  ``context`` is odd.
- window: every layer's ring holds FP8 records (kernels/quant_fp8 of random vectors) for positions
  ``[max(0, context - W), context)`` at slot ``p % W``; the other slots are empty (-1).
- truncations: ``enc_start == write_from == 0`` (an exact, cold state) and ``dec_start == max(0, context - W)``
  (where the decoder replay of a ``context``-token prompt starts).

Not synthesised: the replay tail (``tail_x`` / ``tail_pre``) keeps the real prompt's encoder outputs, because only
a REPLAY work and snapshots read it and a decoding sequence runs neither. No candidate-pool state is carried
between steps (layer 20 rebuilds the pool from its scores every step), so there is none to set.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from flashtier.engine.engine import Engine
from flashtier.engine.model.compressor import PartialGroup
from flashtier.engine.model.numerics import up
from flashtier.engine.core.request import Request
from flashtier.engine.core.request_state import RequestStatus
from flashtier.kernels.quant.fp4 import pack_fp4_record, quantize_fp4
from flashtier.kernels.quant.fp8 import pack_fp8_record, quantize_fp8
from flashtier.kernels.quant.mxfp4 import pack_mxfp4_record, quantize_mxfp4


def _fp4(raw: torch.Tensor) -> torch.Tensor:
    return pack_fp4_record(*quantize_fp4(raw))


def _mxfp4(raw: torch.Tensor) -> torch.Tensor:
    return pack_mxfp4_record(*quantize_mxfp4(raw))


class SyntheticContext:
    """Grows decoding requests of one engine to long contexts (module docstring). Draws every random value from
    one CPU generator seeded by ``seed``, so two engines extended in the same order hold the same bytes."""

    def __init__(self, engine: Engine, *, seed: int = 0, distinct: int | None = None,
                 filler: list[int] | None = None):
        """``distinct``: records drawn per stream and tiled (None: every entry drawn, O(entries) random draws on
        the host: for tests). ``filler``: the token ids appended after the real prompts (None: random ids)."""
        if distinct is not None and (isinstance(distinct, bool) or not isinstance(distinct, int) or distinct < 1):
            raise ValueError(f"distinct must be None or a positive int, got {distinct!r}")
        self.engine, self.distinct = engine, distinct
        self.gen = torch.Generator().manual_seed(seed)
        self.filler, self._given = filler, filler is not None
        self._tiles: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def _filler(self, n: int) -> list[int]:
        if self._given and len(self.filler) < n:
            raise ValueError(f"filler holds {len(self.filler)} tokens, {n} needed")
        if self.filler is None or len(self.filler) < n:
            vocab = self.engine.model.cfg.vocab_size
            self.filler = torch.randint(3, vocab - 1, (n,), generator=self.gen).tolist()
        return self.filler[:n]

    def _randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen).to(self.engine.kvm.spec.device)

    def extend(self, request_id: str, context: int) -> None:
        """Grow request ``request_id`` to ``context`` tokens of context (module docstring).

        Mutates the request (prompt, prefilled), its sequence's KV state and hashes, and the pool (blocks
        allocated, entry bytes written, blocks registered). Failure: ValueError for a request that is not a
        one-choice decode right after its first token, or a ``context`` not above its length; RuntimeError when
        the pool lacks the blocks (nothing is changed then).
        """
        req = _decoding(self.engine, request_id)
        seq = req.seqs[0]
        kv, kvm = seq.kv, self.engine.kvm
        n0 = len(kv.tokens)
        if isinstance(context, bool) or not isinstance(context, int) or context <= n0:
            raise ValueError(f"context must be an int above the request's {n0} tokens, got {context!r}")
        filler = self._filler(context - n0)
        if not kvm.ensure_blocks(kv, context):
            need = -(-context // kvm.block_size) - len(kv.table)
            raise RuntimeError(f"the pool has {kvm.num_free} free blocks; {request_id!r} needs {need} more "
                               f"for {context} tokens")
        kv.tokens.extend(filler)
        req.prompt, req.prefilled = list(kv.tokens), context
        self._fill_entries(kv, context)
        self._fill_rings(kv, context)
        spec = kvm.spec
        dtype = up(torch.empty(0, dtype=spec.dtype)).dtype  # the compressor's kv / score precision
        for src in spec.partial_order:
            kv_row, score = self._randn(spec.head_dim).to(dtype), self._randn(spec.head_dim).to(dtype)
            group = PartialGroup(kv_row, score, context - 1)
            kv.partial[src] = group if context % 2 else None
        kv.enc_start = kv.write_from = 0
        kv.dec_start = max(0, context - kv.window)
        # hashed here, as the postprocessor would have hashed them block by block: the first decode step would
        # otherwise hash every block of the context (16K per sequence at 1M) inside a measured engine step
        kvm.cache_full_blocks(seq, req.namespace)

    def _tile(self, stream: int) -> tuple[torch.Tensor, torch.Tensor]:
        if stream not in self._tiles:
            spec = self.engine.kvm.spec
            self._tiles[stream] = (_fp4(self._randn(self.distinct, spec.head_dim)),
                                   _mxfp4(self._randn(self.distinct, spec.index_head_dim)))
        return self._tiles[stream]

    def _fill_entries(self, kv, context: int) -> None:
        kvm = self.engine.kvm
        spec, dev = kvm.spec, kvm.spec.device
        table = kv.table.tensor()
        for stream, src in enumerate(spec.source_layer_ids):
            store = kv.stores[src]
            first, end = store.count, context // store.ratio
            j = torch.arange(first, end, device=dev)
            if self.distinct is None:
                main = _fp4(self._randn(end - first, spec.head_dim))
                index = _mxfp4(self._randn(end - first, spec.index_head_dim))
            else:
                tile_main, tile_index = self._tile(stream)
                at = (j + int(torch.randint(self.distinct, (1,), generator=self.gen))) % self.distinct
                main, index = tile_main[at], tile_index[at]
            kvm.kv.write(stream, table[j // store.per_block], j % store.per_block, main, index)
            store.count = end

    def _fill_rings(self, kv, context: int) -> None:
        rings = kv.rings
        w = rings.window
        pos = torch.arange(max(0, context - w), context, device=rings.pos.device)
        records = pack_fp8_record(*quantize_fp8(self._randn(rings.data.shape[0], pos.numel(), rings.head_dim)))
        rings.pos.fill_(-1)
        rings.data[:, pos % w] = records
        rings.pos[:, pos % w] = pos


def _decoding(engine: Engine, request_id: str) -> Request:
    req = engine.requests.get(request_id)
    if req is None:
        raise ValueError(f"request_id {request_id!r} is not a running request of this engine")
    if req.status is not RequestStatus.DECODE or len(req.seqs) != 1 or len(req.seqs[0].output) != 1:
        raise ValueError(f"request_id {request_id!r} must be decoding one choice right after its first token "
                         f"(status {req.status.name}, {len(req.seqs)} choices)")
    if req.seqs[0].spec is not None:
        raise ValueError(f"request_id {request_id!r} carries drafter state: speculative engines are not supported")
    return req


def check_context(engine: Engine, contexts: Mapping[str, int], *, check_bytes: bool = True) -> None:
    """Verify the invariants ``SyntheticContext.extend`` establishes (module docstring) for every request id ->
    context of ``contexts``, then the engine's own ``check_integrity`` once. ``check_bytes``: also read every entry
    below each count and require non-zero scale bytes (a written record; the pool starts zeroed).
    Mutates nothing; RuntimeError names the first failure (ValueError for a request that is not decoding)."""
    for request_id, context in contexts.items():
        _check_one(engine, request_id, context, check_bytes)
    engine.check_integrity()


def _check_one(engine: Engine, request_id: str, context: int, check_bytes: bool) -> None:
    req = _decoding(engine, request_id)
    seq = req.seqs[0]
    kv, kvm = seq.kv, engine.kvm
    bs, w = kvm.block_size, kv.window

    def need(ok: bool, what: str) -> None:
        if not ok:
            raise RuntimeError(f"synthetic context of {request_id!r} ({context} tokens): {what}")

    need(len(kv.tokens) == context and kv.tokens == req.prompt, f"{len(kv.tokens)} tokens, not the prompt's "
         f"{len(req.prompt)}")
    need(req.prefilled == context, f"prefilled {req.prefilled}")
    need(len(kv.table) == -(-context // bs), f"{len(kv.table)} blocks in the table")
    need(len(seq.hashes) == context // bs, f"{len(seq.hashes)} full blocks registered")
    need(kv.enc_start == 0 and kv.write_from == 0 and kv.dec_start == max(0, context - w),
         f"truncations enc_start {kv.enc_start}, write_from {kv.write_from}, dec_start {kv.dec_start}")
    for src, store in kv.stores.items():
        stream = store.stream
        need(store.count == context // store.ratio, f"source {src} has {store.count} entries, "
             f"{context // store.ratio} expected at ratio {store.ratio}")
        if check_bytes:
            j = torch.arange(store.count, device=kvm.spec.device)
            blocks, offs = kv.table.tensor()[j // store.per_block], j % store.per_block
            main, index = kvm.kv.read_main(stream, blocks, offs), kvm.kv.read_index(stream, blocks, offs)
            scales = (main[:, store.head_dim // 2 :], index[:, store.index_dim // 2 :])
            need(all(bool(s.ne(0).any(-1).all()) for s in scales), f"source {src} has an unwritten entry below "
                 f"its count")
    for src, group in kv.partial.items():
        want = context - 1 if context % 2 else None
        need((group.position if group is not None else None) == want, f"source {src} partial group "
             f"{None if group is None else group.position}, expected {want}")
    pos = torch.arange(max(0, context - w), context, device=kv.rings.pos.device)
    expect = torch.full((w,), -1, dtype=torch.long, device=pos.device)
    expect[pos % w] = pos
    need(bool((kv.rings.pos == expect).all()), "window ring positions differ from [context - W, context)")
