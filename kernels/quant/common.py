"""Shared plumbing for the quantisation ops: impl dispatch, argument checks, row flattening, kernel launch.

Every quantisation op validates its arguments here (``ValueError`` naming the argument and its shape),
then picks an implementation with :func:`resolve_impl`. The row-block formats (FP8, FP4, MXFP4) are each one
:class:`RowBlockFormat`, whose methods are their public ops (checks, dispatch, reshaping) and launch their
Triton kernels through :func:`triton_quantize_rows`, :func:`triton_qdq_rows` and
:func:`triton_dequantize_rows`. Nothing here holds state.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl

IMPLS = ("auto", "reference", "triton")
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def resolve_impl(impl: str, t: torch.Tensor, op: str) -> str:
    """Return "reference" or "triton" for ``impl`` ("auto" = triton when ``t`` is on CUDA, else reference)."""
    if impl not in IMPLS:
        raise ValueError(f"{op}: impl must be one of {IMPLS}, got {impl!r}")
    if impl == "auto":
        return "triton" if t.is_cuda else "reference"
    # Triton reads TRITON_INTERPRET the same way when a kernel module is imported; without it a CPU
    # tensor cannot reach a kernel, and Triton's own error would not say why.
    if impl == "triton" and not t.is_cuda and os.environ.get("TRITON_INTERPRET", "0") != "1":
        raise ValueError(
            f"{op}: impl='triton' needs CUDA tensors (or TRITON_INTERPRET=1 for the CPU interpreter); "
            f"got a tensor on {t.device}. Use impl='reference' or impl='auto'."
        )
    return impl


def check_float_input(x: torch.Tensor, name: str, op: str, block: int) -> None:
    """Check that ``x`` is a float tensor ``[..., D]`` with ``D`` a positive multiple of ``block``."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{op}: {name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{op}: {name} must be float32, bfloat16 or float16, got {x.dtype} (shape {tuple(x.shape)})")
    if x.dim() == 0 or x.shape[-1] == 0 or x.shape[-1] % block != 0:
        raise ValueError(
            f"{op}: {name} must have shape [..., D] with D a positive multiple of {block}, got shape {tuple(x.shape)}"
        )


def check_last_dim(t: torch.Tensor, name: str, op: str, multiple: int) -> int:
    """Return the last dimension of ``t`` after checking it is a positive multiple of ``multiple``."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() == 0 or t.shape[-1] == 0 or t.shape[-1] % multiple != 0:
        raise ValueError(
            f"{op}: {name} must have shape [..., n] with n a positive multiple of {multiple}, got {tuple(t.shape)}"
        )
    return t.shape[-1]


def check_byte_tensor(t: torch.Tensor, name: str, op: str, last_dim: int, lead: torch.Size) -> None:
    """Check that ``t`` is uint8 with shape ``[*lead, last_dim]``."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.uint8:
        raise ValueError(f"{op}: {name} must be uint8 raw bytes, got {t.dtype} (shape {tuple(t.shape)})")
    expected = (*lead, last_dim)
    if tuple(t.shape) != expected:
        raise ValueError(f"{op}: {name} must have shape {expected}, got {tuple(t.shape)}")


