"""quant_fp4 (NVFP4 without global scale): reference vs Triton byte identity, hand-derived bytes, round trip."""

import pytest
import torch

from flashtier.kernels.quant.fp4 import (
    FP4_RECORD_BYTES,
    dequantize_fp4,
    fp4_qdq,
    pack_fp4_record,
    quantize_fp4,
    unpack_fp4_record,
)

from .quant_checks import assert_same_bytes, check_row_format_impls_agree, u8


def check_impls_agree(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return check_row_format_impls_agree(x, quantize_fp4, dequantize_fp4, fp4_qdq, "packed")


TIES = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]


def edge_blocks() -> dict[str, torch.Tensor]:
    """Named [rows, 32] inputs hitting the corners of the format."""
    ties = torch.tensor([6.0, *TIES, -6.0, *[-t for t in TIES]])
    near_ties = torch.cat([torch.nextafter(ties, torch.zeros(1)), torch.nextafter(ties, ties * 2)])
    near_ties[0], near_ties[16] = 6.0, 6.0  # keep amax 6 (s = 1) in both blocks
    ramp = torch.linspace(-7, 7, 32)  # |x| up to 7 with s from amax 7: saturation at 6 after RNE of 7/6
    scales = torch.tensor([1e-4, 6 * 2**-9, 0.0117, 0.0118, 6.375, 7.125, 2688.0, 2700.0, 1e5])
    unit = torch.randn(9, 32)
    unit = unit / unit.abs().amax(-1, keepdim=True)  # block amax exactly 1
    return {
        "zeros": torch.zeros(3, 32),
        "neg_zeros": torch.full((3, 32), -0.0),
        "plus_minus_6": torch.tensor([6.0, -6.0]).repeat(2, 16),
        "ties": torch.cat([ties, ties, ties, ties]).reshape(2, 32),
        "near_ties": near_ties.reshape(1, 32),
        "ties_scaled": torch.cat([ties, ties]).reshape(1, 32) * torch.tensor([[0.1], [3.0], [1e-3], [400.0]]),
        "saturating_ramp": ramp.repeat(3, 1) * torch.tensor([[1.0], [100.0], [1e4]]),
        "huge_element": torch.cat([torch.full((1, 1), 1e30), torch.randn(1, 31) * 1e-3], dim=1),
        "amax_scan": unit * scales[:, None],
        "tiny_and_negative": -torch.rand(4, 32) * torch.tensor([[1e-3], [1e-6], [1e-40], [2**-149]]),
        "wide_exponents": torch.exp2(torch.randint(-60, 60, (64, 1)).float()) * torch.randn(64, 32),
    }


@pytest.mark.parametrize("name", list(edge_blocks()))
def test_edge_inputs_reference_matches_triton(name):
    check_impls_agree(edge_blocks()[name])


def test_hand_derived_bytes():
    x = torch.tensor(
        [
            [0.0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.5, -1, -1.5, -2, -3, -4, -6, -0.0],
            [6.0, *TIES, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, -0.1],
        ]
    )
    for impl in ("reference", "triton"):
        packed, scales = quantize_fp4(x, impl=impl)
        assert scales[:, 0].tolist() == [0x38, 0x38]  # amax 6: s = e4m3(1.0)
        assert packed[0].tolist() == [0x10, 0x32, 0x54, 0x76, 0xA9, 0xCB, 0xED, 0x8F]
        # -0.0 -> code 8 (the sign bit, as the official kernel); ties to the even code: 0.25->0, 0.75->1,
        # 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4; -0.25 and -0.1 round to "negative zero", code 8 too
        assert packed[1].tolist() == [0x07, 0x22, 0x44, 0x66, 0xA8, 0xCA, 0xEC, 0x8E]


@pytest.mark.parametrize(
    "amax, scale_byte",
    [
        (6.0, 0x38),  # s = 1.0
        (6.375, 0x38),  # 1.0625 is a tie between 1.0 and 1.125: RNE -> 1.0
        (7.125, 0x3A),  # 1.1875 is a tie between 1.125 and 1.25: RNE -> 1.25
        (0.0, 0x01),  # floor 6 * 2^-9 -> s = 2^-9, the smallest subnormal
        (1e-3, 0x01),
        (2688.0, 0x7E),  # 448
        (1e5, 0x7E),  # clamped to 448
    ],
)
def test_scale_bytes(amax, scale_byte):
    x = torch.zeros(1, 16)
    x[0, 3] = amax
    for impl in ("reference", "triton"):
        assert quantize_fp4(x, impl=impl)[1].item() == scale_byte


