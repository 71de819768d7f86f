"""Trained draft exits: a small adapter between layer N's hidden state and the LM head, trained by
self-distillation, optionally scoring only a frequency-ranked subset of the vocabulary. q is zero
outside the subset, which keeps rejection sampling exact: an adapter changes speed, never output.

Kinds: `affine` (h + W h + b, tuned-lens style), `mlp` (h + up(silu(down(h))), a low-rank residual
block), `attn` (one attention block, Kangaroo-style, followed by the affine map). The attention block
has its own query and output projections but reads the keys and values that layer N-1 already wrote
into the shared paged cache: no second cache to fill, and rollback is the cache's own length edit.
Files are safetensors with metadata naming the base model's fingerprint, the exit layer, the
kind, the vocabulary subset and how the head was trained; loading against another model fails."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import SelfspecError
from ..kernels import Linear
from ..model.attention import AttentionBatch, gather_kv
from ..model.cache import PagedKVCache
from ..model.decoder import DecoderModel
from .drafter import ExitDrafter

KINDS = ("affine", "mlp", "attn")
DRAFT_DIR = Path(__file__).resolve().parent / "drafts"


@dataclass
class AttnContext:
    """What the `attn` adapter's queries read: layer N-1's keys/values and the queries' rotations."""

    k: torch.Tensor  # [B, kv_heads, T, head_dim] rotated keys, in position order
    v: torch.Tensor  # [B, kv_heads, T, head_dim]
    cos: torch.Tensor  # [B, S, 1, head_dim] at the query positions
    sin: torch.Tensor  # [B, S, 1, head_dim] (signed, see rope.apply_rope_)
    mask: torch.Tensor | None  # [B, 1, S, T] bool (True = attend), None = attend to all


