"""Weights in huge pages (kernels/pages.py): the same values at new addresses, in one
mapping advised for transparent huge pages, and nothing moved where it does not apply."""

import mmap

import pytest
import torch

from selfspec.kernels import Dense, pages

pytestmark = pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"), reason="no MADV_HUGEPAGE on this platform")


def test_place_moves_tensors_into_one_mapping_with_the_same_values():
    g = torch.Generator().manual_seed(0)
    bf = torch.bfloat16  # Dense keeps it row-major (contiguous); a float32 one is column-major, left alone
    a = Dense(torch.randn(2048, 640, generator=g), torch.randn(2048, generator=g), bf)
    b = Dense(torch.randn(300, 7, generator=g), None, bf)  # an odd size: the next starts aligned
    x = torch.randn(3, 640, generator=g).to(bf)
    before, weights = a(x), (a.weight.clone(), b.weight.clone())
    old = a.weight.data_ptr()
    moved = pages.place([a, b])
    assert moved >= a.weight.nbytes + a.bias.nbytes + b.weight.nbytes
    assert a.weight.data_ptr() != old and torch.equal(a.weight, weights[0]) and torch.equal(b.weight, weights[1])
    assert all(t.data_ptr() % pages.ALIGN == 0 for t in (a.weight, a.bias, b.weight))
    assert min(t.data_ptr() for t in (a.weight, a.bias, b.weight)) % pages.HUGE == 0  # the advised range
    assert torch.equal(a(x), before)


def test_nothing_moves_below_a_huge_page_or_when_turned_off(monkeypatch):
    small = Dense(torch.randn(16, 32), None, torch.float32)
    ptr = small.weight.data_ptr()
    assert pages.place([small]) == 0 and small.weight.data_ptr() == ptr
    big = Dense(torch.randn(2048, 1024), None, torch.bfloat16)
    monkeypatch.setenv("SELFSPEC_HUGE_PAGES", "0")
    ptr = big.weight.data_ptr()
    assert pages.place([big]) == 0 and big.weight.data_ptr() == ptr
