"""The decoder forward for Llama-family models (llama, mistral, qwen2), written to exit at any layer.

`forward(x, cache, seqs, start=a, end=b)` is the one entry point: it reserves the cache slots of the
new tokens, runs layers [a, b) and returns the hidden state there; `logits` applies the final norm and
LM head. Drafting with the first N layers and verifying with the rest are both calls of these two
functions against one paged KV cache."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from ..errors import ModelLoadError
from .attention import AttentionBatch, paged_attention, write_kv
from .cache import PagedKVCache, SequenceKV
from .config import ModelConfig
from .rope import RopeTable, apply_rope_


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor  # [hidden]
    wqkv: torch.Tensor  # [(heads + 2 * kv_heads) * head_dim, hidden]: q, k, v projections fused
    bqkv: torch.Tensor | None  # [(heads + 2 * kv_heads) * head_dim] (qwen2, llama attention_bias)
    wo: torch.Tensor  # [hidden, heads * head_dim]
    bo: torch.Tensor | None  # [hidden]
    mlp_norm: torch.Tensor  # [hidden]
    w_gate_up: torch.Tensor  # [2 * intermediate, hidden]: gate and up projections fused
    w_down: torch.Tensor  # [hidden, intermediate]


class DecoderModel:
    def __init__(
        self,
        config: ModelConfig,
        embed: torch.Tensor,
        layers: list[LayerWeights],
        norm: torch.Tensor,
        head: torch.Tensor,
    ) -> None:
        self.config = config
        self.embed_weight = embed  # [vocab, hidden]
        self.layers = layers
        self.norm_weight = norm  # [hidden]
        self.head_weight = head  # [vocab, hidden]; the same values as embed when tied
        self.dtype = embed.dtype
        self.rope = RopeTable(config.rope, config.head_dim, self.dtype)
        c = config
        self._qkv_split = [c.num_heads * c.head_dim, 2 * c.num_kv_heads * c.head_dim]
        self._qk_heads = c.num_heads + c.num_kv_heads

    @property
    def num_layers(self) -> int:
        return self.config.num_layers

    @property
    def fingerprint(self) -> str:
        """Identifies the base model across dtypes: its architecture and the bfloat16 bits of a slice
        of its embeddings. Profiles and draft adapters record it and refuse other models."""
        c = self.config
        arch = (
            f"{c.model_type}|{c.vocab_size}|{c.hidden_size}|{c.intermediate_size}|"
            f"{c.num_layers}|{c.num_heads}|{c.num_kv_heads}"
        )
        sample = self.embed_weight[:8, :64].to(torch.bfloat16).view(torch.int16).numpy().tobytes()
        return hashlib.sha256(arch.encode() + sample).hexdigest()[:16]

    def new_cache(self, num_tokens: int, block_size: int = 16) -> PagedKVCache:
        c = self.config
        blocks = -(-num_tokens // block_size) + 1  # + the reserved null block
        return PagedKVCache(
            c.num_layers, c.num_kv_heads, c.head_dim, num_blocks=blocks, block_size=block_size, dtype=self.dtype
        )

    # ---- the forward ------------------------------------------------------------------------------
    def forward(
        self,
        x: torch.Tensor,
        cache: PagedKVCache,
        seqs: list[SequenceKV] | None = None,
        *,
        start: int = 0,
        end: int | None = None,
        counts: list[int] | None = None,
        starts: list[int] | None = None,
        batch: AttentionBatch | None = None,
    ) -> torch.Tensor:
        """Token ids [B, S] (with start = 0) or hidden states [B, S, hidden] entering layer `start` ->
        hidden states [B, S, hidden] after layer end - 1 (default: the last layer). Row b holds
        counts[b] real tokens (default S) written at positions from starts[b] (default: the sequence's
        length). `batch`: attention metadata already prepared for this pass (a drafter that also
        reads it); otherwise it is prepared here from `seqs`."""
        end = self.num_layers if end is None else end
        if not 0 <= start <= end <= self.num_layers:
            raise ValueError(f"layer range [{start}, {end}) outside [0, {self.num_layers}]")
        if batch is None:
            if seqs is None:
                raise ValueError("forward needs the sequences (seqs) or prepared attention metadata (batch)")
            batch = cache.prepare(seqs, counts or [x.shape[1]] * x.shape[0], starts)
        h = F.embedding(x, self.embed_weight) if x.dtype == torch.long else x
        cos, sin = self.rope.lookup(batch.positions)  # [B, S, 1, head_dim]
        for i in range(start, end):
            h = self._layer(i, h, cos, sin, batch, cache.layers[i])
        return h

    def prefill(self, cache: PagedKVCache, seq: SequenceKV, tokens: list[int], chunk: int = 512) -> None:
        """Appends `tokens` to `seq`'s cache through all layers, `chunk` tokens per pass (which bounds the
        [S, T] attention scores); computes no logits."""
        for i in range(0, len(tokens), chunk):
            self.forward(torch.tensor([tokens[i : i + chunk]]), cache, [seq])

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """hidden [..., hidden] -> logits [..., vocab] in float32."""
        h = F.rms_norm(h, (h.shape[-1],), self.norm_weight, self.config.rms_norm_eps)
        return linear(h, self.head_weight).float()

    def _layer(
        self,
        i: int,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: AttentionBatch,
        layer_kv: torch.Tensor,
    ) -> torch.Tensor:
        c, w = self.config, self.layers[i]
        b, s, hidden = h.shape
        x = F.rms_norm(h, (hidden,), w.attn_norm, c.rms_norm_eps)
        qkv = linear(x, w.wqkv, w.bqkv)  # [B, S, (heads + 2 kv_heads) * head_dim]
        qk = qkv[..., : self._qk_heads * c.head_dim].view(b, s, self._qk_heads, c.head_dim)
        apply_rope_(qk, cos, sin)  # in place, so that k and v stay adjacent in qkv
        q = qk[:, :, : c.num_heads].transpose(1, 2)  # [B, heads, S, head_dim]
        kv = qkv[..., c.num_heads * c.head_dim :].reshape(b * s, 2, c.num_kv_heads, c.head_dim)
        write_kv(layer_kv, kv.permute(1, 2, 0, 3), batch)  # [2, kv_heads, B * S, head_dim]
        o = paged_attention(q, layer_kv, batch, c.sliding_windows[i])  # [B, heads, S, head_dim]
        h = linear(o.transpose(1, 2).reshape(b, s, -1), w.wo, w.bo, residual=h)
        x = F.rms_norm(h, (hidden,), w.mlp_norm, c.rms_norm_eps)
        gate, up = linear(x, w.w_gate_up).chunk(2, dim=-1)
        return linear(F.silu(gate).mul_(up), w.w_down, residual=h)


def linear(
    x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, *, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """[residual +] x [..., in] @ w[out, in].T [+ b]. A single row goes through gemv, which on CPU gives the
    same result as gemm with one row and is much faster in bfloat16. The residual add is fused into the
    BLAS call (bit-identical to a separate add in float32)."""
    if residual is not None and b is not None:
        return residual + linear(x, w, b)
    shape = (*x.shape[:-1], w.shape[0])
    if x.numel() == x.shape[-1]:
        if residual is not None:
            return torch.addmv(residual.reshape(-1), w, x.reshape(-1)).view(shape)
        y = torch.mv(w, x.reshape(-1)).view(shape)
        return y if b is None else y + b
    if residual is not None:
        return torch.addmm(residual.reshape(-1, shape[-1]), x.reshape(-1, x.shape[-1]), w.t()).view(shape)
    return F.linear(x, w, b)


def build_model(config: ModelConfig, get: Callable[[str], torch.Tensor | None], dtype: torch.dtype) -> DecoderModel:
    """Builds the model from tensors named as in Hugging Face checkpoints; `get(name)` returns a tensor
    or None when absent."""

    def need(name: str) -> torch.Tensor:
        t = get(name)
        if t is None:
            raise ModelLoadError(f"checkpoint is missing tensor {name!r}")
        return t.to(dtype)

    def matrix(t: torch.Tensor) -> torch.Tensor:
        # Measured on CPU: float32 gemv/gemm read a column-major weight ~10% faster; bfloat16 gemv prefers
        # row-major. The logical shape stays [out, in] either way.
        return t.t().contiguous().t() if dtype == torch.float32 else t.contiguous()

    def maybe(name: str) -> torch.Tensor | None:
        t = get(name)
        return None if t is None else t.to(dtype)

    layers = []
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        names = [p + f"self_attn.{x}_proj" for x in "qkv"]
        biases = [maybe(n + ".bias") for n in names]
        if any(bias is not None for bias in biases) and not all(bias is not None for bias in biases):
            raise ModelLoadError(f"layer {i}: q/k/v biases must be all present or all absent")
        layers.append(
            LayerWeights(
                attn_norm=need(p + "input_layernorm.weight"),
                wqkv=matrix(torch.cat([need(n + ".weight") for n in names])),
                bqkv=torch.cat(biases) if biases[0] is not None else None,
                wo=matrix(need(p + "self_attn.o_proj.weight")),
                bo=maybe(p + "self_attn.o_proj.bias"),
                mlp_norm=need(p + "post_attention_layernorm.weight"),
                w_gate_up=matrix(torch.cat([need(p + "mlp.gate_proj.weight"), need(p + "mlp.up_proj.weight")])),
                w_down=matrix(need(p + "mlp.down_proj.weight")),
            )
        )
    embed = need("model.embed_tokens.weight")
    head = matrix(embed if config.tie_word_embeddings else need("lm_head.weight"))
    return DecoderModel(config, embed, layers, need("model.norm.weight"), head)
