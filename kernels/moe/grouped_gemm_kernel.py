"""Triton grouped expert GEMM: one launch per projection, one program per (expert, N tile, K split).

One kernel serves both projections (``GATED``: w1 + w3; else w2). A program owns one expert's BN weight
rows over one K split and *all* of that expert's token tiles, so each weight byte is read from memory and
decoded once per step whatever the batch (the previous design ran a program per 16-row tile and re-read
an expert's weights once per tile):

    grid (E + shared groups, N / BN, S)        program (g, n, s):
        tiles = moe_align's blocks of expert g [first_block[g], first_block[g + 1])   (or MT shared tiles)
        for each chunk of MT tiles:                       MT = ``sub_tiles``: 1 chunk at decode sizes
            for each BK step of split s:
                W = decode(weight bytes [BN rows, BK])                         once per step
                acc_j += W @ A_j^T for each live tile j < MT            (A_j: BT = 16 token rows)
            epilogue of each live tile (or its fp32 partial, S > 1)

The weight tile is the MMA's left operand (swap-AB: BN weight rows x BT tokens), so the decoded weights
stay in registers and only the small activation tile goes through shared memory. A tile j is computed
only when the expert has it (``if`` on the live count), so a batch of one token pays one 16-column MMA
per step, not MT. The M tiles are moe_align's 16-pair blocks of the routed experts followed by the shared
expert's tiles of 16 tokens (FP8 weights with 32 x 32 ue8m0 blocks), which run in the same launch. The rows
each tile reads and writes: ``moe/tile_kernel.py``.

    GATED:      a = A W1^T, b = A W3^T over K = D; act = fp8_qdq(r * (silu(min(a, L)) * clamp(b, -L, L)))
                (r = the pair's routing weight, 1 for the shared expert), stored as bf16 (exact) in tile order
    not GATED:  out = act W2^T over K = I, fp32, written to the pair's own row of [N * k (+ N), D]
                (the shared expert's rows follow the pairs'), so no atomics are needed

Split-K (``MoEGemmConfig.split_k`` S, chosen per weight shape). Split s covers K steps [s * c, (s + 1) * c)
with c = ceil(ceil(K / BK) / S) (whole BK steps, so whole 32-element scale blocks; trailing splits may be
empty and write zeros), accumulates from zero and stores an fp32 partial to a workspace
``[S, 1 or 2 (GATED: a and b), tile rows, N]``; ``moe/splitk_reduce_kernel.py`` then sums the partials in
ascending split order (no atomics) and applies the epilogue. S = 1: no workspace, the epilogue here. The
workspace covers at most ``WORKSPACE_BYTES``: a larger batch runs in windows of M tiles (a program only
takes its tiles inside the window; a tile's instructions do not depend on the window, so neither do its bits).

Numerics. Each K step loads BK contiguous activations and the matching weight bytes (BK / 2 of MXFP4, BK of
FP8) and splits them into even and odd elements (the low and high nibbles: no interleave). The weights are
decoded to bf16 *with their scale folded in*: e2m1 * 2^s and e4m3 * 2^s have at most 4 significant bits,
so they are exact in bf16 (as are the fp8-quantised activations), every product of the bf16 tensor-core dot
is exact, accumulated in fp32: the result differs from the fp32 reference only by summation order.
Decoding (``MoEGemmConfig.decode``). "bits" (the default): integer ops put each code's magnitude and sign bits
into a bf16 (e2m1: value * 2^-126; e4m3: value * 2^-120, NaN codes kept), then two bf16x2 FMAs scale it by 2^126
(2^120) and by the block's 2^(s - 127), in inline PTX over four bytes at a time (``_E2M1_PAIRS_ASM``,
``_E4M3_PAIRS_ASM``): ~3 instructions per weight element and no conversion instruction. "cvt": an e2m1 nibble is
rewritten as the e4m3 code of value / 64 (``_e2m1_as_e4m3``), both formats take the hardware e4m3 -> f16
conversion (two codes per instruction), then the scale (and 64 for e2m1) in fp32 (exact: the kernels keep fp32
subnormals), then bf16: about 9 instructions and 2 conversions (a lower-throughput unit) per weight element. Both give
the same bits (tests/kernels/test_moe_decode_gpu.py, every code under every scale byte). On an H100, same launch
shape, same run, "bits" took w1+w3 from 147 / 308 / 486 us to 128 / 257 / 426 us at 1 / 8 / 64 tokens (the tuned
table: layer 4.6 / 4.1 / 6.1x its byte floor, docs/perf/moe.json): decode was one cost, not the only one. Under
TRITON_INTERPRET=1 operands stay fp32 (the interpreter has no bf16 dot and no inline PTX) and the codes go through
the bit decoder (its fp8 cast misreads NaN codes).

The fp8 x fp8 alternative (e2m1 -> e4m3 is lossless) would halve MMA time, but decode at batch <= 64 is bound
by weight bytes, not MMA rate, and Hopper's fp8 MMA accumulates with ~14 bits (DeepSeek-V3 report §3.3.2),
which would flip the FP8 rounding of the activation before w2 far more often.

Latency. Two K loops, chosen by ``MoEGemmConfig.pipeline``:

    0 (register double buffer)  the raw weight bytes of step k + 1 are requested before step k is decoded, so
                                their latency overlaps one step's decode and dots; activations are gathered as
                                even / odd columns each step
    P >= 2 (staged)             the loads sit inside a ``tl.range(num_stages=P)`` loop and the compiler turns
                                them into asynchronous copies into shared memory, P - 1 steps ahead: weight
                                codes (read from there straight in the MMA operand layout, then decoded in
                                registers) and whole activation rows; only the scale bytes (too narrow for an
                                asynchronous copy) are loaded one step ahead in registers. GATED programs stack
                                BN / 2 w1 rows over the matching BN / 2 w3 rows: one [BN, BK / 2] tile, one dot
                                per step and half the registers of two, split back into a and b after the loop

What bounds it (ncu on an H100, flash-16e w13 at 1 token): not bytes. DRAM is 20-28% busy; each warp issues an
instruction every ~4.5 cycles at 12% (register buffer, 220 registers) or 18% (staged, 139 registers) occupancy,
and the staged loop issues ~255 instructions per 64 x 64 step per thread (32 weight elements): ~90 decode,
the rest operand shuffles, the scale multipliers, masks, barriers and copy bookkeeping. The staged loop's gain
(docs/perf/moe.json) is occupancy and latency; further gains need fewer instructions per weight element.

Batch invariance. The launch shape (BN, BK, MT, warps) and S come from ``MoEGemmConfig`` looked up per
weight shape (``moe/gemm_config.py``), never from the batch; the token tile is 16 rows always. A pair's row
is therefore computed by the same instructions (same MMA shapes, same K order) in a batch of 1 or 64, in
whichever tile or sub-tile slot it lands: its bits do not depend on the batch or on the other rows.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from flashtier.kernels.quant.fp8_bits import _e4m3_to_f32, _e8m0_to_f32
from flashtier.kernels.moe.splitk_reduce_kernel import launch_splitk_reduce
from flashtier.kernels.moe.tile_kernel import _swiglu_qdq, _tile_rows

WORKSPACE_BYTES = 128 << 20  # split-K partials per window: 64 decode tokens at S = 8 fit in one window
MAX_SPLIT_K = 64
TOKEN_TILE = 16  # rows per M tile (moe_align's block): the MMA's narrow side, never chosen from the batch
DECODES = ("bits", "cvt")


def _pairs_asm(regs: str, setup: list[str], pair: list[str], jobs: list[tuple[str, str, str, str]]) -> str:
    """Inline PTX of a "bits" decoder: declare ``regs``, run ``setup`` once, then ``pair`` (the instructions that
    turn two codes into one bf16x2 register) once per job ``(src, sel, mult, out)``: the source register of the
    codes, the ``prmt`` selector putting two of its bytes into 16-bit lanes (0x4140: bytes 0 1; 0x4342: bytes
    2 3), the register of their two scale multipliers and the output register."""
    lines = ["", "{", f".reg .b32 {regs};", *setup]
    for src, sel, mult, out in jobs:
        lines += [line.format(src=src, sel=sel, mult=mult, out=out) for line in pair]
    return "\n".join([*lines, "}", ""])


# Four MXFP4 bytes (eight e2m1 codes: element 2j in the low nibble of byte j) and their four bf16 scale
# multipliers 2^(s - 127) -> the four even and four odd elements as bf16 pairs, exact. Per pair of codes n:
# (n * 0x1040) & 0x81C0 puts the 3 magnitude bits at bf16 bits 8..6 (exponent low bits, mantissa top) and the
# sign at bit 15: that bf16 is the e2m1 value * 2^-126 (e = 0, n = 1: the subnormal 0.5 * 2^-126), so one FMA
# by 2^126 and one by the multiplier give value * 2^(s - 127), exact (at most 2 significant bits; bf16
# subnormals are kept by fma.rn.bf16x2). ~3 instructions per element, against ~9 and two conversions of "cvt".
# Operands: $0 $1 even pairs, $2 $3 odd pairs (outputs); $4 the bytes; $5 $6 the multipliers of bytes 0 1 / 2 3.
_E2M1_PAIRS_ASM = tl.constexpr(_pairs_asm(
    "ev, od, p, z, c, m",
    ["mov.b32 z, 0;", "mov.b32 c, 0x7E807E80;", "mov.b32 m, 0x80008000;",  # c = 2^126 (both halves), m = -0
     "and.b32 ev, $4, 0x0F0F0F0F;", "shr.b32 od, $4, 4;", "and.b32 od, od, 0x0F0F0F0F;"],  # even / odd nibbles
    ["prmt.b32 p, {src}, z, {sel};", "mul.lo.u32 p, p, 0x1040;", "and.b32 p, p, 0x81C081C0;",
     "fma.rn.bf16x2 p, p, c, m;", "fma.rn.bf16x2 {out}, p, {mult}, m;"],
    [("ev", "0x4140", "$5", "$0"), ("ev", "0x4342", "$6", "$1"), ("od", "0x4140", "$5", "$2"),
     ("od", "0x4342", "$6", "$3")]))


# Four e4m3 codes of the even elements ($4), four of the odd ($5) and the bf16 scale multipliers of their four
# columns ($6 $7) -> bf16 pairs $0 $1 (even), $2 $3 (odd). Per pair of codes c: ((c << 4) & 0x7F0) | ((c << 8) &
# 0x8000) is the bf16 of the e4m3 value * 2^-120 (e4m3 subnormals land on bf16 subnormals), then one FMA by 2^120
# and one by the multiplier; a NaN code (magnitude 0x7F) is the only one whose magnitude bits reach 0x7F0, and
# (+ 0x10) carries into bit 11 there: that lane gets 0x7FC0 OR-ed in (a NaN). The products are exact where bf16
# can hold them (scale byte >= 4; below that bf16 rounds, as "cvt"'s fp32 -> bf16 does).
_E4M3_PAIRS_ASM = tl.constexpr(_pairs_asm(
    "p, t, u, v, z, c, m",
    ["mov.b32 z, 0;", "mov.b32 c, 0x7B807B80;", "mov.b32 m, 0x80008000;"],  # c = 2^120 (both halves), m = -0
    ["prmt.b32 p, {src}, z, {sel};", "shl.b32 t, p, 4;", "and.b32 t, t, 0x07F007F0;", "shl.b32 u, p, 8;",
     "and.b32 u, u, 0x80008000;", "add.u32 v, t, 0x00100010;", "and.b32 v, v, 0x08000800;", "shr.u32 v, v, 11;",
     "mul.lo.u32 v, v, 0x7FC0;", "or.b32 t, t, u;", "fma.rn.bf16x2 t, t, c, m;", "fma.rn.bf16x2 t, t, {mult}, m;",
     "or.b32 {out}, t, v;"],
    [("$4", "0x4140", "$6", "$0"), ("$4", "0x4342", "$7", "$1"), ("$5", "0x4140", "$6", "$2"),
     ("$5", "0x4342", "$7", "$3")]))


@dataclass(frozen=True)
class MoEGemmConfig:
    """Launch shape of one projection's grouped GEMM, chosen per weight shape (``moe/gemm_config.py``), never
    per batch. ``split_k`` and ``block_k`` are the reduction order; the rest only move work between programs."""

    block_n: int = 64  # weight rows per program (the MMA's M side: 64 per warpgroup)
    block_k: int = 64  # K elements per step: 32 bytes of each MXFP4 weight row
    sub_tiles: int = 4  # token tiles per chunk sharing each decoded weight step (4 x 16 = 64 pairs of an expert)
    num_warps: int = 4
    num_stages: int = 2
    split_k: int = 1  # K splits (each split a program): parallelism at decode sizes
    decode: str = "bits"  # weight decode on the GPU: "bits" (integer ops + bf16 FMA) or "cvt" (hardware conversions)
    pipeline: int = 0  # 0: a register double buffer of weight bytes; >= 2: loads staged through shared memory
    maxnreg: int | None = None  # register cap per thread (more programs per SM; None: the compiler's choice)

    def __post_init__(self) -> None:
        pow2 = lambda v: isinstance(v, int) and not isinstance(v, bool) and v > 0 and not v & (v - 1)  # noqa: E731
        if not (pow2(self.block_n) and self.block_n >= 16 and pow2(self.block_k) and self.block_k >= 64):
            raise ValueError(f"MoEGemmConfig: block_n >= 16, block_k >= 64, powers of two; got {self}")
        if self.sub_tiles not in (1, 2, 4) or isinstance(self.sub_tiles, bool):
            raise ValueError(f"MoEGemmConfig: sub_tiles must be 1, 2 or 4, got {self.sub_tiles!r}")
        if not pow2(self.num_warps) or not (isinstance(self.num_stages, int) and 1 <= self.num_stages <= 8):
            raise ValueError(f"MoEGemmConfig: num_warps a power of two, num_stages in [1, 8]; got {self}")
        if isinstance(self.split_k, bool) or not isinstance(self.split_k, int) or not 1 <= self.split_k <= MAX_SPLIT_K:
            raise ValueError(f"MoEGemmConfig: split_k must be an int in [1, {MAX_SPLIT_K}], got {self.split_k!r}")
        if isinstance(self.pipeline, bool) or self.pipeline not in (0, 2, 3, 4, 5, 6):
            raise ValueError(f"MoEGemmConfig: pipeline must be 0 or a stage count in [2, 6], got {self.pipeline!r}")
        if self.maxnreg is not None and (isinstance(self.maxnreg, bool) or self.maxnreg not in range(64, 256, 8)):
            raise ValueError(f"MoEGemmConfig: maxnreg must be None or a multiple of 8 in [64, 248], "
                             f"got {self.maxnreg!r}")
        if self.decode not in DECODES:
            raise ValueError(f"MoEGemmConfig: decode must be one of {DECODES}, got {self.decode!r}")


@triton.jit
def _load_codes(p_wq, base_q, o_n, m_n, k0, K, live, FP8_W: tl.constexpr, BK: tl.constexpr):
    """Code bytes of weight rows ``o_n`` at K columns [k0, k0 + BK) (none when ``live`` is false): [BN, BK / 2]
    MXFP4 (element 2j in the low nibble of byte j) or [BN, BK] FP8."""
    o_r = o_n.to(tl.int64)[:, None]
    if FP8_W:  # codes [rows, K]
        o_k = k0 + tl.arange(0, BK)
        b_w = tl.load(p_wq + o_r * K + o_k[None, :], mask=m_n[:, None] & (o_k < K)[None, :] & live, other=0)
    else:  # MXFP4: codes [rows, K / 2]
        o_kb = k0 // 2 + tl.arange(0, BK // 2)
        b_w = tl.load(p_wq + base_q + o_r * (K // 2) + o_kb[None, :],
                      mask=m_n[:, None] & (o_kb < K // 2)[None, :] & live, other=0)
    return b_w


@triton.jit
def _load_scales(p_ws, base_s, o_n, m_n, k0, K, live, FP8_W: tl.constexpr, BK: tl.constexpr):
    """Scale bytes [BN, BK / 32] of weight rows ``o_n`` at K columns [k0, k0 + BK) (127: 1.0 where not live)."""
    NS: tl.constexpr = BK // 32
    o_s = k0 // 32 + tl.arange(0, NS)
    m_s = m_n[:, None] & (o_s < K // 32)[None, :] & live
    if FP8_W:  # one scale per 32 x 32 block [rows / 32, K / 32]
        b_s = tl.load(p_ws + (o_n // 32).to(tl.int64)[:, None] * (K // 32) + o_s[None, :], mask=m_s, other=127)
    else:  # MXFP4: [rows, K / 32]
        b_s = tl.load(p_ws + base_s + o_n.to(tl.int64)[:, None] * (K // 32) + o_s[None, :], mask=m_s, other=127)
    return b_s


@triton.jit
def _load_weights(p_wq, p_ws, base_q, base_s, o_n, m_n, k0, K, live, FP8_W: tl.constexpr, BK: tl.constexpr):
    """Raw bytes of weight rows ``o_n`` at K columns [k0, k0 + BK): codes and scales (``_load_codes``,
    ``_load_scales``)."""
    b_w = _load_codes(p_wq, base_q, o_n, m_n, k0, K, live, FP8_W, BK)
    b_s = _load_scales(p_ws, base_s, o_n, m_n, k0, K, live, FP8_W, BK)
    return b_w, b_s


@triton.jit
def _e2m1_as_e4m3(b):
    """uint8 e4m3 codes of (e2m1 value / 64) for the e2m1 codes in the low nibble of uint8 ``b``.

    e2m1 (s e1 e0 m) -> e4m3 (s 0 0 e1 e0 m 0 0): exponent field e = e1 e0 and mantissa m / 2 give
    2^(e - 7) * (1 + m / 2) for e >= 1, which is the e2m1 value 2^(e - 1) * (1 + m / 2) over 64; for e = 0 the
    e4m3 subnormal m * 4 * 2^-9 = m * 2^-7 is 0.5 * m / 64. The sign bit moves from bit 3 to bit 7
    (code 8 -> 0x80, -0.0).
    """
    return ((b & 7) << 2) | ((b & 8) << 4)


@triton.jit
def _e8m0_bf16(b_s):
    """bf16 2^(s - 127) for uint8 e8m0 bytes (0 -> the subnormal 2^-127, 255 -> NaN), built from bits (no float
    conversion, which could flush the subnormal)."""
    b = b_s.to(tl.int32)
    bits = tl.where(b == 0, 0x0040, tl.where(b == 255, 0x7FC0, b << 7))
    return bits.to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _repeat16(b, BN: tl.constexpr, NS: tl.constexpr):
    """[BN, NS] -> [BN, NS * 16], each value repeated 16 times in registers: one scale per 16 even (odd) elements."""
    return tl.reshape(tl.broadcast_to(b[:, :, None], (BN, NS, 16)), (BN, NS * 16))


@triton.jit
def _decode_weights(b_w, b_s, FP8_W: tl.constexpr, BK: tl.constexpr, DT: tl.constexpr, DECODE: tl.constexpr):
    """Raw bytes from ``_load_weights`` -> (even, odd) elements, each [BN, BK / 2] in DT with the scale folded in
    (exact). ``DECODE`` "bits" (on the GPU): integer ops and two bf16 FMAs per pair (``_E2M1_PAIRS_ASM``,
    ``_E4M3_PAIRS_ASM``) instead of the hardware fp8 conversions."""
    BN: tl.constexpr = b_w.shape[0]
    HALF: tl.constexpr = BK // 2
    NS: tl.constexpr = BK // 32
    if FP8_W:  # even and odd codes (MXFP4 keeps them as the low and high nibbles of one byte)
        b_ce, b_co = tl.split(tl.reshape(b_w, (BN, HALF, 2)))
    if DECODE == "bits" and DT == tl.bfloat16:
        b_m = _repeat16(_e8m0_bf16(b_s), BN, NS)
        if FP8_W:
            b_even, b_odd = tl.inline_asm_elementwise(_E4M3_PAIRS_ASM, "=r,=r,=r,=r,r,r,r,r", [b_ce, b_co, b_m],
                                                      dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
        else:
            b_even, b_odd = tl.inline_asm_elementwise(_E2M1_PAIRS_ASM, "=r,=r,=r,=r,r,r,r", [b_w, b_m],
                                                      dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
        return b_even, b_odd
    b_sf = _repeat16(_e8m0_to_f32(b_s.to(tl.int32)), BN, NS)
    if not FP8_W:  # e2m1 -> the e4m3 code of value / 64 (exact: 2 exponent bits, 1 mantissa bit)
        b_ce = _e2m1_as_e4m3(b_w)
        b_co = _e2m1_as_e4m3(b_w >> 4)
    if DT == tl.float32:  # interpreted: the bit decoder (the interpreter's fp8 cast misreads NaN codes)
        b_ef = _e4m3_to_f32(b_ce.to(tl.int32))
        b_of = _e4m3_to_f32(b_co.to(tl.int32))
    else:  # the hardware conversion, two codes per instruction
        b_ef = b_ce.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        b_of = b_co.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    b_ef = b_ef * b_sf
    b_of = b_of * b_sf
    if not FP8_W:  # value / 64 * 2^s is exact (>= 2^-134, fp32 subnormals reach 2^-149); then * 64
        b_ef = b_ef * 64.0
        b_of = b_of * 64.0
    b_even = b_ef.to(DT)
    b_odd = b_of.to(DT)
    return b_even, b_odd


@triton.jit
def _mma_tile(p_a, o_a, m_r, stride_a, k0, K, b_we, b_wo, b_we3, b_wo3, b_acc, b_acc3,
              GATED: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, DT: tl.constexpr, ROWS: tl.constexpr):
    """One K step of one token tile: ``acc += W A^T`` (and ``acc3 += W3 A^T`` when GATED), fp32 [BN, BT]; the
    activations ``A`` [BT, BK] are the rows ``o_a`` (``m_r``: real) at K columns [k0, k0 + BK), split into even
    and odd columns. ``ROWS`` (the staged loop): loaded as whole rows (16-byte vectors, which the compiler can
    copy asynchronously) and split in registers; else loaded already transposed and split (strided loads of a
    small tile that L2 holds). The same operands either way, so the same products and sums."""
    HALF: tl.constexpr = BK // 2
    if ROWS:
        o_k = k0 + tl.arange(0, BK)
        b_a = tl.load(p_a + o_a.to(tl.int64)[:, None] * stride_a + o_k[None, :],
                      mask=m_r[:, None] & (o_k < K)[None, :], other=0.0).to(DT)
        b_ae, b_ao = tl.split(tl.reshape(b_a, (BT, HALF, 2)))
        b_ae = tl.trans(b_ae)
        b_ao = tl.trans(b_ao)
    else:
        o_k = k0 + 2 * tl.arange(0, HALF)
        p_col = p_a + o_a.to(tl.int64)[None, :] * stride_a + o_k[:, None]
        m = m_r[None, :] & (o_k < K)[:, None]
        b_ae = tl.load(p_col, mask=m, other=0.0).to(DT)
        b_ao = tl.load(p_col + 1, mask=m, other=0.0).to(DT)
    b_acc = tl.dot(b_we, b_ae, b_acc)
    b_acc = tl.dot(b_wo, b_ao, b_acc)
    if GATED:
        b_acc3 = tl.dot(b_we3, b_ae, b_acc3)
        b_acc3 = tl.dot(b_wo3, b_ao, b_acc3)
    return b_acc, b_acc3


@triton.jit
def _store_tile(b_acc, b_acc3, i_m, o_out, m_r, b_rw, o_n, m_n, p_out, p_part, m_lo, stride_out, stride_ps,
                stride_ph, stride_pr, i_k, limit, GATED: tl.constexpr, BT: tl.constexpr, BN: tl.constexpr,
                SPLIT_K: tl.constexpr):
    """Epilogue of tile ``i_m`` from its fp32 [BN, BT] sums (S = 1), or its partial into the window's workspace."""
    b_acc = tl.trans(b_acc)
    m_out = m_r[:, None] & m_n[None, :]
    if SPLIT_K == 1:
        p_orow = p_out + o_out.to(tl.int64)[:, None] * stride_out + o_n[None, :]
        if GATED:
            tl.store(p_orow, _swiglu_qdq(b_acc, tl.trans(b_acc3), b_rw, limit, BT, BN), mask=m_out)
        else:
            tl.store(p_orow, b_acc, mask=m_out)
    else:  # this split's partial sums, at the tile's rows of this window's workspace
        o_w = (i_m - m_lo) * BT + tl.arange(0, BT)
        p_prow = p_part + i_k * stride_ps + o_w.to(tl.int64)[:, None] * stride_pr + o_n[None, :]
        tl.store(p_prow, b_acc, mask=m_out)
        if GATED:
            tl.store(p_prow + stride_ph, tl.trans(b_acc3), mask=m_out)


