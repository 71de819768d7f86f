"""oneDNN with the weight packed once at load (`mkldnn._reorder_linear_weight`), float32 or bfloat16
(bfloat16 needs AVX-512 or AVX-NE-CONVERT; AMX when the CPU has it). F.linear re-packs the weight on
every multi-row call, which is what made verifying k tokens cost up to ~2 steps; packed once, a k-row
forward costs about one row's, and a row comes out bit-identical whatever k is."""

from __future__ import annotations

from functools import cache

import torch

from .base import EXACT_ROWS, Linear
from .cache import cpu

ROWS = range(2, EXACT_ROWS + 1)  # the row counts _probe compares with single rows (all: oneDNN switches kernels)


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
    """Packs and runs weights once per dtype; the error, if any, is the reason. The backend claims
    row-exactness, which held on an AMX Xeon; on an AVX-512 Xeon without AMX, bfloat16 rows of a 9-row
    call on a 1536 x 576 weight differed from 1-row calls (the kernel depends on the row count there),
    and a tiny model's 5-row pass from its steps. So bfloat16 needs AMX-BF16, and the rows of 2-9-row
    calls must equal 1-row calls bit for bit on the default model's shapes, and so must those of longer
    passes up to EXACT_ROWS: on an AMX Xeon (Sapphire Rapids, torch 2.13) bfloat16 rows of 2-32-row calls
    were exact and most calls of 33-64 rows were not (oneDNN takes another kernel there)."""
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN (mkldnn)"
    name = str(dtype).replace("torch.", "")
    if dtype == torch.bfloat16 and "amx_bf16" not in cpu()[1].split():
        return "oneDNN's bfloat16 rows are exact only with AMX-BF16 (seen: not on an AVX-512 Xeon without it)"
    g = torch.Generator().manual_seed(0)
    try:
        for out, inn in ((48, 64), (576, 576), (1536, 576), (576, 1536)):
            w = torch.ops.mkldnn._reorder_linear_weight(torch.randn(out, inn, generator=g).to(dtype), None)
            x = torch.randn(EXACT_ROWS, inn, generator=g).to(dtype)
            run = lambda rows: torch.ops.mkldnn._linear_pointwise(rows, w, None, "none", [], "")  # noqa: E731
            alone = torch.cat([run(x[i : i + 1]) for i in range(len(x))])
            if not all(torch.equal(run(x[:k]), alone[:k]) for k in ROWS):
                return f"oneDNN's {name} rows differ between multi-row and 1-row calls on this CPU (not row-exact)"
    except (RuntimeError, AttributeError) as e:
        return f"oneDNN {name} linear unavailable: {str(e).splitlines()[0]}"
    return None