class Adapter(nn.Module):
    """Maps layer-N hidden states [..., hidden] to hidden states the final norm + head should see.
    Initialized to the identity, so an untrained adapter is the plain early exit."""

    def __init__(self, kind: str, hidden: int, rank: int = 256, heads: int = 0, head_dim: int = 0) -> None:
        super().__init__()
        if kind not in KINDS:
            raise ValueError(f"kind={kind!r} is invalid: use one of {', '.join(KINDS)}")
        self.kind, self.rank, self.heads, self.head_dim = kind, rank, heads, head_dim
        if kind in ("affine", "attn"):
            self.proj = nn.Linear(hidden, hidden)
            nn.init.zeros_(self.proj.weight)
            nn.init.zeros_(self.proj.bias)
        if kind == "mlp":
            self.down = nn.Linear(hidden, rank, bias=False)
            self.up = nn.Linear(rank, hidden, bias=False)
            nn.init.zeros_(self.up.weight)
        if kind == "attn":
            if heads < 1 or head_dim < 1:
                raise ValueError("an attn adapter needs the model's heads and head_dim")
            self.attn_norm = nn.Parameter(torch.ones(hidden))
            self.wq = nn.Linear(hidden, heads * head_dim, bias=False)
            self.wo = nn.Linear(heads * head_dim, hidden, bias=False)
            nn.init.zeros_(self.wo.weight)

    def forward(self, h: torch.Tensor, context: AttnContext | None = None) -> torch.Tensor:
        """h [B, S, hidden] (or [..., hidden] for kinds without attention) -> same shape."""
        if self.kind == "mlp":
            return h + self.up(F.silu(self.down(h)))
        if self.kind == "attn":
            if context is None:
                raise SelfspecError("an attn draft head needs the cache context (use DraftHead.draft)")
            h = h + self._attend(h, context)
        return h + self.proj(h)

    def _attend(self, h: torch.Tensor, ctx: AttnContext) -> torch.Tensor:
        b, s, hidden = h.shape
        x = F.rms_norm(h, (hidden,), self.attn_norm, 1e-5)
        q = self.wq(x).view(b, s, self.heads, self.head_dim)  # [B, S, heads, head_dim]
        q = q * ctx.cos + torch.roll(q, self.head_dim // 2, dims=-1) * ctx.sin  # RoPE at the query positions
        o = F.scaled_dot_product_attention(q.transpose(1, 2), ctx.k, ctx.v, attn_mask=ctx.mask, enable_gqa=True)
        return self.wo(o.transpose(1, 2).reshape(b, s, -1))  # [B, S, hidden]


@dataclass
class DraftHead:
    draft_layers: int
    adapter: Adapter
    vocab: torch.Tensor | None  # [V_sub] token ids the draft may propose; None = the whole vocabulary
    head: Linear  # [V_sub, hidden]: the LM head's rows for those ids, in the model's weight format
    norm: torch.Tensor  # [hidden] the model's final norm weight
    eps: float
    vocab_size: int
    metadata: dict = field(default_factory=dict)
    model: DecoderModel | None = None  # for the attn kind: its RoPE table and layer N-1's window

    @property
    def kind(self) -> str:
        return self.adapter.kind

    @property
    def vocab_subset(self) -> int:
        """Tokens the draft may propose; 0 = the whole vocabulary."""
        return 0 if self.vocab is None else int(self.vocab.numel())

    def draft(self, h: torch.Tensor, batch: AttentionBatch, cache: PagedKVCache) -> torch.Tensor:
        """The drafting call: hidden [B, S, hidden] at layer N of a pass described by `batch` ->
        draft logits [B, vocab] of each row's last position."""
        return self.in_pass(h, batch, cache)[:, -1]

    def in_pass(self, h: torch.Tensor, batch: AttentionBatch, cache: PagedKVCache, first: int = 0) -> torch.Tensor:
        """hidden [B, S, hidden] at layer N of a pass described by `batch` -> draft logits
        [B, S - first, vocab] of the positions from `first` on (the others only as attention keys)."""
        if self.kind != "attn":
            return self.logits(h[:, first:])
        ctx = self.context(batch, cache)
        mask = None if ctx.mask is None else ctx.mask[:, :, first:]
        return self.logits(h[:, first:], AttnContext(ctx.k, ctx.v, ctx.cos[:, first:], ctx.sin[:, first:], mask))

    def context(self, batch: AttentionBatch, cache: PagedKVCache) -> AttnContext:
        k, v = gather_kv(cache.layers[self.draft_layers - 1], batch)  # each [B, kv_heads, T, head_dim]
        cos, sin = self.model.rope.lookup(batch.positions, max(batch.kv_lens))
        return AttnContext(k, v, cos, sin, batch.mask(self.model.config.sliding_windows[self.draft_layers - 1]))

    @torch.inference_mode()
    def logits(self, h: torch.Tensor, context: AttnContext | None = None) -> torch.Tensor:
        """hidden [..., hidden] at layer N -> draft logits [..., vocab] float32 (-inf outside the subset)."""
        x = self.adapter(h, context)
        x = F.rms_norm(x, (x.shape[-1],), self.norm, self.eps)
        sub = self.head(x).float()  # [..., V_sub]
        if self.vocab is None:
            return sub
        full = torch.full((*sub.shape[:-1], self.vocab_size), float("-inf"), device=sub.device)
        return full.index_copy_(-1, self.vocab, sub)

    def save(self, path: str | Path) -> None:
        from safetensors.torch import save_file

        tensors = {f"adapter.{k}": v.detach().float().cpu().contiguous() for k, v in self.adapter.state_dict().items()}
        if self.vocab is not None:
            tensors["vocab"] = self.vocab.cpu().contiguous()
        meta = dict(self.metadata, draft_layers=self.draft_layers, kind=self.kind, rank=self.adapter.rank)
        save_file(tensors, str(path), metadata={"selfspec": json.dumps(meta)})


class HeadDrafter(ExitDrafter):
    """The early exit at the head's depth, with the trained head between layer N and the LM head."""

    name = "head"

    def __init__(self, head: DraftHead) -> None:
        super().__init__(head.draft_layers)
        self.head = head

    def describe(self) -> dict:
        return dict(super().describe(), kind=self.head.kind, vocab_subset=self.head.vocab_subset)

    def logits(self, model: DecoderModel, h: torch.Tensor, batch: AttentionBatch, cache: PagedKVCache) -> torch.Tensor:
        return self.head.draft(h, batch, cache)


def build(
    model: DecoderModel, draft_layers: int, adapter: Adapter, vocab: torch.Tensor | None, metadata: dict | None = None
) -> DraftHead:
    """A draft head for `model` at depth N; the adapter is cast to the model's dtype."""
    if not 1 <= draft_layers < model.num_layers:
        raise SelfspecError(f"draft_layers={draft_layers} is invalid for a {model.num_layers}-layer model")
    vocab = None if vocab is None else vocab.to(model.device)
    head = model.head if vocab is None else model.make_linear(model.head_weight[vocab].contiguous())
    adapter = adapter.to(device=model.device, dtype=model.dtype).eval()
    for p in adapter.parameters():
        p.requires_grad_(False)
    meta = dict(metadata or {}, base_fingerprint=model.fingerprint)
    c = model.config
    return DraftHead(draft_layers, adapter, vocab, head, model.norm_weight, c.rms_norm_eps, c.vocab_size, meta, model)


def new_adapter(model: DecoderModel, kind: str, rank: int = 256) -> Adapter:
    c = model.config
    return Adapter(kind, c.hidden_size, rank, c.num_heads, c.head_dim)


def load(path: str | Path, model: DecoderModel) -> DraftHead:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = json.loads((f.metadata() or {}).get("selfspec", "{}"))
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # a missing, truncated or foreign file: say so instead of a parser traceback
        raise SelfspecError(f"cannot read draft head {path}: {e}") from None
    if meta.get("base_fingerprint") != model.fingerprint:
        raise SelfspecError(
            f"draft head {path} was trained for model {meta.get('base_model', '?')!r} (fingerprint "
            f"{meta.get('base_fingerprint')}), not this one ({model.fingerprint}): train one with selfspec train-draft"
        )
    adapter = new_adapter(model, meta["kind"], meta.get("rank", 256))
    adapter.load_state_dict({k[len("adapter.") :]: v for k, v in tensors.items() if k.startswith("adapter.")})
    return build(model, int(meta["draft_layers"]), adapter, tensors.get("vocab"), meta)


def default_path(model: DecoderModel) -> Path | None:
    """The shipped draft head for this model, if there is one."""
    found = sorted(DRAFT_DIR.glob(f"{model.fingerprint}-*.safetensors"))
    return found[0] if found else None


def find(model: DecoderModel, head: DraftHead | str | bool | None) -> DraftHead | None:
    """An explicit draft head (object or path), none (False), else the shipped one for this model."""
    if head is False or isinstance(head, DraftHead):
        return head or None
    path = head if head is not None else default_path(model)
    return load(path, model) if path else None