@triton.jit
def _regs_loop(k_lo, k_hi, n_live, o_n, m_n, w3_rows, p_a, p_wq, p_ws, base_q, base_s, K, stride_a,
               o_a0, m_r0, o_a1, m_r1, o_a2, m_r2, o_a3, m_r3, b_a0, b_b0, b_a1, b_b1, b_a2, b_b2, b_a3, b_b3,
               GATED: tl.constexpr, FP8_W: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, MT: tl.constexpr,
               DT: tl.constexpr, DECODE: tl.constexpr):
    """The K loop with a register double buffer: step k + 1's weight bytes are loaded before step k is decoded."""
    live = k_lo < k_hi
    b_w, b_s = _load_weights(p_wq, p_ws, base_q, base_s, o_n, m_n, k_lo, K, live, FP8_W, BK)
    b_w3, b_s3 = b_w, b_s
    if GATED:
        b_w3, b_s3 = _load_weights(p_wq, p_ws, base_q, base_s, o_n + w3_rows, m_n, k_lo, K, live, FP8_W, BK)
    for k0 in range(k_lo, k_hi, BK):
        # step k0 + BK's bytes are requested before step k0 is decoded: their latency hides behind the work
        live = k0 + BK < k_hi
        b_w_nxt, b_s_nxt = _load_weights(p_wq, p_ws, base_q, base_s, o_n, m_n, k0 + BK, K, live, FP8_W, BK)
        b_w3_nxt, b_s3_nxt = b_w_nxt, b_s_nxt
        if GATED:
            b_w3_nxt, b_s3_nxt = _load_weights(p_wq, p_ws, base_q, base_s, o_n + w3_rows, m_n, k0 + BK, K, live,
                                               FP8_W, BK)
        b_we, b_wo = _decode_weights(b_w, b_s, FP8_W, BK, DT, DECODE)
        b_we3, b_wo3 = b_we, b_wo
        if GATED:
            b_we3, b_wo3 = _decode_weights(b_w3, b_s3, FP8_W, BK, DT, DECODE)
        b_a0, b_b0 = _mma_tile(p_a, o_a0, m_r0, stride_a, k0, K, b_we, b_wo, b_we3, b_wo3, b_a0, b_b0, GATED, BT, BK,
                               DT, False)
        if MT > 1:
            if n_live > 1:
                b_a1, b_b1 = _mma_tile(p_a, o_a1, m_r1, stride_a, k0, K, b_we, b_wo, b_we3, b_wo3, b_a1, b_b1, GATED,
                                       BT, BK, DT, False)
        if MT > 2:
            if n_live > 2:
                b_a2, b_b2 = _mma_tile(p_a, o_a2, m_r2, stride_a, k0, K, b_we, b_wo, b_we3, b_wo3, b_a2, b_b2, GATED,
                                       BT, BK, DT, False)
            if n_live > 3:
                b_a3, b_b3 = _mma_tile(p_a, o_a3, m_r3, stride_a, k0, K, b_we, b_wo, b_we3, b_wo3, b_a3, b_b3, GATED,
                                       BT, BK, DT, False)
        b_w, b_s, b_w3, b_s3 = b_w_nxt, b_s_nxt, b_w3_nxt, b_s3_nxt
    return b_a0, b_b0, b_a1, b_b1, b_a2, b_b2, b_a3, b_b3


