"""bfloat16 weights on AMX tiles (native.c's `linear_tiles`), where the CPU has AMX-BF16 (Intel Sapphire
Rapids and later) and Linux grants the process its tile state.

The weights are kept as `codes` keeps them for bfloat16 (the 4-bit codes in pair panels' order, or pair
panels), and each group of 32 inputs of a panel is rebuilt into 16 pair rows, which is exactly an AMX
weight tile; one tdpbf16ps then multiplies up to 16 rows of x by it. So a verification of up to 16 tokens
costs about what one token does, where `codes`' vdpbf16ps loops cost a multiply-add per row and weight.
Each output of each row is its own accumulator: row-exact. The bits differ from `codes`' (another order
inside each pair), so `auto` picks between them by timing (choice.py) and every pass of a model shares
the one it picked.

8-bit codes (the default model's LM head, Q8_0) run on the tiles too, and its greedy head
(NativeCodes.argmax) computes a step's few candidate logits on them, so they are the bits the full
head gives: a sampled verification's head then costs what a step's does."""

from __future__ import annotations

import torch

from . import native
from .native_codes import NativeCodes

TILED = {"pair_codes4": "tile_codes4", "pair_codes8": "tile_codes8", "bfloat16_pairs": "tile_pairs"}  # layout -> kind
TILE_BITS = {"tile_codes4": 4, "tile_codes8": 8, "tile_pairs": 0}
LAYOUT = {kind: layout for layout, kind in TILED.items()}  # kind -> the panels' layout


class NativeTiles(NativeCodes):
    name = "amx"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        super().__init__(weight, bias, dtype)
        if self.in_features % 32 == 0:  # an AMX tile of x holds 32 inputs a row
            self.kind = TILED.get(self.kind, self.kind)

    @classmethod
    def unavailable(cls, dtype: torch.dtype, device: torch.device | str = "cpu") -> str | None:
        if dtype != torch.bfloat16:
            return f"AMX tiles multiply bfloat16, not {dtype}"
        why = super().unavailable(dtype, device)
        if why is None and not native.library().tiles:
            return native.library().tiles_why
        return why

    @property
    def layout(self) -> str:
        """The panels' layout: NativeCodes' kind, which the tiles read as they are."""
        return LAYOUT.get(self.kind, self.kind)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """A prompt's rows on the tiles too: AMX is the fastest bfloat16 GEMM here, and the codes are
        rebuilt once per panel for all of them."""
        if self.kind in TILE_BITS:
            return native.NativeLinear.matmul(self, x)
        return super().matmul(x)

    def kernel(self, x: torch.Tensor, y: torch.Tensor, rows: int, threads: int) -> None:
        if self.kind not in TILE_BITS:
            return super().kernel(x, y, rows, threads)
        shape = (rows, self.in_features, self.out_features)
        self.lib.linear_tiles(x.data_ptr(), self.panels.data_ptr(), y.data_ptr(), *shape, TILE_BITS[self.kind], threads)
