"""int4 weight-only in groups along the input dimension (`aten._weight_int4pack_mm_for_cpu`): per group
of `group` weights a scale and a zero, w = (q - 8) * scale + zero with 4-bit codes q. An eighth of
the float32 bytes plus the scales. Built from float weights (asymmetric min/max per group, as GGUF's
Q4_1) or straight from a 4-bit GGUF's own codes (`from_codes`).

The kernel runs in bfloat16 (activations and scales) whatever the activations' dtype: its float32
path is a scalar loop, 10x slower on the CPUs measured (AVX2 and AVX-512 alike). So a Q4_1 weight
computes the GGUF's values to bfloat16 rounding of its scales, close to but not bit-identical with
the dequantized float model."""

from __future__ import annotations

from functools import cache

import torch

from .base import Linear

GROUPS = (32, 64, 128)
Int4Codes = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # codes [out, in] 0..15, scale, zero [out, in / g]
INNER_K_TILES = 2  # the CPU kernel's packing parameter (2, 4 or 8 tiles of 16 along K)
COMPUTE = torch.bfloat16  # the kernel's activations and scales (see above)


class Int4(Linear):
    name = "int4"
    row_exact = True

    def __init__(
        self,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        dtype: torch.dtype,
        group: int = 32,
        *,
        _codes=None,
    ) -> None:
        if group not in GROUPS:
            raise ValueError(f"int4 group={group} is invalid: use one of {GROUPS}")
        if _codes is None:
            _codes = quantize(weight.float(), group)
        codes, scale, zero = _codes  # [out, in] int 0..15, [out, in / group] x 2
        out_features, in_features = codes.shape
        if in_features % group:
            raise ValueError(f"int4: {in_features} input features are not a multiple of the group size {group}")
        super().__init__(out_features, in_features, bias, dtype)
        self.group = group
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            codes.to(torch.int32).contiguous(), INNER_K_TILES
        )
        sz = torch.stack([scale, zero], -1).transpose(0, 1).contiguous()  # [in / g, out, 2]
        self.scales_zeros = sz.to(COMPUTE)

    @classmethod
    def from_codes(
        cls, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype
    ) -> Int4:
        """codes [out, in] in 0..15 with w = (q - 8) * scale + zero per group of in / scale.shape[1]."""
        return cls(None, bias, dtype, codes.shape[1] // scale.shape[1], _codes=(codes, scale.float(), zero.float()))

    @classmethod
    def unavailable(cls, dtype: torch.dtype) -> str | None:
        return _probe(dtype)

    @property
    def nbytes(self) -> int:
        return (
            self.packed.numel() * self.packed.element_size()
            + self.scales_zeros.numel() * self.scales_zeros.element_size()
        )

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(COMPUTE), self.packed, self.group, self.scales_zeros)
        return y.to(self.dtype)


def quantize(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [out, in] float32 -> (codes [out, in] 0..15, scale, zero [out, in / group]), asymmetric per group."""
    out, inn = w.shape
    g = w.view(out, inn // group, group)
    low, high = g.amin(-1), g.amax(-1)
    scale = ((high - low) / 15).clamp(min=1e-12)
    codes = torch.round((g - low[..., None]) / scale[..., None]).clamp(0, 15).to(torch.uint8).view(out, inn)
    return codes, scale, low + 8 * scale


@cache
def _probe(dtype: torch.dtype) -> str | None:
    try:
        Int4(torch.ones(16, 64), None, dtype)(torch.ones(2, 64, dtype=dtype))
    except (RuntimeError, AttributeError, NotImplementedError) as e:
        return f"int4 {str(dtype).replace('torch.', '')} kernel unavailable: {str(e).splitlines()[0]}"
    return None
