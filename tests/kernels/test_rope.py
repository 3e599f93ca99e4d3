"""Rotary embedding (kernels/rope/op.py): Triton (CPU interpreter) against the torch reference, the inverse undoing
the rotation, and the argument checks. Tolerance 4e-6 absolute on O(1) values at positions < 70,000 (the angles
are equal fp32 products; cos / sin may differ by an ulp or two, |x| <= ~5).
"""

import os

import pytest
import torch

from flashtier.kernels.rope.op import rope_reference, rope_rotate

interp = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CPU Triton needs TRITON_INTERPRET=1")
# name: (x shape, rope_dim); heads in the middle, no-rope part absent, ragged D
SHAPES = {"q-heads": ((3, 4, 96), 64), "kv": ((5, 80), 16), "all-rope": ((2, 64), 64), "one": ((1, 2, 40), 8)}


def _case(shape, rope_dim, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    pos = torch.randint(0, 70000, (shape[0],), generator=g)
    freqs = 1.0 / (10000 ** (torch.arange(0, rope_dim, 2, dtype=torch.float64) / rope_dim)).float()
    return x, pos, freqs


@interp
@pytest.mark.parametrize("inverse", [False, True])
@pytest.mark.parametrize("name", list(SHAPES))
def test_triton_matches_reference(name, inverse):
    shape, r = SHAPES[name]
    x, pos, freqs = _case(shape, r, seed=len(name))
    got = rope_rotate(x, pos, freqs, r, inverse=inverse, impl="triton")
    want = rope_reference(x, pos, freqs, r, inverse)
    assert got.shape == want.shape and float((got - want).abs().max()) <= 4e-6
    assert torch.equal(got[..., : shape[-1] - r], x[..., : shape[-1] - r])  # the no-rope part is copied


@interp
def test_inverse_undoes_and_a_wrong_position_is_caught():
    x, pos, freqs = _case((4, 2, 64), 32, seed=3)
    back = rope_rotate(rope_rotate(x, pos, freqs, 32, impl="triton"), pos, freqs, 32, inverse=True, impl="triton")
    assert float((back - x).abs().max()) <= 1e-5
    moved = rope_rotate(x, pos + 1, freqs, 32, impl="triton")
    assert float((moved - rope_reference(x, pos, freqs, 32, False)).abs().max()) > 1e-2


def test_cpu_auto_is_the_reference_bit_for_bit():
    for dt in (torch.float32, torch.float64):
        x, pos, freqs = _case((3, 2, 48), 16, seed=5)
        x = x.to(dt)
        assert torch.equal(rope_rotate(x, pos, freqs, 16), rope_reference(x, pos, freqs, 16, False))


@pytest.mark.parametrize("kw, needle", [
    ({"rope_dim": 7}, "rope_dim must be an even int"), ({"rope_dim": 128}, "rope_dim must be an even int"),
    ({"pos": torch.zeros(2, dtype=torch.long)}, "pos must be an integer tensor"),
    ({"freqs": torch.zeros(3)}, "freqs must have shape"),
])
def test_bad_arguments(kw, needle):
    x, pos, freqs = _case((3, 64), 16)
    args = {"x": x, "pos": pos, "freqs": freqs, "rope_dim": 16} | kw
    with pytest.raises(ValueError, match=needle):
        rope_rotate(args["x"], args["pos"], args["freqs"], args["rope_dim"])
