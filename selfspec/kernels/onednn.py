"""oneDNN with the weight packed once at load (`mkldnn._reorder_linear_weight`), float32 or bfloat16
(bfloat16 needs AVX-512 or AVX-NE-CONVERT; AMX when the CPU has it). F.linear re-packs the weight on
every multi-row call, which is what made verifying k tokens cost up to ~2 steps; packed once, a k-row
forward costs about one row's, and a row comes out bit-identical whatever k is."""

from __future__ import annotations

from functools import cache

import torch

from .base import Linear


class OneDNN(Linear):
    name = "onednn"
    row_exact = True

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        super().__init__(*weight.shape, bias, dtype, weight.device)
        self._nbytes = weight.numel() * dtype.itemsize
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.to(dtype).contiguous(), None)

    @classmethod
    def unavailable(cls, dtype: torch.dtype, device: torch.device | str = "cpu") -> str | None:
        if torch.device(device).type != "cpu":
            return "oneDNN's prepacked weights (mkldnn._reorder_linear_weight) are a CPU format"
        return _probe(dtype)

    @property
    def nbytes(self) -> int:
        return self._nbytes

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")


@cache
def _probe(dtype: torch.dtype) -> str | None:
    """Packs and runs a tiny weight once per dtype; the error, if any, is the reason."""
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN (mkldnn)"
    try:
        w = torch.ops.mkldnn._reorder_linear_weight(torch.ones(8, 16, dtype=dtype, device="cpu"), None)
        torch.ops.mkldnn._linear_pointwise(torch.ones(2, 16, dtype=dtype, device="cpu"), w, None, "none", [], "")
    except (RuntimeError, AttributeError) as e:
        return f"oneDNN {str(dtype).replace('torch.', '')} linear unavailable: {str(e).splitlines()[0]}"
    return None
