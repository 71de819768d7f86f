"""Self-distillation of draft heads: the model answers the training prompts itself (batched greedy
decoding), one teacher-forced forward per sequence records the hidden state at every candidate exit
and the full model's next-token distribution, and an adapter per (exit, kind) learns to match that
distribution (soft cross-entropy on the teacher's top-k, over the draft's vocabulary subset).
Held-out prompts measure top-1 agreement and the expected acceptance Σ min(p_T, q_T) at several T."""

from __future__ import annotations

import json
import math
import random
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from ..decoding.head import Adapter, AttnContext, DraftHead, build, new_adapter
from ..decoding.head import load as load_head
from ..decoding.sampling import SamplingParams
from ..errors import SelfspecError
from ..model.attention import gather_kv
from ..model.decoder import DecoderModel
from .rollout import generate_batch
from .speedup import estimate

TOP_K = 32  # teacher probabilities kept per position for training


@dataclass
class TrainConfig:
    draft_layers: list[int]
    kinds: list[str]
    vocab_subset: int = 8192  # 0 = the whole vocabulary
    rank: int = 256
    steps: int = 1500
    batch_size: int = 512
    lr: float = 2e-3
    new_tokens: int = 96
    prompt_positions: int = 128  # teacher-forced prompt positions per prompt, besides the response
    heldout_fraction: float = 0.15
    temperatures: list[float] = field(default_factory=lambda: [0.0, 0.3, 0.7])
    seed: int = 0


@dataclass
class Positions:
    """Training positions of one split: layer-N hidden states and the teacher's next-token view."""

    hidden: dict[int, torch.Tensor]  # N -> [P, hidden] float32
    top_ids: torch.Tensor  # [P, TOP_K] teacher's most likely next tokens
    top_probs: torch.Tensor  # [P, TOP_K] their probabilities (T = 1)
    final: torch.Tensor | None = None  # [P, hidden] last-layer hidden (held-out split: full teacher at eval)
    spans: list[tuple[int, int, int]] = field(default_factory=list)  # per sequence: first row, rows, first position
    kv: dict[int, list[torch.Tensor]] = field(
        default_factory=dict
    )  # N -> per sequence [2, kv_heads, T, head_dim] of layer N-1 (attn kind)


def split_prompts(prompts: list[list[int]], fraction: float, seed: int) -> tuple[list[int], list[int]]:
    order = list(range(len(prompts)))
    random.Random(seed).shuffle(order)
    n_held = max(1, int(round(fraction * len(prompts))))
    return sorted(order[n_held:]), sorted(order[:n_held])


@torch.inference_mode()
def responses(
    model: DecoderModel, prompts: list[list[int]], new_tokens: int, eos: set[int], batch: int = 16
) -> list[list[int]]:
    """The model's own greedy answers, cut after EOS."""
    out = []
    for first in range(0, len(prompts), batch):
        chunk = prompts[first : first + batch]
        cache = model.new_cache(sum(len(p) for p in chunk) + len(chunk) * (new_tokens + 32))
        seqs = [cache.allocate() for _ in chunk]
        for seq, p in zip(seqs, chunk):
            model.prefill(cache, seq, p[:-1])
        outs = generate_batch(
            model,
            cache,
            seqs,
            [p[-1] for p in chunk],
            SamplingParams(temperature=0),
            None,
            [None] * len(chunk),
            new_tokens,
        )
        for o in outs:
            end = next((i for i, t in enumerate(o) if t in eos), len(o) - 1)
            out.append(o[: end + 1])
    return out


