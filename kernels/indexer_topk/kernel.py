"""Indexer scoring + top-k in Triton: packed MXFP4 keys read by block table, decoded in registers.

Three steps, no host sync (CUDA-graph safe):

1. ``_score_kernel``, grid ``(chunks, B)``: a program owns ``TILES`` tiles of ``BLOCK_N`` positions of one
   row. Per tile it gathers the 68 B key records, decodes each 32-channel block's nibbles to fp16 and runs
   ``[BLOCK_N, 16] x [16, heads]`` MMAs on the even and odd channels (a byte holds channels 2j, 2j + 1) to
   get the block's exact dot S. Then d = sum_n (S_n * s_k) * s_q in block order, relu, times w, and a
   pairwise head tree, exactly as ``indexer_topk/reference.py``. Each score is written as an order-preserving
   int32 key (fp32 bits, negatives flipped, -0 -> +0; invalid = INT32_MIN). Layer 20 also writes each
   ``CB``-entry block's max key, the newest visible block pinned to key(+inf).
2. ``torch.topk`` on the keys (the caller): only its VALUES are used, to get the row's k-th key T.
3. ``_count_kernel`` then ``_write_kernel``, grid ``(chunks, B)``: keys > T are all taken, keys == T the
   first ``need`` by position. Pass 1 counts both per chunk; pass 2 scans each chunk from the counts before
   it and writes the picks in position order (so ascending, as the reference), -1 pads. torch.topk's tie
   order never reaches the output.

Why exact: nibble n -> fp16 bits ((n & 7) << 9 | (n & 8) << 12) is the e2m1 value * 2^-14 (0.5 is an
fp16 subnormal); the q operand is v_q * 2^(e_q + shift) with one shift per row (exact while the row's q
scales span <= 2^36). A block's products then share one power of two and its 32-term sum has <= 13
significant bits: exact in any MMA accumulation order. ``S * (s_k * 2^(14 - shift))`` is the exact term, so
the FMAs that add the terms in block order round like the reference's adds. The one inexact product,
w * relu(d), is an explicit ``mul.rn.f32`` so it cannot be fused into the head tree's adds. ``NORMAL``
decodes k to plain fp16 values (two more ops per channel) in case a target flushed fp16 subnormals;
``SWAR`` decodes 4 bytes per register in inline PTX (the interpreter uses the plain decode).

Failure: ids or block ids out of range read as absent (memory-safe); the reference raises.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from flashtier.kernels.quant.e2m1 import _e2m1_to_f32

INT32_MIN = -(2**31)
_IMIN = tl.constexpr(INT32_MIN)  # invalid position (below every score's key); compiled kernels only read constexpr globals
_KEY_POS_INF = tl.constexpr(0x7F800000)  # key of +inf: the pinned newest block


@dataclass(frozen=True)
class IndexerTopKConfig:
    """Launch shape and decode variant. Scores are per entry (no cross-entry reduction) and exact, so no
    choice here changes a bit of the output (the tests hold every variant to the reference)."""

    block_n: int = 128  # positions per tile (MMA M); 128 x 4 warps: ~37 warp instructions per entry (SASS)
    num_warps: int = 4
    tiles: int = 0  # tiles per scoring program; 0 = from the batch and the SM count
    normal_decode: bool = False  # decode to normal fp16 values (no subnormal operands)
    swar_decode: bool = True  # compiled GPU path: decode 4 bytes per register in inline PTX
    final_block: int = 1024  # positions per finalize step (< 2^16: one scan packs two counts)
    final_tiles: int = 4  # finalize steps per program (chunk = final_block * final_tiles positions)
    final_warps: int = 4


@triton.jit
def _nibble_f16(c, NORMAL: tl.constexpr, INTERPRET: tl.constexpr):
    """int32 e2m1 codes (bits 0-3) -> fp16 MMA operand: value * 2^-14, or the value itself if NORMAL."""
    mag = c & 7
    if NORMAL:  # 0x3800 = 0.5; codes 2..7 are value bits << 9 with the exponent moved up by 14
        bits = (mag << 9) + 0x3800 - tl.where(mag == 1, 0x200, 0)
        bits = tl.where(mag == 0, 0, bits) | ((c & 8) << 12)
    else:
        bits = (mag << 9) | ((c & 8) << 12)
    v = bits.to(tl.int16).to(tl.float16, bitcast=True)
    if INTERPRET:  # the interpreter multiplies fp16 in fp16: give it the same (exact) values in fp32
        v = v.to(tl.float32)
    return v


# SWAR decode, 4 bytes per 32-bit register: PRMT spreads two bytes into 16-bit lanes, then each lane's low
# nibble goes to fp16 bits ((n & 7) << 9 | (n & 8) << 12) and its high nibble likewise -- the same bits as
# _nibble_f16, ~2 instructions per nibble instead of ~5. GPU only (the interpreter cannot run PTX).
_SWAR_ASM = tl.constexpr("""{
.reg .b32 t, a, c;
prmt.b32 t, $4, 0, 0x4140;
shl.b32 a, t, 9; shl.b32 c, t, 12; and.b32 a, a, 0x0E000E00; and.b32 c, c, 0x80008000; or.b32 $0, a, c;
shl.b32 a, t, 5; shl.b32 c, t, 8; and.b32 a, a, 0x0E000E00; and.b32 c, c, 0x80008000; or.b32 $2, a, c;
prmt.b32 t, $4, 0, 0x4342;
shl.b32 a, t, 9; shl.b32 c, t, 12; and.b32 a, a, 0x0E000E00; and.b32 c, c, 0x80008000; or.b32 $1, a, c;
shl.b32 a, t, 5; shl.b32 c, t, 8; and.b32 a, a, 0x0E000E00; and.b32 c, c, 0x80008000; or.b32 $3, a, c;
}""")


@triton.jit
def _bytes_f16(byte, NORMAL: tl.constexpr, SWAR: tl.constexpr, INTERPRET: tl.constexpr):
    """uint8 bytes -> (low-nibble, high-nibble) fp16 operands (even, odd channels)."""
    if SWAR:
        lo, hi = tl.inline_asm_elementwise(_SWAR_ASM, "=r,=r,=r,=r,r", [byte], dtype=(tl.float16, tl.float16),
                                           is_pure=True, pack=4)
    else:
        x = byte.to(tl.int32)
        lo = _nibble_f16(x & 15, NORMAL, INTERPRET)
        hi = _nibble_f16(x >> 4, NORMAL, INTERPRET)
    return lo, hi


@triton.jit
def _e8m0(b):  # fp32 2^(b - 127) of int32 scale bytes (byte 0 is the subnormal 2^-127)
    return tl.where(b == 0, 0x400000, b << 23).to(tl.float32, bitcast=True)


@triton.jit
def _pow2(e):  # fp32 2^e, clamped to the normal range (the contract keeps every use inside it)
    return (tl.minimum(tl.maximum(e + 127, 1), 254) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _q_exp(qs_row, s_qsh, heads, hm, n: tl.constexpr):  # block-n scale exponents [HP]; padding heads -127
    return tl.load(qs_row + heads * s_qsh + n, mask=hm, other=0).to(tl.int32) - 127


@triton.jit
def _q_block(qc_row, s_qch, heads, hm, e, shift, n: tl.constexpr, INTERPRET: tl.constexpr):
    """The query's block n as fp16 MMA operands ``[16, HP]`` (even, odd channels): v * 2^(e + shift).

    ``shift`` puts the row's largest scale at 2^13 (6 * 2^13 < 65504); an e2m1 value times 2^(e + shift)
    has 2 significant bits, so it is exact in fp16 while e + shift >= -23: the row's q scales must span
    at most 2^36 (zero blocks excepted, whatever their scale byte)."""
    j = tl.arange(0, 16)
    byte = tl.load(qc_row + heads[None, :] * s_qch + n * 16 + j[:, None], mask=hm[None, :], other=0).to(tl.int32)
    scale = _pow2(e + shift)[None, :]
    qe = (_e2m1_to_f32(byte & 15) * scale).to(tl.float16)
    qo = (_e2m1_to_f32(byte >> 4) * scale).to(tl.float16)
    if INTERPRET:  # same values, fp32 operands (the interpreter multiplies fp16 in fp16)
        qe = qe.to(tl.float32)
        qo = qo.to(tl.float32)
    return qe, qo


@triton.jit
def _block_dot(rec, qe, qo, f, n: tl.constexpr, HALF: tl.constexpr, NORMAL: tl.constexpr, SWAR: tl.constexpr,
               INTERPRET: tl.constexpr):
    """Block n's exact term S_n * s_k * s_q ``[N, HP]`` for key records ``rec [N]`` (``f`` undoes the operand shifts).

    Unmasked: invalid positions point at a real record (the caller masks their scores), which saves a
    predicate per byte."""
    lo, hi = _bytes_f16(tl.load(rec[:, None] + n * 16 + tl.arange(0, 16)[None, :]), NORMAL, SWAR, INTERPRET)
    sk = _e8m0(tl.load(rec + HALF + n).to(tl.int32)) * f
    s = tl.dot(lo, qe)
    s = tl.dot(hi, qo, s)
    return s, sk[:, None]


@triton.jit
def _mul_rn(a, b, INTERPRET: tl.constexpr):
    """a * b rounded on its own: as mul.rn.f32 no compiler may fuse it into the add that follows."""
    if INTERPRET:  # numpy never fuses
        y = a * b
    else:
        y = tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=f,f,f", [a, b], dtype=tl.float32,
                                      is_pure=True, pack=1)
    return y


# Integer arguments that follow the batch (rows, table width, key length, tiles), left unspecialised
# (engine/warmup.py says why)
SCORE_COUNTS = ("MAX_BLOCKS", "L_CAP", "C_CAP", "NB_CAP", "TILES", "s_tb", "s_cb", "s_bb")
COUNT_COUNTS = ("L", "KTOP", "s_tb", "NCH")  # _count_kernel
WRITE_COUNTS = COUNT_COUNTS + ("s_cb",)  # _write_kernel
MIN_CHUNK_PAD = 64  # the write pass's prefix over chunk counts: one variant up to 64 chunks of keys


@triton.jit(do_not_specialize=SCORE_COUNTS)
def _score_kernel(
    qc_ptr, s_qcb, s_qch, qs_ptr, s_qsb, s_qsh, w_ptr, s_wb,
    pool_ptr, s_pn, s_pe, tab_ptr, s_tb, nvis_ptr,
    cand_ptr, s_cb, ccnt_ptr, key_ptr, s_kb, bkey_ptr, s_bb,
    IH, N_BLOCKS, MAX_BLOCKS, L_CAP, C_CAP, NB_CAP, TILES,
    E: tl.constexpr, HALF: tl.constexpr, HP: tl.constexpr, LOG2_HP: tl.constexpr, BLOCK_N: tl.constexpr,
    CB: tl.constexpr, GATHER: tl.constexpr, POOL: tl.constexpr, K_SHIFT: tl.constexpr, NORMAL: tl.constexpr,
    SWAR: tl.constexpr, INTERPRET: tl.constexpr,
):
    b = tl.program_id(1).to(tl.int64)
    heads = tl.arange(0, HP)
    hm = heads < IH
    qc_row = qc_ptr + b * s_qcb
    qs_row = qs_ptr + b * s_qsb
    e0 = _q_exp(qs_row, s_qsh, heads, hm, 0)
    e1 = _q_exp(qs_row, s_qsh, heads, hm, 1)
    e2 = _q_exp(qs_row, s_qsh, heads, hm, 2)
    e3 = _q_exp(qs_row, s_qsh, heads, hm, 3)
    shift = 13 - tl.max(tl.maximum(tl.maximum(e0, e1), tl.maximum(e2, e3)), 0)
    qe0, qo0 = _q_block(qc_row, s_qch, heads, hm, e0, shift, 0, INTERPRET)
    qe1, qo1 = _q_block(qc_row, s_qch, heads, hm, e1, shift, 1, INTERPRET)
    qe2, qo2 = _q_block(qc_row, s_qch, heads, hm, e2, shift, 2, INTERPRET)
    qe3, qo3 = _q_block(qc_row, s_qch, heads, hm, e3, shift, 3, INTERPRET)
    # k operands carry 2^-14 (subnormal encoding) or 1 (NORMAL); q operands 2^shift: f undoes both
    f = _pow2(K_SHIFT - shift)
    w = tl.broadcast_to(tl.load(w_ptr + b * s_wb + heads, mask=hm, other=0.0)[None, :], (BLOCK_N, HP))
    n_vis = tl.minimum(tl.maximum(tl.load(nvis_ptr + b), 0), MAX_BLOCKS * E)
    if GATHER:
        length = tl.minimum(tl.maximum(tl.load(ccnt_ptr + b), 0), C_CAP) * CB
    else:
        length = n_vis
    newest = (n_vis - 1) // CB  # the block pinned by layer 20 (none when n_vis == 0)
    tab_row = tab_ptr + b * s_tb
    key_row = key_ptr + b * s_kb
    T = tl.arange(0, BLOCK_N)
    lo = tl.program_id(0) * TILES * BLOCK_N
    for t0 in range(lo, tl.minimum(lo + TILES * BLOCK_N, L_CAP), BLOCK_N):
        pos = t0 + T
        if t0 < length:
            valid = pos < length
            if GATHER:
                cb = tl.load(cand_ptr + b * s_cb + pos // CB, mask=valid, other=-1)
                ent = cb * CB + pos % CB
                valid = valid & (cb >= 0) & (ent < n_vis)
            else:
                ent = pos
            ent = tl.maximum(ent, 0)
            valid = valid & (ent // E < MAX_BLOCKS)
            blk = tl.load(tab_row + ent // E, mask=valid, other=0)
            valid = valid & (blk >= 0) & (blk < N_BLOCKS)
            off = blk.to(tl.int64) * s_pn + (ent % E).to(tl.int64) * s_pe
            rec = pool_ptr + tl.where(valid, off, 0)  # invalid -> record 0 of block 0: in bounds
            # exact terms, summed in block order (an FMA of an exact product rounds like mul + add)
            s, sk = _block_dot(rec, qe0, qo0, f, 0, HALF, NORMAL, SWAR, INTERPRET)
            d = s * sk
            s, sk = _block_dot(rec, qe1, qo1, f, 1, HALF, NORMAL, SWAR, INTERPRET)
            d = s * sk + d
            s, sk = _block_dot(rec, qe2, qo2, f, 2, HALF, NORMAL, SWAR, INTERPRET)
            d = s * sk + d
            s, sk = _block_dot(rec, qe3, qo3, f, 3, HALF, NORMAL, SWAR, INTERPRET)
            d = s * sk + d
            x = _mul_rn(tl.maximum(d, 0.0), w, INTERPRET)
            for i in tl.static_range(LOG2_HP):  # pairwise tree: heads 2j + 2j+1, level by level
                x = tl.sum(tl.reshape(x, (BLOCK_N, HP >> (i + 1), 2)), axis=2)
            score = tl.reshape(x, (BLOCK_N,))
            bits = score.to(tl.int32, bitcast=True)
            key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
            key = tl.where(valid & (score != 0.0), key, tl.where(valid, 0, _IMIN))
        else:
            key = tl.full((BLOCK_N,), _IMIN, tl.int32)
        tl.store(key_row + pos, key, mask=pos < L_CAP)
        if POOL:
            bmax = tl.max(tl.reshape(key, (BLOCK_N // CB, CB)), axis=1)
            bi = t0 // CB + tl.arange(0, BLOCK_N // CB)
            bmax = tl.where((bi == newest) & (n_vis > 0), _KEY_POS_INF, bmax)
            tl.store(bkey_ptr + b * s_bb + bi, bmax, mask=bi < NB_CAP)


@triton.jit
def _threshold(top_ptr, s_tb, b, KTOP, KPAD: tl.constexpr):
    """(k, T, need) of row b from torch.topk's values: k = min(k, #valid), T the k-th key, need = keys == T to take."""
    i = tl.arange(0, KPAD)
    tv = tl.load(top_ptr + b * s_tb + i, mask=i < KTOP, other=_IMIN)
    ok = tv != _IMIN  # every valid key outranks the sentinel
    k = tl.sum(ok.to(tl.int32), 0)
    thr = tl.min(tl.where(ok, tv, 2147483647), 0)
    return k, thr, k - tl.sum((ok & (tv > thr)).to(tl.int32), 0)


