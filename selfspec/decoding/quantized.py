"""Quantized self-draft (QSpec, ipex-llm's self-speculation): the model drafts with its own weights at
4 or 8 bits — all of its layers, or the first N with the final norm and LM head — on the same paged
cache. The draft writes K/V into the slots of its draft positions; verification runs the target's
own weights over [last, d_1 .. d_γ] from layer 0 and overwrites every one of them, so rollback stays
a length edit and the draft never changes output. A 4-bit GGUF drafts with the file's own codes.

The draft copy shares the target's embeddings and norms, and, where the target keeps 4-bit codes, its
layers' code panels too (`shared_codes`); its own linears are what it adds to memory
(`describe()["memory_mb"]`). Its LM head is a `Shortlist`: the head in 4 bits scores the vocabulary and
the best few scores are recomputed from the target's own float head rows."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

from ..kernels import native
from ..kernels.base import Linear
from ..kernels.choice import QUANTIZED
from ..kernels.native import NativeLinear
from ..kernels.native_int2 import NativeInt2Dot
from ..kernels.native_shared import SharedCodes
from ..model.cache import PagedKVCache
from ..model.decoder import DecoderModel
from ..model.ops import Sampled
from .drafter import Draft, Drafter, autoregress
from .sampling import SamplingParams, uniforms

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
            "head": self.draft.head.name,
        }

    @property
    def memory_bytes(self) -> int:
        """What the draft copy adds: its linears (the LM head included when it is tied), less those it
        reads from its target."""
        return sum(lin.nbytes for lin in self.draft.linears() if id(lin) not in self.draft.borrowed)

    def propose(self, model: DecoderModel, cache: PagedKVCache, step: RoundInput) -> Draft:
        n, draft = self.draft_layers, self.draft
        fast = self._native(cache, step)
        if fast is not None:
            return fast
        run = autoregress(draft, cache, step, n, lambda h, batch: draft.logits(h[:, -1]))
        return Draft(run.tokens, run.probs)  # resume = 0: the target recomputes (and rewrites) every layer

    def _native(self, cache: PagedKVCache, step: RoundInput) -> Draft | None:
        """Rows drafting the same γ, in one native call (ops.Fused.draft): greedy rows take the tokens
        autoregress would draft (the same kernels in the same order), sampled rows draw from the draft
        scores at their temperature, top-k and top-p (sampling.process_logits' cuts) with the uniforms
        their generators give autoregress, one per step, and return that q; all without autoregress's
        Python and tensor bookkeeping, ~0.4-0.6 ms of a ~4 ms greedy draft token here and ~1.1 of a ~4.5
        ms sampled one. Rows with γ = 0 (the hybrid's looked-up ones) draft nothing. None where that path
        does not apply: penalties, a confidence threshold, rows of different γ, or a head or layer off
        native.c."""
        draft, head = self.draft, self.draft.head
        if step.penalties is not None or step.confidence_threshold > 0:
            return None
        if not hasattr(draft.ops, "draft") or not isinstance(head, Shortlist):
            return None
        if not isinstance(head.coarse, NativeLinear) or head.coarse.spec is None:
            return None
        if head.weight.dtype != draft.dtype:  # native.c reads the float rows in the activations' dtype
            return None
        active = [b for b, g in enumerate(step.gammas) if g > 0]
        if len({step.gammas[b] for b in active}) > 1:
            return None
        tokens: list[list[int]] = [[] for _ in step.seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in step.seqs]  # greedy rows: none (the round's one-hot)
        if not active:
            return Draft(tokens, probs)
        steps = step.gammas[active[0]]
        gens = [step.generators[b] for b in active]
        sampled = _sampled([step.params[b] for b in active], gens, steps, draft.device)
        drafted = draft.ops.draft(
            draft.layers,
            self.draft_layers,
            cache,
            [step.seqs[b] for b in active],
            [step.last[b] for b in active],
            steps,
            draft.embed_weight,
            draft.norm_weight,
            head.coarse.spec,
            head.k,
            head.weight,
            sampled,
        )
        if drafted is None:
            return None
        rows, q = drafted
        for i, b in enumerate(active):
            tokens[b] = rows[i]
            if q is not None and not step.params[b].greedy:
                probs[b] = list(q[i])
        return Draft(tokens, probs)


def _sampled(
    params: list[SamplingParams], generators: list[torch.Generator | None], steps: int, device: torch.device
) -> Sampled | None:
    """A native draft's temperatures and uniforms for rows `params` (None when every row is greedy): each
    sampled row's `steps` uniforms from its generator, the numbers autoregress draws there one step at a
    time (a CPU generator gives n draws at once as n single ones)."""
    if all(p.greedy for p in params):
        return None
    draws = torch.zeros(len(params), steps, device=device)
    for i, (p, g) in enumerate(zip(params, generators)):
        if not p.greedy:
            draws[i] = uniforms(1, steps, [g], device)[0]
    return Sampled(
        torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device),
        torch.tensor([p.top_k for p in params], dtype=torch.long, device=device),
        torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
        draws,
    )


# Shortlisted tokens per draft position. benchmarks/shortlist.py (the default model in float32, 1152
# teacher-forced positions of its own greedy answers to 24 dev prompts, int4 layers): the draft's top-1
# agreed with the target's at 0.9797 with an int8 head, 0.9848 with the float head itself and 0.9848 with
# a shortlist of 8 or more (the float head's token at every position); at T = 0.7 the expected acceptance
# sum(min(p, q)) was 0.9767 (int8), 0.9805 (float), 0.9742 / 0.9772 / 0.9787 / 0.9795 with 8 / 16 / 32 / 64.
SHORTLIST = 32
# A bfloat16 draft's coarse head is 2-bit where native.c has that kernel (kernels/native_int2.py), with a
# shortlist of 128: benchmarks/shortlist.py (AMD EPYC Zen 4, 985 teacher-forced positions) found the float
# head's token among its best 32 / 128 at 0.976 / 0.996 of positions (the 4-bit head's best 8: all). It
# reads 10.6 MB where the 4-bit head reads 17.7 (0.51 against 0.74 ms a call from memory; k = 128 costs
# the shortlist 0.18 against 0.11 ms). Decoding 26 dev prompts (greedy, 128 tokens, the shipped policy,
# both heads and plain alternating per prompt, twice each), the median speedup over plain went 1.495 ->
# 1.540 and 1.462 -> 1.512 in bf16; in fp32 1.287 -> 1.295 with a geometric mean 1.353 -> 1.339 (its
# acceptance fell 0.849 -> 0.820, against 0.865 -> 0.858 in bf16), so fp32 keeps 4 bits.
SHORTLIST_2BIT = 128


class Shortlist(Linear):
    """The draft's LM head: the head's weight in 4 bits (`coarse`; 2 for bfloat16, see `shortlist`) scores
    the whole vocabulary, and the `k` highest scores are replaced by the exact ones, recomputed from the
    float head rows (`weight`, the target's). A greedy draft then picks the float head's token wherever it
    is among the coarse top k (at every position measured for 4 bits); a sampled one draws from these
    scores, which is all the acceptance rule needs (q is whatever the draft sampled from). It reads ~60 %
    of an int8 head's bytes (the default model's 49152 x 576 head: 17.7 against 28.5 MB), and a draft
    token took 0.91-0.96x the time it took with the int8 head (benchmarks/shortlist.py, AMD EPYC Zen 3)."""

    name = "shortlist"
    row_exact = False  # a draft's scores need not be (verification decides every token)

    def __init__(self, coarse: Linear, weight: torch.Tensor, k: int = SHORTLIST) -> None:
        super().__init__(coarse.out_features, coarse.in_features, None, coarse.dtype, coarse.device)
        self.coarse, self.weight, self.k = coarse, weight, min(k, coarse.out_features)

    @property
    def nbytes(self) -> int:
        return self.coarse.nbytes  # and k rows of the float weight, shared with the target

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, in] -> [rows, vocab] float32 whatever the activations (DecoderModel.logits wants float32:
        rounding 49152 scores to bfloat16 and widening them back cost ~0.1 ms a step)."""
        coarse = self.coarse
        y = coarse.matmul_float32(x) if isinstance(coarse, NativeLinear) else coarse.matmul(x).float()  # [rows, vocab]
        lib = native.library() if y.device.type == "cpu" else None
        if lib is not None:  # one C call
            lib.shortlist(y, self.k, x, self.weight)
            return y
        idx = y.topk(self.k, -1).indices  # [rows, k]
        exact = torch.bmm(self.weight[idx], x.to(self.weight.dtype).unsqueeze(-1)).squeeze(-1)  # [rows, k]
        return y.scatter_(-1, idx, exact.float())


def shortlist(weight: torch.Tensor, bits: int | None = None) -> Shortlist | None:
    """A Shortlist over the float head `weight` [vocab, hidden] (its activations' dtype and device): its
    coarse head on native.c's 2-bit kernel for bfloat16 where the build has it, else on the fastest int4
    backend available there (`bits` asks for 2 or 4); None where there is none."""
    if weight.shape[1] % 32:
        return None
    two = bits == 2 or (bits is None and weight.dtype == torch.bfloat16)
    if two and NativeInt2Dot.unavailable(weight.dtype, weight.device) is None:
        return Shortlist(NativeInt2Dot(weight, None, weight.dtype), weight, SHORTLIST_2BIT)
    backend = next((b for b in QUANTIZED["int4"] if b.unavailable(weight.dtype, weight.device) is None), None)
    if backend is None or bits == 2:
        return None
    return Shortlist(backend(weight, None, weight.dtype), weight)


def share_embeddings(draft: DecoderModel, target: DecoderModel) -> DecoderModel:
    """Points the draft at the target's embedding, norm and RoPE tensors (they are identical: only
    linears are quantized), so the copy costs only its linears (and its head: the Shortlist the
    engine loads it with)."""
    draft.embed_weight = target.embed_weight
    draft.norm_weight = target.norm_weight
    draft.head_weight = target.head_weight
    draft.rope = draft.ops.rope = target.rope
    for mine, theirs in zip(draft.layers, target.layers):
        mine.attn_norm, mine.mlp_norm = theirs.attn_norm, theirs.mlp_norm
    return draft


def shared_codes(target: DecoderModel) -> Callable[[int, str, str], Linear | None]:
    """For loading an int4 draft (build_model's `given`): layer i's linear `name` as a view of the target's
    own 4-bit code panels where the target keeps that weight as codes and the draft's timed backend is
    the int8-activation kernel the view computes like (kernels/native_shared.py), the target's linear
    itself where it already runs on the draft's backend (an int4 target), else None (the draft packs its
    own). The codes are the same weights (the target's are checked bit for bit at load), so
    the draft drafts what its copy would, and the copy (~66 MB for the default model) is never made."""

    def given(i: int, name: str, backend: str) -> Linear | None:
        lin = getattr(target.layers[i], name)
        if target.kernels.weights == "int4" and lin.name == backend:  # --weights int4: the target's own
            return lin
        if backend != SharedCodes.mirrors:
            return None
        return SharedCodes.of(lin, target.dtype)

    return given