@torch.inference_mode()
def collect(
    model: DecoderModel, sequences: list[tuple[list[int], int]], exits: list[int], keep_final: bool, kv: bool = False
) -> Positions:
    """sequences: (tokens, first position to keep). One forward each; positions i predict tokens[i + 1].
    kv: also keep layer N-1's keys/values of every position (what an attn adapter reads)."""
    hidden = {n: [] for n in exits}
    keys: dict[int, list[torch.Tensor]] = {n: [] for n in exits} if kv else {}
    ids, probs, finals, spans, rows = [], [], [], [], 0
    for tokens, first in sequences:
        cache = model.new_cache(len(tokens) + 16)
        seq = cache.allocate()
        batch = cache.prepare([seq], [len(tokens) - 1])  # one pass, run a slice of layers at a time
        h, done = torch.tensor([tokens[:-1]]), 0
        spans.append((rows, len(tokens) - 1 - first, first))
        rows += len(tokens) - 1 - first
        for n in sorted(exits):
            h = model.forward(h, cache, start=done, end=n, batch=batch)
            hidden[n].append(h[0, first:].float())
            if kv:
                keys[n].append(
                    gather_kv(cache.layers[n - 1], batch)[:, 0].float().clone()
                )  # [2, kv_heads, T, head_dim]
            done = n
        h = model.forward(h, cache, start=done, batch=batch)
        top = torch.softmax(model.logits(h[0, first:]), -1).topk(TOP_K)
        ids.append(top.indices)
        probs.append(top.values)
        if keep_final:
            finals.append(h[0, first:].float())
    return Positions(
        {n: torch.cat(v) for n, v in hidden.items()},
        torch.cat(ids),
        torch.cat(probs),
        torch.cat(finals) if keep_final else None,
        spans,
        keys,
    )


def attn_context(model: DecoderModel, data: Positions, n: int, j: int, dtype: torch.dtype) -> AttnContext:
    """The attn adapter's view for sequence j of `data`: its kept positions read layer N-1's keys up to
    themselves."""
    _, count, first = data.spans[j]
    # clones: tensors made under inference_mode (the cache, the RoPE table) cannot enter autograd
    k, v = data.kv[n][j].to(dtype).clone()[:, None]  # each [1, kv_heads, T, head_dim]
    positions = torch.arange(first, first + count)[None]  # [1, S]
    cos, sin = (t.to(dtype).clone() for t in model.rope.lookup(positions))
    mask = torch.arange(k.shape[2])[None, None, None, :] <= positions[:, None, :, None]  # [1, 1, S, T]
    window = model.config.sliding_windows[n - 1]
    if window is not None:
        mask &= torch.arange(k.shape[2])[None, None, None, :] > positions[:, None, :, None] - window
    return AttnContext(k, v, cos, sin, mask)


def vocabulary_subset(texts: list[list[int]], size: int, vocab_size: int, always: set[int]) -> torch.Tensor | None:
    """The `size` most frequent tokens of the model's own generations (plus `always`, e.g. EOS),
    sorted; None for the whole vocabulary."""
    if size <= 0 or size >= vocab_size:
        return None
    counts = Counter(t for text in texts for t in text)
    ranked = [t for t, _ in counts.most_common()]
    chosen = list(dict.fromkeys(list(always) + ranked))[:size]
    if len(chosen) < size:  # pad with the lowest ids not yet chosen (rarely needed)
        taken = set(chosen)
        chosen += [t for t in range(vocab_size) if t not in taken][: size - len(chosen)]
    return torch.tensor(sorted(chosen), dtype=torch.long)


def train_adapter(
    model: DecoderModel, n: int, kind: str, data: Positions, vocab: torch.Tensor | None, cfg: TrainConfig, progress=None
) -> tuple[Adapter, list[float]]:
    """Soft cross-entropy of the student (adapter -> final norm -> head over the subset) against the
    teacher's top-k distribution. -> (adapter, loss curve)."""
    torch.manual_seed(cfg.seed)
    adapter = new_adapter(model, kind, cfg.rank)
    if kind == "attn":
        _init_attention(adapter, model, n)
    head = (model.head_weight if vocab is None else model.head_weight[vocab]).float()  # [V_sub, hidden]
    norm = model.norm_weight.float()
    targets_ids, targets_p = _targets_in_subset(data, vocab, model.config.vocab_size)
    opt = torch.optim.AdamW(adapter.parameters(), lr=cfg.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, cfg.steps) / cfg.steps))
    )
    gen = torch.Generator().manual_seed(cfg.seed)
    x_all = data.hidden[n]
    losses = []
    for step in range(cfg.steps):
        if kind == "attn":  # whole sequences (each query needs its prefix), about batch_size rows
            idx, adapted = _attn_batch(model, adapter, data, n, cfg.batch_size, gen)
        else:
            idx = torch.randint(0, x_all.shape[0], (cfg.batch_size,), generator=gen)
            adapted = adapter(x_all[idx])
        x = F.rms_norm(adapted, (x_all.shape[-1],), norm, model.config.rms_norm_eps)
        logq = torch.log_softmax(x @ head.T, -1)  # [B, V_sub]
        picked = logq.gather(-1, targets_ids[idx])  # [B, K]
        loss = -(targets_p[idx] * picked).sum(-1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.detach().item())
        if progress:
            progress(1)
    return adapter, losses


