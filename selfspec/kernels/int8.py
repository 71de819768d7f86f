"""int8 weight-only: each output channel's weights as int8 codes with one scale
(`aten._weight_int8pack_mm`): a quarter of the float32 bytes. The kernel runs in bfloat16 whatever the
activations' dtype (its float32 path is a scalar loop, ~7x slower on the CPUs measured).

On CUDA torch has no int8 weight-only matmul (`_weight_int8pack_mm` is CPU/MPS only): the codes times
their scales are stored dequantized in the activations' dtype and run through F.linear. The weight
computes the same int8-rounded values, so an int8 draft drafts what it drafts on CPU (to kernel
rounding), but it saves neither memory nor bandwidth there (`CUDA_NOTE`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .base import Linear

COMPUTE = torch.bfloat16
CUDA_NOTE = (
    "int8 on cuda: torch has no CUDA int8 weight-only matmul (_weight_int8pack_mm is CPU/MPS only); "
    "the int8-rounded weights are stored dequantized in the activations' dtype (F.linear): same values, "
    "no memory or bandwidth saved"
)


class Int8(Linear):
    name = "int8"
    row_exact = True  # on CPU; see CUDA_NOTE (the plan records row_exact False there)

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        super().__init__(*weight.shape, bias, dtype, weight.device)
        w = weight.float()
        scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127  # [out], symmetric per channel
        self.codes = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8).contiguous()  # [out, in]
        self.scales = scale.to(COMPUTE)
        # CUDA: [out, in] in the activations' dtype (no int8 kernel there, see above); CPU: None.
        self.weight = self.dequantized().to(dtype) if self.device.type != "cpu" else None

    @property
    def nbytes(self) -> int:
        if self.weight is not None:
            return self.weight.numel() * self.weight.element_size()
        return self.codes.numel() + self.scales.numel() * self.scales.element_size()

    def dequantized(self) -> torch.Tensor:
        # Codes times their scales directly: the base class's identity matmul costs ~30 ms per weight,
        # and the loader asks every re-quantized weight for its error.
        return self.codes.float() * self.scales.float()[:, None]

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight is not None:
            return F.linear(x, self.weight)
        return torch.ops.aten._weight_int8pack_mm(x.to(COMPUTE), self.codes, self.scales).to(self.dtype)
