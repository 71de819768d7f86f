"""The decoder forward for Llama-family models (llama, mistral, qwen2), written to exit at any layer.

`forward(x, cache, seqs, start=a, end=b)` is the one entry point: it reserves the cache slots of the
new tokens, runs layers [a, b) and returns the hidden state there; `logits` applies the final norm and
LM head. Drafting with the first N layers and verifying with the rest are both calls of these two
functions against one paged KV cache."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from typing import Callable, ClassVar

import torch
import torch.nn.functional as F

from ..errors import ModelLoadError
from ..kernels import BACKENDS, Dense, Linear, native, pages
from ..kernels.choice import QUANTIZED, KernelPlan, plan
from ..kernels.int4 import Int4Codes
from .attention import AttentionBatch
from .cache import PagedKVCache, SequenceKV
from .config import ModelConfig
from .ops import NativePass, make_ops
from .rope import RopeTable


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor  # [hidden]
    qkv: Linear  # [(heads + 2 * kv_heads) * head_dim, hidden]: q, k, v projections fused (+ qwen2's biases)
    o: Linear  # [hidden, heads * head_dim]
    mlp_norm: torch.Tensor  # [hidden]
    gate_up: Linear  # [2 * intermediate, hidden]: gate and up projections fused
    down: Linear  # [hidden, intermediate]

    LINEARS: ClassVar[tuple[str, ...]] = ("qkv", "o", "gate_up", "down")
    # Assignments to any layer's weights so far: what was built from them before (ops.Fused's native
    # layer table) is stale once this moves (a test or benchmark swapping a linear).
    edits: ClassVar[int] = 0

    def __setattr__(self, name: str, value) -> None:
        object.__setattr__(self, name, value)
        LayerWeights.edits += 1

    def linears(self) -> list[Linear]:
        return [getattr(self, name) for name in self.LINEARS]


class DecoderModel:
    def __init__(
        self,
        config: ModelConfig,
        embed: torch.Tensor,
        layers: list[LayerWeights],
        norm: torch.Tensor,
        head_weight: torch.Tensor,
        kernels: KernelPlan,
        head: Linear | None = None,
    ) -> None:
        self.config = config
        self.embed_weight = embed  # [vocab, hidden]
        self.layers = layers
        self.norm_weight = norm  # [hidden]
        self.head_weight = head_weight  # [vocab, hidden] float; the same tensor as embed when tied
        self.dtype = embed.dtype  # the activations' dtype
        self.device = embed.device  # where every weight, the cache and each forward's tensors live
        self.kernels = kernels  # the weight format and backend of every linear
        self.borrowed: set[int] = set()  # ids of the linears another model owns (a draft's of its target)
        self.head = head if head is not None else self.make_linear(head_weight)  # given, or of the model's format
        self.rope = RopeTable(config.rope, config.head_dim, self.dtype, self.device)
        self.ops, note = make_ops(config, self.rope, self.dtype, self.device)  # the glue between the linears
        if note not in kernels.reasons:
            kernels.reasons.append(note)

    def make_linear(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Linear:
        """A linear of this model's weight format and backend for weight [out, in]."""
        return make_linear(self.kernels, weight, bias, self.dtype)

    def linears(self) -> list[Linear]:
        return [lin for layer in self.layers for lin in layer.linears()] + [self.head]

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
        sample = self.embed_weight[:8, :64].to(torch.bfloat16).view(torch.int16).cpu().numpy().tobytes()
        return hashlib.sha256(arch.encode() + sample).hexdigest()[:16]

    def new_cache(self, num_tokens: int, block_size: int = 16) -> PagedKVCache:
        c = self.config
        blocks = -(-num_tokens // block_size) + 1  # + the reserved null block
        return PagedKVCache(
            c.num_layers,
            c.num_kv_heads,
            c.head_dim,
            num_blocks=blocks,
            block_size=block_size,
            dtype=self.dtype,
            device=self.device,
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
        state = self.ops.prepare(batch)  # what every layer's attention reads
        y = None  # the last linear's output, not yet added to the residual stream h
        whole = self.ops.layers(h, self.layers, start, end, state, cache.layers)
        if whole is not None:
            h, y = whole
            return h + y
        for i in range(start, end):
            h, y = self._layer(i, h, y, batch, state, cache.layers[i])
        return h if y is None else h + y

    def prefill(self, cache: PagedKVCache, seq: SequenceKV, tokens: list[int], chunk: int = 512) -> None:
        """Appends `tokens` to `seq`'s cache through all layers, `chunk` tokens per pass (which bounds the
        [S, T] attention scores); computes no logits."""
        for i in range(0, len(tokens), chunk):
            part = tokens[i : i + chunk]
            batch = cache.prepare([seq], [len(part)])
            batch.exact = False
            self.forward(torch.tensor([part], device=self.device), cache, batch=batch)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """hidden [..., hidden] -> logits [..., vocab] in float32."""
        _, h = self.ops.add_norm(h, None, self.norm_weight, self.config.rms_norm_eps)
        return self.head(h).float()

    def greedy(self, h: torch.Tensor) -> torch.Tensor:
        """hidden [..., hidden] -> [...] int64: argmax(logits(h)), the first of equal maxima, from the head's
        own argmax where its backend has one (kernels: Linear.argmax), which skips most logits."""
        _, x = self.ops.add_norm(h, None, self.norm_weight, self.config.rms_norm_eps)
        ids = self.head.argmax(x)
        return ids if ids is not None else native.argmax(self.head(x).float())

    def _layer(
        self,
        i: int,
        h: torch.Tensor,
        y: torch.Tensor | None,
        batch: AttentionBatch,
        state: tuple | NativePass,
        layer_kv: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(h, y): the residual stream and the previous layer's output -> this layer's (h, y). Each
        residual add is left to the next norm, which makes it one fused call (ops.Fused)."""
        c, w, ops = self.config, self.layers[i], self.ops
        h, x = ops.add_norm(h, y, w.attn_norm, c.rms_norm_eps)
        o = ops.attend(w.qkv(x), batch, state, layer_kv, c.sliding_windows[i])  # [B, S, heads * head_dim]
        h, x = ops.add_norm(h, w.o(o), w.mlp_norm, c.rms_norm_eps)
        return h, w.down(ops.silu_mul(w.gate_up(x)))


def make_linear(kernels: KernelPlan, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> Linear:
    """`kernels`' backend for this weight, or the dense reference where that backend cannot take its
    shape (int4 packs 16 output rows and whole groups at a time); the plan then says so."""
    try:
        return BACKENDS[kernels.backend](weight, bias, dtype)
    except (RuntimeError, ValueError) as e:
        note = (
            f"a {weight.shape[0]}x{weight.shape[1]} weight runs on dense: {kernels.backend}: {str(e).splitlines()[0]}"
        )
        if note not in kernels.reasons:
            kernels.reasons.append(note)
        kernels.row_exact = kernels.row_exact and Dense.row_exact
        return Dense(weight, bias, dtype)


def build_model(
    config: ModelConfig,
    get: Callable[[str], torch.Tensor | None],
    dtype: torch.dtype,
    kernels: KernelPlan | None = None,
    codes: Callable[[str], Int4Codes | None] | None = None,
    device: torch.device | str = "cpu",
    head: Linear | None = None,
    given: Callable[[int, str, str], Linear | None] | None = None,
) -> DecoderModel:
    """Builds the model from tensors named as in Hugging Face checkpoints; `get(name)` returns a tensor
    or None when absent. `kernels`: the weight format and backend of the linears (default: the
    dtype's float weights on the best backend for `device`). `codes(name)`: a weight's own 4-bit codes
    (a 4-bit GGUF), which int4 linears take as they are instead of re-quantizing. Every tensor is moved
    to `device` as it is read, so the backends pack (or keep) weights there. `head`: the LM head's linear
    where the caller has one (a quantized draft's shortlist: building the model's own only to replace it
    took ~2 s of a 2.9 s draft load here). `given(i, name, backend)`: layer i's linear `name` (LayerWeights.LINEARS)
    where the caller has one for the plan's backend, used as it is (a quantized draft's view of its
    target's codes)."""
    device = torch.device(device)
    kernels = replace(kernels, reasons=list(kernels.reasons)) if kernels else plan(dtype, device=device)

    def need(name: str, keep: bool = False) -> torch.Tensor:
        """The tensor in `dtype`, or as the checkpoint holds it (`keep`)."""
        t = get(name)
        if t is None:
            raise ModelLoadError(f"checkpoint is missing tensor {name!r}")
        return t.to(device=device) if keep else t.to(device=device, dtype=dtype)

    def maybe(name: str) -> torch.Tensor | None:
        t = get(name)
        return None if t is None else t.to(device=device, dtype=dtype)

    def source(name: str) -> torch.Tensor:
        """A linear's weight: as the checkpoint holds it for a backend that reads its values (codes, found
        before the rounding to `dtype` hides them), else in `dtype`."""
        return need(name, keep=getattr(BACKENDS[kernels.backend], "source", False))

    def linear(names: list[str], bias: torch.Tensor | None = None, at: tuple[int, str] | None = None) -> Linear:
        """One linear over the weights `names` stacked along the output dimension (`at`: its layer and
        name, for `given`)."""
        lin = given(*at, kernels.backend) if given is not None and at is not None and bias is None else None
        if lin is not None:
            kept.append(lin)
            return lin
        backend = BACKENDS[kernels.backend]
        found = [codes(n) for n in names] if codes is not None and hasattr(backend, "from_codes") else []
        if found and all(c is not None for c in found):
            own.append(names[0])
            parts = (torch.cat(p).to(device) for p in zip(*found))  # codes, scale, zero
            return backend.from_codes(*parts, bias, dtype)
        weight = torch.cat([source(n) for n in names]) if len(names) > 1 else source(names[0])
        return quantized(make_linear(kernels, weight, bias, dtype), weight, names[0])

    errors: dict[str, float] = {}
    own: list[str] = []  # linears built from the checkpoint's own 4-bit codes
    kept: list[Linear] = []  # the caller's (`given`), whose tensors stay where they are

    def quantized(lin: Linear, weight: torch.Tensor, name: str) -> Linear:
        """Records the relative (Frobenius) error of a weight re-quantized here."""
        if kernels.weights in ("int8", "int4") and not isinstance(lin, Dense):
            w = weight.float()
            errors[name] = float((lin.dequantized() - w).norm() / w.norm().clamp(min=1e-12))
        return lin

    layers = []
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        qkv = [p + f"self_attn.{x}_proj" for x in "qkv"]
        biases = [maybe(n + ".bias") for n in qkv]
        if any(bias is not None for bias in biases) and not all(bias is not None for bias in biases):
            raise ModelLoadError(f"layer {i}: q/k/v biases must be all present or all absent")
        layers.append(
            LayerWeights(
                attn_norm=need(p + "input_layernorm.weight"),
                qkv=linear(
                    [n + ".weight" for n in qkv], torch.cat(biases) if biases[0] is not None else None, (i, "qkv")
                ),
                o=linear([p + "self_attn.o_proj.weight"], maybe(p + "self_attn.o_proj.bias"), (i, "o")),
                mlp_norm=need(p + "post_attention_layernorm.weight"),
                gate_up=linear([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"], None, (i, "gate_up")),
                down=linear([p + "mlp.down_proj.weight"], None, (i, "down")),
            )
        )
    embed = need("model.embed_tokens.weight")
    head_weight = embed if config.tie_word_embeddings else need("lm_head.weight")
    # choice.py's int8 order, the native kernels first (native8: 1.5 ms against torch's 3.7 ms for this
    # 49152x576 head on an AMD EPYC with AVX2; native8i8 faster still where AVX2 has its dot products).
    int8 = next((b for b in QUANTIZED["int8"] if b.unavailable(dtype, device) is None), None)
    if head is None and own and int8 is not None:
        # The 4-bit GGUFs seen keep the embedding / LM head at 6-8 bits: re-quantizing it to int4 costs
        # ~9 % relative error (it decides every token), int8 ~0.5 % for twice int4's bytes of that one weight.
        head = quantized(int8(head_weight, None, dtype), head_weight, "lm_head.weight")
        kernels.reasons.append(f"the LM head has no 4-bit codes in the checkpoint: int8 per channel ({int8.name})")
    elif head is None:
        head_source = source("model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight")
        head = quantized(make_linear(kernels, head_source, None, dtype), head_weight, "lm_head.weight")
    # The linears' tensors in huge pages (kernels/pages.py); a draft's Shortlist head keeps the target's
    # float head rows where they are (it reads k of them a step) and moves its coarse linear
    shared = {id(lin) for lin in kept}
    mine = [lin for layer in layers for lin in layer.linears() if id(lin) not in shared]
    pages.place([*mine, getattr(head, "coarse", head)])
    model = DecoderModel(config, embed, layers, need("model.norm.weight"), head_weight, kernels, head)
    model.borrowed = shared
    if errors:
        worst = max(errors, key=errors.get)
        kernels.reasons.append(
            f"{len(errors)} linears re-quantized here from float weights"
            + (f" ({len(own)} are the checkpoint's own 4-bit codes)" if own else "")
            + f": relative error mean {sum(errors.values()) / len(errors):.4f}, worst {errors[worst]:.4f} ({worst})"
        )
    return model
