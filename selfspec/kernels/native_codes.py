"""float32 weights held as the 4-bit or 8-bit codes they were dequantized from (`linear_codes`).

A GGUF's Q4_0 / Q4_1 / Q8_0 tensors dequantize to float32 as w = q * d + m (Q4_1), d * (q - 8) (Q4_0)
or q * d (Q8_0), d and m float16. Those float32 values are the fp32 model, and a step that streams them
reads 4 bytes a weight where the file holds ~0.6. This backend finds, for each group of 32 inputs of
each output column, a scale d with a float16's precision, an offset m and codes q such that q * d + m
rounds to exactly the stored float32 (or q * d, for 8-bit codes), checks every weight's bits, and keeps
the codes: native.c rebuilds each weight in registers and sums exactly as `native` does on the float32
panels, so the output bits are `native`'s, from 0.625 or 1.0625 bytes a weight. A weight that is not
exactly such codes (a model that never was 4- or 8-bit) stays in `native`'s panels.

A bfloat16 model's weights are these float32 values rounded to bfloat16. Where the CPU has AVX512-BF16
they are kept as the same codes in pair panels' order (`linear_pair_codes`): rebuilt in float32, rounded
to bfloat16 in registers and summed as `native`'s pair panels sum, so the bits are `native`'s there too,
from 0.625 bytes a weight instead of 2. Such a model's linears are built from the checkpoint's float32
weights (`source`), not from the bfloat16 ones, which no longer tell the codes."""

from __future__ import annotations

from functools import cached_property

import torch

from . import native
from .native_float import PANEL, NativeFloat, pack, pack_pairs, padded

GROUP = 32
BITS = {"codes4": 4, "codes8": 8, "pair_codes4": 4, "pair_codes8": 8}
SAMPLE = 256  # groups a width is tried on first
# Rows past which an AMX head computes every logit rather than its greedy bounding pass (int8 dot products
# per row, ~0.35 ms a row for the default model's head, where the tiles' whole head is nearly flat in rows).
# Head alone, bfloat16, 2 threads (Intel Xeon with AMX): greedy / every logit + argmax 0.84 / 2.07 ms at
# 1 row, 2.88 / 3.15 at 8, 3.60 / 3.26 at 9, 4.47 / 3.62 at 12. The float32 head has no tiles: its whole
# head grows faster than the bounding pass (6.44 ms at 9 rows against 3.36), and it stays greedy.
TILE_GREEDY_ROWS = 8


