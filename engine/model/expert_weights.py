"""One MoE layer's expert weights resident on a device in their checkpoint formats (no float copy).

``ExpertWeights`` holds the routed experts stacked in MXFP4 (e2m1 codes two per byte, even element in the
low nibble, one e8m0 scale per 32 along K) and the shared expert in FP8 (e4m3 codes, one ue8m0 scale per
32 x 32 block), as uint8 buffers laid out as ``kernels/moe/weights.py`` describes: w1 and w3 are fused
along the output axis (w1 first), so the grouped GEMM reads one tensor per projection.

    routed  w13_codes [E, 2I, D/2]  w13_scales [E, 2I, D/32]  w2_codes [E, D, I/2]  w2_scales [E, D, I/32]
    shared  s13_codes [2Is, D]      s13_scales [2Is/32, D/32]  s2_codes [D, Is]      s2_scales [D/32, Is/32]

Built from a module's float experts (``from_float``: each weight is quantised on the target device one
expert matrix at a time; lossless for weights already snapped to the formats) or from checkpoint bytes
(``from_packed``: copied as stored). The buffers are not part of ``state_dict()``: the container is a
serving form, and a model is saved from its float weights.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from flashtier.kernels.quant.fp8_weight import as_raw_bytes, quantize_fp8_weight
from flashtier.kernels.moe.grouped_gemm_reference import DenseExpert, dense_fp8_expert, dense_mxfp4_expert
from flashtier.kernels.moe.weights import FP8Expert, MXFP4Experts
from flashtier.kernels.quant.mxfp4 import quantize_mxfp4

Packed = tuple[torch.Tensor, torch.Tensor]  # (codes, scales) of one weight matrix, as stored


def _put(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    """Copy the raw bytes of ``src`` into ``dst`` (mutated), or raise ValueError naming ``what``."""
    src = as_raw_bytes(src)
    if tuple(src.shape) != tuple(dst.shape):
        raise ValueError(f"ExpertWeights.from_packed: {what} must have shape {list(dst.shape)}, got {list(src.shape)}")
    dst.copy_(src)


class ExpertWeights(nn.Module):
    """Routed experts (MXFP4) and shared expert (FP8) of one MoE layer on one device.

    ``impl`` is what the MoE forward passes to the kernels: "auto" (Triton on CUDA, reference elsewhere);
    tests set "triton" to run the kernels interpreted on the CPU.
    """

    def __init__(self, n_experts: int, dim: int, inter: int, shared_inter: int, device: torch.device | str):
        super().__init__()
        for name, v in (("n_experts", n_experts), ("dim", dim), ("inter", inter), ("shared_inter", shared_inter)):
            if not isinstance(v, int) or v < 1 or (name != "n_experts" and v % 32):
                raise ValueError(f"ExpertWeights: {name} must be a positive int (widths: multiples of 32), got {v!r}")
        self.n_experts, self.dim, self.inter, self.shared_inter = n_experts, dim, inter, shared_inter
        self.impl = "auto"
        shapes = {
            "w13_codes": (n_experts, 2 * inter, dim // 2), "w13_scales": (n_experts, 2 * inter, dim // 32),
            "w2_codes": (n_experts, dim, inter // 2), "w2_scales": (n_experts, dim, inter // 32),
            "s13_codes": (2 * shared_inter, dim), "s13_scales": (2 * shared_inter // 32, dim // 32),
            "s2_codes": (dim, shared_inter), "s2_scales": (dim // 32, shared_inter // 32),
        }
        for name, shape in shapes.items():
            self.register_buffer(name, torch.zeros(shape, dtype=torch.uint8, device=device), persistent=False)

    # ---- views the kernels take ------------------------------------------------------------
    def routed(self) -> MXFP4Experts:
        return MXFP4Experts(self.w13_codes, self.w13_scales, self.w2_codes, self.w2_scales)

    def shared(self) -> FP8Expert:
        return FP8Expert(self.s13_codes, self.s13_scales, self.s2_codes, self.s2_scales)

    def dense_expert(self, e: int) -> DenseExpert:
        """Routed expert ``e`` decoded to fp32 ``(w1, w3, w2)`` (tests and the CPU reference)."""
        return dense_mxfp4_expert(self.routed(), e)

    def dense_shared(self) -> DenseExpert:
        return dense_fp8_expert(self.shared())

    @property
    def nbytes(self) -> int:
        """Bytes resident on the device."""
        return sum(b.numel() for b in self.buffers())

    def expert_nbytes(self) -> int:
        """Bytes of one routed expert (what a token's visit to it reads)."""
        return sum(t[0].numel() for t in self.routed())

    # ---- construction ----------------------------------------------------------------------
    @classmethod
    @torch.no_grad()
    def from_float(cls, experts: Sequence[nn.Module], shared: nn.Module, device: torch.device | str) -> "ExpertWeights":
        """Quantise float experts (modules with ``w1/w2/w3`` Linear layers) onto ``device``.

        Reads the float weights without changing them. Only one weight matrix at a time exists in fp32 on
        the device. Raises ValueError when the experts' shapes disagree.
        """
        first = experts[0]
        inter, dim = first.w1.weight.shape
        out = cls(len(experts), dim, inter, shared.w1.weight.shape[0], device)

        def on_device(w: torch.Tensor) -> torch.Tensor:
            return w.detach().to(device=device, dtype=torch.float32)

        for e, ex in enumerate(experts):
            shapes = (ex.w1.weight.shape, ex.w3.weight.shape, ex.w2.weight.shape)
            if shapes != ((inter, dim), (inter, dim), (dim, inter)):
                raise ValueError(f"ExpertWeights.from_float: expert {e} has shapes unlike expert 0's")
            for rows, w in ((slice(0, inter), ex.w1.weight), (slice(inter, 2 * inter), ex.w3.weight)):
                codes, scales = quantize_mxfp4(on_device(w))
                out.w13_codes[e, rows], out.w13_scales[e, rows] = codes, scales
            out.w2_codes[e], out.w2_scales[e] = quantize_mxfp4(on_device(ex.w2.weight))
        si = out.shared_inter
        for rows, w in ((slice(0, si), shared.w1.weight), (slice(si, 2 * si), shared.w3.weight)):
            q, s = quantize_fp8_weight(on_device(w))
            out.s13_codes[rows], out.s13_scales[rows.start // 32 : rows.stop // 32] = as_raw_bytes(q), as_raw_bytes(s)
        q, s = quantize_fp8_weight(on_device(shared.w2.weight))
        out.s2_codes.copy_(as_raw_bytes(q))
        out.s2_scales.copy_(as_raw_bytes(s))
        return out

    @classmethod
    @torch.no_grad()
    def from_packed(
        cls,
        w1: Sequence[Packed],
        w3: Sequence[Packed],
        w2: Sequence[Packed],
        shared: tuple[Packed, Packed, Packed],
        device: torch.device | str,
    ) -> "ExpertWeights":
        """Copy checkpoint bytes onto ``device``: per routed expert the (I8/uint8 codes ``[N, K/2]``, E8M0 scales
        ``[N, K/32]``) of w1, w3 and w2, and the shared expert's (F8_E4M3 ``[N, K]``, E8M0 ``[N/32, K/32]``)
        for w1, w3, w2. Tensors are taken by their raw bytes (any one-byte dtype). Raises ValueError on any
        shape that does not fit expert 0's."""
        inter, half = w1[0][0].shape
        out = cls(len(w1), 2 * half, inter, shared[0][0].shape[0], device)
        if not len(w1) == len(w3) == len(w2):
            raise ValueError(
                f"ExpertWeights.from_packed: w1, w3, w2 must list every expert, got {len(w1)}, {len(w3)}, {len(w2)}"
            )
        for e in range(out.n_experts):
            for name, rows, (codes, scales) in (("w1", slice(0, inter), w1[e]), ("w3", slice(inter, 2 * inter), w3[e])):
                _put(out.w13_codes[e, rows], codes, f"expert {e} {name} codes")
                _put(out.w13_scales[e, rows], scales, f"expert {e} {name} scales")
            _put(out.w2_codes[e], w2[e][0], f"expert {e} w2 codes")
            _put(out.w2_scales[e], w2[e][1], f"expert {e} w2 scales")
        si = out.shared_inter
        for name, rows, (codes, scales) in (("w1", slice(0, si), shared[0]), ("w3", slice(si, 2 * si), shared[1])):
            _put(out.s13_codes[rows], codes, f"shared {name} codes")
            _put(out.s13_scales[rows.start // 32 : rows.stop // 32], scales, f"shared {name} scales")
        _put(out.s2_codes, shared[2][0], "shared w2 codes")
        _put(out.s2_scales, shared[2][1], "shared w2 scales")
        return out

    @torch.no_grad()
    def random_(self, seed: int = 0) -> "ExpertWeights":
        """Fill every buffer (mutated) with seeded N(0, 1/K) weights quantised on this device, one matrix at a
        time (seconds for a flash-16e layer on a GPU); returns self. For benchmarks and tests."""
        dev = self.w13_codes.device
        g = torch.Generator(device=dev).manual_seed(seed)
        randn = lambda rows, k: torch.randn(rows, k, generator=g, device=dev) / k**0.5  # noqa: E731
        for e in range(self.n_experts):
            self.w13_codes[e], self.w13_scales[e] = quantize_mxfp4(randn(2 * self.inter, self.dim))
            self.w2_codes[e], self.w2_scales[e] = quantize_mxfp4(randn(self.dim, self.inter))
        for codes, scales, (rows, k) in ((self.s13_codes, self.s13_scales, (2 * self.shared_inter, self.dim)),
                                         (self.s2_codes, self.s2_scales, (self.dim, self.shared_inter))):
            q, s = quantize_fp8_weight(randn(rows, k))
            codes.copy_(as_raw_bytes(q))
            scales.copy_(as_raw_bytes(s))
        return self

    def extra_repr(self) -> str:
        return (f"experts={self.n_experts}, dim={self.dim}, inter={self.inter}, shared_inter={self.shared_inter}, "
                f"{self.nbytes / 2**20:.1f} MiB on {self.w13_codes.device}")
