"""FP8 GEMM with block scales, the official V4.1 ``fp8_gemm`` (model.md §4), plus its ``act_quant``.

    codes, scales = act_quant(x)                                     x [M, K] -> e4m3 [M, K], e8m0 [M, K/32]
    y = fp8_gemm(codes, scales, w_q, w_scale, block_n=32)           y [M, N]
    y[m, n] = sum_kb (qa[m, kb] . qw[n, kb]) * sa[m, kb] * sw[n // block_n, kb]      (kb: 32-blocks of K)

    y = fp8_gemm_fused(x, w_q, w_scale)                             the same y (same bits on the same device) in
                                                                    one launch: x quantised as it is loaded

``fp8_gemm_fused`` is the official ``linear()`` of an FP8 weight (``act_quant`` then ``fp8_gemm``). Where the
launch table says so (``Fp8Tile.fuse``, per weight shape, device and decode row bucket: a tuning run measured it
faster there) the quantisation runs inside the GEMM's loads, so no codes reach memory and there is no second
launch; elsewhere (prefill always, where every N tile would quantise the same rows again) it runs ``act_quant``
once and then the GEMM. The GEMM's instructions are the same either way (``kernel.py``), so the switch changes
no bits.

Inputs:

    a        [M, K]                float8_e4m3fn (or raw uint8) activation codes, with a_scale;
                                   or float32 / bfloat16 values with a_scale=None (not quantised: wo_a)
    a_scale  [M, K / 32]           float8_e8m0fnu (or uint8), one scale per 32 along K
    w        [N, K / groups]       float8_e4m3fn (or uint8) weight codes
    w_scale  [ceil(N / block_n), K / groups / 32]   float8_e8m0fnu (or uint8)
    block_n  32: the checkpoint's 32 x 32 blocks; 1: one scale per row and 32 (1 x 32, FP4 -> FP8 repacked experts)
    groups   G > 1: block-diagonal weight (attention wo_a): output columns of group g (N / G of them) read
             activation columns g*K/G:(g+1)*K/G and weight rows g*N/G:(g+1)*N/G; N / G a multiple of 16
    out_dtype float32 or bfloat16 (fp32 accumulation either way)

Dispatch: ``impl="auto"`` runs Triton on CUDA tensors and the reference (``fp8_gemm/reference.py``) elsewhere;
"reference" / "triton" force one (Triton on CPU needs TRITON_INTERPRET=1). ``config`` overrides the
shape-derived launch shape (``Fp8GemmConfig``). Tolerances vs the reference: tests/kernels/test_fp8_gemm.py.

Failure: shapes, dtypes, devices, ``block_n``, ``groups`` and ``out_dtype`` are checked here (ValueError
naming the argument). Code values are not checked (e4m3 NaN codes give NaN). Nothing mutates its inputs.
"""

from __future__ import annotations

import torch

from flashtier.kernels.fp8_gemm.kernel import (
    Fp8GemmConfig, default_config, fp8_gemm_triton, fp8_scaled_mma, split_counters,
)
from flashtier.kernels.quant.common import resolve_impl
from flashtier.kernels.fp8_gemm.reference import fp8_gemm_reference
from flashtier.kernels.quant.fp8 import quantize_fp8

__all__ = ["Fp8GemmConfig", "act_quant", "default_config", "fp8_gemm", "fp8_gemm_fused",
           "fp8_scaled_mma", "split_counters"]


_OP = "fp8_gemm"
_CODE_DTYPES = (torch.float8_e4m3fn, torch.uint8)
_SCALE_DTYPES = (torch.float8_e8m0fnu, torch.uint8)
_FLOAT_A = (torch.float32, torch.bfloat16)


