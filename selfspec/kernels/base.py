"""The one linear interface every kernel backend implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch

# Passes of up to this many rows (tokens) are row-exact: decoding steps, verifications and batches of
# them. A longer one is a prompt's (or a big batch's): computed for speed, its linears on a GEMM and its
# attention on one masked SDPA call (model.attention), so plain and speculative decoding still share it.
EXACT_ROWS = 64


class Linear(ABC):
    """y = x @ W.T + b [+ residual] for one weight W [out, in], stored the way its backend wants.

    `row_exact`: row i of a k-row call (k <= EXACT_ROWS) is bit-identical to a 1-row call on that row.
    Speculative verification runs k rows where plain decoding runs one, so fp32 greedy output equals
    plain greedy output exactly only when every linear is row-exact."""

    name: ClassVar[str]
    row_exact: ClassVar[bool]
    spec = None  # native.LinearSpec where native.c's `layers` can run this linear (the native backends)

    def __init__(
        self,
        out_features: int,
        in_features: int,
        bias: torch.Tensor | None,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        self.out_features, self.in_features = out_features, in_features
        self.dtype = dtype  # the activations' dtype, in and out
        self.device = torch.device(device)  # where the weight lives and the matmul runs (the weight's device)
        self.bias = None if bias is None else bias.to(device=self.device, dtype=dtype)

    @classmethod
    def unavailable(cls, dtype: torch.dtype, device: torch.device | str = "cpu") -> str | None:
        """Why this backend cannot run activations of `dtype` on `device` here (None: it can)."""
        return None

    @abstractmethod
    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, in] (self.dtype) -> [rows, out] (self.dtype), without bias."""

    @property
    @abstractmethod
    def nbytes(self) -> int:
        """Bytes a forward reads for this weight (its stored form, scales included)."""

    def argmax(self, x: torch.Tensor) -> torch.Tensor | None:
        """x [..., in] -> [...] int64: each row's argmax of this linear's output, in the activations' dtype,
        the first of equal maxima (as torch.argmax), where the backend finds it without every output (an LM
        head under greedy decoding); None where it cannot."""
        return None

    def dequantized(self) -> torch.Tensor:
        """[out, in] float32: the weight this backend multiplies by, whatever its stored form (for
        tests, error reports and draft-head initialisation)."""
        eye = torch.eye(self.in_features, dtype=self.dtype, device=self.device)
        return self.matmul(eye).float().t().contiguous()

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        shape = (*x.shape[:-1], self.out_features)
        y = self.matmul(x.reshape(-1, self.in_features)).view(shape)
        if self.bias is not None:
            y = y + self.bias
        return y if residual is None else residual + y

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.out_features}x{self.in_features}, {self.dtype})"