def check_tensor(t, name: str, dtypes: tuple[torch.dtype, ...], shape: tuple[int | None, ...], op: str) -> None:
    """``t`` is a tensor of one of ``dtypes`` with ``len(shape)`` dims; ``None`` in ``shape`` = any size."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        names = " or ".join(str(d).replace("torch.", "") for d in dtypes)
        raise ValueError(f"{op}: {name} must be {names}, got {t.dtype} (shape {tuple(t.shape)})")
    want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
    if t.dim() != len(shape) or any(s is not None and s != n for s, n in zip(shape, t.shape)):
        raise ValueError(f"{op}: {name} must have shape {want}, got {tuple(t.shape)}")


def check_out_dtype(dtype: torch.dtype, op: str) -> None:
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"{op}: dtype must be float32, bfloat16 or float16, got {dtype}")


def check_same_device(a: torch.Tensor, b: torch.Tensor, names: str, op: str) -> None:
    if a.device != b.device:
        raise ValueError(f"{op}: {names} must be on one device, got {a.device} and {b.device}")


def check_record(rec: torch.Tensor, d: int, block: int, data_bytes: int, scale_bytes: int, op: str) -> None:
    """Check ``d`` and a packed record tensor ``uint8[..., data_bytes + scale_bytes]``."""
    if d <= 0 or d % block != 0:
        raise ValueError(f"{op}: D must be a positive multiple of {block}, got {d}")
    record_bytes = data_bytes + scale_bytes
    if not isinstance(rec, torch.Tensor) or rec.dtype != torch.uint8 or rec.dim() == 0:
        raise ValueError(f"{op}: rec must be a uint8 tensor [..., {record_bytes}]")
    if rec.shape[-1] != record_bytes:
        raise ValueError(
            f"{op}: rec must have shape [..., {record_bytes}] for D={d} ({data_bytes} data bytes + "
            f"{scale_bytes} scale bytes), got {tuple(rec.shape)}"
        )


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed as a contiguous 2-D ``[rows, last]`` tensor (copies only if ``t`` is not contiguous)."""
    return t.reshape(-1, t.shape[-1]).contiguous()


# Row-block kernels: the input [R, D] is cut into R * D // BLOCK blocks of BLOCK consecutive elements
# (D % BLOCK == 0, so no block straddles two rows), each with one scale byte; one program handles BLOCK_G
# consecutive blocks. A quantise kernel takes (p_x, p_data, p_scales, p_out, n_groups, ..., BLOCK_G, QDQ)
# and a dequantise kernel (p_data, p_scales, p_out, n_groups, ..., BLOCK_G, OUT_BF16).
_ELEMS_PER_PROGRAM = 2048


