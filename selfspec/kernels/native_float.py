"""float32 or bfloat16 weights on native.c's own linear (`linear_dense`): the weight kept as it is
(a bfloat16 one is widened to float32 in registers: half the bytes of float32), float32 accumulation,
each output column one OpenMP thread's, up to 8 rows per read of a weight row. Row-exact by
construction (native.c). Measured against oneDNN's prepacked weights per machine (choice.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import native
from .base import EXACT_ROWS


class NativeFloat(native.NativeLinear):
    name = "native"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        super().__init__(*weight.shape, bias, dtype, weight.device)
        self.weight = weight.to(dtype).contiguous()  # the activations' float format
        self.kind = "bfloat16" if dtype == torch.bfloat16 else "float32"

    def tensors(self) -> tuple[torch.Tensor, None, None]:
        return self.weight, None, None

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()

    def dequantized(self) -> torch.Tensor:
        return self.weight.float()  # float32: the weight itself, not a copy (read it, never write it)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """More than EXACT_ROWS rows (a prompt) go to torch's float32 GEMM, blocked for the caches where
        linear_dense is built for a step's few rows: a 767-token prompt prefills in 1.7 s instead of 3.8 s
        (fp32; bf16, widened first, 2.0 s instead of 3.6 s, where torch's own bf16 GEMM is ~4x slower;
        AMD EPYC, 2 threads). Not row-exact, which a prompt's pass is not asked to be (base.EXACT_ROWS)."""
        if x.numel() // self.in_features > EXACT_ROWS:
            return F.linear(x.to(torch.float32), self.dequantized()).to(self.dtype)
        return super().matmul(x)

    def kernel(self, x: torch.Tensor, y: torch.Tensor, rows: int, threads: int) -> None:
        w, bf = self.weight, native.DTYPES[self.dtype]
        self.lib.linear_dense(x.data_ptr(), w.data_ptr(), y.data_ptr(), rows, *w.shape[::-1], bf, threads)
