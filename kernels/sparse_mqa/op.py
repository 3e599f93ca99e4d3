"""Sparse MQA attention over the packed paged pool, decode form: one query token per sequence, whole batch.

    out[b, h] = softmax-with-sink over { window slots of row b } + { selected global entries of row b }
                of (scale * q[b, h] . K) applied to V = K      (math: ``sparse_mqa/reference.py``)

Inputs (B sequences, H heads, latent width D; the real model: H = 64, D = 512, W = 128, K <= 512):

    q            [B, H, D]        fp32 or bf16, already rotated (RoPE on the last channels)
    sel_idx      [B, K] int32     global entry ids of the row's KV source, -1 = padding
    sel_count    [B] int32        ids beyond the count are ignored
    pool         [N, E, D/2+D/16] uint8, one stream's main-KV records (``GlobalKVPool.streams[s][0]``):
                                  e2m1 codes (even element in the low nibble) then e4m3 scales per 16
    block_table  [B, max_blocks] int32: entry j of row b is pool[block_table[b, j // E], j % E]
    window       [B, W, D+D/32]   uint8, one layer's ring per row: e4m3 codes then ue8m0 scales per 32
    win_start    [B] int32        slot of the oldest visible window key
    win_count    [B] int32        visible slots: win_start, win_start + 1, ... (mod W), count <= W
    sink         [H] fp32         per-head attention sink logit
    scale        float            softmax scale (512 ** -0.5 in the model)

Returns ``[B, H, D]`` in q's dtype (or writes ``out``). Dispatch: ``impl="auto"`` runs the Triton kernel
on CUDA tensors and the reference on CPU; ``"reference"`` / ``"triton"`` force one (Triton on CPU needs
TRITON_INTERPRET=1). The Triton path needs D a power of two; the reference also takes fp64 q (the
oracle's float64 mode) and any D % 32 == 0.

Failure: shapes, dtypes, devices, strides and the scale are checked here (``ValueError`` naming the
argument). Index values are not checked on the Triton path (that would need a host sync): there an id
or block id out of range reads as an absent key; the reference raises ``ValueError`` for them.
"""

from __future__ import annotations

import math
from functools import partial

import torch

from flashtier.kernels.quant.common import check_tensor, resolve_impl
from flashtier.kernels.sparse_mqa.kernel import SparseMQAConfig, sparse_mqa_decode_triton
from flashtier.kernels.sparse_mqa.reference import sparse_mqa_decode_reference

__all__ = ["SparseMQAConfig", "sparse_mqa_decode"]

_OP = "sparse_mqa_decode"
# Measured on one H200 (docs/perf/sparse_mqa.json). Fixed per geometry, never per batch size: a row's
# reduction order (split-K chunks, tile order) must not depend on which batch it runs in.
DEFAULT_CONFIG = SparseMQAConfig()


_check_tensor = partial(check_tensor, op=_OP)


def _validate(q, sel_idx, sel_count, pool, block_table, window, win_start, win_count, sink, scale, out, impl):
    _check_tensor(q, "q", (torch.float32, torch.bfloat16, torch.float64), (None, None, None))
    b, h, d = q.shape
    if h < 1 or d < 32 or d % 32:
        raise ValueError(f"{_OP}: q must be [B, H, D] with H >= 1 and D a positive multiple of 32, got {tuple(q.shape)}")
    i32 = (torch.int32,)
    _check_tensor(sel_idx, "sel_idx", i32, (b, None))
    _check_tensor(sel_count, "sel_count", i32, (b,))
    _check_tensor(pool, "pool", (torch.uint8,), (None, None, d // 2 + d // 16))
    if pool.shape[0] < 1 or pool.shape[1] < 1:
        raise ValueError(f"{_OP}: pool must hold at least one block of at least one entry, got {tuple(pool.shape)}")
    _check_tensor(block_table, "block_table", i32, (b, None))
    _check_tensor(window, "window", (torch.uint8,), (b, None, d + d // 32))
    if window.shape[1] < 1:
        raise ValueError(f"{_OP}: window must have at least one slot per row, got {tuple(window.shape)}")
    _check_tensor(win_start, "win_start", i32, (b,))
    _check_tensor(win_count, "win_count", i32, (b,))
    _check_tensor(sink, "sink", (torch.float32,), (h,))
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"{_OP}: scale must be a positive finite number, got {scale!r}")
    named = {"sel_idx": sel_idx, "sel_count": sel_count, "pool": pool, "block_table": block_table,
             "window": window, "win_start": win_start, "win_count": win_count, "sink": sink}
    for name, t in named.items():
        if t.device != q.device:
            raise ValueError(f"{_OP}: {name} is on {t.device}, q on {q.device}: all inputs must be on one device")
    # The kernel walks records byte by byte from a per-entry base address: only the inner axis must be dense.
    for name, t in (("pool", pool), ("window", window)):
        if t.stride(2) != 1:
            raise ValueError(f"{_OP}: {name} must be dense in its last (byte) axis, got strides {t.stride()}")
    if out is not None:
        _check_tensor(out, "out", (q.dtype,), (b, h, d))
        if out.device != q.device or out.stride(2) != 1:
            raise ValueError(f"{_OP}: out must be on q's device and dense in its last axis")
    impl = resolve_impl(impl, q, _OP)
    if impl == "triton":
        if q.dtype == torch.float64:
            raise ValueError(f"{_OP}: the Triton path takes fp32 or bf16 q; fp64 runs with impl='reference'")
        if d & (d - 1):
            raise ValueError(f"{_OP}: the Triton path needs D a power of two, got D={d}; use impl='reference'")
    return impl


def sparse_mqa_decode(
    q: torch.Tensor,
    sel_idx: torch.Tensor,
    sel_count: torch.Tensor,
    pool: torch.Tensor,
    block_table: torch.Tensor,
    window: torch.Tensor,
    win_start: torch.Tensor,
    win_count: torch.Tensor,
    sink: torch.Tensor,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    impl: str = "auto",
    config: SparseMQAConfig | None = None,
) -> torch.Tensor:
    """Decode attention of ``q [B, H, D]`` over each row's selected global entries and window slots.

    See the module docstring for the layout of every argument. ``out`` (optional, q's dtype) is written
    in place; ``config`` overrides the Triton launch shape (benchmarks only: keep it fixed per geometry).

    Example (real geometry, one sequence with 512 selected entries and a full window)::

        # q [1, 64, 512] bf16; idx [1, 512] int32; counts, starts int32 [1]; rings [1, L, 128, 528] uint8
        o = sparse_mqa_decode(q, idx, n_sel, kv_pool.streams[3][0], table, rings[:, layer],
                              w_start, n_win, attn.attn_sink, 512 ** -0.5)
    """
    impl = _validate(q, sel_idx, sel_count, pool, block_table, window, win_start, win_count, sink, scale, out, impl)
    if impl == "reference":
        o = sparse_mqa_decode_reference(
            q, sel_idx, sel_count, pool, block_table, window, win_start, win_count, sink, scale
        )
        if out is None:
            return o
        return out.copy_(o)
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    # q's last axis is read with stride 2 (even / odd channels): make it dense if it is not.
    q = q if q.stride(2) == 1 else q.contiguous()
    return sparse_mqa_decode_triton(
        q, sel_idx, sel_count, pool, block_table, window, win_start, win_count, sink, float(scale), out,
        config or DEFAULT_CONFIG,
    )
