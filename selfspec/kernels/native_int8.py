"""8-bit weights on native.c's own linear (`linear_q8`): int8 codes per output channel with one float32
scale each (the codes of int8.py: symmetric, w = q * scale), float32 activations and accumulation.
Each output column is one OpenMP thread's; row-exact by construction (native.c). torch's int8 kernel
(int8.py) computes in bfloat16; choice.py measures the two per machine."""

from __future__ import annotations

import torch

from . import native


class NativeInt8(native.NativeLinear):
    name = "native8"
    kind = "q8"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        super().__init__(*weight.shape, bias, dtype, weight.device)
        w = weight.float()
        self.scales = (w.abs().amax(dim=1).clamp(min=1e-12) / 127).contiguous()  # [out], symmetric per channel
        self.codes = torch.round(w / self.scales[:, None]).clamp(-127, 127).to(torch.int8).contiguous()

    @property
    def nbytes(self) -> int:
        return self.codes.numel() + self.scales.numel() * 4

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, None]:
        return self.codes, self.scales, None

    def dequantized(self) -> torch.Tensor:
        return self.codes.float() * self.scales[:, None]

    def kernel(self, x: torch.Tensor, y: torch.Tensor, rows: int, threads: int) -> None:
        q, s = self.codes, self.scales
        self.lib.linear_q8(x.data_ptr(), q.data_ptr(), s.data_ptr(), y.data_ptr(), rows, *q.shape[::-1], threads)
