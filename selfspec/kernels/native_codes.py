"""float32 weights held as the 4-bit or 8-bit codes they were dequantized from (`linear_codes`).

A GGUF's Q4_0 / Q4_1 / Q8_0 tensors dequantize to float32 as w = q * d + m (Q4_1), d * (q - 8) (Q4_0)
or q * d (Q8_0), d and m float16. Those float32 values are the fp32 model, and a step that streams them
reads 4 bytes a weight where the file holds ~0.6. This backend finds, for each group of 32 inputs of
each output column, a scale d with a float16's precision, an offset m and codes q such that q * d + m
rounds to exactly the stored float32 (or q * d, for 8-bit codes), checks every weight's bits, and keeps
the codes: native.c rebuilds each weight in registers and sums exactly as `native` does on the float32
panels, so the output bits are `native`'s, from 0.625 or 1.0625 bytes a weight. A weight that is not
exactly such codes (a model that never was 4- or 8-bit) stays in float32 panels.

float32 activations only: a bfloat16 model's weights are rounded from these values, and its kernels
(pair panels) are not rebuilt here."""

from __future__ import annotations

import torch

from . import native
from .native_float import PANEL, NativeFloat, pack, padded

GROUP = 32
BITS = {"codes4": 4, "codes8": 8}
SAMPLE = 256  # groups a width is tried on first


