"""float32 weights on native.c's own linear (`linear_f32`): the weight kept as it is, each output column
one OpenMP thread's, up to 4 rows per read of a weight row. Row-exact by construction (native.c).
Measured against oneDNN's prepacked weights per machine (choice.py); float32 only."""

from __future__ import annotations

import torch

from . import native
from .base import Linear


class NativeFloat(Linear):
    name = "native"
    row_exact = True

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        super().__init__(*weight.shape, bias, dtype, weight.device)
        why = self.unavailable(dtype, weight.device)
        if why:
            raise RuntimeError(why)
        if self.in_features % 16:
            raise ValueError(f"native: {self.in_features} input features are not a multiple of 16")
        self.weight = weight.to(torch.float32).contiguous()
        self.lib = native.library().lib

    @classmethod
    def unavailable(cls, dtype: torch.dtype, device: torch.device | str = "cpu") -> str | None:
        if torch.device(device).type != "cpu":
            return "native.c is CPU code"
        if dtype != torch.float32:
            return f"native float linears take float32 activations and weights, not {str(dtype)[6:]}"
        return native.unavailable()

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * 4

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        y = x.new_empty(x.shape[0], self.out_features)
        rows, threads = x.shape[0], torch.get_num_threads()
        self.lib.linear_f32(x.data_ptr(), self.weight.data_ptr(), y.data_ptr(), rows, *self.weight.shape[::-1], threads)
        return y
