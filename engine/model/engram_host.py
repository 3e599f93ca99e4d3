"""Engram tables in host memory: each step's rows gathered on the host and copied to the device ahead of use.

The V4.1 tables are 2 x ~98 GB (e4m3 rows ``[R, 256]`` + one e8m0 scale per 1x32, ``[R, 8]``; model.md §3.7).
On a GPU they stay in host memory, pinned so the copies are DMA, in that stored form; a step moves only the
rows its tokens select (T tokens x 24 hashes x 264 B per layer)::

    host          rows = Engram.rows(classes)                  [T, H] int64, hashed on the CPU
                  staging[s] <- table[rows]                    index_select into pinned memory
    side stream   wait consumed[s]; buffer[s] <- staging[s]    non_blocking H2D; record copied[s]
    consumer      wait copied[s]; e = dequant(buffer[s])       Engram.forward; record consumed[s]

Each layer has two slots (s alternates per gather), so a step's host gather fills one slot while the
previous step's copy out of the other may still be in flight. Reuse rules:

- ``staging[s]`` is rewritten by the host only once ``copied[s]`` of its previous use has completed (the
  host waits on that event; it was recorded a gather earlier, so normally it is long done);
- ``buffer[s]`` is rewritten by the side stream only after ``consumed[s]`` of its previous use: a
  device-side wait, no host sync;
- so at most two gathers per layer may be outstanding: issuing a third reissues the oldest slot, and its
  handle becomes stale (finishing it raises RuntimeError). A handle is finished at most once.

``prefetch`` issues every Engram layer's gather of a step before the first layer runs (paged_forward); an
Engram layer whose rows were not prefetched gathers on demand (a host sync when its ids are on the device).
On the CPU the same path runs synchronously in plain memory, without streams or events, and gives the
numbers the table parameter gives: the stored codes dequantise exactly to the snapped weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashtier.engine.model.engram_table import ROW_BLOCK, HostTable
from flashtier.kernels.quant.common import FLOAT_DTYPES
from flashtier.kernels.quant.fp8_weight import dequantize_fp8_weight

DEFAULT_TOKENS = 512  # staging rows per slot = tokens x hashes (EngineConfig's default token budget)


def _empty(shape: tuple[int, ...], dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """Staging memory: torch's pinned (caching host) allocator, fine for buffers of a few MB."""
    return torch.empty(shape, dtype=dtype, pin_memory=pin)


def _host_select(table: torch.Tensor, rows: torch.Tensor, out: torch.Tensor) -> None:
    """``out[i] = table[rows[i]]`` on the host, written in place (``out`` is a staging slice)."""
    torch.index_select(table, 0, rows, out=out)


class _Slot:
    """One layer's staging (host) and buffer (device) pair with its two events (module docstring)."""

    def __init__(self, cuda: bool):
        self.capacity = 0
        self.gen = 0  # bumped per issue: a handle is current while its gen matches
        self.staging: tuple[torch.Tensor, torch.Tensor | None] | None = None
        self.buffer: tuple[torch.Tensor, torch.Tensor | None] | None = None
        self.copied = torch.cuda.Event() if cuda else None
        self.consumed = torch.cuda.Event() if cuda else None


@dataclass(eq=False)
class EngramCopy:
    """One issued gather: ``shape`` = rows' [T, H] of ``layer``, on their way into ``slot`` (``finish`` them)."""

    layer: int
    shape: tuple[int, int]
    slot: _Slot
    gen: int
    done: bool = False

    @property
    def copied(self) -> torch.cuda.Event | None:
        """The event the consumer waits on (recorded on the side stream after the copy; None on the CPU)."""
        return self.slot.copied