@triton.jit
def _row_len(len_ptr, b, L, CB: tl.constexpr, LEN_MODE: tl.constexpr):
    v = tl.load(len_ptr + b)
    if LEN_MODE == 0:  # entries
        n = v
    elif LEN_MODE == 1:  # layer-20 blocks of CB entries
        n = (v + CB - 1) // CB
    else:  # candidate positions: CB per kept block
        n = v * CB
    return tl.minimum(tl.maximum(n, 0), L)


@triton.jit(do_not_specialize=COUNT_COUNTS)
def _count_kernel(key_ptr, s_kb, L, top_ptr, s_tb, KTOP, len_ptr, cnt_ptr, NCH,
                  CB: tl.constexpr, LEN_MODE: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
                  KPAD: tl.constexpr):
    """Pass 1, grid (chunks, B): keys > T and keys == T in each chunk of a row."""
    c = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    k, thr, _ = _threshold(top_ptr, s_tb, b, KTOP, KPAD)
    n = _row_len(len_ptr, b, L, CB, LEN_MODE)
    gt = k * 0
    eq = k * 0
    for t0 in range(c * CHUNK, tl.minimum(c * CHUNK + CHUNK, n), BLOCK):
        pos = t0 + tl.arange(0, BLOCK)
        m = pos < n
        key = tl.load(key_ptr + b * s_kb + pos, mask=m, other=_IMIN)
        gt += tl.sum((m & (key > thr)).to(tl.int32), 0)
        eq += tl.sum((m & (key == thr)).to(tl.int32), 0)
    tl.store(cnt_ptr + (b * NCH + c) * 2, gt)
    tl.store(cnt_ptr + (b * NCH + c) * 2 + 1, tl.where(k > 0, eq, 0))


