"""float32 or bfloat16 weights on native.c's own linear (`linear_dense`): the weight kept as it is
(a bfloat16 one is widened to float32 in registers: half the bytes of float32), float32 accumulation,
each output column one OpenMP thread's, up to 4 rows per read of a weight row. Row-exact by
construction (native.c). Measured against oneDNN's prepacked weights per machine (choice.py)."""

from __future__ import annotations

import torch

from . import native


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

    def kernel(self, x: torch.Tensor, y: torch.Tensor, rows: int, threads: int) -> None:
        w, bf = self.weight, native.DTYPES[self.dtype]
        self.lib.linear_dense(x.data_ptr(), w.data_ptr(), y.data_ptr(), rows, *w.shape[::-1], bf, threads)
