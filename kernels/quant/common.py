"""Shared plumbing for the quantisation ops: impl dispatch, argument checks, row flattening, kernel launch.

Every quantisation op validates its arguments here (``ValueError`` naming the argument and its shape),
then picks an implementation with :func:`resolve_impl`. The row-block ops (FP8, FP4, MXFP4) launch their
Triton kernels through :func:`triton_quantize_rows`, :func:`triton_qdq_rows` and
:func:`triton_dequantize_rows`. Nothing here holds state.
"""

from __future__ import annotations

import os

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
