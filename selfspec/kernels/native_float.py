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

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(torch.float32).contiguous()
        y = x.new_empty(x.shape[0], self.out_features)
        self.lib.linear_dense(
            x.data_ptr(),
            self.weight.data_ptr(),
            y.data_ptr(),
            x.shape[0],
            self.in_features,
            self.out_features,
            native.DTYPES[self.dtype],
            torch.get_num_threads(),
        )
        return y.to(self.dtype)
