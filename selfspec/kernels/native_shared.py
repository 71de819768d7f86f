"""A quantized self-draft's 4-bit linears on the target's own code panels (native.c's
`linear_q4_codes_i8`): where the target keeps a weight as 4-bit codes (native_codes.py's `codes4`, or
`pair_codes4` for bfloat16 and the AMX tiles), the draft multiplies those same bytes with int8
activations, as native4i8 does with a copy of its own. One copy of the weights instead of two (the
default model's layers: ~66 MB less); the bytes a draft step streams are the ones verification streams
next, though a draft token took no less time for it on the Xeon measured (its own reads bound it).
Needs AVX512-VBMI (vpermb gathers each column's codes) and AVX512BW; elsewhere the draft keeps its own
panels."""

from __future__ import annotations

import torch

from . import native
from .base import Linear
from .native_dot import NativeInt4Dot

LAYOUTS = {"codes4": "q4_codes_i8", "pair_codes4": "q4_pair_codes_i8"}  # target layout -> kind


class SharedCodes(native.NativeLinear):
    """The target linear `target`'s code panels, read with int8 activations."""

    name = "shared4i8"
    multiple = 32
    mirrors = NativeInt4Dot.name  # the backend whose products it computes: drafts share only where it was chosen
    needs = "shared_codes"
    lacking = "reading the target's codes with int8 activations needs AVX512-VBMI and AVX512BW (not built here)"

    def __init__(self, target: native.NativeLinear, dtype: torch.dtype) -> None:
        super().__init__(target.out_features, target.in_features, None, dtype, target.device)
        self.kind = LAYOUTS[target.layout]
        self.panels = target.panels  # the target's tensor, not a copy

    @classmethod
    def of(cls, target: Linear, dtype: torch.dtype) -> SharedCodes | None:
        """The draft linear over `target`'s codes, or None where it holds none (or the kernel is missing)."""
        if getattr(target, "layout", None) not in LAYOUTS or target.bias is not None:
            return None
        if cls.unavailable(dtype, target.device) is not None:
            return None
        return cls(target, dtype)

    @property
    def nbytes(self) -> int:
        return 0  # the target's bytes

    def tensors(self) -> tuple[torch.Tensor, None, None]:
        return self.panels, None, None

    def kernel(self, x: torch.Tensor, y: torch.Tensor, rows: int, threads: int) -> None:
        pairs = int(self.kind == "q4_pair_codes_i8")
        shape = (rows, self.in_features, self.out_features)
        self.lib.linear_q4_codes_i8(x.data_ptr(), self.panels.data_ptr(), y.data_ptr(), *shape, pairs, threads)