class HostEngramTables:
    """The Engram tables of a model in host memory and the machinery that brings a step's rows to ``device``.

    ``tables``: Engram layer -> its ``HostTable``; ``n_hashes``: H, the rows per token; ``dtype``: what the
    rows are dequantised to (the Engram's former parameter dtype). Staging holds ``max_tokens`` x H rows per
    slot up front and grows when a gather needs more (growing waits for the slot's last copy and reader).
    Shared, not copied, by ``copy.deepcopy`` (the tables are read-only; two models may use them in turn).
    ``model.double()`` leaves ``dtype`` as it is: the rows are exact in any float dtype and ``linear`` casts
    its input to the weight's.
    """

    def __init__(self, tables: dict[int, HostTable], *, n_hashes: int, device: torch.device | str,
                 dtype: torch.dtype, max_tokens: int = DEFAULT_TOKENS):
        if not tables:
            raise ValueError("tables must hold at least one Engram layer")
        if n_hashes < 1:
            raise ValueError(f"n_hashes must be >= 1, got {n_hashes}")
        if dtype not in (*FLOAT_DTYPES, torch.float64):
            raise ValueError(f"dtype must be a float dtype, got {dtype}")
        self.tables = dict(tables)
        self.n_hashes, self.dtype = n_hashes, dtype
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.side_stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._slots = {layer: (_Slot(self.cuda), _Slot(self.cuda)) for layer in self.tables}
        self._turn = dict.fromkeys(self.tables, 0)
        self._pending: tuple[torch.Tensor, dict[int, EngramCopy]] | None = None
        self._map: tuple[torch.Tensor, torch.Tensor] | None = None  # (model's token map, its host copy)
        self.prefetched = self.on_demand = 0  # how the rows reached the Engram layers (tests, metrics)
        # layer -> device rows [T, H, hd] that take() returns as they are: set by a CUDA-graph runner around its
        # warm-up and capture (engine/runner/decode_graphs.py fills them before each replay); None otherwise
        self.feed: dict[int, torch.Tensor] | None = None
        self.reserve(max_tokens)

    def __deepcopy__(self, memo):
        return self

    @property
    def nbytes(self) -> int:
        """Host bytes of the tables."""
        return sum(t.nbytes for t in self.tables.values())

    @property
    def device_nbytes(self) -> int:
        """Device bytes of the copy buffers (what the tables cost in device memory)."""
        if not self.cuda:
            return 0
        return sum(sum(b.nbytes for b in s.buffer if b is not None) for pair in self._slots.values() for s in pair)

    def reserve(self, tokens: int) -> None:
        """Size every slot for ``tokens`` x H rows (never shrinks). May wait for in-flight copies (see _fit)."""
        if tokens < 0:
            raise ValueError(f"tokens must be >= 0, got {tokens}")
        for layer, pair in self._slots.items():
            for slot in pair:
                self._fit(layer, slot, tokens * self.n_hashes)

    def _fit(self, layer: int, slot: _Slot, n: int) -> None:
        if n <= slot.capacity and slot.staging is not None:
            return
        if self.cuda:  # the old staging may still be copied from and the old buffer still read
            slot.copied.synchronize()
            slot.consumed.synchronize()
        cap = max(n, 2 * slot.capacity)
        table = self.tables[layer]
        shapes = [(cap, *table.data.shape[1:])] + ([] if table.scale is None else [(cap, *table.scale.shape[1:])])
        dts = [table.data.dtype, torch.uint8]
        staged = [_empty(s, d, self.cuda) for s, d in zip(shapes, dts)]
        bufs = [torch.empty(s, dtype=d, device=self.device) for s, d in zip(shapes, dts)]
        slot.staging = (staged[0], staged[1] if len(staged) > 1 else None)
        slot.buffer = (bufs[0], bufs[1] if len(bufs) > 1 else None)
        slot.capacity = cap
        slot.gen += 1  # handles into the old buffers are stale

    def issue(self, layer: int, rows: torch.Tensor) -> EngramCopy:
        """Start bringing ``rows [T, H]`` (int64 table rows; on the device: one host sync to read them) of
        ``layer`` to the device: host gather into the next slot's staging, then its copy on the side stream.

        Mutates that slot (its older handle goes stale). Raises ValueError on an unknown layer, a wrong
        shape or a row outside the table."""
        if layer not in self.tables:
            raise ValueError(f"layer {layer} holds no host Engram table (layers {sorted(self.tables)})")
        if rows.dim() != 2 or rows.shape[1] != self.n_hashes or rows.dtype != torch.long:
            raise ValueError(f"rows must be int64 [T, {self.n_hashes}], got {rows.dtype} {tuple(rows.shape)}")
        table = self.tables[layer]
        flat = rows.reshape(-1).cpu()
        n = flat.numel()
        if n and (int(flat.min()) < 0 or int(flat.max()) >= table.num_rows):
            raise ValueError(f"rows must lie in [0, {table.num_rows}) for layer {layer}, got "
                             f"[{int(flat.min())}, {int(flat.max())}]")
        slot = self._slots[layer][self._turn[layer]]
        self._turn[layer] ^= 1
        self._fit(layer, slot, n)
        if self.cuda:
            slot.copied.synchronize()  # the staging's previous copy has left it
        parts = [(table.data, slot.staging[0], slot.buffer[0])]
        if table.scale is not None:
            parts.append((table.scale, slot.staging[1], slot.buffer[1]))
        for src, staged, _ in parts:
            _host_select(src, flat, staged[:n])
        slot.gen += 1
        if self.cuda:
            with torch.cuda.stream(self.side_stream):
                self.side_stream.wait_event(slot.consumed)  # the buffer's previous reader is done
                for _, staged, buf in parts:
                    buf[:n].copy_(staged[:n], non_blocking=True)
                slot.copied.record(self.side_stream)
        else:
            for _, staged, buf in parts:
                buf[:n].copy_(staged[:n])
        return EngramCopy(layer, (rows.shape[0], rows.shape[1]), slot, slot.gen)

    def finish(self, handle: EngramCopy) -> torch.Tensor:
        """The rows of ``handle`` as ``[T, H, hd]`` in ``dtype`` on the device, a fresh tensor: the current stream
        waits for the copy (on the device, no host sync) and releases the slot's buffer after reading it.

        Raises RuntimeError when the handle was finished already or its slot was reissued since."""
        slot = handle.slot
        if handle.done or handle.gen != slot.gen:
            raise RuntimeError(f"Engram layer {handle.layer}: this gather was consumed already or its slot was "
                               f"reused (at most two gathers per layer may be outstanding)")
        handle.done = True
        t, h = handle.shape
        n = t * h
        table = self.tables[handle.layer]
        stream = torch.cuda.current_stream(self.device) if self.cuda else None
        if stream is not None:
            stream.wait_event(slot.copied)
        data = slot.buffer[0][:n]
        if table.scale is None:
            out = data.to(self.dtype, copy=True)
        else:
            out_dtype = self.dtype if self.dtype in FLOAT_DTYPES else torch.float32  # float64: exact widening
            out = dequantize_fp8_weight(data, slot.buffer[1][:n], block=ROW_BLOCK, dtype=out_dtype).to(self.dtype)
        if stream is not None:
            slot.consumed.record(stream)
        return out.reshape(t, h, table.data.shape[1])

    def gather(self, layer: int, rows: torch.Tensor) -> torch.Tensor:
        """``finish(issue(layer, rows))``: the rows ``[T, H, hd]`` on the device (see both)."""
        return self.finish(self.issue(layer, rows))

    def prefetch(self, key: torch.Tensor, rows: dict[int, torch.Tensor]) -> None:
        """Issue every layer's gather of ``rows`` (layer -> host rows [T, H]) now; ``take(layer, ids)`` returns
        them when called with ``ids is key`` (the step's n-gram ids tensor). Replaces an earlier prefetch."""
        self._pending = (key, {layer: self.issue(layer, r) for layer, r in rows.items()})

    def take(self, layer: int, ngram_ids: torch.Tensor, hash_rows) -> torch.Tensor:
        """The rows of ``layer`` for ``ngram_ids [T, N]``: the prefetched copy when ``ngram_ids`` is the prefetch's
        key, else gathered now from ``hash_rows(ids on the host)`` (a host sync when ``ngram_ids`` is on the
        device). With ``feed`` set, returns ``feed[layer]`` (no copy, no wait)."""
        if self.feed is not None:
            return self.feed[layer]
        if self._pending is not None and self._pending[0] is ngram_ids and layer in self._pending[1]:
            handle = self._pending[1].pop(layer)
            if not self._pending[1]:
                self._pending = None
            self.prefetched += 1
            return self.finish(handle)
        self.on_demand += 1
        return self.gather(layer, hash_rows(ngram_ids.cpu()))

    def host_classes(self, token_map: torch.Tensor, pad_token: int, tokens: torch.Tensor) -> torch.Tensor:
        """Engram classes ``[T, n]`` of host token ids (-1 before position 0: the pad class), as
        ``paged_forward.ngram_classes`` computes them on the device. Copies ``token_map`` to the host once
        per map (a new map installed with ``set_token_map`` is a new tensor)."""
        if self._map is None or self._map[0] is not token_map:
            self._map = (token_map, token_map.cpu())
        host_map = self._map[1]
        return torch.where(tokens >= 0, host_map[tokens.clamp(min=0)], host_map[pad_token])
