"""Sparse MQA decode attention in Triton: one launch over the whole batch, FP4/FP8 decoded in registers.

Grid ``(cdiv(H, BLOCK_H), n_splits, B)``: the head groups of one (row, chunk) are neighbours, so the
records they all decode come from HBM once and from L2 after. A program owns BLOCK_H heads of one row
and one chunk of that row's keys, in a fixed row-local order: the ``sel_count`` global entries, then the
``win_count`` window slots. Per tile of BLOCK_N keys it gathers the packed records, decodes them to bf16
(exact: an e2m1 x e4m3 product has at most 6 significant bits, an e4m3 x 2^k value 4) and runs an online
softmax in the log2 domain, both matmuls on the tensor cores with fp32 accumulation. Nothing dequantised
is written to memory. The tile loops are software-pipelined by hand (ids, block ids and record bytes
are fetched one or two tiles ahead): without it every tile waited on three dependent loads.

Even / odd split: a FP4 byte holds elements 2j (low nibble) and 2j + 1 (high nibble), so the kernel works
on the even and odd channels as two D/2-wide halves (q loaded, o stored with stride 2) instead of
interleaving nibbles in registers: q.k = q_even.k_even + q_odd.k_odd.

Split-K (``CHUNK`` > 0): chunk c covers the row's keys [c * CHUNK, (c + 1) * CHUNK); each writes its
unnormalised (m, l, o) to an fp32 workspace and ``_combine_kernel`` folds them with the sink in chunk
order. Chunk boundaries depend only on the row's own counts, so a row's result never depends on the
batch it is in (batch invariance) -- as long as the config is chosen from the geometry, not from B.

Precision: bf16 q -> bf16 operands, p rounded to bf16 for P @ V (and l summed from the rounded p). fp32 q
(``PRECISE``) -> q and p each split into bf16 high + low parts (two MMAs each), ~16 significant bits.
Under TRITON_INTERPRET=1 the MMAs run in fp32 on the same (exactly representable) bf16 values.

Failure: ids or block ids out of range are read as absent keys (memory-safe; the reference raises).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from flashtier.kernels.quant.fp8_bits import _f32_to_bf16_rne

LOG2E = 1.4426950408889634
_LOG2E_K = tl.constexpr(LOG2E)  # compiled kernels only read constexpr globals
_COMBINE_HEADS = 4


@dataclass(frozen=True)
class SparseMQAConfig:
    """Launch shape. Pick it from the geometry (H, D, dtype) only: B must not change a row's result.

    The defaults are the fastest measured on an H200 at B >= 17 (docs/perf/sparse_mqa.json): one pass per
    (sequence, 16 heads), 32-key tiles. Split-K (chunk > 0) writes fp32 partials (128 KB per chunk and
    row at 64 x 512) and cost +60% at B = 64.
    """

    block_h: int = 16  # heads per program (MMA M; >= 16)
    block_n: int = 32  # keys per tile (MMA N / K; >= 16)
    chunk: int = 0  # keys per split; 0 = one pass per (sequence, head group), no workspace
    num_warps: int = 4
    num_stages: int = 1  # the loops are pipelined by hand; Triton's pipeliner added nothing measurable


@triton.jit
def _f16_bits(bits):
    """fp32 value of int32 fp16 bit patterns (exact; fp16 subnormals included)."""
    return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _dot(a, b, acc, INTERPRET: tl.constexpr):
    # The CPU interpreter has no bf16 matmul: run it in fp32 on the same values (bf16 -> fp32 is exact).
    if INTERPRET:
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _bf16(x, INTERPRET: tl.constexpr):
    """Round fp32 to bf16 to nearest even (the interpreter's own cast truncates, which biases p down)."""
    if INTERPRET:
        y = _f32_to_bf16_rne(x)
    else:
        y = x.to(tl.bfloat16)
    return y


@triton.jit
def _spread(s, GROUP: tl.constexpr):
    """[N, G] per-block scales -> [N, G * GROUP]: each scale repeated over its GROUP consecutive columns."""
    n: tl.constexpr = s.shape[0]
    g: tl.constexpr = s.shape[1]
    return tl.reshape(tl.broadcast_to(s[:, :, None], (n, g, GROUP)), (n, g * GROUP))


@triton.jit
def _load_ids(idx_row, t, lim):
    """Entry ids at row positions ``t [N]`` (those >= ``lim`` or < 0 are absent): (ids, valid)."""
    valid = t < lim
    ent = tl.load(idx_row + t, mask=valid, other=-1)
    return ent, valid & (ent >= 0)


@triton.jit
def _load_blocks(tab_row, ent, valid, E, MAX_BLOCKS, N_BLOCKS):
    """Pool block of each entry through the row's block table; ids or block ids out of range are absent."""
    logical = tl.maximum(ent, 0) // E
    valid = valid & (logical < MAX_BLOCKS)
    blk = tl.load(tab_row + logical, mask=valid, other=0)
    return blk, valid & (blk >= 0) & (blk < N_BLOCKS)


@triton.jit
def _fp4_load(pool_ptr, blk, ent, valid, s_pn, s_pe, E, HALF: tl.constexpr):
    """Raw FP4 records of entries (blk, ent % E): codes ``[N, HALF]`` and scales ``[N, HALF / 8]`` (uint8)."""
    p_rec = pool_ptr + blk.to(tl.int64) * s_pn + (tl.maximum(ent, 0) % E).to(tl.int64) * s_pe
    m2 = valid[:, None]
    byte = tl.load(p_rec[:, None] + tl.arange(0, HALF)[None, :], mask=m2, other=0)
    sc = tl.load(p_rec[:, None] + HALF + tl.arange(0, HALF // 8)[None, :], mask=m2, other=0x38)
    return byte, sc


@triton.jit
def _fp4_decode(byte, sc):
    """FP4 codes + e4m3 scales -> (even, odd) channels bf16 (exact).

    e2m1 nibble -> fp16 bits (magnitude << 9, sign << 15) is the value * 2^-14; the e4m3 scale byte ->
    fp16 bits (magnitude << 7, sign << 15) is the scale * 2^-8; so value = f16(n) * f16(s) * 2^22.
    Elements 2j and 2j+1 share the scale of their block of 16: scale byte j // 8.
    """
    byte = byte.to(tl.int32)
    sc = sc.to(tl.int32)
    s = _spread(_f16_bits(((sc & 0x7F) << 7) | ((sc & 0x80) << 8)) * 4194304.0, 8)
    k_e = (_f16_bits(((byte & 0x7) << 9) | ((byte & 0x8) << 12)) * s).to(tl.bfloat16)
    k_o = (_f16_bits(((byte & 0x70) << 5) | ((byte & 0x80) << 8)) * s).to(tl.bfloat16)
    return k_e, k_o


@triton.jit
def _fp8_load(win_row, s_ws, slot, valid, D: tl.constexpr):
    """Raw FP8 window records of ring ``slot [N]``: codes ``[N, D]`` and ue8m0 scales ``[N, D / 32]`` (uint8)."""
    p_rec = win_row + slot.to(tl.int64) * s_ws
    m2 = valid[:, None]
    codes = tl.load(p_rec[:, None] + tl.arange(0, D)[None, :], mask=m2, other=0)
    sb = tl.load(p_rec[:, None] + D + tl.arange(0, D // 32)[None, :], mask=m2, other=127)
    return codes, sb


@triton.jit
def _fp8_decode(codes, sb, D: tl.constexpr):
    """FP8 codes + ue8m0 scales -> (even, odd) channels bf16 (exact).

    e4m3 byte -> fp16 bits (magnitude << 7, sign << 15) is the value * 2^-8; the ue8m0 scale b is
    2^(b - 127), so value = f16(c) * 2^(b - 119), an fp32 built from the exponent bits (b + 8) << 23.
    """
    codes = codes.to(tl.int32)
    c_e, c_o = tl.split(tl.reshape(codes, (codes.shape[0], D // 2, 2)))
    s = _spread(((sb.to(tl.int32) + 8) << 23).to(tl.float32, bitcast=True), 16)  # element 2j, 2j+1: scale j // 16
    k_e = (_f16_bits(((c_e & 0x7F) << 7) | ((c_e & 0x80) << 8)) * s).to(tl.bfloat16)
    k_o = (_f16_bits(((c_o & 0x7F) << 7) | ((c_o & 0x80) << 8)) * s).to(tl.bfloat16)
    return k_e, k_o


@triton.jit
def _tile_update(
    q_e, q_o, q_e_lo, q_o_lo, k_e, k_o, valid, m_i, l_i, acc_e, acc_o, qk_scale,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, PRECISE: tl.constexpr, INTERPRET: tl.constexpr,
):
    """One online-softmax step over a decoded bf16 key tile (log2 domain; masked keys get -inf)."""
    s = tl.zeros((BLOCK_H, BLOCK_N), tl.float32)
    s = _dot(q_e, tl.trans(k_e), s, INTERPRET)
    s = _dot(q_o, tl.trans(k_o), s, INTERPRET)
    if PRECISE:
        s = _dot(q_e_lo, tl.trans(k_e), s, INTERPRET)
        s = _dot(q_o_lo, tl.trans(k_o), s, INTERPRET)
    s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # a chunk may start at -inf (split mode) and see only masked keys: subtract 0 then, not -inf
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    acc_e = acc_e * alpha[:, None]
    acc_o = acc_o * alpha[:, None]
    p_hi = _bf16(p, INTERPRET)
    acc_e = _dot(p_hi, k_e, acc_e, INTERPRET)
    acc_o = _dot(p_hi, k_o, acc_o, INTERPRET)
    if PRECISE:
        p_lo = _bf16(p - p_hi.to(tl.float32), INTERPRET)
        acc_e = _dot(p_lo, k_e, acc_e, INTERPRET)
        acc_o = _dot(p_lo, k_o, acc_o, INTERPRET)
        l_i = l_i * alpha + tl.sum(p, 1)
    else:
        # normalise by the weights the P @ V product really used: the bf16 rounding of p then
        # perturbs each weight a little but does not scale the whole output
        l_i = l_i * alpha + tl.sum(p_hi.to(tl.float32), 1)
    return m_new, l_i, acc_e, acc_o


@triton.jit
def _row_counts(cnt_ptr, wcnt_ptr, wst_ptr, b, K_CAP, W):
    """Clamped (n_global, n_window, first window slot) of row ``b``: counts out of range cannot read out of bounds."""
    n_g = tl.minimum(tl.maximum(tl.load(cnt_ptr + b), 0), K_CAP)
    n_w = tl.minimum(tl.maximum(tl.load(wcnt_ptr + b), 0), W)
    w0 = ((tl.load(wst_ptr + b) % W) + W) % W
    return n_g, n_w, w0


@triton.jit
def _sparse_mqa_decode_kernel(
    q_ptr, s_qb, s_qh,
    idx_ptr, s_ib, cnt_ptr,
    tab_ptr, s_tb,
    pool_ptr, s_pn, s_pe,
    win_ptr, s_wb, s_ws, wst_ptr, wcnt_ptr,
    sink_ptr, out_ptr, s_ob, s_oh,
    ws_o_ptr, ws_ml_ptr,
    H, K_CAP, E, N_BLOCKS, MAX_BLOCKS, W, N_SPLITS, qk_scale,
    D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr,
    SPLIT: tl.constexpr, PRECISE: tl.constexpr, INTERPRET: tl.constexpr, OUT_BF16: tl.constexpr,
):
    HALF: tl.constexpr = D // 2
    b = tl.program_id(2).to(tl.int64)
    chunk = tl.program_id(1)
    heads = tl.program_id(0) * BLOCK_H + tl.arange(0, BLOCK_H)
    m_h = heads < H
    j = tl.arange(0, HALF)
    p_q = q_ptr + b * s_qb + heads[:, None].to(tl.int64) * s_qh + 2 * j[None, :]
    q_e = tl.load(p_q, mask=m_h[:, None], other=0.0)
    q_o = tl.load(p_q + 1, mask=m_h[:, None], other=0.0)
    if PRECISE:  # fp32 q: a bf16 high part plus a bf16 low part
        q_e_f, q_o_f = q_e, q_o
        q_e = _bf16(q_e_f, INTERPRET)
        q_o = _bf16(q_o_f, INTERPRET)
        q_e_lo = _bf16(q_e_f - q_e.to(tl.float32), INTERPRET)
        q_o_lo = _bf16(q_o_f - q_o.to(tl.float32), INTERPRET)
    else:
        q_e_lo = q_e
        q_o_lo = q_o

    n_g, n_w, w0 = _row_counts(cnt_ptr, wcnt_ptr, wst_ptr, b, K_CAP, W)
    n = n_g + n_w
    acc_e = tl.zeros((BLOCK_H, HALF), tl.float32)
    acc_o = tl.zeros((BLOCK_H, HALF), tl.float32)
    if SPLIT:
        lo = chunk * CHUNK
        hi = tl.minimum(lo + CHUNK, n)
        m_i = tl.full((BLOCK_H,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_H,), tl.float32)
    else:
        lo = 0
        hi = n
        # the sink as a key of value 0 and logit sink: m starts there with l = e^(sink - m) = 1
        m_i = tl.load(sink_ptr + heads, mask=m_h, other=0.0) * _LOG2E_K
        l_i = tl.full((BLOCK_H,), 1.0, tl.float32)

    # Global tiles, software-pipelined by hand so every load has one tile of compute to land in:
    # entry ids two tiles ahead, block ids one tile ahead, record bytes for the next tile.
    T = tl.arange(0, BLOCK_N)
    idx_row = idx_ptr + b * s_ib
    tab_row = tab_ptr + b * s_tb
    g_hi = tl.minimum(hi, n_g)
    ent0, v0 = _load_ids(idx_row, lo + T, g_hi)
    ent1, v1 = _load_ids(idx_row, lo + BLOCK_N + T, g_hi)
    ent2, v2 = _load_ids(idx_row, lo + 2 * BLOCK_N + T, g_hi)
    blk0, v0 = _load_blocks(tab_row, ent0, v0, E, MAX_BLOCKS, N_BLOCKS)
    blk1, v1 = _load_blocks(tab_row, ent1, v1, E, MAX_BLOCKS, N_BLOCKS)
    byte0, sc0 = _fp4_load(pool_ptr, blk0, ent0, v0, s_pn, s_pe, E, HALF)
    for t0 in range(lo, g_hi, BLOCK_N):
        byte1, sc1 = _fp4_load(pool_ptr, blk1, ent1, v1, s_pn, s_pe, E, HALF)
        blk2, v2r = _load_blocks(tab_row, ent2, v2, E, MAX_BLOCKS, N_BLOCKS)
        ent3, v3 = _load_ids(idx_row, t0 + 3 * BLOCK_N + T, g_hi)
        k_e, k_o = _fp4_decode(byte0, sc0)
        m_i, l_i, acc_e, acc_o = _tile_update(
            q_e, q_o, q_e_lo, q_o_lo, k_e, k_o, v0, m_i, l_i, acc_e, acc_o, qk_scale,
            BLOCK_H, BLOCK_N, PRECISE, INTERPRET,
        )
        byte0, sc0, v0 = byte1, sc1, v1
        ent1, blk1, v1 = ent2, blk2, v2r
        ent2, v2 = ent3, v3

    # Window tiles: slots are arithmetic, so only the record bytes are fetched one tile ahead.
    w_lo = tl.maximum(lo, n_g)
    win_row = win_ptr + b * s_wb
    vw = w_lo + T < hi
    codes0, sb0 = _fp8_load(win_row, s_ws, (w0 + (w_lo + T - n_g)) % W, vw, D)
    for t0 in range(w_lo, hi, BLOCK_N):
        t1 = t0 + BLOCK_N + T
        vw1 = t1 < hi
        codes1, sb1 = _fp8_load(win_row, s_ws, (w0 + (t1 - n_g)) % W, vw1, D)
        k_e, k_o = _fp8_decode(codes0, sb0, D)
        m_i, l_i, acc_e, acc_o = _tile_update(
            q_e, q_o, q_e_lo, q_o_lo, k_e, k_o, vw, m_i, l_i, acc_e, acc_o, qk_scale,
            BLOCK_H, BLOCK_N, PRECISE, INTERPRET,
        )
        codes0, sb0, vw = codes1, sb1, vw1

    if SPLIT:
        if lo < n:  # chunks past the row's keys write nothing; the combine stops before them
            row = (b * N_SPLITS + chunk) * H + heads.to(tl.int64)
            p_o = ws_o_ptr + row[:, None] * D + 2 * j[None, :]
            tl.store(p_o, acc_e, mask=m_h[:, None])
            tl.store(p_o + 1, acc_o, mask=m_h[:, None])
            tl.store(ws_ml_ptr + 2 * row, m_i, mask=m_h)
            tl.store(ws_ml_ptr + 2 * row + 1, l_i, mask=m_h)
    else:
        inv = 1.0 / l_i
        o_e = acc_e * inv[:, None]
        o_o = acc_o * inv[:, None]
        p_out = out_ptr + b * s_ob + heads[:, None].to(tl.int64) * s_oh + 2 * j[None, :]
        if OUT_BF16:
            o_e = _f32_to_bf16_rne(o_e)
            o_o = _f32_to_bf16_rne(o_o)
        tl.store(p_out, o_e, mask=m_h[:, None])
        tl.store(p_out + 1, o_o, mask=m_h[:, None])


@triton.jit
def _combine_kernel(
    ws_o_ptr, ws_ml_ptr, cnt_ptr, wcnt_ptr, wst_ptr, sink_ptr, out_ptr, s_ob, s_oh,
    H, K_CAP, W, N_SPLITS,
    D: tl.constexpr, BLOCK_H: tl.constexpr, CHUNK: tl.constexpr, OUT_BF16: tl.constexpr,
):
    """Fold a row's chunk partials (m_c, l_c, o_c), in chunk order, with the sink: o = sum / denominator."""
    b = tl.program_id(1).to(tl.int64)
    heads = tl.program_id(0) * BLOCK_H + tl.arange(0, BLOCK_H)
    m_h = heads < H
    d = tl.arange(0, D)
    n_g, n_w, _ = _row_counts(cnt_ptr, wcnt_ptr, wst_ptr, b, K_CAP, W)
    m = tl.load(sink_ptr + heads, mask=m_h, other=0.0) * _LOG2E_K
    l_sum = tl.full((BLOCK_H,), 1.0, tl.float32)
    o = tl.zeros((BLOCK_H, D), tl.float32)
    for c in range(0, tl.cdiv(n_g + n_w, CHUNK)):
        row = (b * N_SPLITS + c) * H + heads.to(tl.int64)
        m_c = tl.load(ws_ml_ptr + 2 * row, mask=m_h, other=float("-inf"))
        l_c = tl.load(ws_ml_ptr + 2 * row + 1, mask=m_h, other=0.0)
        o_c = tl.load(ws_o_ptr + row[:, None] * D + d[None, :], mask=m_h[:, None], other=0.0)
        m_new = tl.maximum(m, m_c)  # finite: m starts at the sink
        a = tl.exp2(m - m_new)
        a_c = tl.exp2(m_c - m_new)
        l_sum = l_sum * a + l_c * a_c
        o = o * a[:, None] + o_c * a_c[:, None]
        m = m_new
    o = o * (1.0 / l_sum)[:, None]
    if OUT_BF16:
        o = _f32_to_bf16_rne(o)
    p_out = out_ptr + b * s_ob + heads[:, None].to(tl.int64) * s_oh + d[None, :]
    tl.store(p_out, o, mask=m_h[:, None])


def sparse_mqa_decode_triton(
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
    out: torch.Tensor,
    config: SparseMQAConfig,
) -> torch.Tensor:
    """Launch on validated inputs (see ``sparse_mqa/op.py``); writes and returns ``out [B, H, D]``."""
    b, h, d = q.shape
    k_cap, w = sel_idx.shape[1], window.shape[1]
    if b == 0:
        return out
    interpret = os.environ.get("TRITON_INTERPRET", "0") == "1"
    block_h = min(config.block_h, max(16, triton.next_power_of_2(h)))
    n_keys = k_cap + w
    split = config.chunk > 0 and n_keys > 0
    n_splits = triton.cdiv(n_keys, config.chunk) if split else 1
    if split:
        ws_o = torch.empty((b, n_splits, h, d), dtype=torch.float32, device=q.device)
        ws_ml = torch.empty((b, n_splits, h, 2), dtype=torch.float32, device=q.device)
    else:
        ws_o = ws_ml = out  # unused
    grid = (triton.cdiv(h, block_h), n_splits, b)
    _sparse_mqa_decode_kernel[grid](
        q, q.stride(0), q.stride(1),
        sel_idx, sel_idx.stride(0), sel_count,
        block_table, block_table.stride(0),
        pool, pool.stride(0), pool.stride(1),
        window, window.stride(0), window.stride(1), win_start, win_count,
        sink, out, out.stride(0), out.stride(1),
        ws_o, ws_ml,
        h, k_cap, pool.shape[1], pool.shape[0], block_table.shape[1], w, n_splits, scale * LOG2E,
        D=d, BLOCK_H=block_h, BLOCK_N=config.block_n, CHUNK=max(config.chunk, 1),
        SPLIT=split, PRECISE=q.dtype == torch.float32, INTERPRET=interpret, OUT_BF16=out.dtype == torch.bfloat16,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    if split:
        # a few heads per program: the combine holds [heads, D] fp32 partials and does no MMA
        _combine_kernel[(triton.cdiv(h, _COMBINE_HEADS), b)](
            ws_o, ws_ml, sel_count, win_count, win_start, sink, out, out.stride(0), out.stride(1),
            h, k_cap, w, n_splits,
            D=d, BLOCK_H=_COMBINE_HEADS, CHUNK=config.chunk, OUT_BF16=out.dtype == torch.bfloat16,
            num_warps=4,
        )
    return out