@triton.jit
def _unstack(b_acc, BO: tl.constexpr, BT: tl.constexpr):
    """fp32 ``[2 BO, BT]`` sums of stacked w1 / w3 rows -> (a, b), each ``[BO, BT]``."""
    return tl.split(tl.permute(tl.reshape(b_acc, (2, BO, BT)), (1, 2, 0)))


@triton.jit
def _chunk(
    c0, t1, i_k, o_n, o_w, m_w, p_a, p_ids, p_block_expert, p_rw, p_wq, p_ws, base_q, base_s, p_out, p_part,
    n_pairs, n_tok, top_k, n_rblocks, m_lo, K, N, stride_a, stride_out, stride_ps, stride_ph, stride_pr, limit,
    GATED: tl.constexpr, FP8_W: tl.constexpr, BT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    MT: tl.constexpr, DT: tl.constexpr, SPLIT_K: tl.constexpr, DECODE: tl.constexpr, PIPE: tl.constexpr,
    BO: tl.constexpr, KALIGN: tl.constexpr,
):
    """Tiles [c0, min(c0 + MT, t1)) of one expert (routed: MXFP4 at ``base_q`` / ``base_s``; shared: FP8) over
    split ``i_k``: each weight step is loaded and decoded once and multiplied into every live tile. ``o_n``: the
    BO output columns; ``o_w`` / ``m_w``: the BN weight rows a staged step reads (GATED: BO w1 rows over the same
    BO w3 rows) and which of them exist. The register-buffered loop reads ``o_n`` (and ``o_n + N`` for w3)."""
    K = tl.multiple_of(K, 32)  # checked by the caller (whole scale blocks): lets the loads be 16-byte vectors
    if KALIGN:  # K is a multiple of BK (checked by the caller): a step's scale bytes are one aligned vector
        K = tl.multiple_of(K, BK)
    n_live = t1 - c0
    m_n = o_n < N
    w3_rows = N  # GATED: the w3 rows follow the N w1 rows
    _, o_a0, o_out0, m_r0, b_rw0 = _tile_rows(c0, p_ids, p_block_expert, p_rw, n_pairs, n_tok, top_k, n_rblocks,
                                             GATED, BT)
    o_a1, o_out1, m_r1, b_rw1 = o_a0, o_out0, m_r0, b_rw0
    o_a2, o_out2, m_r2, b_rw2 = o_a0, o_out0, m_r0, b_rw0
    o_a3, o_out3, m_r3, b_rw3 = o_a0, o_out0, m_r0, b_rw0
    if MT > 1:
        _, o_a1, o_out1, m_r1, b_rw1 = _tile_rows(c0 + 1, p_ids, p_block_expert, p_rw, n_pairs, n_tok, top_k,
                                                 n_rblocks, GATED, BT)
        m_r1 = m_r1 & (n_live > 1)
    if MT > 2:
        _, o_a2, o_out2, m_r2, b_rw2 = _tile_rows(c0 + 2, p_ids, p_block_expert, p_rw, n_pairs, n_tok, top_k,
                                                 n_rblocks, GATED, BT)
        _, o_a3, o_out3, m_r3, b_rw3 = _tile_rows(c0 + 3, p_ids, p_block_expert, p_rw, n_pairs, n_tok, top_k,
                                                 n_rblocks, GATED, BT)
        m_r2 = m_r2 & (n_live > 2)
        m_r3 = m_r3 & (n_live > 3)
    if SPLIT_K == 1:
        k_lo = 0
        k_hi = K
    else:
        k_len = tl.cdiv(tl.cdiv(K, BK), SPLIT_K) * BK
        k_lo = i_k * k_len
        k_hi = tl.minimum(k_lo + k_len, K)
    b_a0 = tl.zeros((BN, BT), dtype=tl.float32)
    b_b0 = tl.zeros((BN, BT), dtype=tl.float32)
    b_a1, b_b1, b_a2, b_b2, b_a3, b_b3 = b_a0, b_b0, b_a0, b_b0, b_a0, b_b0
    if PIPE > 0:  # loads inside the loop: the compiler stages them through shared memory, PIPE steps deep
        # GATED: one [BN, BK / 2] tile holds w1 rows (top half) and the matching w3 rows (bottom half), one dot
        # per step; the accumulator is split into a and b after the loop (``_unstack``)
        # (the scale bytes, too narrow for an asynchronous copy, are loaded one step ahead into registers)
        b_s = _load_scales(p_ws, base_s, o_w, m_w, k_lo, K, k_lo < k_hi, FP8_W, BK)
        for k0 in tl.range(k_lo, k_hi, BK, num_stages=PIPE):
            b_w = _load_codes(p_wq, base_q, o_w, m_w, k0, K, True, FP8_W, BK)
            b_s_nxt = _load_scales(p_ws, base_s, o_w, m_w, k0 + BK, K, k0 + BK < k_hi, FP8_W, BK)
            b_we, b_wo = _decode_weights(b_w, b_s, FP8_W, BK, DT, DECODE)
            b_s = b_s_nxt
            b_a0, b_b0 = _mma_tile(p_a, o_a0, m_r0, stride_a, k0, K, b_we, b_wo, b_we, b_wo, b_a0, b_b0, False,
                                   BT, BK, DT, True)
            if MT > 1:
                if n_live > 1:
                    b_a1, b_b1 = _mma_tile(p_a, o_a1, m_r1, stride_a, k0, K, b_we, b_wo, b_we, b_wo, b_a1, b_b1,
                                           False, BT, BK, DT, True)
            if MT > 2:
                if n_live > 2:
                    b_a2, b_b2 = _mma_tile(p_a, o_a2, m_r2, stride_a, k0, K, b_we, b_wo, b_we, b_wo, b_a2, b_b2,
                                           False, BT, BK, DT, True)
                if n_live > 3:
                    b_a3, b_b3 = _mma_tile(p_a, o_a3, m_r3, stride_a, k0, K, b_we, b_wo, b_we, b_wo, b_a3, b_b3,
                                           False, BT, BK, DT, True)
        if GATED:
            b_a0, b_b0 = _unstack(b_a0, BO, BT)
            if MT > 1:
                b_a1, b_b1 = _unstack(b_a1, BO, BT)
            if MT > 2:
                b_a2, b_b2 = _unstack(b_a2, BO, BT)
                b_a3, b_b3 = _unstack(b_a3, BO, BT)
    else:
        b_a0, b_b0, b_a1, b_b1, b_a2, b_b2, b_a3, b_b3 = _regs_loop(
            k_lo, k_hi, n_live, o_n, m_n, w3_rows, p_a, p_wq, p_ws, base_q, base_s, K, stride_a,
            o_a0, m_r0, o_a1, m_r1, o_a2, m_r2, o_a3, m_r3, b_a0, b_b0, b_a1, b_b1, b_a2, b_b2, b_a3, b_b3,
            GATED, FP8_W, BT, BK, MT, DT, DECODE)
    m_n = o_n < N
    _store_tile(b_a0, b_b0, c0, o_out0, m_r0, b_rw0, o_n, m_n, p_out, p_part, m_lo, stride_out, stride_ps, stride_ph,
                stride_pr, i_k, limit, GATED, BT, BO, SPLIT_K)
    if MT > 1:
        if n_live > 1:
            _store_tile(b_a1, b_b1, c0 + 1, o_out1, m_r1, b_rw1, o_n, m_n, p_out, p_part, m_lo, stride_out, stride_ps,
                        stride_ph, stride_pr, i_k, limit, GATED, BT, BO, SPLIT_K)
    if MT > 2:
        if n_live > 2:
            _store_tile(b_a2, b_b2, c0 + 2, o_out2, m_r2, b_rw2, o_n, m_n, p_out, p_part, m_lo, stride_out, stride_ps,
                        stride_ph, stride_pr, i_k, limit, GATED, BT, BO, SPLIT_K)
        if n_live > 3:
            _store_tile(b_a3, b_b3, c0 + 3, o_out3, m_r3, b_rw3, o_n, m_n, p_out, p_part, m_lo, stride_out, stride_ps,
                        stride_ph, stride_pr, i_k, limit, GATED, BT, BO, SPLIT_K)


