"""The decoder's glue between its linears: residual add + RMSNorm, SiLU * up, and RoPE + cache write +
attention. `Eager` is the torch reference (any device); `Fused` runs the same steps as one compiled call
each (kernels/native.c) on the CPU, where a small eager op costs ~5-10 us and a decoding step issues
~20 of them per layer. Both keep every row's bits independent of the rows beside it (see
attention.paged_attention), so verification reproduces plain decoding exactly under either."""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from ..kernels import native
from ..kernels.base import EXACT_ROWS
from .attention import AttentionBatch, paged_attention, write_kv
from .cache import PagedKVCache, SequenceKV
from .config import ModelConfig
from .rope import RopeTable, apply_rope_

if TYPE_CHECKING:
    from .decoder import LayerWeights


@dataclass
class NativePass:
    """native.c's arguments for one pass, made once for all its layers: `info` points into the tensors
    beside it (int64, contiguous), which this object keeps alive."""

    positions: torch.Tensor  # [B * S]
    slots: torch.Tensor  # [B * S] where each row's k, v are written
    tables: torch.Tensor  # [B, max_blocks]
    counts: torch.Tensor  # [B] real rows per sequence
    info: native.PassInfo  # their addresses and the model's sizes, for native.c's attend_pass and layer


@dataclass
class Sampled:
    """The sampled rows of a native draft (Fused.draft): 0 marks a greedy row."""

    temperatures: torch.Tensor  # [B] float32
    top_k: torch.Tensor  # [B] int64 (0: off)
    top_p: torch.Tensor  # [B] float32 (1: off)
    uniforms: torch.Tensor  # [B, steps] float32 in [0, 1): the draw of each row's draft token at each step

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """In native.c's draft_tokens order."""
        return self.temperatures, self.top_k, self.top_p, self.uniforms