@triton.jit
def _row_block_offsets(n_groups, BLOCK: tl.constexpr, BLOCK_G: tl.constexpr):
    """This program's block indices ``o_g [BLOCK_G]`` (int64), the offsets ``o_g * BLOCK + [0, BLOCK)`` of
    their elements ``[BLOCK_G, BLOCK]``, and the mask ``o_g < n_groups``."""
    o_g = tl.program_id(0).to(tl.int64) * BLOCK_G + tl.arange(0, BLOCK_G)
    o_x = o_g[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    return o_g, o_x, o_g < n_groups


def _launch_row_blocks(kernel, n_groups: int, block: int, *args, **constexprs) -> None:
    """Run ``kernel(*args, n_groups, BLOCK_G=..., **constexprs)`` over ``n_groups`` blocks of ``block``
    elements, ``_ELEMS_PER_PROGRAM // block`` blocks per program (nothing to launch for zero blocks)."""
    if n_groups:
        block_g = _ELEMS_PER_PROGRAM // block
        kernel[(triton.cdiv(n_groups, block_g),)](*args, n_groups, BLOCK_G=block_g, **constexprs)


def triton_quantize_rows(
    kernel, x: torch.Tensor, block: int, data_cols: int, **constexprs
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise rows ``x [R, D]`` with a row-block ``kernel``: ``(data uint8[R, data_cols], scales uint8[R, D // block])``.

    ``data_cols`` is D for one byte per element, D // 2 for packed nibbles.
    """
    r, d = x.shape
    data = torch.empty((r, data_cols), dtype=torch.uint8, device=x.device)
    scales = torch.empty((r, d // block), dtype=torch.uint8, device=x.device)
    _launch_row_blocks(kernel, r * (d // block), block, x, data, scales, data, QDQ=False, **constexprs)
    return data, scales


def triton_qdq_rows(kernel, x: torch.Tensor, block: int, **constexprs) -> torch.Tensor:
    """Quantise and decode rows ``x [R, D]`` in one pass of a row-block ``kernel``: fp32 ``[R, D]``."""
    r, d = x.shape
    out = torch.empty((r, d), dtype=torch.float32, device=x.device)
    _launch_row_blocks(kernel, r * (d // block), block, x, out, out, out, QDQ=True, **constexprs)
    return out


def triton_dequantize_rows(
    kernel, data: torch.Tensor, scales: torch.Tensor, d: int, dtype: torch.dtype, block: int, **constexprs
) -> torch.Tensor:
    """Decode rows ``data [R, ...]`` with ``scales [R, d // block]`` by a row-block ``kernel``: ``dtype [R, d]``."""
    r = data.shape[0]
    out = torch.empty((r, d), dtype=dtype, device=data.device)
    bf16 = dtype == torch.bfloat16
    _launch_row_blocks(kernel, r * (d // block), block, data, scales, out, OUT_BF16=bf16, **constexprs)
    return out


@dataclass(frozen=True)
class RowBlockFormat:
    """A row-block format's ops: one scale byte per ``block`` consecutive elements of the last dimension.

    The data of a vector of D elements is ``uint8[D]`` (one code per element, ``packed=False``: FP8) or
    ``uint8[D // 2]`` (two e2m1 codes per byte, ``packed=True``: FP4, MXFP4); its scales ``uint8[D // block]``.
    A format module states its spec (``reference_quantize`` / ``reference_dequantize`` on rows ``[R, D]``) and
    its Triton kernels (launched with ``constexprs``); the methods here are its public ops, named after
    ``name`` in errors (``quantize_fp4``, ``dequantize_fp4``, ``fp4_qdq``, ``pack_fp4_record``, ...).
    """

    name: str
    block: int
    packed: bool
    reference_quantize: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    reference_dequantize: Callable[[torch.Tensor, torch.Tensor, torch.dtype], torch.Tensor]
    quantize_kernel: object
    dequantize_kernel: object
    constexprs: dict = field(default_factory=dict)
    # the reference round trip in one pass, bit-identical to dequantize(quantize(x)) (None: those two)
    reference_qdq: Callable[[torch.Tensor], torch.Tensor] | None = None

    @property
    def data_name(self) -> str:
        return "packed" if self.packed else "codes"

    def data_bytes(self, d: int) -> int:
        """Data bytes of a vector of ``d`` elements."""
        return d // 2 if self.packed else d

    def record_bytes(self, d: int) -> int:
        """Bytes of one packed record for ``d`` elements: data bytes, then ``d // block`` scale bytes."""
        if d <= 0 or d % self.block != 0:
            raise ValueError(
                f"{self.name.upper()}_RECORD_BYTES: D must be a positive multiple of {self.block}, got {d}"
            )
        return self.data_bytes(d) + d // self.block

    def quantize(self, x: torch.Tensor, impl: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
        """Quantise ``x [..., D]`` (fp32/bf16/fp16, D % block == 0): ``(data uint8[..., data_bytes(D)], scales
        uint8[..., D // block])``. ``impl``: "auto" (triton on CUDA, else reference), "reference" or "triton";
        both give identical bytes."""
        op = f"quantize_{self.name}"
        check_float_input(x, "x", op, self.block)
        impl = resolve_impl(impl, x, op)
        d = x.shape[-1]
        fn = self.reference_quantize if impl == "reference" else self._triton_quantize
        data, scales = fn(as_rows(x))
        return data.reshape(*x.shape[:-1], self.data_bytes(d)), scales.reshape(*x.shape[:-1], d // self.block)

    def dequantize(
        self, data: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32, impl: str = "auto"
    ) -> torch.Tensor:
        """Decode ``data uint8[..., data_bytes(D)]`` with ``scales uint8[..., D // block]`` to ``dtype [..., D]``
        (fp32, bf16 or fp16): the format's value in fp32, then cast with round-to-nearest-even."""
        op = f"dequantize_{self.name}"
        d = self._check_data_and_scales(data, scales, op)
        check_same_device(data, scales, f"{self.data_name} and scales", op)
        check_out_dtype(dtype, op)
        impl = resolve_impl(impl, data, op)
        fn = self.reference_dequantize if impl == "reference" else self._triton_dequantize
        return fn(as_rows(data), as_rows(scales), dtype).reshape(*data.shape[:-1], d)

    def qdq(self, x: torch.Tensor, impl: str = "auto") -> torch.Tensor:
        """``dequantize(*quantize(x))`` in fp32: the model's in-line fake quantisation (fused on GPU)."""
        op = f"{self.name}_qdq"
        check_float_input(x, "x", op, self.block)
        impl = resolve_impl(impl, x, op)
        rows = as_rows(x)
        if impl == "reference":
            if self.reference_qdq is not None:
                return self.reference_qdq(rows).reshape(x.shape)
            return self.reference_dequantize(*self.reference_quantize(rows), torch.float32).reshape(x.shape)
        return triton_qdq_rows(self.quantize_kernel, rows, self.block, **self.constexprs).reshape(x.shape)

    def pack_record(self, data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """``data uint8[..., data_bytes(D)]`` + ``scales uint8[..., D // block]`` -> ``uint8[..., record_bytes(D)]``
        (data, then scales)."""
        self._check_data_and_scales(data, scales, f"pack_{self.name}_record")
        return torch.cat((data, scales), dim=-1)

    def unpack_record(self, rec: torch.Tensor, d: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Split ``rec uint8[..., record_bytes(d)]`` into ``(data, scales)`` (views of ``rec``)."""
        n = self.data_bytes(d)
        check_record(rec, d, self.block, n, d // self.block, f"unpack_{self.name}_record")
        return rec[..., :n], rec[..., n:]

    def ops(self) -> tuple[Callable, ...]:
        """The format's public ops, in this order: quantize, dequantize, qdq, pack_record, unpack_record,
        record_bytes (a format module binds them to its own names: ``quantize_fp8``, ...)."""
        return self.quantize, self.dequantize, self.qdq, self.pack_record, self.unpack_record, self.record_bytes

    def _check_data_and_scales(self, data: torch.Tensor, scales: torch.Tensor, op: str) -> int:
        """Check ``data uint8[..., n]`` and ``scales uint8[..., D // block]``; return D."""
        per_byte = 2 if self.packed else 1
        n = check_last_dim(data, self.data_name, op, self.block // per_byte)
        check_byte_tensor(data, self.data_name, op, n, data.shape[:-1])
        check_byte_tensor(scales, "scales", op, n * per_byte // self.block, data.shape[:-1])
        return n * per_byte

    def _triton_quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return triton_quantize_rows(self.quantize_kernel, x, self.block, self.data_bytes(x.shape[1]), **self.constexprs)

    def _triton_dequantize(self, data: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        d = data.shape[1] * (2 if self.packed else 1)
        return triton_dequantize_rows(self.dequantize_kernel, data, scales, d, dtype, self.block, **self.constexprs)


def resolve_on_device(op: str, x: torch.Tensor, named: dict, impl: str) -> str:
    """Check every tensor in ``named`` is on ``x``'s device, then ``resolve_impl``; float64 ``x`` always runs the
    reference (the Triton paths take fp32 / bf16). ValueError naming the offending argument."""
    for name, t in named.items():
        if t.device != x.device:
            raise ValueError(f"{op}: {name} is on {t.device}, x on {x.device}: all inputs must be on one device")
    impl = resolve_impl(impl, x, op)
    if x.dtype == torch.float64:
        if impl == "triton":
            raise ValueError(f"{op}: the Triton path takes fp32 or bf16 x; float64 runs with impl='reference'")
        impl = "reference"
    return impl
