"""mHC residual-stream ops with a batch-invariant sum over the streams (model.md §3.2).

    hc_collapse(x, pre)              x [T, hc, D], pre [T, hc]              -> [T, D]      sum_j pre[j] x[j]
    hc_expand(f, x, post, comb)      f [T, D], post [T, hc], comb [T, hc, hc] -> [T, hc, D]
                                     y[k] = post[k] f + sum_j comb[j, k] x[j]

fp32 out for fp32 / bf16 streams (x, f may be bf16; pre/post/comb fp32); float64 in, float64 out (reference).
The references are the plain-torch expressions the model ran before (``(pre[..., None] * x).sum(-2)``, an
einsum), kept for the CPU and the float64 oracle; on CUDA one Triton launch each (``mhc/streams_kernel.py``)
sums the hc streams in a fixed order whatever the batch (the einsum's batched GEMM and torch's reduction pick
their algorithm by the token count), in one launch where torch took three.

Dispatch: ``impl="auto"`` Triton on CUDA tensors, else the reference; "reference" / "triton" force one.
Against the reference: fp32 rounding of another order (tests/kernels/test_mhc_streams.py). Failure: ValueError
naming the argument. Reads its inputs only.
"""

from __future__ import annotations

import torch

from flashtier.kernels.mhc.streams_kernel import collapse_triton, expand_triton
from flashtier.kernels.quant.common import resolve_impl

__all__ = ["hc_collapse", "hc_expand"]


def _up(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


def _check(t, name: str, shape: tuple[int, ...], op: str) -> None:
    if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape:
        raise ValueError(f"{op}: {name} must have shape {list(shape)}, got {getattr(t, 'shape', type(t).__name__)}")
    if t.dtype not in (torch.float32, torch.bfloat16, torch.float64):
        raise ValueError(f"{op}: {name} must be float32, bfloat16 or float64, got {t.dtype}")


def _streams(x, op: str) -> tuple[int, int, int]:
    if not isinstance(x, torch.Tensor) or x.dim() != 3:
        raise ValueError(f"{op}: x must be [T, hc, D], got {getattr(x, 'shape', type(x).__name__)}")
    t, hc, d = x.shape
    if hc < 1 or hc & (hc - 1):
        raise ValueError(f"{op}: hc must be a power of two, got {hc}")
    return t, hc, d


def _triton(impl: str, x: torch.Tensor, op: str, *coeffs: torch.Tensor) -> bool:
    impl = resolve_impl(impl, x, op)
    return impl == "triton" and x.dtype != torch.float64 and all(c.dtype == torch.float32 for c in coeffs)


def hc_collapse(x: torch.Tensor, pre: torch.Tensor, *, impl: str = "auto") -> torch.Tensor:
    """Collapse the streams: ``sum_j pre[:, j] * x[:, j]`` -> [T, D] (fp32; fp64 for fp64 x)."""
    t, hc, d = _streams(x, "hc_collapse")
    _check(pre, "pre", (t, hc), "hc_collapse")
    if not _triton(impl, x, "hc_collapse", pre):
        return (pre[..., None] * _up(x)).sum(-2)
    out = torch.empty((t, d), dtype=torch.float32, device=x.device)
    return collapse_triton(x.contiguous(), pre.contiguous(), out) if t else out


def hc_expand(f: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, *,
              impl: str = "auto") -> torch.Tensor:
    """Residual update ``post[k] * f + sum_j comb[j, k] * x[j]`` -> [T, hc, D] (fp32; fp64 for fp64 x)."""
    t, hc, d = _streams(x, "hc_expand")
    _check(f, "f", (t, d), "hc_expand")
    _check(post, "post", (t, hc), "hc_expand")
    _check(comb, "comb", (t, hc, hc), "hc_expand")
    if not _triton(impl, x, "hc_expand", post, comb):
        return post[..., None] * _up(f)[:, None, :] + torch.einsum("tjk,tjd->tkd", comb, _up(x))
    out = torch.empty((t, hc, d), dtype=torch.float32, device=x.device)
    return expand_triton(f.contiguous(), x.contiguous(), post.contiguous(), comb.contiguous(), out) if t else out
