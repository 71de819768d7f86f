"""Quantized self-draft (QSpec, ipex-llm's self-speculation): the model drafts with its own weights at
4 or 8 bits — all of its layers, or the first N with the final norm and LM head — on the same paged
cache. The draft writes K/V into the slots of its draft positions; verification runs the target's
own weights over [last, d_1 .. d_γ] from layer 0 and overwrites every one of them, so rollback stays
a length edit and the draft never changes output. A 4-bit GGUF drafts with the file's own codes.

The draft copy shares the target's embeddings and norms; its linears are what it adds to memory
(`describe()["memory_mb"]`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..model.cache import PagedKVCache
from ..model.decoder import DecoderModel
from .drafter import Draft, Drafter, autoregress

if TYPE_CHECKING:
    from .round import RoundInput


class QuantizedDrafter(Drafter):
    def __init__(self, draft: DecoderModel, draft_layers: int | None = None) -> None:
        self.draft = draft  # the same architecture with quantized linears (see share_embeddings)
        self.draft_layers = draft_layers or draft.num_layers
        self.name = draft.kernels.weights  # "int4" or "int8"

    def describe(self) -> dict:
        return {
            "drafter": self.name,
            "draft_layers": self.draft_layers,
            "backend": self.draft.kernels.backend,
            "memory_mb": round(self.memory_bytes / 2**20, 1),
        }

    @property
    def memory_bytes(self) -> int:
        """What the draft copy adds: its linears (the LM head included when it is tied)."""
        return sum(lin.nbytes for lin in self.draft.linears())

    def propose(self, model: DecoderModel, cache: PagedKVCache, step: RoundInput) -> Draft:
        n, draft = self.draft_layers, self.draft
        run = autoregress(draft, cache, step, n, lambda h, batch: draft.logits(h[:, -1]))
        return Draft(run.tokens, run.probs)  # resume = 0: the target recomputes (and rewrites) every layer


def share_embeddings(draft: DecoderModel, target: DecoderModel) -> DecoderModel:
    """Points the draft at the target's embedding, norm and RoPE tensors (they are identical: only
    linears are quantized), so the copy costs only its linears."""
    draft.embed_weight = target.embed_weight
    draft.norm_weight = target.norm_weight
    draft.head_weight = target.head_weight  # the float tensor only; the draft's head linear is its own
    draft.rope = draft.ops.rope = target.rope
    for mine, theirs in zip(draft.layers, target.layers):
        mine.attn_norm, mine.mlp_norm = theirs.attn_norm, theirs.mlp_norm
    return draft