class Eager:
    name = "eager"

    def __init__(self, config: ModelConfig, rope: RopeTable) -> None:
        c = config
        self.config, self.rope = config, rope
        self._qk = (c.num_heads + c.num_kv_heads) * c.head_dim  # q and k columns of qkv

    def add_norm(
        self, h: torch.Tensor, y: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """h [..., n] (+ y, the last linear's output, when given) -> (the residual stream, its RMSNorm)."""
        h = h if y is None else h + y
        return h, F.rms_norm(h, (h.shape[-1],), weight, eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up [..., 2 * intermediate] -> silu(gate) * up [..., intermediate]."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate).mul_(up)

    def layers(
        self,
        h: torch.Tensor,
        weights: list[LayerWeights],
        start: int,
        end: int,
        state: tuple | NativePass,
        kv: list[torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Layers [start, end) from h (no pending output) in one call, where the ops can (Fused):
        (h, y) after the last of them; None: the caller runs them one by one."""
        return None

    def prepare(self, batch: AttentionBatch) -> tuple | NativePass:
        """What every layer's `attend` of this pass reads: here cos, sin [B, S, 1, head_dim]."""
        return self.rope.lookup(batch.positions, max(batch.kv_lens))

    def attend(
        self,
        qkv: torch.Tensor,
        batch: AttentionBatch,
        state: tuple | NativePass,
        layer_kv: torch.Tensor,
        window: int | None,
    ) -> torch.Tensor:
        """qkv [B, S, (heads + 2 kv_heads) * head_dim] -> attention output [B, S, heads * head_dim], after
        rotating q and k and writing k, v to the cache. `state`: this pass's `prepare`."""
        c, (cos, sin) = self.config, state
        b, s, _ = qkv.shape
        qk = qkv[..., : self._qk].view(b, s, c.num_heads + c.num_kv_heads, c.head_dim)
        apply_rope_(qk, cos, sin)  # in place, so that k and v stay adjacent in qkv
        q = qk[:, :, : c.num_heads].transpose(1, 2)  # [B, heads, S, head_dim]
        kv = qkv[..., c.num_heads * c.head_dim :].reshape(b * s, 2, c.num_kv_heads, c.head_dim)
        write_kv(layer_kv, kv.permute(1, 2, 0, 3), batch)  # [2, kv_heads, B * S, head_dim]
        o = paged_attention(q, layer_kv, batch, window)  # [B, heads, S, head_dim]
        return o.transpose(1, 2).reshape(b, s, -1)


class Fused(Eager):
    """native.c's kernels for the row-exact passes (decoding, verification); a long or prompt pass's
    attention stays on torch's masked SDPA, which uses both cores and its own vectorised exp."""

    name = "fused"

    def __init__(self, config: ModelConfig, rope: RopeTable, lib: native.Native) -> None:
        super().__init__(config, rope)
        self.lib = lib
        self._scale = 1.0 / math.sqrt(config.head_dim)  # SDPA's default
        self._table: tuple | None = None  # (key, weights, native.LayerSpec array or None): see _layer_table

    def add_norm(
        self, h: torch.Tensor, y: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.lib.add_norm(h.contiguous(), None if y is None else y.contiguous(), weight, eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.lib.silu_mul(gate_up.contiguous())

    def prepare(self, batch: AttentionBatch) -> tuple | NativePass:
        """The eager state for a long or prompt pass (its attention stays on SDPA), else native.c's."""
        b, s = batch.positions.shape
        if b * s > EXACT_ROWS or (s > 1 and not batch.exact):
            return super().prepare(batch)
        self.rope.reserve(max(batch.kv_lens))
        c, cos, sin = self.config, self.rope.cos, self.rope.sin_signed
        positions, slots = batch.positions.reshape(-1).contiguous(), batch.write_slots.contiguous()
        tables = batch.block_tables.contiguous()
        counts = torch.tensor(batch.num_tokens, dtype=torch.long, device=batch.positions.device)
        info = native.PassInfo(
            *(t.data_ptr() for t in (cos, sin, positions, slots, tables)),
            tables.shape[1],
            batch.block_size,
            counts.data_ptr(),
            b,
            s,
            c.num_heads,
            c.num_kv_heads,
            c.head_dim,
            c.hidden_size,
            self._scale,
            c.rms_norm_eps,
            native.DTYPES[cos.dtype],
            torch.get_num_threads(),
        )
        return NativePass(positions, slots, tables, counts, info)

    def layers(
        self,
        h: torch.Tensor,
        weights: list[LayerWeights],
        start: int,
        end: int,
        state: tuple | NativePass,
        kv: list[torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """decoder layers [start, end) in one native.c call (`layers`: `layer` after `layer`, so the same
        bits) for a row-exact pass whose linears are all native; None otherwise."""
        table = self._layer_table(weights) if isinstance(state, NativePass) and end > start else None
        if table is None:
            return None
        h = h.contiguous()
        h_out, y_out = torch.empty_like(h), torch.empty_like(h)  # y: the down projection's output, hidden wide
        slots = kv[0].shape[2] * kv[0].shape[3]  # blocks * block_size, the same in every layer
        # the cache's layer addresses, made per pass (~7 us) and kept by nothing, so no cache outlives its use
        addresses = (ctypes.c_void_p * len(kv))(*(t.data_ptr() for t in kv))
        self.lib.lib.layers(
            state.info,
            ctypes.addressof(table) + start * ctypes.sizeof(native.LayerSpec),
            end - start,
            ctypes.addressof(addresses) + start * ctypes.sizeof(ctypes.c_void_p),
            slots,
            h.data_ptr(),
            None,
            h_out.data_ptr(),
            y_out.data_ptr(),
        )
        return h_out, y_out

    def draft(
        self,
        weights: list[LayerWeights],
        end: int,
        cache: PagedKVCache,
        seqs: list[SequenceKV],
        tokens: list[int],
        steps: int,
        embed: torch.Tensor,
        norm: torch.Tensor,
        head: native.LinearSpec,
        k: int,
        rows: torch.Tensor,
        sampled: Sampled | None = None,
    ) -> tuple[list[list[int]], torch.Tensor | None] | None:
        """`steps` draft tokens for each sequence from its token in `tokens`, in one native.c call
        (`draft_tokens`): each step runs layers [0, end), the final norm `norm`, the coarse head `head`, the
        shortlist of its `k` best rescored from the float head `rows`, then each row's argmax, or, for the
        rows `sampled` gives a temperature, a draw from softmax(scores / temperature) cut by its top-k and
        top-p (sampling.process_logits) with its uniforms;
        K/V go to the cache as forward's would. -> (tokens [B][steps], q [B, steps, vocab] float32: the
        sampled rows' distributions, None without `sampled`); None (and the cache as it was) where the
        layers are not all native."""
        table = self._layer_table(weights)
        if table is None or len(seqs) * steps > EXACT_ROWS:
            return None
        batch = cache.prepare(seqs, [steps] * len(seqs))  # every step's positions and slots, read one by one
        state = self.prepare(batch)
        kv = cache.layers
        addresses = (ctypes.c_void_p * len(kv))(*(t.data_ptr() for t in kv))
        first = torch.tensor(tokens, dtype=torch.long, device=embed.device)
        out = torch.empty(len(seqs), steps, dtype=torch.long, device=embed.device)
        q = None if sampled is None else torch.empty(len(seqs), steps, head.out, device=embed.device)
        self.lib.lib.draft_tokens(
            state.info,
            ctypes.addressof(table),
            end,
            addresses,
            kv[0].shape[2] * kv[0].shape[3],
            embed.data_ptr(),
            norm.data_ptr(),
            head,
            k,
            rows.data_ptr(),
            first.data_ptr(),
            *((None,) * 4 if sampled is None else (t.data_ptr() for t in sampled.tensors())),
            None if q is None else q.data_ptr(),
            out.data_ptr(),
        )
        return out.tolist(), q

    def _layer_table(self, weights: list[LayerWeights]) -> ctypes.Array | None:
        """Every layer's native.LayerSpec (None where a linear is not native), built once per model and
        again after any layer's weights are reassigned (LayerWeights.edits)."""
        key = (type(weights[0]).edits, id(weights))
        if self._table is None or self._table[0] != key:
            specs = [(w.qkv.spec, w.o.spec, w.gate_up.spec, w.down.spec) for w in weights]
            table = None
            if all(None not in s for s in specs):
                windows = [w or 0 for w in self.config.sliding_windows]
                rows = [
                    native.LayerSpec(w.attn_norm.data_ptr(), w.mlp_norm.data_ptr(), *map(ctypes.pointer, s), window)
                    for w, s, window in zip(weights, specs, windows)
                ]
                table = (native.LayerSpec * len(rows))(*rows)
            self._table = (key, weights, table)  # holding `weights` keeps its id from being reused
        return self._table[2]

    def attend(
        self,
        qkv: torch.Tensor,
        batch: AttentionBatch,
        state: tuple | NativePass,
        layer_kv: torch.Tensor,
        window: int | None,
    ) -> torch.Tensor:
        if not isinstance(state, NativePass):
            return super().attend(qkv, batch, state, layer_kv, window)
        c, qkv = self.config, qkv.contiguous()
        out = qkv.new_empty(*qkv.shape[:2], c.num_heads * c.head_dim)
        slots = layer_kv.shape[2] * layer_kv.shape[3]  # blocks * block_size
        self.lib.lib.attend_pass(state.info, qkv.data_ptr(), layer_kv.data_ptr(), slots, window or 0, out.data_ptr())
        return out


def make_ops(config: ModelConfig, rope: RopeTable, dtype: torch.dtype, device: torch.device) -> tuple[Eager, str]:
    """The fused ops where they can run (CPU, float32 / bfloat16, a working C compiler), else eager;
    with the reason for the choice."""
    if device.type != "cpu":
        return Eager(config, rope), f"glue ops: eager (native.c is CPU code; this model is on {device.type})"
    if dtype not in native.DTYPES:
        return Eager(config, rope), f"glue ops: eager (native.c takes float32 or bfloat16, not {dtype})"
    if config.head_dim % 8:
        why = f"native.c's attention takes head sizes in 8s, not {config.head_dim}"
        return Eager(config, rope), f"glue ops: eager ({why})"
    lib = native.library()
    if lib is None:
        return Eager(config, rope), f"glue ops: eager ({native.unavailable()})"
    pairs = (
        "; bfloat16 attention scores and native linears by AVX512-BF16" if lib.pairs and dtype == torch.bfloat16 else ""
    )
    return Fused(config, rope, lib), f"glue ops: fused (native.c{pairs})"
