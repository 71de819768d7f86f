"""Trained draft exits: a small adapter between layer N's hidden state and the LM head, trained by
self-distillation, optionally scoring only a frequency-ranked subset of the vocabulary. q is zero
outside the subset, which keeps rejection sampling exact: an adapter changes speed, never output.

Kinds: `affine` (h + W h + b, tuned-lens style), `mlp` (h + up(silu(down(h))), a low-rank residual
block). Files are safetensors with metadata naming the base model's fingerprint, the exit layer, the
kind, the vocabulary subset and how the head was trained; loading against another model fails."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .errors import SelfspecError
from .model import DecoderModel, linear

KINDS = ("affine", "mlp")
DRAFT_DIR = Path(__file__).resolve().parent / "drafts"


class Adapter(nn.Module):
    """Maps layer-N hidden states [..., hidden] to hidden states the final norm + head should see.
    Initialized to the identity, so an untrained adapter is the plain early exit."""

    def __init__(self, kind: str, hidden: int, rank: int = 256) -> None:
        super().__init__()
        if kind not in KINDS:
            raise ValueError(f"kind={kind!r} is invalid: use one of {', '.join(KINDS)}")
        self.kind, self.rank = kind, rank
        if kind == "affine":
            self.proj = nn.Linear(hidden, hidden)
            nn.init.zeros_(self.proj.weight)
            nn.init.zeros_(self.proj.bias)
        else:
            self.down = nn.Linear(hidden, rank, bias=False)
            self.up = nn.Linear(rank, hidden, bias=False)
            nn.init.zeros_(self.up.weight)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.kind == "affine":
            return h + self.proj(h)
        return h + self.up(F.silu(self.down(h)))


@dataclass
class DraftHead:
    draft_layers: int
    adapter: Adapter
    vocab: torch.Tensor | None  # [V_sub] token ids the draft may propose; None = the whole vocabulary
    head: torch.Tensor  # [V_sub, hidden]: the LM head's rows for those ids (model dtype)
    norm: torch.Tensor  # [hidden] the model's final norm weight
    eps: float
    vocab_size: int
    metadata: dict = field(default_factory=dict)

    @property
    def kind(self) -> str:
        return self.adapter.kind

    @torch.inference_mode()
    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """hidden [..., hidden] at layer N -> draft logits [..., vocab] float32 (-inf outside the subset)."""
        x = self.adapter(h)
        x = F.rms_norm(x, (x.shape[-1],), self.norm, self.eps)
        sub = linear(x, self.head).float()  # [..., V_sub]
        if self.vocab is None:
            return sub
        full = torch.full((*sub.shape[:-1], self.vocab_size), float("-inf"))
        return full.index_copy_(-1, self.vocab, sub)

    def save(self, path: str | Path) -> None:
        from safetensors.torch import save_file

        tensors = {f"adapter.{k}": v.detach().float().contiguous() for k, v in self.adapter.state_dict().items()}
        if self.vocab is not None:
            tensors["vocab"] = self.vocab.contiguous()
        meta = dict(self.metadata, draft_layers=self.draft_layers, kind=self.kind, rank=self.adapter.rank)
        save_file(tensors, str(path), metadata={"selfspec": json.dumps(meta)})


def build(model: DecoderModel, draft_layers: int, adapter: Adapter, vocab: torch.Tensor | None, metadata: dict | None = None) -> DraftHead:
    """A draft head for `model` at depth N; the adapter is cast to the model's dtype."""
    if not 1 <= draft_layers < model.num_layers:
        raise SelfspecError(f"draft_layers={draft_layers} is invalid for a {model.num_layers}-layer model")
    head = model.head_weight if vocab is None else model.head_weight[vocab].contiguous()
    adapter = adapter.to(model.dtype).eval()
    for p in adapter.parameters():
        p.requires_grad_(False)
    meta = dict(metadata or {}, base_fingerprint=model.fingerprint)
    return DraftHead(draft_layers, adapter, vocab, head, model.norm_weight, model.config.rms_norm_eps, model.config.vocab_size, meta)


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
    adapter = Adapter(meta["kind"], model.config.hidden_size, meta.get("rank", 256))
    adapter.load_state_dict({k[len("adapter."):]: v for k, v in tensors.items() if k.startswith("adapter.")})
    return build(model, int(meta["draft_layers"]), adapter, tensors.get("vocab"), meta)


def default_path(model: DecoderModel) -> Path | None:
    """The shipped draft head for this model, if there is one."""
    found = sorted(DRAFT_DIR.glob(f"{model.fingerprint}-*.safetensors"))
    return found[0] if found else None