# Integer arguments that follow the batch, left unspecialised (engine/warmup.py says why)
BATCH_COUNTS = ("n_pairs", "n_tok", "n_rblocks", "n_m", "m_lo", "m_hi")


@triton.jit(do_not_specialize=BATCH_COUNTS)
def _moe_gemm_kernel(
    p_a, p_ids, p_block_expert, p_first, p_rw, p_wq, p_ws, p_sq, p_ss, p_out, p_part,
    n_pairs, n_tok, top_k, n_exp, n_rblocks, n_m, m_lo, m_hi, K_R, K_S, N_R, N_S, stride_a, stride_out,
    stride_ps, stride_ph, stride_pr, limit,
    GATED: tl.constexpr, UPCAST: tl.constexpr, BT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    MT: tl.constexpr, SPLIT_K: tl.constexpr, DECODE: tl.constexpr, PIPE: tl.constexpr, KALIGN: tl.constexpr,
):
    # Traffic per program: BN weight rows (x2 when GATED and register-buffered) of K / SPLIT_K elements, read
    # once; each live tile's BT activation rows of as many (L2 hits after the first N tile).
    # Groups [0, n_exp): routed expert g, its moe_align blocks. Groups [n_exp, ...): MT shared-expert tiles each.
    g, i_n, i_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    DT: tl.constexpr = tl.float32 if UPCAST else tl.bfloat16
    if g < n_exp:
        t0 = tl.load(p_first + g)
        t1 = tl.load(p_first + g + 1)
    else:
        t0 = n_rblocks + (g - n_exp) * MT
        t1 = tl.minimum(t0 + MT, n_m)
    t0 = tl.maximum(t0, m_lo)  # this window's tiles only
    t1 = tl.minimum(t1, m_hi)
    if KALIGN:
        K_R = tl.multiple_of(K_R, BK)
        K_S = tl.multiple_of(K_S, BK)
    # BO output columns per program; staged GATED programs stack BO w1 rows over the same BO w3 rows (BN rows)
    BO: tl.constexpr = BN // 2 if GATED and PIPE > 0 else BN
    o_n = i_n * BO + tl.arange(0, BO)
    n_g = tl.where(g < n_exp, N_R, N_S)  # this group's output width
    o_w = o_n
    if GATED and PIPE > 0:
        o_r = tl.arange(0, BN)
        o_w = i_n * BO + o_r % BO + tl.where(o_r < BO, 0, n_g)  # w3's rows follow w1's n_g rows
    m_w = i_n * BO + tl.arange(0, BN) % BO < n_g
    for c0 in range(t0, t1, MT):
        if g < n_exp:
            n_w = 2 * N_R if GATED else N_R  # w1 and w3 are 2 * N_R rows per expert
            e64 = g.to(tl.int64)
            _chunk(c0, t1, i_k, o_n, o_w, m_w, p_a, p_ids, p_block_expert, p_rw, p_wq, p_ws, e64 * n_w * (K_R // 2),
                   e64 * n_w * (K_R // 32), p_out, p_part, n_pairs, n_tok, top_k, n_rblocks, m_lo, K_R, N_R,
                   stride_a, stride_out, stride_ps, stride_ph, stride_pr, limit,
                   GATED, False, BT, BN, BK, MT, DT, SPLIT_K, DECODE, PIPE, BO, KALIGN)
        else:
            _chunk(c0, t1, i_k, o_n, o_w, m_w, p_a, p_ids, p_block_expert, p_rw, p_sq, p_ss, 0, 0, p_out, p_part,
                   n_pairs, n_tok, top_k, n_rblocks, m_lo, K_S, N_S, stride_a, stride_out, stride_ps, stride_ph,
                   stride_pr, limit, GATED, True, BT, BN, BK, MT, DT, SPLIT_K, DECODE, PIPE, BO, KALIGN)


def _upcast() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def launch_moe_gemm(
    a: torch.Tensor, out: torch.Tensor, routed: tuple[torch.Tensor, torch.Tensor],
    shared: tuple[torch.Tensor, torch.Tensor] | None, *, gated: bool, ids: torch.Tensor,
    block_expert: torch.Tensor, first_block: torch.Tensor, n_tok: int, top_k: int, k_r: int, k_s: int, n_r: int,
    n_s: int, route_w: torch.Tensor | None = None, limit: float = 0.0, config: MoEGemmConfig = MoEGemmConfig(),
) -> torch.Tensor:
    """Run one projection, routed experts and shared expert together, into ``out`` (mutated); return it.

    ``a``: gated, the quantised tokens ``[n_tok, D]`` (bf16 or fp32); else the activation buffer the gated launch
    wrote. ``routed`` / ``shared``: (codes, scales) of the projection (MXFP4 stack / FP8 matrix, or None).
    ``ids`` / ``block_expert`` / ``first_block``: ``moe_align`` with block_m = ``TOKEN_TILE``. ``k_*`` / ``n_*``:
    reduction length and output width of the routed (r) and shared (s) weights, multiples of 32. ``out``: gated,
    bf16 ``[M tiles * TOKEN_TILE, >= max(n_r, n_s)]``; else fp32 ``[n_pairs (+ n_tok with shared), n_r]``. With
    ``config.split_k > 1`` a workspace of at most ``WORKSPACE_BYTES`` is allocated here and freed after.
    """
    bt, mt, splits = TOKEN_TILE, config.sub_tiles, config.split_k
    n_rblocks = block_expert.numel()
    n_exp = first_block.numel() - 1
    n_stiles = triton.cdiv(n_tok, bt) if shared is not None else 0
    n_m = n_rblocks + n_stiles
    if n_m == 0 or n_tok == 0:
        return out
    sq, ss = shared if shared is not None else routed  # never read without shared tiles
    width = max(n_r, n_s)
    per_program = config.block_n // 2 if gated and config.pipeline else config.block_n  # output columns
    grid = (n_exp + triton.cdiv(n_stiles, mt), triton.cdiv(width, per_program), splits)
    rows = (a, ids, block_expert, first_block, out if route_w is None else route_w)
    sizes = (top_k * n_tok, n_tok, top_k, n_exp, n_rblocks, n_m)
    consts = dict(GATED=gated, UPCAST=_upcast(), BT=bt, BN=config.block_n, BK=config.block_k, MT=mt,
                  DECODE=config.decode, PIPE=config.pipeline,
                  KALIGN=k_r % config.block_k == 0 and k_s % config.block_k == 0,
                  num_warps=config.num_warps, **({} if config.maxnreg is None else dict(maxnreg=config.maxnreg)),
                  num_stages=config.num_stages)
    if splits == 1:
        _moe_gemm_kernel[grid](
            *rows, routed[0], routed[1], sq, ss, out, out, *sizes, 0, n_m, k_r, k_s, n_r, n_s, a.stride(0),
            out.stride(0), 0, 0, 0, float(limit), SPLIT_K=1, **consts,
        )
        return out
    halves = 2 if gated else 1
    window = max(1, min(n_m, WORKSPACE_BYTES // (splits * halves * bt * width * 4)))
    part = torch.empty((splits, halves, window * bt, width), dtype=torch.float32, device=a.device)
    for m0 in range(0, n_m, window):
        n_win = min(window, n_m - m0)
        _moe_gemm_kernel[grid](
            *rows, routed[0], routed[1], sq, ss, out, part, *sizes, m0, m0 + n_win, k_r, k_s, n_r, n_s, a.stride(0),
            out.stride(0), part.stride(0), part.stride(1), part.stride(2), float(limit), SPLIT_K=splits, **consts,
        )
        launch_splitk_reduce(part, out, ids, block_expert, rows[-1], top_k * n_tok, n_tok, top_k, n_rblocks, m0,
                             n_win, n_r, n_s, float(limit), gated=gated, block_m=bt, splits=splits)
    return out
