"""FP8-format linears as the official V4.1 code runs them: activation quantisation, then the GEMM.

Every linear whose checkpoint weight is FP8 (e4m3 + one ue8m0 scale per 32x32 block: attention wq_a,
wq_b, wkv, wo_b, indexer wq_b, Engram wkv, DSpark main_proj, shared experts) is, in the official
``model.py``, a ``Linear`` whose forward is ``linear()``: ``act_quant(x, 32, "ue8m0")`` (e4m3, one ue8m0
scale per 32 along K) then ``fp8_gemm``. ``wo_a`` is the exception: ``convert.py`` dequantises it to bf16
and ``Attention.forward`` runs it as a plain einsum, so its input is NOT quantised (``grouped``).

Two weight holders, one semantics:

- ``nn.Linear`` holding the dequantised values (what ``random_model`` and the loader build; the CPU and
  float64 paths): ``linear`` quantise-dequantises x (``numerics.qdq``) and runs ``F.linear``.
- ``Fp8Linear`` holding the checkpoint bytes (``weight_q`` e4m3 + ``weight_scale`` e8m0, built by
  ``placement.quantize_linears_``): on CUDA ``fp8_gemm_fused`` (``act_quant``, then ``fp8_gemm`` with its
  split-K summed inside the GEMM: the in-load quantisation it can also run measured slower on an H100,
  docs/perf/fp8_gemm.json; the same bits either way); elsewhere the dequantised weight and ``F.linear``, bit-identical to
  the ``nn.Linear`` path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from flashtier.engine.model.numerics import qdq, up
from flashtier.kernels.fp8_gemm.op import fp8_gemm, fp8_gemm_fused, split_counters
from flashtier.kernels.quant.fp8_weight import dequantize_fp8_weight, quantize_fp8_weight
from flashtier.kernels.quant.fp8 import fp8_qdq

WEIGHT_BLOCK = (32, 32)


def act_quant(x: torch.Tensor) -> torch.Tensor:
    """The official ``act_quant`` as values: e4m3 with one ue8m0 scale per 32 along the last dim.

    ``fp8_qdq`` is bit-identical to the official kernel (amax floor 1e-4, s = 2^ceil(log2(amax / 448)),
    RNE e4m3 cast; tests/engine/test_act_quant_sites.py). float64 x is rounded to fp32 first
    (``numerics.qdq``). Raises ValueError if the last dim is not a multiple of 32.
    """
    return qdq(fp8_qdq, x)


def linear(x: torch.Tensor, layer: nn.Module) -> torch.Tensor:
    """An FP8-format linear of x [..., K] -> [..., N] in the compute precision (fp32, or float64).

    ``layer`` is an ``nn.Linear`` (dequantised weight) or an ``Fp8Linear`` (checkpoint bytes); both
    quantise x first, as the official ``linear()`` does for an fp8 weight.
    """
    if isinstance(layer, Fp8Linear):
        return layer(x)
    w = layer.weight
    return up(F.linear(act_quant(x).to(w.dtype), w))


def grouped_linear(o: torch.Tensor, layer: nn.Module, groups: int) -> torch.Tensor:
    """wo_a: o [T, G, K/G] -> [T, G, R], group g through rows g*R:(g+1)*R of the weight; x NOT quantised.

    Official ``Attention.forward`` (the ``wo_a`` einsum over a bf16 weight, dequantised by convert.py).
    """
    if isinstance(layer, Fp8Linear):
        return layer.grouped(o, groups)
    wa = layer.weight.view(groups, -1, o.shape[-1])
    return up(torch.einsum("tgd,grd->tgr", o.to(wa.dtype), wa))


class Fp8Linear(nn.Module):
    """A bias-free linear holding its weight as stored: ``weight_q`` float8_e4m3fn [N, K] and
    ``weight_scale`` float8_e8m0fnu [ceil(N/32), ceil(K/32)] (buffers; no float copy is kept).

    ``compute_dtype`` is the dtype the replaced ``nn.Linear`` computed in (fp32, bf16 or float64); the
    CPU path dequantises to it so that results equal that module's bit for bit. Keep the buffers in their
    float8 dtypes: ``module.double()`` / ``.float()`` would convert them (move with ``.to(device)``).

    ``split_counters`` (int32 zeros, not saved) are the GEMM's split-K tile counters: one per 16 output columns
    (the smallest tile), so every launch shape fits; each launch leaves them zeroed. Kept here rather than
    allocated per call so that a decode step (and its CUDA graph) has no memset for them.
    """

    def __init__(self, weight_q: torch.Tensor, weight_scale: torch.Tensor, compute_dtype: torch.dtype = torch.float32):
        super().__init__()
        n, k = _check_weight(weight_q, weight_scale)
        self.in_features, self.out_features, self.compute_dtype = k, n, compute_dtype
        self.register_buffer("weight_q", weight_q)
        self.register_buffer("weight_scale", weight_scale)
        self.register_buffer("split_counters", split_counters(-(-n // 16), weight_q.device), persistent=False)

    @classmethod
    def from_float(cls, w: torch.Tensor, device: torch.device | str | None = None) -> "Fp8Linear":
        """Quantise a float weight [N, K] in 32x32 blocks (``kernels/quant/fp8_weight.py``) on ``device``.

        A weight already snapped to the format (``init.snap_to_formats``, a loaded checkpoint) dequantises
        back to exactly the same values. Does not modify ``w``.
        """
        w = w.detach().to(device if device is not None else w.device)
        q, s = quantize_fp8_weight(w.float() if w.dtype == torch.float64 else w, WEIGHT_BLOCK)
        return cls(q, s, compute_dtype=w.dtype)

    def dequantized(self) -> torch.Tensor:
        """The weight's values [N, K] in ``compute_dtype`` (exact: e4m3 x 2^k fits fp32 and bf16)."""
        w = dequantize_fp8_weight(self.weight_q, self.weight_scale, WEIGHT_BLOCK, torch.float32)
        return w.to(self.compute_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """act_quant(x) then the GEMM: x [..., K] -> [..., N] fp32 (float64 for float64 x). Mutates nothing
        (``split_counters`` are back to zero when the GEMM ends)."""
        if not x.is_cuda:
            return up(F.linear(act_quant(x).to(self.compute_dtype), self.dequantized()))
        rows = x.reshape(-1, self.in_features)
        if rows.dtype not in (torch.float32, torch.bfloat16):  # bf16 is read exactly; anything else via fp32
            rows = rows.float()
        y = fp8_gemm_fused(rows, self.weight_q, self.weight_scale, block_n=32, out_dtype=torch.float32,
                           counters=self.split_counters)
        return y.to(up(x[:0]).dtype).reshape(*x.shape[:-1], self.out_features)

    def grouped(self, o: torch.Tensor, groups: int) -> torch.Tensor:
        """The wo_a form (see ``grouped_linear``): o [T, G, K/G] -> [T, G, N/G], o not quantised."""
        t = o.shape[0]
        if not o.is_cuda:
            wa = self.dequantized().view(groups, -1, o.shape[-1])
            return up(torch.einsum("tgd,grd->tgr", o.to(wa.dtype), wa))
        # in the compute dtype, as the official bf16 einsum and the CPU path above read it: a bf16 model's o is
        # rounded to bf16 (one MMA per block, half the activation bytes), an fp32 model's stays fp32 (the kernel
        # splits it into bf16 high + low parts: two MMAs)
        a = o.reshape(t, -1).to(torch.bfloat16 if self.compute_dtype == torch.bfloat16 else torch.float32)
        y = fp8_gemm(a, None, self.weight_q, self.weight_scale, block_n=32,
                     groups=groups, out_dtype=torch.float32, counters=self.split_counters)
        return y.to(up(o[:0]).dtype).view(t, groups, -1)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, compute_dtype={self.compute_dtype}"


def _check_weight(q: torch.Tensor, s: torch.Tensor) -> tuple[int, int]:
    if not isinstance(q, torch.Tensor) or q.dim() != 2 or q.dtype != torch.float8_e4m3fn:
        raise ValueError(f"Fp8Linear: weight_q must be a float8_e4m3fn tensor [N, K], got {getattr(q, 'dtype', q)}")
    n, k = q.shape
    want = (-(-n // 32), -(-k // 32))
    if not isinstance(s, torch.Tensor) or s.dtype != torch.float8_e8m0fnu or tuple(s.shape) != want:
        got = f"{s.dtype} {tuple(s.shape)}" if isinstance(s, torch.Tensor) else type(s).__name__
        raise ValueError(f"Fp8Linear: weight_scale must be float8_e8m0fnu {want} for weight_q {tuple(q.shape)}, "
                         f"got {got}")
    if q.device != s.device:
        raise ValueError(f"Fp8Linear: weight_q and weight_scale must be on one device, got {q.device} and {s.device}")
    return n, k
