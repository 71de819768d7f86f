"""int8 weight-only: each output channel's weights as int8 codes with one scale
(`aten._weight_int8pack_mm`): a quarter of the float32 bytes. The kernel runs in bfloat16 whatever the
activations' dtype (its float32 path is a scalar loop, ~7x slower on the CPUs measured)."""

from __future__ import annotations

import torch

from .base import Linear

COMPUTE = torch.bfloat16


class Int8(Linear):
    name = "int8"
    row_exact = True

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        super().__init__(*weight.shape, bias, dtype)
        w = weight.float()
        scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127  # [out], symmetric per channel
        self.codes = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8).contiguous()  # [out, in]
        self.scales = scale.to(COMPUTE)

    @property
    def nbytes(self) -> int:
        return self.codes.numel() + self.scales.numel() * self.scales.element_size()

    def dequantized(self) -> torch.Tensor:
        # Codes times their scales directly: the base class's identity matmul costs ~30 ms per weight,
        # and the loader asks every re-quantized weight for its error.
        return self.codes.float() * self.scales.float()[:, None]

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x.to(COMPUTE), self.codes, self.scales).to(self.dtype)