class NativeCodes(NativeFloat):
    name = "codes"  # NativeFloat's input widths: one that is not whole groups of 32 stays float32
    source = True  # built from the checkpoint's weights, before they are rounded to the activations' dtype

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        native.NativeLinear.__init__(self, *weight.shape, bias, dtype, weight.device)
        weight = weight.to(torch.float32)
        pairs = dtype == torch.bfloat16
        found = find_codes(weight, pairs)
        if found is not None:
            self.kind, self.panels = found
        elif pairs:  # NativeFloat's pair panels
            self.kind, self.panels = "bfloat16_pairs", pack_pairs(weight.to(dtype))
        else:
            self.kind, self.panels = "float32", pack(weight)

    @classmethod
    def unavailable(cls, dtype: torch.dtype, device: torch.device | str = "cpu") -> str | None:
        if dtype not in (torch.float32, torch.bfloat16):
            return f"codes rebuild float32 or bfloat16 weights, not {dtype}"
        why = super().unavailable(dtype, device)
        if why is None and dtype == torch.bfloat16 and not native.library().pairs:
            return "bfloat16 codes are rebuilt into pair panels, which need AVX512-BF16 (not on this CPU)"
        return why

    @property
    def nbytes(self) -> int:
        return self.panels.numel() * self.panels.element_size()

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """A prompt's rows on the codes too (native.c rebuilds each panel once for them): torch's GEMM would
        need the whole weight rebuilt first, every prompt (the default model in bf16, AMD EPYC Zen 4, 2
        threads, best of 3: a 100-token prefill 354 ms that way against 132 on the codes)."""
        if self.kind not in BITS:
            return super().matmul(x)
        return native.NativeLinear.matmul(self, x)

    def transposed(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """W.T [in, out] for a prompt's GEMM: the float panels unpacked, or the codes rebuilt (and rounded to
        the activations' dtype, as the kernel rounds them)."""
        if self.layout not in BITS:
            return super().transposed(dtype)
        weight = unpack(self.panels, BITS[self.layout], self.in_features, self.layout.startswith("pair"))
        return weight[: self.out_features].to(self.dtype).t().to(dtype)

    def argmax(self, x: torch.Tensor) -> torch.Tensor | None:
        """An 8-bit head's greedy argmax without every logit (native.c's greedy_codes8: an int8 pass bounds
        each logit, and the few that may be the largest are computed exactly by this kernel), the ids the
        full logits give, ties to the lowest. None for other weights, where the build lacks the kernel, or
        for more than TILE_GREEDY_ROWS rows on the tiles (every logit is then cheaper)."""
        if self.layout not in ("codes8", "pair_codes8") or not self.native.greedy or self.bias is not None:
            return None
        rows, pairs, tiles = x.numel() // self.in_features, self.layout == "pair_codes8", self.kind.startswith("tile_")
        if tiles and rows > TILE_GREEDY_ROWS:
            return None  # every logit on the tiles costs less there
        x = x.to(torch.float32).contiguous()
        ids = torch.empty(x.shape[:-1], dtype=torch.int64)
        shape = (rows, self.in_features, self.out_features, int(pairs), int(tiles), torch.get_num_threads())
        self.lib.greedy_codes8(x.data_ptr(), self.panels.data_ptr(), self.bound.data_ptr(), *shape, ids.data_ptr())
        return ids

    @cached_property
    def bound(self) -> torch.Tensor:
        """greedy_codes8's W1 [panels, groups, 16] float16: per column and group of 32 inputs, sum |w| rounded
        up (native.c's greedy_bound); made on first use (~5 ms for the default model's head)."""
        out = torch.empty(*self.panels.shape[:2], PANEL, dtype=torch.float16)
        pairs = int(self.layout == "pair_codes8")
        self.lib.greedy_bound(self.panels.data_ptr(), self.in_features, self.out_features, pairs, out.data_ptr())
        return out

    def kernel(self, x: torch.Tensor, y: torch.Tensor, rows: int, threads: int) -> None:
        if self.kind not in BITS:
            return super().kernel(x, y, rows, threads)
        run = self.lib.linear_pair_codes if self.kind.startswith("pair") else self.lib.linear_codes
        shape = (rows, self.in_features, self.out_features)
        run(x.data_ptr(), self.panels.data_ptr(), y.data_ptr(), *shape, BITS[self.kind], threads)


def find_codes(weight: torch.Tensor, pairs: bool = False) -> tuple[str, torch.Tensor] | None:
    """(kind, code panels) for a float32 weight [out, in] that is exactly 4-bit, else 8-bit codes per
    group of 32 inputs, in pair panels' order if `pairs`; None when it is neither (or `in` is not a
    multiple of 32). Each width is tried on the first groups before the whole weight (a full try costs
    ~10 passes over it). Rebuilt weights are multiples of 2^-24 (d and m are float16 values), so never
    float32 subnormals, which vcvtne2ps2bf16 would flush to zero where torch's rounding keeps them."""
    if weight.shape[1] % GROUP:
        return None
    groups = padded(weight).view(-1, GROUP)  # [out padded * G, 32]
    for bits in (4, 8):
        if _codes(groups[:SAMPLE], bits) is None:
            continue
        found = _codes(groups, bits)
        if found is not None:
            shape = (-1, weight.shape[1] // GROUP)
            panels = _pack(*(t.view(*shape, t.shape[-1]) for t in found), bits, pairs)
            return f"pair_codes{bits}" if pairs else f"codes{bits}", panels
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


def _pack(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, bits: int, pairs: bool) -> torch.Tensor:
    """q [out, G, 32], d and m [out, G, 1] (float16 values) -> native.c's code panels, uint8 [P, G, block]:
    d, m as float16 (CODES4; CODES8 d alone), then the codes in rows of 16 lanes (`_lanes`), a CODES4 row's
    byte j holding lane j of rows 2t and 2t + 1 in its low and high nibble."""
    out, groups = q.shape[:2]
    panels = out // PANEL

    def by_panel(t: torch.Tensor) -> torch.Tensor:  # [out, G, n] -> [P, G, n, 16]
        return t.view(panels, PANEL, groups, -1).permute(0, 2, 3, 1)

    scales = [d] if bits == 8 else [d, m]
    head = [by_panel(s.half()).reshape(panels, groups, PANEL).contiguous().view(torch.uint8) for s in scales]
    codes = _lanes(by_panel(q), pairs)  # [P, G, 32, 16]
    if bits == 4:
        codes = codes.to(torch.uint8)
        body = codes[:, :, 0::2] | codes[:, :, 1::2] << 4  # [P, G, 16, 16]
    else:
        body = codes.to(torch.int8).view(torch.uint8)
    return torch.cat([*head, body.reshape(panels, groups, -1)], -1).contiguous()


def _lanes(codes: torch.Tensor, pairs: bool) -> torch.Tensor:
    """[P, G, 32 inputs, 16 columns] -> the 32 rows of 16 lanes native.c reads. Float32 panels: row i is
    input i. Pair panels: pair t (inputs 2t, 2t + 1) is rows 2t and 2t + 1 (CODES4: byte j's nibbles;
    CODES8: bytes 0-15 and 16-31), lane k of the first holding column k / 2, of the second column
    8 + k / 2, each for input 2t + k % 2, so that the two rebuilt halves round into one pair row."""
    if not pairs:
        return codes
    p, g = codes.shape[:2]
    c = codes.view(p, g, GROUP // 2, 2, 2, PANEL // 2)  # [P, G, pair t, input e, half h, column c]
    return c.permute(0, 1, 2, 4, 5, 3).reshape(p, g, GROUP, PANEL)  # lane 2c + e of row 2t + h


def unpack(panels: torch.Tensor, bits: int, inn: int, pairs: bool = False) -> torch.Tensor:
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
    if pairs:  # _lanes undone: lane 2c + e of row 2t + h -> input 2t + e, column 8h + c
        q = q.view(p, groups, GROUP // 2, 2, PANEL // 2, 2).permute(0, 1, 2, 5, 3, 4).reshape(q.shape)
    w = m + q * d  # [P, G, 32, 16]
    return w.permute(0, 3, 1, 2).reshape(p * PANEL, inn)