def test_saturation_to_six():
    x = torch.zeros(2, 16)
    x[0, :2] = torch.tensor([6.375, -6.375])  # s = 1.0 (RNE down), so |x / s| > 6
    x[1, :2] = torch.tensor([1e5, -1e5])  # s = 448
    packed, _ = quantize_fp4(x)
    assert packed[:, 0].tolist() == [0xF7, 0xF7]
    assert dequantize_fp4(packed, quantize_fp4(x)[1])[1, :2].tolist() == [2688.0, -2688.0]


def half_gap(a: torch.Tensor) -> torch.Tensor:
    """Half the distance between the e2m1 values around magnitude a (in units of s)."""
    return torch.where(a <= 2, 0.25, torch.where(a <= 4, 0.5, 1.0))


def test_round_trip_error_within_half_step():
    x = torch.randn(64, 512) * torch.exp2(torch.randint(-5, 8, (64, 1)).float())
    packed, scales = quantize_fp4(x)
    s = scales.view(torch.float8_e4m3fn).float().repeat_interleave(16, dim=-1)
    a = x.abs() / s
    bound = s * half_gap(a.clamp(max=6)) + (x.abs() - 6 * s).clamp(min=0)
    assert ((dequantize_fp4(packed, scales) - x).abs() <= bound * (1 + 1e-6)).all()


def test_records_and_layout():
    assert FP4_RECORD_BYTES(512) == 288 and FP4_RECORD_BYTES(16) == 9
    x = torch.randn(2, 5, 512)
    packed, scales = quantize_fp4(x)
    rec = pack_fp4_record(packed, scales)
    assert rec.shape == (2, 5, 288)
    assert torch.equal(rec[..., :256], packed) and torch.equal(rec[..., 256:], scales)
    p2, s2 = unpack_fp4_record(rec, 512)
    assert torch.equal(p2, packed) and torch.equal(s2, scales)
    for impl in ("reference", "triton"):
        assert torch.equal(dequantize_fp4(p2, s2, impl=impl), dequantize_fp4(packed, scales))


def test_dequantize_every_byte_with_every_scale():
    # Row r gives block b the scale byte (r + b) % 256, and block b holds bytes 8b .. 8b + 7,
    # so every (code byte, scale byte) pair appears, NaN scales 0x7F / 0xFF included.
    packed = torch.arange(256, dtype=torch.uint8).repeat(256, 1)
    scales = ((torch.arange(256)[:, None] + torch.arange(32)[None, :]) % 256).to(torch.uint8)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        ref = dequantize_fp4(packed, scales, dtype, impl="reference")
        assert_same_bytes(f"dequantize {dtype}", ref, dequantize_fp4(packed, scales, dtype, impl="triton"))


def test_empty_and_non_contiguous_inputs():
    for impl in ("reference", "triton"):
        packed, scales = quantize_fp4(torch.randn(0, 32), impl=impl)
        assert packed.shape == (0, 16) and scales.shape == (0, 2)
    x = torch.randn(32, 40).t()
    assert_same_bytes("packed", quantize_fp4(x, impl="reference")[0], quantize_fp4(x.contiguous(), impl="triton")[0])


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: quantize_fp4(torch.randn(4, 24)), "multiple of 16"),
        (lambda: quantize_fp4(torch.randn(4, 16, dtype=torch.float64)), "float32"),
        (lambda: quantize_fp4(torch.randn(4, 16), impl="fast"), "impl"),
        (lambda: dequantize_fp4(u8(4, 8), u8(4, 2)), r"\(4, 1\)"),
        (lambda: dequantize_fp4(u8(4, 6), u8(4, 1)), "multiple of 8"),
        (lambda: dequantize_fp4(torch.zeros(4, 8), u8(4, 1)), "uint8"),
        (lambda: unpack_fp4_record(u8(4, 287), 512), "288"),
        (lambda: FP4_RECORD_BYTES(24), "multiple of 16"),
    ],
)
def test_validation_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_empty_rows_round_trip(impl):
    """Zero rows is a legal batch (a chunk that completes no compressed entry)."""
    from flashtier.kernels.quant.fp8 import fp8_qdq
    from flashtier.kernels.quant.mxfp4 import mxfp4_qdq

    for op in (fp4_qdq, mxfp4_qdq, fp8_qdq):
        assert op(torch.zeros(0, 64), impl=impl).shape == (0, 64)
