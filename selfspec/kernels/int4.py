"""int4 weight-only in groups along the input dimension (`aten._weight_int4pack_mm_for_cpu`): per group
of `group` weights a scale and a zero, w = (q - 8) * scale + zero with 4-bit codes q. An eighth of
the float32 bytes plus the scales. Built from float weights (asymmetric min/max per group, as GGUF's
Q4_1) or straight from a 4-bit GGUF's own codes (`from_codes`).

The kernel runs in bfloat16 (activations and scales) whatever the activations' dtype: its float32
path is a scalar loop, 10x slower on the CPUs measured (AVX2 and AVX-512 alike). So a Q4_1 weight
computes the GGUF's values to bfloat16 rounding of its scales, close to but not bit-identical with
the dequantized float model.

On CUDA the weight runs on torch's CUDA int4 kernel (`aten._weight_int4pack_mm`, tinygemm: the same
w = (q - 8) * scale + zero groups, bfloat16 activations, two codes per byte packed as
`_convert_weight_to_int4pack` wants them) when a probe at first use finds it present and in agreement
with the dequantized weight; otherwise the weight is stored dequantized in the activations' dtype
(same values, no memory saved) and the plan says why (`cuda_note`)."""

from __future__ import annotations

from functools import cache

import torch
import torch.nn.functional as F

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
        _probing: bool = False,
    ) -> None:
        if group not in GROUPS:
            raise ValueError(f"int4 group={group} is invalid: use one of {GROUPS}")
        if _codes is None:
            _codes = quantize(weight.float(), group)
        codes, scale, zero = _codes  # [out, in] int 0..15, [out, in / group] x 2
        out_features, in_features = codes.shape
        if in_features % group:
            raise ValueError(f"int4: {in_features} input features are not a multiple of the group size {group}")
        super().__init__(out_features, in_features, bias, dtype, codes.device)
        self.group = group
        self.weight = None  # [out, in] in the activations' dtype where no int4 kernel runs (CUDA fallback)
        self.packed = self.scales_zeros = None
        if self.device.type == "cuda" and not _cuda_kernel(dtype, self.device, _probing):
            self.weight = dequantize(codes, scale, zero).to(dtype)
            return
        self.packed = _pack(codes, self.device)
        sz = torch.stack([scale, zero], -1).transpose(0, 1).contiguous()  # [in / g, out, 2]
        self.scales_zeros = sz.to(COMPUTE)

    @classmethod
    def from_codes(
        cls, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype
    ) -> Int4:
        """codes [out, in] in 0..15 with w = (q - 8) * scale + zero per group of in / scale.shape[1]."""
        return cls(None, bias, dtype, codes.shape[1] // scale.shape[1], _codes=(codes, scale.float(), zero.float()))

    @classmethod
    def unavailable(cls, dtype: torch.dtype, device: torch.device | str = "cpu") -> str | None:
        if torch.device(device).type == "cuda":
            return None  # the CUDA kernel, or the dequantized fallback (cuda_note)
        return _probe(dtype)

    @classmethod
    def cuda_note(cls, dtype: torch.dtype, device: torch.device | str = "cuda") -> str:
        """How int4 weights run on this CUDA device (for the kernel plan's reasons)."""
        device = torch.device(device)
        if _cuda_kernel(dtype, device):
            return (
                "int4 on cuda: aten._weight_int4pack_mm (tinygemm), bfloat16 activations and scales; "
                "not row-exact across row counts"
            )
        return (
            f"int4 on cuda: the CUDA int4 kernel is unavailable or disagrees here ({_cuda_probe(device)}): "
            "the int4-rounded weights are stored dequantized in the activations' dtype (F.linear): "
            "same values, no memory or bandwidth saved"
        )

    @property
    def nbytes(self) -> int:
        if self.weight is not None:
            return self.weight.numel() * self.weight.element_size()
        return (
            self.packed.numel() * self.packed.element_size()
            + self.scales_zeros.numel() * self.scales_zeros.element_size()
        )

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight is not None:
            return F.linear(x, self.weight)
        if self.device.type == "cuda":
            y = torch.ops.aten._weight_int4pack_mm(x.to(COMPUTE), self.packed, self.group, self.scales_zeros)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(COMPUTE), self.packed, self.group, self.scales_zeros)
        return y.to(self.dtype)


def _pack(codes: torch.Tensor, device: torch.device) -> torch.Tensor:
    """codes [out, in] 0..15 -> the kernel's packed layout on `device`."""
    if device.type == "cuda":
        # The CUDA packer takes uint8 [out, in / 2], two codes per byte, the even column in the high nibble.
        c = codes.to(torch.int32)
        pairs = (c[:, ::2] << 4 | c[:, 1::2]).to(torch.uint8).contiguous()
        return torch.ops.aten._convert_weight_to_int4pack(pairs, INNER_K_TILES)
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), INNER_K_TILES)


def dequantize(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """codes [out, in] 0..15, scale / zero [out, in / g] -> w [out, in] float32 = (q - 8) * scale + zero."""
    out, inn = codes.shape
    groups = scale.shape[1]
    q = codes.float().view(out, groups, inn // groups) - 8
    return (q * scale.float()[..., None] + zero.float()[..., None]).view(out, inn)


def _cuda_kernel(dtype: torch.dtype, device: torch.device, probing: bool = False) -> bool:
    """Whether int4 linears on this CUDA device run the int4 kernel (else: dequantized weights)."""
    return probing or _cuda_probe(device) is None


@cache
def _cuda_probe(device: torch.device) -> str | None:
    """Runs the CUDA int4 kernel once on a small weight and checks it against the dequantized weight:
    a missing op, an unsupported GPU or a packing layout this torch does not expect all show here."""
    try:
        w = torch.linspace(-1, 1, 32 * 128, device=device).view(32, 128).sin()
        lin = Int4(w, None, torch.bfloat16, _probing=True)
        x = torch.linspace(-1, 1, 3 * 128, device=device).view(3, 128).cos().to(torch.bfloat16)
        got = lin.matmul(x).float()
        want = x.float() @ dequantize(*quantize(w.float(), 32)).t()
        err = float((got - want).norm() / want.norm())
    except Exception as e:  # noqa: BLE001  a probe: whatever stops the kernel is the reason it is not used
        return f"{str(e).splitlines()[0]}"
    if not err < 2e-2:
        return f"relative error {err:.3g} against the dequantized weight"
    return None


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
        Int4(torch.ones(16, 64, device="cpu"), None, dtype)(torch.ones(2, 64, dtype=dtype, device="cpu"))
    except (RuntimeError, AttributeError, NotImplementedError) as e:
        return f"int4 {str(dtype).replace('torch.', '')} kernel unavailable: {str(e).splitlines()[0]}"
    return None