@triton.jit(do_not_specialize=WRITE_COUNTS)
def _write_kernel(
    key_ptr, s_kb, L, top_ptr, s_tb, KTOP, len_ptr, cnt_ptr, NCH, cand_ptr, s_cb, out_ptr, s_ob, counts_ptr, K_OUT,
    CB: tl.constexpr, LEN_MODE: tl.constexpr, GATHER: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
    KPAD: tl.constexpr, NCH_PAD: tl.constexpr,
):
    """Pass 2, grid (chunks, B): keys > T all, keys == T the first ``need`` by position, written in position
    order from the counts of the chunks before (so the row comes out ascending); chunk 0 pads with -1."""
    c = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    k, thr, need = _threshold(top_ptr, s_tb, b, KTOP, KPAD)
    n = _row_len(len_ptr, b, L, CB, LEN_MODE)
    j = tl.arange(0, NCH_PAD)
    prev = j < c
    gt_seen = tl.sum(tl.load(cnt_ptr + (b * NCH + j) * 2, mask=prev, other=0), 0)
    eq_seen = tl.sum(tl.load(cnt_ptr + (b * NCH + j) * 2 + 1, mask=prev, other=0), 0)
    hi = tl.minimum(c * CHUNK + CHUNK, n)
    hi = tl.where(gt_seen + tl.minimum(eq_seen, need) >= k, 0, hi)  # the row's picks are all before this chunk
    out_row = out_ptr + b * s_ob
    for t0 in range(c * CHUNK, hi, BLOCK):
        pos = t0 + tl.arange(0, BLOCK)
        m = pos < n
        key = tl.load(key_ptr + b * s_kb + pos, mask=m, other=_IMIN)
        gt = m & (key > thr)
        eq = m & (key == thr) & (k > 0)
        packed = gt.to(tl.int32) | (eq.to(tl.int32) << 16)  # one scan counts both (BLOCK < 2^16)
        before = tl.cumsum(packed, 0) - packed
        eq_rank = eq_seen + (before >> 16)
        sel = gt | (eq & (eq_rank < need))
        slot = gt_seen + (before & 0xFFFF) + tl.minimum(eq_rank, need)
        if GATHER:
            cb = tl.load(cand_ptr + b * s_cb + pos // CB, mask=sel, other=0)
            ident = cb * CB + pos % CB
        else:
            ident = pos
        tl.store(out_row + slot, ident, mask=sel)
        tot = tl.sum(packed, 0)
        gt_seen += tot & 0xFFFF
        eq_seen += tot >> 16
    if c == 0:
        for t0 in range(0, K_OUT, BLOCK):
            i = t0 + tl.arange(0, BLOCK)
            tl.store(out_row + i, tl.full((BLOCK,), -1, tl.int32), mask=(i >= k) & (i < K_OUT))
        tl.store(counts_ptr + b, k)


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"  # read like Triton does at import


def _tiles(cfg: IndexerTopKConfig, b: int, n_tiles: int, device: torch.device) -> int:
    if cfg.tiles:
        return cfg.tiles
    if _interpret():
        return max(1, n_tiles)  # one program per row: the interpreter's cost is per program
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(64, (b * n_tiles) // (8 * sms)))  # ~8 programs per SM


def score_keys(qc, qs, w, pool, table, n_vis, cand, cand_cnt, cand_block, pool_blocks, cfg) -> tuple:
    """Launch ``_score_kernel``: int32 keys ``[B, L]`` (and layer-20 block keys ``[B, NB]`` when ``pool_blocks``)."""
    b, ih, half = qc.shape
    n_phys, e, _ = pool.shape
    gather = cand is not None
    length = cand.shape[1] * cand_block if gather else table.shape[1] * e
    keys = torch.empty(b, length, dtype=torch.int32, device=qc.device)
    nb = -(-length // cand_block)
    bkeys = torch.empty(b, nb, dtype=torch.int32, device=qc.device) if pool_blocks else keys
    hp = max(16, 1 << (ih - 1).bit_length())
    n_tiles = -(-length // cfg.block_n)
    tiles = _tiles(cfg, b, n_tiles, qc.device)
    dummy = n_vis  # an int32 tensor for unused pointer arguments
    grid = (triton.cdiv(n_tiles, tiles), b)
    _score_kernel[grid](
        qc, qc.stride(0), qc.stride(1), qs, qs.stride(0), qs.stride(1), w, w.stride(0),
        pool, pool.stride(0), pool.stride(1), table, table.stride(0), n_vis,
        cand if gather else dummy, cand.stride(0) if gather else 0, cand_cnt if gather else dummy,
        keys, keys.stride(0), bkeys, bkeys.stride(0),
        ih, n_phys, table.shape[1], length, cand.shape[1] if gather else 0, nb, tiles,
        E=e, HALF=half, HP=hp, LOG2_HP=hp.bit_length() - 1, BLOCK_N=cfg.block_n, CB=cand_block, GATHER=gather, POOL=bool(pool_blocks),
        K_SHIFT=0 if cfg.normal_decode else 14, NORMAL=cfg.normal_decode,
        SWAR=cfg.swar_decode and not cfg.normal_decode and not _interpret(), INTERPRET=_interpret(),
        num_warps=cfg.num_warps,
    )
    return keys, (bkeys if pool_blocks else None)


def select_from_keys(keys, k, lengths, len_mode, cand, cand_block, cfg) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k positions (or candidate entry ids) ``[B, k]`` int32, ascending, -1 padded, and counts ``[B]``."""
    ktop = min(k, keys.shape[1])
    top = torch.topk(keys, ktop, dim=1, sorted=False).values if ktop > 0 else keys[:, :1]
    return finalize(keys, top, ktop, k, lengths, len_mode, cand, cand_block, cfg)


def finalize(keys, top, ktop, k, lengths, len_mode, cand, cand_block, cfg) -> tuple[torch.Tensor, torch.Tensor]:
    """The two finalize launches, from torch.topk's values ``top [B, ktop]``."""
    b, length = keys.shape
    out, counts = (torch.empty(shape, dtype=torch.int32, device=keys.device) for shape in ((b, k), (b,)))
    chunk = cfg.final_block * cfg.final_tiles
    nch = max(1, triton.cdiv(length, chunk))
    cnt = torch.empty(b, nch, 2, dtype=torch.int32, device=keys.device)
    # Both pads follow fixed sizes, not the context: the top-k (not the count of keys, which grows with the
    # context until it reaches k) and a floor of 64 chunks (256K keys); a pad that tracked the context would
    # compile a new variant each time a conversation crossed a power of two, on the request path.
    kpad = max(16, triton.next_power_of_2(max(k, 1)))  # k >= ktop
    common = dict(CB=cand_block, LEN_MODE=len_mode, CHUNK=chunk, BLOCK=cfg.final_block, KPAD=kpad,
                  num_warps=cfg.final_warps)
    _count_kernel[(nch, b)](keys, keys.stride(0), length, top, top.stride(0), ktop, lengths, cnt, nch, **common)
    gather = cand is not None
    _write_kernel[(nch, b)](
        keys, keys.stride(0), length, top, top.stride(0), ktop, lengths, cnt, nch,
        cand if gather else lengths, cand.stride(0) if gather else 0, out, out.stride(0), counts, k,
        GATHER=gather, NCH_PAD=max(MIN_CHUNK_PAD, triton.next_power_of_2(nch)), **common,
    )
    return out, counts


def keys_to_scores(keys: torch.Tensor) -> torch.Tensor:
    """fp32 scores of int32 keys (INT32_MIN -> -inf): the inverse of the kernel's encoding."""
    bits = torch.where(keys < 0, keys ^ 0x7FFFFFFF, keys)
    return torch.where(keys == INT32_MIN, float("-inf"), bits.view(torch.float32))
