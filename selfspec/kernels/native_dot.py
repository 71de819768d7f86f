"""The 8-bit and 4-bit weights of native8 / native4 on int8 activations (native.c's `linear_q8_i8`,
`linear_q4_i8`): each row of activations is quantized in blocks of 32 (llama.cpp's Q8 blocks) and
multiplied with the weight codes in int32 (AVX2's vpmaddubsw), fewer instructions than widening every
code to float (a 1536x576 int4 weight: 0.063 against 0.088 ms, mean of a 1- and a 5-row call, AMD EPYC). The cost is
a second rounding: of the activations, ~0.4 % of a block's largest value, on top of the weights' own.
Row-exact like the float kernels (a row's blocks are its own). Needs AVX2; choice.py measures these
against the float-activation kernels per machine."""

from __future__ import annotations

import torch

from . import native
from .native_int4 import NativeInt4
from .native_int8 import NativeInt8


def _missing() -> str | None:
    lib = native.library()
    if lib is not None and not lib.dot_i8:
        return "native.c's int8 dot products need AVX2, which this build lacks"
    return None


class NativeInt4Dot(NativeInt4):
    name = "native4i8"
    kind = "q4_i8"

    @classmethod
    def unavailable(cls, dtype: torch.dtype, device: torch.device | str = "cpu") -> str | None:
        return super().unavailable(dtype, device) or _missing()

    def kernel(self, x: torch.Tensor, y: torch.Tensor, rows: int, threads: int) -> None:
        q, s, m = self.codes, self.scale, self.offset
        inn, out = self.in_features, self.out_features
        self.lib.linear_q4_i8(
            x.data_ptr(), q.data_ptr(), s.data_ptr(), m.data_ptr(), y.data_ptr(), rows, inn, out, threads
        )


class NativeInt8Dot(NativeInt8):
    name = "native8i8"
    kind = "q8_i8"
    multiple = 32

    @classmethod
    def unavailable(cls, dtype: torch.dtype, device: torch.device | str = "cpu") -> str | None:
        return super().unavailable(dtype, device) or _missing()

    def kernel(self, x: torch.Tensor, y: torch.Tensor, rows: int, threads: int) -> None:
        q, s = self.codes, self.scales
        self.lib.linear_q8_i8(x.data_ptr(), q.data_ptr(), s.data_ptr(), y.data_ptr(), rows, *q.shape[::-1], threads)