def _init_attention(adapter: Adapter, model: DecoderModel, n: int) -> None:
    """Start the queries as layer N-1's own (its norm and q projection): they already match its keys."""
    c, w = model.config, model.layers[n - 1]
    with torch.no_grad():
        adapter.attn_norm.copy_(w.attn_norm.float())
        adapter.wq.weight.copy_(w.qkv.dequantized()[: c.num_heads * c.head_dim])


def _attn_batch(
    model, adapter: Adapter, data: Positions, n: int, rows: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random sequences until about `rows` rows -> (row indices [R], adapted hidden [R, hidden])."""
    idx, out, total = [], [], 0
    while total < rows:
        j = int(torch.randint(0, len(data.spans), (1,), generator=gen))
        start, count, _ = data.spans[j]
        if count == 0:
            continue
        h = data.hidden[n][start : start + count][None]  # [1, S, hidden]
        out.append(adapter(h, attn_context(model, data, n, j, torch.float32))[0])
        idx.append(torch.arange(start, start + count))
        total += count
    return torch.cat(idx), torch.cat(out)


def _targets_in_subset(
    data: Positions, vocab: torch.Tensor | None, vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher top-k ids as indices into the subset; probabilities of ids outside it are dropped
    (the draft can never propose those)."""
    if vocab is None:
        return data.top_ids, data.top_probs
    where = torch.full((vocab_size,), -1, dtype=torch.long)
    where[vocab] = torch.arange(vocab.numel())
    mapped = where[data.top_ids]
    return mapped.clamp(min=0), data.top_probs * (mapped >= 0)


@torch.inference_mode()
def evaluate(model: DecoderModel, head: DraftHead | None, n: int, data: Positions, temperatures: list[float]) -> dict:
    """Held-out top-1 agreement and expected acceptance per temperature (Σ min(p_T, q_T), where p is
    the full model's distribution and q the draft's; greedy: argmax agreement)."""
    out, agree, counts, loss = {}, 0, 0, 0.0
    sums = {t: 0.0 for t in temperatures}
    for first, rows, draft in _draft_chunks(model, head, n, data):
        target = model.logits(data.final[first : first + rows].to(model.dtype))  # [P, vocab]
        agree += int((target.argmax(-1) == draft.argmax(-1)).sum())
        counts += rows
        logq = torch.log_softmax(draft, -1).gather(-1, data.top_ids[first : first + rows]).clamp_min(-30.0)
        loss += float(-(data.top_probs[first : first + rows] * logq).sum())
        for t in temperatures:
            if t == 0:
                sums[t] += float((target.argmax(-1) == draft.argmax(-1)).sum())
            else:
                sums[t] += float(torch.minimum(torch.softmax(target / t, -1), torch.softmax(draft / t, -1)).sum())
    out["top1_agreement"] = agree / counts
    out["loss"] = loss / counts  # soft cross-entropy against the teacher's top-k (log q floored at -30)
    out["acceptance"] = {f"{t:g}": sums[t] / counts for t in temperatures}
    out["positions"] = counts
    return out


def _draft_chunks(model: DecoderModel, head: DraftHead | None, n: int, data: Positions):
    """Yields (first row, rows, draft logits [rows, vocab]) over a split: per sequence for the attn kind
    (its queries need their prefix), in chunks otherwise (head None: the plain exit)."""
    if head is not None and head.kind == "attn":
        for j, (start, count, _) in enumerate(data.spans):
            if count:
                h = data.hidden[n][start : start + count][None].to(model.dtype)  # [1, S, hidden]
                yield start, count, head.logits(h, attn_context(model, data, n, j, model.dtype))[0]
        return
    for first in range(0, data.final.shape[0], 1024):
        hid = data.hidden[n][first : first + 1024].to(model.dtype)
        yield first, hid.shape[0], head.logits(hid) if head is not None else model.logits(hid)


@dataclass
class TrainResult:
    draft_layers: int
    kind: str
    heldout: dict
    baseline: dict  # the same head untrained (identity adapter, same vocabulary subset)
    plain_exit: dict  # the plain early exit (full vocabulary), for reference
    final_loss: float
    choice: dict = field(default_factory=dict)  # set by choose_best: γ, c, v, predicted speedup
    full_vocab: dict = field(default_factory=dict)  # the same adapter scoring the whole vocabulary
    head: DraftHead | None = None

    def to_dict(self) -> dict:
        # Not asdict(self): it would deep-copy the head, whose packed kernel weights cannot be copied.
        return {k: v for k, v in asdict(replace(self, head=None)).items() if k != "head"}


def prepare_data(model: DecoderModel, prompts: list[list[int]], eos: set[int], cfg: TrainConfig, log=print) -> dict:
    """Responses, teacher-forced positions of both splits, and the vocabulary subset."""
    train_idx, held_idx = split_prompts(prompts, cfg.heldout_fraction, cfg.seed)
    log(f"generating the model's own responses to {len(prompts)} prompts ({cfg.new_tokens} tokens each)")
    answers = responses(model, prompts, cfg.new_tokens, eos)
    train_seqs = [(prompts[i] + answers[i], max(0, len(prompts[i]) - 1 - cfg.prompt_positions)) for i in train_idx]
    held_seqs = [(prompts[i] + answers[i], len(prompts[i]) - 1) for i in held_idx]  # responses only
    log(f"teacher-forced positions: {len(train_idx)} training and {len(held_idx)} held-out prompts")
    kv = "attn" in cfg.kinds
    return {
        "train": collect(model, train_seqs, cfg.draft_layers, keep_final=False, kv=kv),
        "held": collect(model, held_seqs, cfg.draft_layers, keep_final=True, kv=kv),
        "vocab": vocabulary_subset([answers[i] for i in train_idx], cfg.vocab_subset, model.config.vocab_size, eos),
        "train_prompts": len(train_idx),
        "held_prompts": len(held_idx),
    }


def train_one(
    model: DecoderModel, n: int, kind: str, data: dict, cfg: TrainConfig, metadata: dict, progress=None
) -> TrainResult:
    vocab = data["vocab"]
    adapter, losses = train_adapter(model, n, kind, data["train"], vocab, cfg, progress)
    meta = dict(
        metadata,
        train_prompts=data["train_prompts"],
        heldout_prompts=data["held_prompts"],
        train_positions=int(data["train"].top_ids.shape[0]),
        vocab_subset=0 if vocab is None else int(vocab.numel()),
        config=asdict(cfg),
    )
    head = build(model, n, adapter, vocab, meta)
    held = evaluate(model, head, n, data["held"], cfg.temperatures)
    head.metadata["heldout"] = held
    untrained = build(model, n, new_adapter(model, kind, cfg.rank), vocab)  # identity, same subset
    return TrainResult(
        n,
        kind,
        held,
        evaluate(model, untrained, n, data["held"], cfg.temperatures),
        evaluate(model, None, n, data["held"], cfg.temperatures),
        losses[-1],
        head=head,
    )


def train_resumable(
    model, prompts, eos, cfg: TrainConfig, metadata: dict, work: Path, progress=None, log=print
) -> list[TrainResult]:
    """prepare_data + train_one for every (N, kind), keeping each finished piece in `work` so that an
    interrupted run picks up where it stopped."""
    work.mkdir(parents=True, exist_ok=True)
    _check_work_config(work, cfg)
    data_file = work / "data.pt"
    data = None
    if data_file.exists():
        stored = torch.load(data_file, weights_only=True)
        data = {**stored, "train": Positions(**stored["train"]), "held": Positions(**stored["held"])}
        needed = set(cfg.draft_layers)
        if not needed <= set(data["train"].hidden) or ("attn" in cfg.kinds and not needed <= set(data["train"].kv)):
            data = None
            log(f"{data_file} lacks some exit layer's hidden states or keys/values: preparing it again")
        else:
            log(f"reusing the teacher-forced data in {data_file}")
    if data is None:
        data = prepare_data(model, prompts, eos, cfg, log)
        torch.save({**data, "train": asdict(data["train"]), "held": asdict(data["held"])}, data_file)
    results = []
    for n in cfg.draft_layers:
        for kind in cfg.kinds:
            head_file, report = work / f"N{n}-{kind}.safetensors", work / f"N{n}-{kind}.json"
            if head_file.exists() and report.exists():
                r = TrainResult(**json.loads(report.read_text()))
                r.head = load_head(head_file, model)
                if progress:
                    progress(cfg.steps)
            else:
                r = train_one(model, n, kind, data, cfg, metadata, progress)
                r.head.save(head_file)
                report.write_text(json.dumps(r.to_dict()))
            if r.head.vocab is not None and not r.full_vocab:  # what the reduced vocabulary costs in α
                whole = build(model, n, r.head.adapter, None)
                r.full_vocab = evaluate(model, whole, n, data["held"], cfg.temperatures)
                report.write_text(json.dumps(r.to_dict()))
            results.append(r)
            log(
                f"N={n:2d} {kind:6s}: held-out top-1 {r.heldout['top1_agreement']:.3f} (plain exit "
                f"{r.plain_exit['top1_agreement']:.3f}); expected acceptance "
                + ", ".join(f"T={t}: {a:.3f}" for t, a in r.heldout["acceptance"].items())
                + f"; held-out loss {r.baseline['loss']:.3f} -> {r.heldout['loss']:.3f}"
            )
    return results


def _check_work_config(work: Path, cfg: TrainConfig) -> None:
    """A work directory holds results of one configuration (any N and kind); refuse to mix others in."""
    mine = {k: v for k, v in asdict(cfg).items() if k not in ("draft_layers", "kinds")}
    stored = work / "config.json"
    if stored.exists():
        theirs = json.loads(stored.read_text())
        differ = sorted(k for k in mine if theirs.get(k) != mine[k])
        if differ:
            raise SelfspecError(
                f"{work} holds a run with different settings ({', '.join(f'{k}={theirs.get(k)!r}' for k in differ)}): "
                "use another --out, or delete that directory to start over"
            )
    else:
        stored.write_text(json.dumps(mine))


@torch.inference_mode()
def choose_best(
    model: DecoderModel, results: list[TrainResult], gammas=range(1, 7), repeats: int = 7
) -> tuple[TrainResult, dict]:
    """Times a draft step with each head and verification per (N, γ), then picks the (head, γ) with
    the best predicted speedup E(α, γ) / (γc + v) from its held-out greedy acceptance."""
    from .calibrate import time_costs

    context = list(range(100, 228))
    cache = model.new_cache(len(context) + 64)
    depths = sorted({r.draft_layers for r in results})
    full, _, v = time_costs(model, cache, context, depths, list(gammas), repeats)
    costs = {"full_step_seconds": full, "verify_cost": v, "draft_cost": {}, "draft_cost_full_vocab": {}}
    best, best_speed = None, -1.0
    for r in results:
        c = _time_draft_step(model, cache, context, r.head) / full
        costs["draft_cost"][f"{r.draft_layers}-{r.kind}"] = c
        if r.head.vocab is not None:
            whole = build(model, r.draft_layers, r.head.adapter, None)
            costs["draft_cost_full_vocab"][f"{r.draft_layers}-{r.kind}"] = (
                _time_draft_step(model, cache, context, whole) / full
            )
        alpha = r.heldout["acceptance"]["0"]
        for g in gammas:  # each head's own best γ goes in its report; the best head overall is returned
            speed = estimate(alpha, g, c, v[str(r.draft_layers)][str(g)]).speedup
            if speed > r.choice.get("predicted_speedup", -1.0):
                r.choice = {
                    "gamma": g,
                    "c": c,
                    "verify_cost": v[str(r.draft_layers)][str(g)],
                    "alpha": alpha,
                    "predicted_speedup": speed,
                }
        if r.choice["predicted_speedup"] > best_speed:
            best, best_speed = r, r.choice["predicted_speedup"]
    return best, costs


def _time_draft_step(model: DecoderModel, cache, context: list[int], head: DraftHead, repeats: int = 7) -> float:
    import statistics
    import time

    seq = cache.allocate()
    try:
        model.forward(torch.tensor([context]), cache, [seq])
        samples = []
        for _ in range(repeats + 1):
            start = time.perf_counter()
            b = cache.prepare([seq], [1])
            h = model.forward(torch.tensor([[7]]), cache, end=head.draft_layers, batch=b)
            head.draft(h, b, cache).argmax(-1)
            samples.append(time.perf_counter() - start)
            cache.truncate(seq, len(context))
        return statistics.median(samples[1:])
    finally:
        cache.free(seq)
