"""quant_fp8: reference vs Triton byte identity, hand-derived bytes, round trip, validation."""

import pytest
import torch

from flashtier.kernels.quant.fp8 import (
    FP8_RECORD_BYTES,
    dequantize_fp8,
    fp8_qdq,
    pack_fp8_record,
    quantize_fp8,
    unpack_fp8_record,
)

from .quant_checks import assert_same_bytes, check_row_format_impls_agree, u8

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")


def check_impls_agree(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return check_row_format_impls_agree(x, quantize_fp8, dequantize_fp8, fp8_qdq, "codes")


def edge_blocks() -> dict[str, torch.Tensor]:
    """Named [rows, 64] inputs hitting the corners of the format."""
    grid = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # every finite e4m3 >= 0
    mids = (grid[1:] + grid[:-1]) / 2  # the exact ties
    vals = torch.cat([grid, mids, torch.nextafter(mids, torch.zeros(1)), torch.nextafter(mids, torch.full((1,), 1e9))])
    vals = torch.cat([vals, -vals, torch.tensor([-0.0, 1e-40, -1e-40, 2**-149])])
    vals = torch.cat([vals, torch.zeros(-vals.numel() % 63)]).reshape(-1, 63)
    ties = torch.cat([torch.full((vals.shape[0], 1), 448.0), vals], dim=1)  # amax 448 -> s = 1: x / s = x
    huge = torch.randn(5, 64) * 1e-3
    huge[:, 7] = torch.tensor([1e30, -3e38, 448.5, 1e6, -1e6])
    tiny = torch.tensor([0.0, 1e-5, 9.9e-5, 1e-4, 1.0001e-4, 1.1e-4, 2e-4, 1e-38]).repeat_interleave(64).reshape(8, 64)
    tiny = tiny * torch.linspace(-1, 1, 64)
    exps = torch.exp2(torch.randint(-60, 60, (64, 1)).float()) * torch.randn(64, 64)
    return {
        "zeros": torch.zeros(3, 64),
        "neg_zeros": torch.full((3, 64), -0.0),
        "grid_and_ties": ties,
        "huge_element": huge,
        "tiny_amax": tiny,
        "wide_exponents": exps,
        "plus_minus_448": torch.tensor([448.0, -448.0]).repeat(3, 32),
    }


@pytest.mark.parametrize("name", list(edge_blocks()))
def test_edge_inputs_reference_matches_triton(name):
    check_impls_agree(edge_blocks()[name])


def test_hand_derived_bytes():
    x = torch.zeros(4, 32)
    x[0, :5] = torch.tensor([448.0, 1.0, -1.0, 0.5, -0.0])
    x[1, 0] = 449.0
    x[2, 0] = 1.0  # amax 1: s = 2^ceil(log2(1/448)) = 2^-8
    codes, scales = quantize_fp8(x)
    assert scales[:, 0].tolist() == [127, 128, 119, 105]  # row 3: amax floor 1e-4 -> s = 2^-22
    assert codes[0, :5].tolist() == [0x7E, 0x38, 0xB8, 0x30, 0x80]
    assert codes[1, 0].item() == 0x76  # 449 / 2 = 224.5 -> 224 = 2^7 * 1.75: exponent 14, mantissa 6
    assert codes[2, 0].item() == 0x78  # 1 / 2^-8 = 256 = 2^8: exponent 15, mantissa 0
    assert codes[3].eq(0).all()
    for impl in ("reference", "triton"):
        assert torch.equal(quantize_fp8(x, impl=impl)[0], codes)


def test_round_trip_error_within_half_step():
    x = torch.randn(64, 512) * torch.exp2(torch.randint(-20, 20, (64, 1)).float())
    codes, scales = quantize_fp8(x)
    s = torch.exp2(scales.float() - 127).repeat_interleave(32, dim=-1)
    err = (dequantize_fp8(codes, scales) - x).abs()
    # e4m3 has 3 mantissa bits: half a step is <= 2^-4 |x| in the normal range, 2^-10 s among subnormals.
    assert (err <= torch.maximum(x.abs() * 2**-4, s * 2**-10)).all()


def test_qdq_is_idempotent():
    x = torch.randn(130, 512) * torch.exp2(torch.randint(-30, 30, (130, 1)).float())
    once = fp8_qdq(x)
    assert torch.equal(fp8_qdq(once).view(torch.int32), once.view(torch.int32))
    assert torch.equal(fp8_qdq(once, impl="triton").view(torch.int32), once.view(torch.int32))


def test_records_and_layout():
    assert FP8_RECORD_BYTES(512) == 528 and FP8_RECORD_BYTES(32) == 33
    x = torch.randn(2, 5, 512)
    codes, scales = quantize_fp8(x)
    rec = pack_fp8_record(codes, scales)
    assert rec.shape == (2, 5, 528) and rec.dtype == torch.uint8
    assert torch.equal(rec[..., :512], codes) and torch.equal(rec[..., 512:], scales)
    c2, s2 = unpack_fp8_record(rec, 512)
    assert torch.equal(c2, codes) and torch.equal(s2, scales)
    for impl in ("reference", "triton"):  # non-contiguous record views decode the same
        assert torch.equal(dequantize_fp8(c2, s2, impl=impl), dequantize_fp8(codes, scales))


def test_empty_and_non_contiguous_inputs():
    for impl in ("reference", "triton"):
        codes, scales = quantize_fp8(torch.randn(0, 64), impl=impl)
        assert codes.shape == (0, 64) and scales.shape == (0, 2)
    x = torch.randn(64, 40).t()  # [40, 64], not contiguous
    assert_same_bytes("codes", quantize_fp8(x, impl="reference")[0], quantize_fp8(x.contiguous(), impl="triton")[0])


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: quantize_fp8(torch.randn(4, 48)), "multiple of 32"),
        (lambda: quantize_fp8(torch.randn(4, 0)), "multiple of 32"),
        (lambda: quantize_fp8(torch.tensor(1.0)), "multiple of 32"),
        (lambda: quantize_fp8(torch.randn(4, 32, dtype=torch.float64)), "float32"),
        (lambda: quantize_fp8(torch.ones(4, 32, dtype=torch.int32)), "float32"),
        (lambda: quantize_fp8(torch.randn(4, 32), impl="cuda"), "impl"),
        (lambda: dequantize_fp8(torch.zeros(4, 32, dtype=torch.int8), u8(4, 1)), "uint8"),
        (lambda: dequantize_fp8(u8(4, 32), u8(4, 2)), r"\(4, 1\)"),
        (lambda: dequantize_fp8(u8(4, 32), u8(4, 1), torch.float64), "dtype"),
        (lambda: unpack_fp8_record(u8(4, 527), 512), "528"),
        (lambda: unpack_fp8_record(u8(4, 33), 33), "multiple of 32"),
        (lambda: FP8_RECORD_BYTES(500), "multiple of 32"),
    ],
)
def test_validation_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_triton_on_cpu_without_interpreter_is_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="CUDA"):
        quantize_fp8(torch.randn(1, 32), impl="triton")


