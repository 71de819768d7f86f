"""2-bit weights on int8 activations (native.c's `linear_q2_i8`), for the quantized draft's coarse LM head
alone: a head's scores only have to rank the vocabulary, since the shortlist rescores its best from the
float head (decoding/quantized.py). Groups of 32 inputs, w = q * s + m with q in 0..3, s and m float16
per group (the group's range over 3 levels, and its least value): 3 bits a weight, so the default
model's 49152 x 576 head reads 10.6 MB where the 4-bit one reads 17.7. The same panels of 16 output
columns and the same integer products as native4i8 (native_dot.py), with four codes to a byte."""

from __future__ import annotations

import torch

from . import native
from .native_float import PANEL, padded

GROUP = 32
LEVELS = 3  # the largest code


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [out, in] -> codes [out, in] uint8 in 0..LEVELS, scale and offset [out, in / GROUP] float32,
    each rounded to float16 first (what the panels hold) so that the codes fit the values used."""
    g = weight.float().reshape(weight.shape[0], -1, GROUP)
    offset = g.amin(-1).half().float()
    scale = ((g.amax(-1) - offset) / LEVELS).half().float()
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    if not (torch.isfinite(scale).all() and torch.isfinite(offset).all()):
        raise ValueError("native2i8: a scale or offset is out of float16's range")
    codes = ((g - offset[..., None]) / safe[..., None]).round().clamp(0, LEVELS).to(torch.uint8)
    return codes.reshape(weight.shape), scale, offset


def pack(codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """codes [out, in] in 0..3, scale / offset [out, groups] -> native.c's 2-bit panels [ceil(out / 16),
    groups, 192] bytes: per panel and group 2 chunks of 64 code bytes (chunk k, byte 4 * o + t: column
    o's codes 4 (k + 2 s) + t in bits 2 s and 2 s + 1), then the 16 scales and the 16 offsets as float16."""
    groups = scale.shape[1]
    q = padded(codes).view(-1, PANEL, groups, 4, 2, 4).to(torch.int32)  # [P, o, g, s, k, t]: input 4 (k + 2 s) + t
    byte = sum(q[:, :, :, s] << (2 * s) for s in range(4)).to(torch.uint8)  # [P, o, g, k, t]
    chunks = byte.permute(0, 2, 3, 1, 4).reshape(len(q), groups, 2 * PANEL * 4)
    halves = [
        padded(t).view(-1, PANEL, groups).transpose(1, 2).half().contiguous().view(torch.uint8) for t in (scale, offset)
    ]
    return torch.cat([chunks, *halves], dim=2).contiguous()


class NativeInt2Dot(native.NativeLinear):
    """A weight in 2-bit panels (`pack`); `dequantized` gives the weights the kernel multiplies."""

    name = "native2i8"
    kind = "q2_i8"
    multiple = GROUP
    needs, lacking = "q2", "native.c's 2-bit kernel needs AVX-512 BW, AVX2 and F16C, which this build lacks"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        super().__init__(weight.shape[0], weight.shape[1], bias, dtype, weight.device)
        codes, self.scale, self.offset = quantize(weight)
        self.panels = pack(codes, self.scale, self.offset)

    @property
    def nbytes(self) -> int:
        return self.panels.numel()

    def tensors(self) -> tuple[torch.Tensor, None, None]:
        return self.panels, None, None

    def dequantized(self) -> torch.Tensor:
        """The weights [out, in] float32 the panels hold (q * s + m)."""
        groups, out = self.in_features // GROUP, self.out_features
        chunks = self.panels[:, :, : 2 * PANEL * 4].view(-1, groups, 2, PANEL, 4).to(torch.int32)  # [P, g, k, o, t]
        q = torch.stack([(chunks >> (2 * s)) & 3 for s in range(4)], 2)  # [P, g, s, k, o, t]
        q = q.permute(0, 4, 1, 2, 3, 5).reshape(-1, self.in_features)[:out].float()
        return (q.view(out, groups, GROUP) * self.scale[..., None] + self.offset[..., None]).view(out, -1)

    def kernel(self, x: torch.Tensor, y: torch.Tensor, rows: int, threads: int) -> None:
        inn, out = self.in_features, self.out_features
        self.lib.linear_q2_i8(x.data_ptr(), self.panels.data_ptr(), y.data_ptr(), rows, inn, out, threads)
