"""float32 or bfloat16 weights on native.c's own linear (`linear_dense`): the weight packed once at load
in panels of 16 output columns (a bfloat16 one is widened to float32 in registers: half the bytes of
float32), float32 accumulation, panels split over OpenMP threads, up to 6 rows per read of a panel
(8 with AVX-512). Where the CPU has AVX512-BF16, bfloat16 weights are packed in pair panels instead
and multiplied by vdpbf16ps (`linear_pairs`). Row-exact by construction (native.c). Measured against
oneDNN's prepacked weights per machine (choice.py)."""

from __future__ import annotations

import time
from functools import cache

import torch

from . import native
from .base import EXACT_ROWS


class NativeFloat(native.NativeLinear):
    name = "native"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        super().__init__(*weight.shape, bias, dtype, weight.device)
        weight = weight.to(dtype)  # in the activations' float format
        self.kind = "float32" if dtype == torch.float32 else "bfloat16_pairs" if self.native.pairs else "bfloat16"
        self.panels = pack_pairs(weight) if self.kind == "bfloat16_pairs" else pack(weight)

    def tensors(self) -> tuple[torch.Tensor, None, None]:
        return self.panels, None, None

    @property
    def nbytes(self) -> int:
        return self.panels.numel() * self.panels.element_size()

    def dequantized(self) -> torch.Tensor:
        """The weight [out, in] in float32: a copy, unpacked from the panels."""
        return self.transposed().t().contiguous()

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """More than EXACT_ROWS rows (a prompt) take whichever of native.c's panels and torch's GEMM ran a
        prompt's product faster here (`native_prompts`). Not row-exact, which a prompt's pass is not
        asked to be (base.EXACT_ROWS): plain and speculative decoding share it."""
        if x.numel() // self.in_features > EXACT_ROWS and not native_prompts(self.dtype):
            return self.gemm(x)
        return super().matmul(x)

    def gemm(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W.T on torch's GEMM, blocked for the caches. bfloat16 takes torch's bfloat16 GEMM where it
        beats the float32 one here (`bf16_gemm`: 2.3-2.7x faster with AVX512-BF16), else is widened to
        float32 (torch's bf16 GEMM was ~4x slower on the AVX2 EPYC)."""
        if self.dtype == torch.bfloat16 and bf16_gemm():
            return x.contiguous() @ self.transposed(torch.bfloat16)
        return (x.to(torch.float32) @ self.transposed()).to(self.dtype)

    @property
    def layout(self) -> str:
        """How the panels are laid out (a kind of this class's kernels; another backend may run them)."""
        return self.kind

    def transposed(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """W.T [in, out] in `dtype`, unpacked (one copy) for a prompt's GEMM: as fast as F.linear on the
        plain weight for the layers here, where unpacking to [out, in] first cost 10-50 % more."""
        panels = self.panels
        if self.layout == "bfloat16_pairs":  # [P, in / 2, 16, 2] -> [in / 2, 2, P, 16]: W.T's order
            panels = panels.permute(1, 3, 0, 2)
        else:
            panels = panels.transpose(0, 1)  # [P, in, 16] -> [in, P, 16]
        wt = torch.empty(panels.shape, dtype=dtype, device=panels.device)
        return wt.copy_(panels).view(self.in_features, -1)[:, : self.out_features]

    def kernel(self, x: torch.Tensor, y: torch.Tensor, rows: int, threads: int) -> None:
        p, shape = self.panels.data_ptr(), (rows, self.in_features, self.out_features)
        if self.kind == "bfloat16_pairs":
            self.lib.linear_pairs(x.data_ptr(), p, y.data_ptr(), *shape, threads)
        else:
            self.lib.linear_dense(x.data_ptr(), p, y.data_ptr(), *shape, native.DTYPES[self.dtype], threads)


@cache
def native_prompts(dtype: torch.dtype) -> bool:
    """Whether native.c's panels run a prompt's product (256 x 576 -> 1536) faster than torch's GEMM
    (with its unpacking of the panels) here, timed once per process and dtype (~0.05 s; bfloat16's first
    GEMM also times `bf16_gemm`). Whole prefills, AMD EPYC Zen 3 (AVX2), 2 threads, alternating, torch's
    GEMM against the panels: float32 100 / 200 / 1000 tokens 266-307 / 363-432 / 1825-2247 ms against
    169-191 / 274-287 / 1640-1788 ms; bfloat16 218-230 / 402-464 / 2098-2283 against 151-161 / 312-340 /
    1904-2267 ms. Where torch's GEMM has AVX-512 or AMX to run on it may win: timed, not assumed."""
    g = torch.Generator(device="cpu").manual_seed(0)  # not the global generator a seeded caller may use
    x = torch.randn(256, 576, generator=g, device="cpu").to(dtype)
    linear = NativeFloat(torch.randn(1536, 576, generator=g, device="cpu"), None, dtype)
    return _best(lambda: native.NativeLinear.matmul(linear, x)) < _best(lambda: linear.gemm(x))


def _best(f) -> float:
    """The fastest of three timed calls of f (after one untimed)."""
    f()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        f()
        times.append(time.perf_counter() - start)
    return min(times)


@cache
def bf16_gemm() -> bool:
    """Whether torch's bfloat16 GEMM beats its float32 GEMM (inputs widened first) on a prompt's product
    here, timed once per process (~30 ms): oneDNN runs it on AVX512-BF16 or AMX where the CPU has them,
    and much slower where it has not."""
    g = torch.Generator(device="cpu").manual_seed(0)  # not the global generator a seeded caller may use
    x = torch.randn(256, 576, generator=g, device="cpu")
    w = torch.randn(576, 1536, generator=g, device="cpu")
    xb, wb = x.bfloat16(), w.bfloat16()
    return _best(lambda: xb @ wb) < 0.8 * _best(lambda: (xb.float() @ w).bfloat16())


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] -> [ceil(out / 16), in, 16]: native.c's panels (output columns 16p .. 16p + 15 of every
    input, contiguous; the last panel padded with zero columns). A tile then reads one contiguous run
    and each output is one lane of its vectors, summed over the inputs in order."""
    return padded(weight).view(-1, PANEL, weight.shape[1]).transpose(1, 2).contiguous()


def pack_pairs(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] -> [ceil(out / 16), in / 2, 16, 2]: native.c's pair panels (pair row j of a panel: each
    of its 16 columns' weights 2j and 2j + 1, what one vdpbf16ps multiplies); in is even."""
    return padded(weight).view(-1, PANEL, weight.shape[1] // 2, 2).transpose(1, 2).contiguous()


def padded(t: torch.Tensor) -> torch.Tensor:
    """t [out, ...] with zero rows appended up to a whole number of panels (a copy)."""
    return torch.nn.functional.pad(t, (0, 0) * (t.dim() - 1) + (0, -len(t) % PANEL))


PANEL = 16  # native.c's PANEL
