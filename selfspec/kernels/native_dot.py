"""The 8-bit and 4-bit weights of native8 / native4 on int8 activations (native.c's `linear_q8_i8`,
`linear_q4_i8`): each row of activations is quantized in blocks of 32 (llama.cpp's Q8 blocks) and
multiplied with the weight codes in int32, the weights repacked in panels of 16 output columns so that
one VNNI instruction (vpdpbusd; vpmaddubsw + vpmaddwd without VNNI) does 64 multiply-adds, four per
column. The 4-bit scales and offsets are float16 beside their codes (a GGUF's own d and m are float16):
5 bytes per 8 weights where native4 reads 6. The default model's int4 linears and int8 head take
5.3 ms a step (native4's float kernel ~2x longer; 2-core Xeon, AVX-512 VNNI). The cost is a second
rounding: of the activations, ~0.4 % of a block's largest value, on top of the weights' own.
Row-exact like the float kernels (a row's blocks are its own). Needs AVX2 and F16C; choice.py measures
these against the float-activation kernels per machine."""

from __future__ import annotations

import torch

from .native_float import PANEL, padded
from .native_int4 import NativeInt4
from .native_int8 import NativeInt8

DOT_I8 = "native.c's int8 dot products need AVX2, which this build lacks"


class NativeInt4Dot(NativeInt4):
    """native4's codes, scales and offsets repacked in panels of 16 output columns (`pack`): the
    kernel reads one stream per panel and multiplies four codes of each column at once (VNNI)."""

    name = "native4i8"
    kind = "q4_i8"
    needs, lacking = "dot_i8", DOT_I8

    def __init__(
        self, weight: torch.Tensor | None, bias: torch.Tensor | None, dtype: torch.dtype, *, _codes=None
    ) -> None:
        super().__init__(weight, bias, dtype, _codes=_codes)
        self.panels = pack(self.codes, self.scale, self.offset)
        del self.codes, self.scale, self.offset  # the panels hold them

    @property
    def nbytes(self) -> int:
        return self.panels.numel()

    def tensors(self) -> tuple[torch.Tensor, None, None]:
        return self.panels, None, None

    def kernel(self, x: torch.Tensor, y: torch.Tensor, rows: int, threads: int) -> None:
        inn, out = self.in_features, self.out_features
        self.lib.linear_q4_i8(x.data_ptr(), self.panels.data_ptr(), y.data_ptr(), rows, inn, out, threads)


def pack(codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """native4's [out, groups, 16] code bytes (GGUF order: code j low, j + 16 high) and float32 scale /
    offset [out, groups] -> native.c's q4 panels [ceil(out / 16), groups, 320] bytes: per panel and
    group 4 chunks of 64 code bytes (chunk c, byte 4 * o + t: column o's codes 4c + t low, 4c + 16 + t
    high), then the 16 columns' scales and offsets as float16 (a GGUF's own d and m are float16)."""
    groups = codes.shape[1]
    # byte j = 4c + t of a group holds codes 4c + t and 4c + 16 + t already: a chunk is a transpose
    q = padded(codes).view(-1, PANEL, groups, 4, 4)  # [P, o, g, c, t]
    chunks = q.permute(0, 2, 3, 1, 4).reshape(len(q), groups, 4 * PANEL * 4)
    halves = []
    for t in (scale, offset):
        h = padded(t).view(-1, PANEL, groups).transpose(1, 2).half()
        if not torch.isfinite(h).all():
            raise ValueError("native4i8: a scale or offset is out of float16's range")
        halves.append(h.contiguous().view(torch.uint8))
    return torch.cat([chunks, *halves], dim=2).contiguous()


class NativeInt8Dot(NativeInt8):
    """native8's codes repacked in panels of 16 output columns (`pack8`), as native4i8's."""

    name = "native8i8"
    kind = "q8_i8"
    multiple = 32
    needs, lacking = "dot_i8", DOT_I8

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        super().__init__(weight, bias, dtype)
        self.panels = pack8(self.codes)
        self.scales = padded(self.scales)  # [16 * panels]
        del self.codes

    @property
    def nbytes(self) -> int:
        return self.panels.numel() + self.scales.numel() * 4

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, None]:
        return self.panels, self.scales, None

    def dequantized(self) -> torch.Tensor:
        blocks = self.in_features // 32
        q = self.panels.view(-1, blocks, 8, PANEL, 4).permute(0, 3, 1, 2, 4).reshape(-1, self.in_features)
        codes = q[: self.out_features].to(torch.int16) - 128
        return codes.float() * self.scales[: self.out_features, None]

    def kernel(self, x: torch.Tensor, y: torch.Tensor, rows: int, threads: int) -> None:
        p, s, inn, out = self.panels.data_ptr(), self.scales.data_ptr(), self.in_features, self.out_features
        self.lib.linear_q8_i8(x.data_ptr(), p, s, y.data_ptr(), rows, inn, out, threads)


def pack8(codes: torch.Tensor) -> torch.Tensor:
    """int8 codes [out, in] -> native.c's q8 panels [ceil(out / 16), in / 32, 512] bytes: per panel and
    block of 32 inputs 8 chunks of 64 bytes, chunk j byte 4 * o + t holding column o's code 4j + t plus
    128 (unsigned)."""
    inn = codes.shape[1]
    q = (padded(codes).to(torch.int16) + 128).to(torch.uint8).view(-1, PANEL, inn // 32, 8, 4)  # [P, o, block, j, t]
    return q.permute(0, 2, 3, 1, 4).reshape(len(q), inn // 32, 8 * PANEL * 4).contiguous()