def act_quant(x: torch.Tensor, impl: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """The official ``act_quant(x, 32, "ue8m0")``: x [..., K] -> (float8_e4m3fn [..., K], float8_e8m0fnu [..., K/32]).

    Per 32 along K: amax = max(max|x|, 1e-4), s = 2^ceil(log2(amax / 448)), q = e4m3(clamp(x / s, +-448))
    (``quant_fp8.quantize_fp8``, Triton on CUDA). Raises ValueError unless K is a positive multiple of 32.
    """
    codes, scales = quantize_fp8(x, impl=impl)
    return codes.view(torch.float8_e4m3fn), scales.view(torch.float8_e8m0fnu)


def _check(t, name: str, dtypes: tuple[torch.dtype, ...], shape: tuple[int, ...] | None) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{_OP}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        names = " or ".join(str(d).replace("torch.", "") for d in dtypes)
        raise ValueError(f"{_OP}: {name} must be {names}, got {t.dtype} (shape {tuple(t.shape)})")
    if t.dim() != 2 or (shape is not None and tuple(t.shape) != shape):
        want = "2-D" if shape is None else str(shape)
        raise ValueError(f"{_OP}: {name} must have shape {want}, got {tuple(t.shape)}")


def _validate(a, a_scale, w, w_scale, block_n, groups, out_dtype) -> None:
    if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1:
        raise ValueError(f"{_OP}: groups must be a positive int, got {groups!r}")
    if block_n not in (1, 32) or isinstance(block_n, bool):
        raise ValueError(f"{_OP}: block_n must be 1 or 32, got {block_n!r}")
    if out_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"{_OP}: out_dtype must be float32 or bfloat16, got {out_dtype}")
    _check(w, "w", _CODE_DTYPES, None)
    n, kw = w.shape
    if kw == 0 or kw % 32:
        raise ValueError(f"{_OP}: w must be [N, Kw] with Kw a positive multiple of 32, got {tuple(w.shape)}")
    if n % groups or (groups > 1 and (n // groups) % 16):
        raise ValueError(f"{_OP}: w has {n} rows, which groups={groups} must split into multiples of 16")
    _check(w_scale, "w_scale", _SCALE_DTYPES, (-(-n // block_n), kw // 32))
    if a_scale is None:
        _check(a, "a", _FLOAT_A, None)
    else:
        _check(a, "a", _CODE_DTYPES, None)
    if a.shape[1] != groups * kw:
        raise ValueError(f"{_OP}: a must be [M, {groups * kw}] (groups x w's K), got {tuple(a.shape)}")
    if a_scale is not None:
        _check(a_scale, "a_scale", _SCALE_DTYPES, (a.shape[0], a.shape[1] // 32))
    for name, t in (("a_scale", a_scale), ("w", w), ("w_scale", w_scale)):
        if t is not None and t.device != a.device:
            raise ValueError(f"{_OP}: a and {name} must be on one device, got {a.device} and {t.device}")


def _raw(t: torch.Tensor | None) -> torch.Tensor | None:
    if t is None:
        return None
    t = t.contiguous()
    return t.view(torch.uint8) if t.element_size() == 1 else t


def fp8_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor | None,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    *,
    block_n: int = 32,
    groups: int = 1,
    out_dtype: torch.dtype = torch.float32,
    impl: str = "auto",
    config: Fp8GemmConfig | None = None,
    counters: torch.Tensor | None = None,
) -> torch.Tensor:
    """``y [M, N]`` (see the module docstring). Returns a new tensor; reads its inputs only, except ``counters``
    (int32 zeros from ``split_counters``, used by a split launch and left zeroed; None: allocated when needed).

    Example::

        codes, scales = act_quant(x)                      # x [M, K] fp32
        y = fp8_gemm(codes, scales, w_q, w_scale)          # w_q [N, K] e4m3, w_scale [N/32, K/32] e8m0
    """
    _validate(a, a_scale, w, w_scale, block_n, groups, out_dtype)
    impl = resolve_impl(impl, a, _OP)
    a, a_scale, w, w_scale = _raw(a), _raw(a_scale), _raw(w), _raw(w_scale)
    if impl == "reference":
        return fp8_gemm_reference(a, a_scale, w, w_scale, block_n, groups, out_dtype)
    out = torch.empty((a.shape[0], w.shape[0]), dtype=out_dtype, device=a.device)
    if out.numel() == 0:
        return out
    return fp8_gemm_triton(a, a_scale, w, w_scale, block_n, groups, out, config, counters=counters)


def fp8_gemm_fused(
    x: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    *,
    block_n: int = 32,
    out_dtype: torch.dtype = torch.float32,
    impl: str = "auto",
    config: Fp8GemmConfig | None = None,
    counters: torch.Tensor | None = None,
    fuse: bool | None = None,
) -> torch.Tensor:
    """``fp8_gemm(*act_quant(x), w, w_scale)`` for ``x [M, K]`` fp32 / bf16: ``y [M, N]``, a new tensor.
    ``fuse``: quantise inside the GEMM's loads (True) or launch the quantiser first (False); None: as the launch
    says (``config.fuse``, else the table's tile for this row count). The bits are the same either way.

    Same arguments and failures as ``fp8_gemm`` (``groups`` 1: the quantised linears are not grouped);
    ``counters`` as there (mutated, left zeroed). The reference quantises with ``quantize_fp8`` and runs
    ``fp8_gemm_reference``: bit-identical to the two calls. The Triton path quantises each 1 x 32 block of x in
    registers by the quantiser's own rule (fused) or launches it first.

    Example::

        y = fp8_gemm_fused(x, w_q, w_scale)          # x [M, K] fp32, w_q [N, K] e4m3, w_scale [N/32, K/32] e8m0
    """
    if not isinstance(x, torch.Tensor) or x.dtype not in _FLOAT_A:
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{_OP}: x must be a float32 or bfloat16 tensor [M, K], got {got}")
    _validate(x, None, w, w_scale, block_n, 1, out_dtype)
    impl = resolve_impl(impl, x, _OP)
    w, w_scale = _raw(w), _raw(w_scale)
    if fuse is None:
        fuse = impl != "reference" and (config or default_config(x.shape[0], *w.shape, x.device)).fuse
    if impl == "reference" or not fuse:
        codes, scales = quantize_fp8(x.contiguous(), impl=impl)
        return fp8_gemm(codes, scales, w, w_scale, block_n=block_n, out_dtype=out_dtype, impl=impl, config=config,
                        counters=counters)
    x = x.contiguous()
    out = torch.empty((x.shape[0], w.shape[0]), dtype=out_dtype, device=x.device)
    if out.numel() == 0:
        return out
    return fp8_gemm_triton(x, None, w, w_scale, block_n, 1, out, config, quantize_a=True, counters=counters)
