"""quant_mxfp4: reference vs Triton byte identity, hand-derived bytes, round trip, idempotence."""

import pytest
import torch

from flashtier.kernels.quant.mxfp4 import (
    MXFP4_RECORD_BYTES,
    dequantize_mxfp4,
    mxfp4_qdq,
    pack_mxfp4_record,
    quantize_mxfp4,
    unpack_mxfp4_record,
)

from .quant_checks import assert_same_bytes, check_row_format_impls_agree, u8

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")

TIES = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]


def check_impls_agree(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return check_row_format_impls_agree(x, quantize_mxfp4, dequantize_mxfp4, mxfp4_qdq, "packed")


def edge_blocks() -> dict[str, torch.Tensor]:
    """Named [rows, 32] inputs hitting the corners of the format."""
    ties = torch.tensor([6.0, *TIES, -6.0, *[-t for t in TIES]] * 2)
    near = torch.cat([torch.nextafter(ties[:16], torch.zeros(1)), torch.nextafter(ties[:16], ties[:16] * 2)])
    near[0], near[16] = 6.0, 6.0  # amax 6 (s = 1)
    amaxes = torch.tensor([0.0, 1e-40, 1e-38, 6 * 2**-126, 3.0, 6.0, 6.01, 12.0, 3e38])
    unit = torch.randn(9, 32)
    unit = unit / unit.abs().amax(-1, keepdim=True)  # block amax exactly 1
    return {
        "zeros": torch.zeros(3, 32),
        "neg_zeros": torch.full((3, 32), -0.0),
        "plus_minus_6": torch.tensor([6.0, -6.0]).repeat(2, 16),
        "ties": ties.reshape(1, 32),
        "near_ties": near.reshape(1, 32),
        "ties_scaled": ties.reshape(1, 32) * torch.exp2(torch.tensor([[-126.0], [-100.0], [-3.0], [20.0], [120.0]])),
        "huge_element": torch.cat([torch.full((2, 1), 1e30), torch.randn(2, 31) * 1e-3], dim=1),
        "amax_scan": unit * amaxes[:, None],
        "tiny_and_negative": -torch.rand(4, 32) * torch.tensor([[1e-3], [1e-30], [1e-40], [2**-149]]),
        "wide_exponents": torch.exp2(torch.randint(-120, 120, (64, 1)).float()) * torch.randn(64, 32),
    }


@pytest.mark.parametrize("name", list(edge_blocks()))
def test_edge_inputs_reference_matches_triton(name):
    check_impls_agree(edge_blocks()[name])


def test_hand_derived_bytes():
    x = torch.tensor(
        [
            [0.0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.5, -1, -1.5, -2, -3, -4, -6, -0.0] * 2,
            [6.0, *TIES, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, -0.1] * 2,
        ]
    )
    for impl in ("reference", "triton"):
        packed, scales = quantize_mxfp4(x, impl=impl)
        assert scales[:, 0].tolist() == [127, 127]  # amax 6: s = 1
        assert packed[0].tolist() == [0x10, 0x32, 0x54, 0x76, 0xA9, 0xCB, 0xED, 0x8F] * 2
        # -0.0 -> code 8 (the sign bit, as the official kernel); ties to the even code: 0.25->0, 0.75->1,
        # 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4; -0.25 and -0.1 round to "negative zero", code 8 too
        assert packed[1].tolist() == [0x07, 0x22, 0x44, 0x66, 0xA8, 0xCA, 0xEC, 0x8E] * 2


@pytest.mark.parametrize(
    "amax, scale_byte, code",
    [
        (6.0, 127, 0x7),  # s = 1
        (6.01, 128, 0x5),  # s = 2: 3.005 -> 3
        (3.0, 126, 0x7),  # 3 / 6 = 0.5 exactly: s = 0.5
        (12.0, 128, 0x7),
        (12.000001, 129, 0x5),  # s = 4: 3.0000002 -> 3
        (0.0, 1, 0x0),  # floor 6 * 2^-126 -> s = 2^-126
        (1e-38, 1, 0x2),  # below the floor: 1e-38 / 2^-126 = 0.85 -> 1
    ],
)
def test_scale_bytes(amax, scale_byte, code):
    x = torch.zeros(1, 32)
    x[0, 0] = amax
    for impl in ("reference", "triton"):
        packed, scales = quantize_mxfp4(x, impl=impl)
        assert scales.item() == scale_byte and packed[0, 0].item() == code


def half_gap(a: torch.Tensor) -> torch.Tensor:
    """Half the distance between the e2m1 values around magnitude a (in units of s)."""
    return torch.where(a <= 2, 0.25, torch.where(a <= 4, 0.5, 1.0))


def test_round_trip_error_within_half_step():
    x = torch.randn(64, 512) * torch.exp2(torch.randint(-40, 40, (64, 1)).float())
    packed, scales = quantize_mxfp4(x)
    s = torch.exp2(scales.float() - 127).repeat_interleave(32, dim=-1)
    # s is rounded UP, so |x / s| <= 6 and nothing saturates.
    assert (x.abs() / s <= 6).all()
    assert ((dequantize_mxfp4(packed, scales) - x).abs() <= s * half_gap(x.abs() / s)).all()


def test_qdq_is_idempotent():
    x = torch.randn(130, 512) * torch.exp2(torch.randint(-100, 100, (130, 1)).float())
    once = mxfp4_qdq(x)
    assert bool((torch.signbit(once) & (once == 0)).any())  # small negatives became -0.0 (code 8) ...
    for impl in ("reference", "triton"):
        twice = mxfp4_qdq(once, impl=impl)
        assert torch.equal(twice.view(torch.int32), once.view(torch.int32))  # ... and stay -0.0: bitwise
        assert torch.equal(mxfp4_qdq(twice, impl=impl).view(torch.int32), twice.view(torch.int32))


def test_records_and_layout():
    assert MXFP4_RECORD_BYTES(128) == 68 and MXFP4_RECORD_BYTES(512) == 272
    x = torch.randn(3, 7, 128)
    packed, scales = quantize_mxfp4(x)
    rec = pack_mxfp4_record(packed, scales)
    assert rec.shape == (3, 7, 68)
    assert torch.equal(rec[..., :64], packed) and torch.equal(rec[..., 64:], scales)
    p2, s2 = unpack_mxfp4_record(rec, 128)
    assert torch.equal(p2, packed) and torch.equal(s2, scales)
    for impl in ("reference", "triton"):
        assert torch.equal(dequantize_mxfp4(p2, s2, impl=impl), dequantize_mxfp4(packed, scales))


def test_dequantize_every_byte_with_every_scale():
    # Row r gives block b the scale byte (r + b) % 256, and block b holds bytes 16b .. 16b + 15.
    packed = torch.arange(256, dtype=torch.uint8).repeat(256, 1)
    scales = ((torch.arange(256)[:, None] + torch.arange(16)[None, :]) % 256).to(torch.uint8)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        ref = dequantize_mxfp4(packed, scales, dtype, impl="reference")
        assert_same_bytes(f"dequantize {dtype}", ref, dequantize_mxfp4(packed, scales, dtype, impl="triton"))


def test_empty_and_non_contiguous_inputs():
    for impl in ("reference", "triton"):
        packed, scales = quantize_mxfp4(torch.randn(2, 0, 64), impl=impl)
        assert packed.shape == (2, 0, 32) and scales.shape == (2, 0, 2)
    x = torch.randn(64, 40).t()
    ref, tri = quantize_mxfp4(x, impl="reference")[0], quantize_mxfp4(x.contiguous(), impl="triton")[0]
    assert_same_bytes("packed", ref, tri)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: quantize_mxfp4(torch.randn(4, 16)), "multiple of 32"),
        (lambda: quantize_mxfp4(torch.randn(4, 32, dtype=torch.float64)), "float32"),
        (lambda: quantize_mxfp4(torch.randn(4, 32), impl=None), "impl"),
        (lambda: dequantize_mxfp4(u8(4, 16), u8(4, 2)), r"\(4, 1\)"),
        (lambda: dequantize_mxfp4(u8(4, 8), u8(4, 1)), "multiple of 16"),
        (lambda: dequantize_mxfp4(u8(4, 16), u8(3, 1)), r"\(4, 1\)"),
        (lambda: unpack_mxfp4_record(u8(4, 64), 128), "68"),
        (lambda: MXFP4_RECORD_BYTES(48), "multiple of 32"),
    ],
)
def test_validation_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()