def _nonfinite_blocks() -> torch.Tensor:
    x = torch.randn(4, 64)
    x[0, 3], x[1, 40], x[2, 0], x[3, 9] = float("nan"), float("inf"), float("-inf"), float("nan")
    x[3, 10] = float("inf")
    return x


def _bits_of_qdq_paths(x: torch.Tensor, fused) -> tuple[torch.Tensor, torch.Tensor]:
    from flashtier.kernels.quant.fp8 import _reference_dequantize_fp8, _reference_quantize_fp8

    two_pass = _reference_dequantize_fp8(*_reference_quantize_fp8(x), torch.float32)
    return fused(x).view(torch.int32), two_pass.view(torch.int32)


def _qdq_inputs() -> dict[str, torch.Tensor]:
    with torch.random.fork_rng():  # the same inputs whatever ran before the import
        torch.manual_seed(0)
        return {**edge_blocks(), "non_finite": _nonfinite_blocks(),
                "bf16_rows": torch.randn(33, 256).bfloat16().float() * 3}


QDQ_INPUTS = _qdq_inputs()


@pytest.mark.parametrize("name", list(QDQ_INPUTS))
def test_fused_reference_round_trip_is_bit_identical_to_the_byte_path(name):
    from flashtier.kernels.quant.fp8 import _reference_qdq_fp8

    fused, two_pass = _bits_of_qdq_paths(QDQ_INPUTS[name], _reference_qdq_fp8)
    assert torch.equal(fused, two_pass)
    assert torch.equal(fp8_qdq(QDQ_INPUTS[name], impl="reference").view(torch.int32), two_pass)  # the op takes it


