"""The reference backend: torch's own matmuls on a plain weight. On CPU one row goes through gemv,
which there is much faster than gemm with one row; several rows through F.linear. The two round a
row differently, so this backend is not row-exact (see base.Linear). On CUDA every call is F.linear
(cuBLAS), whose kernel choice also depends on the row count: not row-exact either."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .base import Linear


class Dense(Linear):
    name = "dense"
    row_exact = False

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        super().__init__(*weight.shape, bias, dtype, weight.device)
        w = weight.to(dtype)
        self._gemv = self.device.type == "cpu"  # one row through gemv (see above); cuBLAS picks its own kernel
        # Measured on CPU: float32 gemv/gemm read a column-major weight ~10% faster; bfloat16 gemv prefers
        # row-major. The logical shape stays [out, in] either way. (GPU: row-major, F.linear's own layout.)
        column_major = dtype == torch.float32 and self._gemv
        self.weight = w.t().contiguous().t() if column_major else w.contiguous()

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 1 and self._gemv:
            return torch.mv(self.weight, x[0])[None]
        return F.linear(x, self.weight)

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if residual is None or self.bias is not None:
            return super().__call__(x, residual)
        # The residual add fused into the BLAS call: bit-identical to a separate add in float32.
        shape = (*x.shape[:-1], self.out_features)
        x2, r = x.reshape(-1, self.in_features), residual.reshape(-1, self.out_features)
        if x2.shape[0] == 1 and self._gemv:
            return torch.addmv(r[0], self.weight, x2[0]).view(shape)
        return torch.addmm(r, x2, self.weight.t()).view(shape)