class NativeCodes(NativeFloat):
    name = "codes"  # NativeFloat's input widths: one that is not whole groups of 32 stays float32

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        native.NativeLinear.__init__(self, *weight.shape, bias, dtype, weight.device)
        weight = weight.to(torch.float32)
        found = find_codes(weight)
        if found is None:
            self.kind, self.panels = "float32", pack(weight)
        else:
            self.kind, self.panels = found

    @classmethod
    def unavailable(cls, dtype: torch.dtype, device: torch.device | str = "cpu") -> str | None:
        if dtype != torch.float32:
            return f"codes rebuild float32 weights, for float32 activations, not {dtype}"
        return super().unavailable(dtype, device)

    @property
    def nbytes(self) -> int:
        return self.panels.numel() * self.panels.element_size()

    def transposed(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """W.T [in, out] for a prompt's GEMM: the float32 panels unpacked, or the codes rebuilt."""
        if self.kind == "float32":
            return super().transposed(dtype)
        return unpack(self.panels, BITS[self.kind], self.in_features)[: self.out_features].t().to(dtype)

    def kernel(self, x: torch.Tensor, y: torch.Tensor, rows: int, threads: int) -> None:
        if self.kind == "float32":
            return super().kernel(x, y, rows, threads)
        shape = (rows, self.in_features, self.out_features)
        self.lib.linear_codes(x.data_ptr(), self.panels.data_ptr(), y.data_ptr(), *shape, BITS[self.kind], threads)


def find_codes(weight: torch.Tensor) -> tuple[str, torch.Tensor] | None:
    """(kind, code panels) for a float32 weight [out, in] that is exactly 4-bit, else 8-bit codes per
    group of 32 inputs; None when it is neither (or `in` is not a multiple of 32). Each width is tried on
    the first groups before the whole weight (a full try costs ~10 passes over it)."""
    if weight.shape[1] % GROUP:
        return None
    groups = padded(weight).view(-1, GROUP)  # [out padded * G, 32]
    for bits in (4, 8):
        if _codes(groups[:SAMPLE], bits) is None:
            continue
        found = _codes(groups, bits)
        if found is not None:
            shape = (-1, weight.shape[1] // GROUP)
            return f"codes{bits}", _pack(*(t.view(*shape, t.shape[-1]) for t in found), bits)
    return None


def _codes(groups: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(q, d, m) with q * d + m == groups [n, 32] bit for bit (m = 0 for 8 bits), or None. 4 bits: m is a
    group's least weight (its code 0; a float16 value, as Q4_1's m and Q4_0's -8d are) and d = (max - m) / k
    rounded to float16, k = 15 first (Q4_1 and Q4_0 put a group's extremes at codes 0 and 15), then 14 .. 1
    for the groups k = 15 does not fit. 8 bits: d = max |w| / 127 (Q8_0). A float16 d makes q * d exact, so
    the sum rounds once, as in C."""
    if bits == 4:
        m = groups.amin(-1, keepdim=True)
        if not torch.equal(m.half().float(), m):  # native.c keeps m as a float16
            return None
        spread, lo, hi, ks = groups.amax(-1, keepdim=True) - m, 0, 15, range(15, 0, -1)
    else:
        m = torch.zeros_like(groups[:, :1])
        spread, lo, hi, ks = groups.abs().amax(-1, keepdim=True), -127, 127, (127,)
    q, d = torch.empty_like(groups), torch.empty_like(m)
    todo = None  # indices of the groups still without codes (None: all of them)
    for k in ks:
        g, mk, sk = (groups, m, spread) if todo is None else (groups[todo], m[todo], spread[todo])
        dk = (sk / k).half().float()
        qk = (g - mk).div_(torch.where(dk > 0, dk, 1)).round_().clamp_(lo, hi)  # d = 0: all equal, q = 0
        exact = (torch.addcmul(mk, qk, dk).view(torch.int32) == g.view(torch.int32)).all(-1)
        if todo is None and bool(exact.all()):
            return qk, dk, m
        if todo is None:
            q, d, todo = qk, dk, torch.arange(len(groups))
        else:
            q[todo[exact]], d[todo[exact]] = qk[exact], dk[exact]
        todo = todo[~exact]
        if len(todo) == 0:
            return q, d, m
        if len(todo) * 2 > len(groups):  # most groups fit no codes: the weight never was quantized
            return None
    return None


def _pack(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, bits: int) -> torch.Tensor:
    """q [out, G, 32], d and m [out, G, 1] (float16 values) -> native.c's code panels, uint8 [P, G, block]
    (CODES4: d, m as float16, then byte t of column j = q[2t] | q[2t + 1] << 4; CODES8: d, then the int8
    codes input by input)."""
    out, groups = q.shape[:2]
    panels = out // PANEL

    def by_panel(t: torch.Tensor) -> torch.Tensor:  # [out, G, n] -> [P, G, n, 16]
        return t.view(panels, PANEL, groups, -1).permute(0, 2, 3, 1)

    scales = [d] if bits == 8 else [d, m]
    head = [by_panel(s.half()).reshape(panels, groups, PANEL).contiguous().view(torch.uint8) for s in scales]
    if bits == 4:
        codes = by_panel(q.to(torch.uint8))  # [P, G, 32, 16]
        body = codes[:, :, 0::2] | codes[:, :, 1::2] << 4  # [P, G, 16, 16]
    else:
        body = by_panel(q.to(torch.int8)).view(torch.uint8)  # [P, G, 32, 16]
    return torch.cat([*head, body.reshape(panels, groups, -1)], -1).contiguous()


def unpack(panels: torch.Tensor, bits: int, inn: int) -> torch.Tensor:
    """Code panels -> the float32 weight [out padded, in] they rebuild (q * d + m, as native.c)."""
    p, groups = panels.shape[:2]
    scale_bytes = 2 * PANEL * (2 if bits == 4 else 1)
    head, body = panels[..., :scale_bytes], panels[..., scale_bytes:]
    scales = head.contiguous().view(torch.float16).float().view(p, groups, -1, PANEL)  # [P, G, 1 or 2, 16]
    d = scales[:, :, :1]
    m = scales[:, :, 1:] if bits == 4 else torch.zeros_like(d)
    if bits == 4:
        b = body.reshape(p, groups, GROUP // 2, PANEL)
        q = torch.stack([b & 15, b >> 4], 3).view(p, groups, GROUP, PANEL).float()
    else:
        q = body.contiguous().view(torch.int8).view(p, groups, GROUP, PANEL).float()
    w = m + q * d  # [P, G, 32, 16]
    return w.permute(0, 3, 1, 2).reshape(p * PANEL, inn)
