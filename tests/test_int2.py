"""The 2-bit coarse head (kernels/native_int2.py): its codes and panels, its kernel against the 4-bit one on
the same weights, row-exactness, and which drafts use it."""

from __future__ import annotations

import pytest
import torch

from selfspec.decoding.quantized import SHORTLIST, SHORTLIST_2BIT, Shortlist, shortlist
from selfspec.kernels import native
from selfspec.kernels.native_dot import NativeInt4Dot
from selfspec.kernels.native_int2 import GROUP, NativeInt2Dot, quantize

pytestmark = pytest.mark.skipif(
    NativeInt2Dot.unavailable(torch.float32) is not None, reason=str(NativeInt2Dot.unavailable(torch.float32))
)


def weight(out: int, inn: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(out, inn, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("shape", [(16, 32), (37, 96), (100, 576)])
def test_codes_round_each_weight_to_the_nearest_of_four_levels(shape):
    """Each weight is within half a step of its group's level (q * s + m, q in 0..3), the group's least
    value is a level, and the panels hold exactly those codes, scales and offsets (dequantized)."""
    w = weight(*shape)
    codes, scale, offset = quantize(w)
    assert codes.max() <= 3 and codes.dtype == torch.uint8
    levels = (codes.float().view(shape[0], -1, GROUP) * scale[..., None] + offset[..., None]).view(shape)
    step = scale.repeat_interleave(GROUP, 1)
    assert ((levels - w).abs() <= step / 2 + 1e-3).all()
    assert torch.equal(NativeInt2Dot(w, None, torch.float32).dequantized(), levels)
    with pytest.raises(ValueError, match="float16"):
        quantize(w * 1e5)  # scales past float16's range


@pytest.mark.parametrize("rows", [1, 2, 5, 8, 13, 20])
def test_kernel_equals_the_4_bit_kernel_on_the_same_weights(rows):
    """The 2-bit codes read as 4-bit ones (codes 0..3 with the same scales and offsets) give the same bits
    through native4i8's kernel: the same integer products and float steps, only the bytes differ."""
    w = weight(37, 96, seed=rows)
    codes, scale, offset = quantize(w)
    two = NativeInt2Dot(w, None, torch.float32)
    four = NativeInt4Dot(None, None, torch.float32, _codes=(codes.to(torch.int64), scale, offset + 8 * scale))
    assert torch.equal(four.panels[..., 256:], two.panels[..., 128:])  # the same float16 scales and offsets
    x = weight(rows, 96, seed=100 + rows) * 3
    assert torch.equal(two.matmul(x), four.matmul(x))


def test_rows_are_exact_alone_and_in_a_batch():
    w, x = weight(100, 576), weight(20, 576, seed=1)
    lin = NativeInt2Dot(w, None, torch.float32)
    batch = lin.matmul(x)
    for r in (0, 7, 19):
        assert torch.equal(lin.matmul(x[r : r + 1])[0], batch[r])
    ref = x @ lin.dequantized().t()  # the int8 activations' rounding: well within 1 % of the largest value
    assert ((batch - ref).abs().max() / ref.abs().max()) < 0.02


def test_bfloat16_drafts_shortlist_a_2_bit_head_and_float32_a_4_bit_one(monkeypatch):
    """A bfloat16 draft's head scores in 2 bits and rescores its SHORTLIST_2BIT best from the float head
    (quantized.py says why); float32 keeps 4 bits, and bits=4 asks for them; a build without the 2-bit
    kernel gives 4 bits, and bits=2 None, with the reason."""
    w = weight(256, 64)
    two = shortlist(w.bfloat16())
    assert isinstance(two.coarse, NativeInt2Dot) and two.k == SHORTLIST_2BIT
    for four in (shortlist(w), shortlist(w.bfloat16(), 4)):
        assert isinstance(four, Shortlist) and not isinstance(four.coarse, NativeInt2Dot) and four.k == SHORTLIST
    assert two.nbytes < shortlist(w.bfloat16(), 4).nbytes
    x = weight(3, 64, seed=2).bfloat16()
    scores, coarse = two.matmul(x), two.coarse.matmul(x).float()
    top = coarse.topk(SHORTLIST_2BIT, -1).indices  # rescored from the float head's rows
    exact = (x.float() @ w.bfloat16().float().t()).bfloat16().float()
    assert torch.allclose(scores.gather(-1, top), exact.gather(-1, top), rtol=1e-2, atol=1e-2)
    monkeypatch.setattr(native.library(), "q2", False)  # a build without the kernel
    assert "AVX-512 BW" in NativeInt2Dot.unavailable(torch.bfloat16) and shortlist(w.bfloat16(), 2) is None
    assert not isinstance(shortlist(w.bfloat16()).coarse, NativeInt2Dot)
