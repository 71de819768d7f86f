"""4-bit weights on native.c's own linear (`linear_q4`): groups of 32 along the input, two codes per
byte in GGUF's Q4 block order, a float32 scale and offset per group (w = q * s + m), float32
activations. A 4-bit GGUF's Q4_0 / Q4_1 codes go in as they are (`from_codes`). Each output column
is one OpenMP thread's; row-exact by construction (native.c). torch's int4 kernel (int4.py) computes
in bfloat16 and unpacks at ~5 GB/s on AVX2; choice.py measures the two per machine."""

from __future__ import annotations

import torch

from . import native
from .int4 import quantize

GROUP = 32


class NativeInt4(native.NativeLinear):
    name = "native4"
    kind = "q4"
    multiple = GROUP

    def __init__(
        self, weight: torch.Tensor | None, bias: torch.Tensor | None, dtype: torch.dtype, *, _codes=None
    ) -> None:
        codes, scale, zero = quantize(weight.float(), GROUP) if _codes is None else _codes  # w = (q - 8) s + z
        out_features, in_features = codes.shape
        super().__init__(out_features, in_features, bias, dtype, codes.device)
        if scale.shape[1] * GROUP != in_features:
            raise ValueError(f"native4: needs groups of {GROUP}, not {in_features // scale.shape[1]}")
        q = codes.to(torch.uint8).view(out_features, -1, GROUP)
        self.codes = (q[..., : GROUP // 2] | q[..., GROUP // 2 :] << 4).contiguous()  # [out, groups, 16]
        self.scale = scale.float().contiguous()  # [out, groups]
        self.offset = (zero.float() - 8 * self.scale).contiguous()  # m = z - 8 s

    @classmethod
    def from_codes(
        cls, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype
    ) -> NativeInt4:
        """codes [out, in] in 0..15 with w = (q - 8) * scale + zero per group of 32 (int4.Int4Codes)."""
        return cls(None, bias, dtype, _codes=(codes, scale, zero))

    @property
    def nbytes(self) -> int:
        return self.codes.numel() + (self.scale.numel() + self.offset.numel()) * 4

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.codes, self.scale, self.offset

    def kernel(self, x: torch.Tensor, y: torch.Tensor, rows: int, threads: int) -> None:
        q, s, m = self.codes, self.scale, self.offset
        inn, out = self.in_features, self.out_features
        self.lib.linear_q4(
            x.data_ptr(), q.data_ptr(), s.data_ptr(), m.data_ptr(), y.data_ptr(), rows, inn, out, threads
        )