def test_a_fused_round_trip_with_a_finer_scale_is_caught():
    """One power of two too fine (the scale rounded down): the largest elements clip; the check must see it."""
    from flashtier.kernels.quant.fp8 import E4M3_MAX, FP8_AMAX_FLOOR, e8m0_scale_bytes, e8m0_to_float

    def finer(x):
        r, d = x.shape
        b = x.reshape(r, d // 32, 32)
        amax = b.abs().amax(-1, keepdim=True).clamp_min(FP8_AMAX_FLOOR)
        scale = e8m0_to_float(e8m0_scale_bytes(amax, E4M3_MAX)) / 2
        return ((b / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).to(torch.float32) * scale).reshape(r, d)

    fused, two_pass = _bits_of_qdq_paths(QDQ_INPUTS["bf16_rows"], finer)
    assert not torch.equal(fused, two_pass)


def test_ceil_pow2_byte_equals_the_exponent_rule_on_every_exponent_and_edge():
    """Every exponent byte with sign and mantissa edges (0, 1, 0x400000, 0x7FFFFF) and 2^20 random patterns:
    zeros, subnormals, normals, infinities and NaNs of both signs."""
    from flashtier.kernels.quant.fp8_bits import ceil_pow2_byte

    def ceil_pow2_exponent(s):  # the rule as first written: exponent, plus one when a mantissa bit is set
        bits = s.view(torch.int32)
        return ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(torch.int32)

    exp = torch.arange(256, dtype=torch.int64)[:, None] << 23
    mant = torch.tensor([0, 1, 0x400000, 0x7FFFFF], dtype=torch.int64)[None, :]
    edges = torch.cat([(exp | mant).flatten(), (exp | mant).flatten() | (1 << 31)])
    g = torch.Generator().manual_seed(0)
    rand = torch.randint(0, 1 << 32, (1 << 20,), dtype=torch.int64, generator=g)
    bits = torch.cat([edges, rand])
    s = torch.where(bits >= 1 << 31, bits - (1 << 32), bits).to(torch.int32).view(torch.float32)
    assert torch.equal(ceil_pow2_byte(s), ceil_pow2_exponent(s).to(torch.uint8))
    assert not torch.equal(ceil_pow2_byte(s * 1.5), ceil_pow2_exponent(s).to(torch.uint8))  # the check can fail


def test_e4m3_to_float_decodes_every_byte_as_the_format_says():
    """The table decoder against the e4m3fn definition, byte by byte (sign, exponent bias 7, subnormals m * 2^-9,
    0x7F / 0xFF NaN), and against torch's own cast bit for bit; uint8 or float8 input, any shape and strides."""
    from flashtier.kernels.quant.fp8_bits import e4m3_to_float

    def by_definition(b: int) -> float:
        sign, e, m = -1.0 if b & 0x80 else 1.0, (b >> 3) & 0xF, b & 7
        if e == 15 and m == 7:
            return float("nan")
        return sign * (m * 2.0**-9 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))

    codes = torch.arange(256, dtype=torch.uint8).repeat(4)[:1024]  # the table's size (fewer codes take the cast)
    got = e4m3_to_float(codes)[:256]
    assert torch.equal(e4m3_to_float(codes[:256]).view(torch.int32), got.view(torch.int32))  # the cast path
    want = torch.tensor([by_definition(b) for b in range(256)], dtype=torch.float32)
    assert torch.equal(got.isnan(), want.isnan()) and int(got.isnan().sum()) == 2
    assert torch.equal(torch.nan_to_num(got), torch.nan_to_num(want))
    assert torch.equal(got.signbit()[~want.isnan()], want.signbit()[~want.isnan()])  # 0x80 is -0.0
    cast = codes.view(torch.float8_e4m3fn).to(torch.float32)
    assert torch.equal(e4m3_to_float(codes).view(torch.int32), cast.view(torch.int32))
    grid = codes.reshape(32, 32).t()  # non-contiguous, float8 view
    want_grid = cast.reshape(32, 32).t().view(torch.int32)
    assert torch.equal(e4m3_to_float(grid.view(torch.float8_e4m3fn)).view(torch.int32), want_grid)
    assert not torch.equal(torch.nan_to_num(e4m3_to_float(codes ^ 1)[:256]), torch.nan_to_num(want))  # can fail
