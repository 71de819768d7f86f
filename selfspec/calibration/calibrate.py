"""Offline calibration: measure what speculation would gain per draft depth N, γ and request bucket.

Acceptance is measured teacher-forced, which is exact here: a draft at depth N reads the same
layer-(<N) cache entries as the full model, so the draft's distribution at each position of a
continuation is the early exit's distribution on that same prefix. One full forward per continuation
gives the acceptance of every N at once: greedy agreement (argmax equal) at T = 0, and the
acceptance probability β = Σ min(p, q) at T > 0. Costs (c per N, v per N and γ) are timed on this
machine. The predicted speedup of (N, γ) is E(N, γ) / (γ·c(N) + v(N, γ))."""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from ..decoding.hybrid import FALLBACK
from ..decoding.lookup import SHORTEST, match
from ..decoding.profile import BucketChoice, Profile, length_bucket, weight_format
from ..decoding.quantized import QuantizedDrafter
from ..decoding.round import RoundInput, SpecConfig
from ..decoding.sampling import SamplingParams, argmax, make_generator
from ..errors import SelfspecError
from ..kernels import native
from ..kernels.choice import machine_key
from ..model.cache import PagedKVCache
from ..model.decoder import DecoderModel
from .rollout import generate_batch
from .speedup import expected_accepted_from_positions


@dataclass
class AcceptanceRecord:
    """Teacher-forced acceptance of one continuation, for every calibrated draft depth."""

    question_id: str
    category: str
    prompt_tokens: int
    temperature: float
    accept: dict[str, list[float]]  # source -> per position: 1/0 agreement (T = 0) or β = Σ min(p, q) (T > 0)
    top_prob: dict[str, list[float]] = field(default_factory=dict)  # source -> the draft's top probability
    plain_exit: dict[str, list[float]] = field(default_factory=dict)  # N with a draft head -> acceptance without it
    lookup: list[list[float]] = field(default_factory=list)  # per start position: β of each token lookup drafts
    hybrid: list[list[float]] = field(default_factory=list)  # the same for the hybrid's lookup (whole n-gram only)

    @property
    def length_bucket(self) -> str:
        return length_bucket(self.prompt_tokens)


@torch.inference_mode()
def teacher_forced_acceptance(
    model: DecoderModel,
    cache: PagedKVCache,
    prompt: list[int],
    continuation: list[int],
    draft_layers: list[int],
    temperature: float,
    heads: dict | None = None,
    copies: dict[str, DecoderModel] | None = None,
) -> tuple[dict[str, list[float]], dict[str, list[float]], dict[str, list[float]]]:
    """-> (acceptance per position, draft top probability per position, acceptance of the plain exit
    where `heads` has a draft head for N), each keyed by source: N (the exit, or the head where
    `heads` has one) and the name of each quantized copy in `copies` (its own teacher-forced pass)."""
    heads = heads or {}
    seq = cache.allocate()
    tokens = prompt + continuation
    first = len(prompt) - 1  # positions from here predict the continuation
    drafts = {}
    try:
        batch = cache.prepare([seq], [len(tokens) - 1])  # one pass, run a slice of layers at a time
        h = torch.tensor([tokens[:-1]])
        done = 0
        for n in sorted(draft_layers):
            h = model.forward(h, cache, start=done, end=n, batch=batch)
            drafts[n] = model.logits(h[0, first:])  # [n, vocab]
            if n in heads:  # the head reads the cache as it stands after this forward (attn: layer N-1)
                drafts[n], drafts[-n] = heads[n].in_pass(h, batch, cache, first)[0], drafts[n]
            done = n
        h = model.forward(h, cache, start=done, batch=batch)
        target = model.logits(h[0, first:])  # [n, vocab]
        for name, copy in (copies or {}).items():  # rewrites the same slots with the copy's own K/V
            h = copy.forward(torch.tensor([tokens[:-1]]), cache, batch=batch)
            drafts[name] = copy.logits(h[0, first:])
    finally:
        cache.free(seq)
    accept, top, plain = {}, {}, {}
    t = temperature if temperature > 0 else 1.0
    p = torch.softmax(target / t, -1)
    for n, draft in drafts.items():
        q = torch.softmax(draft / t, -1)
        if temperature == 0:
            a = (draft.argmax(-1) == target.argmax(-1)).float()
        else:
            a = torch.minimum(p, q).sum(-1)
        if isinstance(n, int) and n < 0:
            plain[str(-n)] = a.tolist()
        else:
            accept[str(n)] = a.tolist()
            top[str(n)] = q.max(-1).values.tolist()
    if temperature == 0:  # lookup's point-mass drafts are kept with probability p(d): 1/0 under argmax
        p = torch.nn.functional.one_hot(target.argmax(-1), target.shape[-1]).float()
    return accept, top, plain, p


def lookup_acceptance(
    prompt: list[int], continuation: list[int], p: torch.Tensor, gamma: int, ngram: int, shortest: int | None = None
) -> list[list[float]]:
    """Per start position s of the continuation: the acceptance probability of each token lookup would
    draft there (its context: prompt + continuation[:s]; suffixes of `ngram` .. `shortest` tokens).
    p [len(continuation), vocab] is the target's teacher-forced distribution; a draft past the first
    one that differs from the continuation has an unmeasured context, so it counts as rejected
    (conservative). `shortest`: the lookup drafter's own where None."""
    shortest = min(SHORTEST, ngram) if shortest is None else shortest
    out = []
    for s in range(len(continuation)):
        run = match(prompt + continuation[:s], ngram, min(gamma, len(continuation) - s), shortest)
        betas = []
        for i, d in enumerate(run):
            betas.append(float(p[s + i, d]) if i == 0 or run[i - 1] == continuation[s + i - 1] else 0.0)
        out.append(betas)
    return out


def walk(n: int, round_at: Callable[[int], tuple[float, float]]) -> tuple[list[float], list[float]]:
    """The rounds a decode of n positions makes: from position 0, each round starts where the previous
    round's (expected, rounded) tokens end. round_at(s) -> (tokens, cost) of a round starting at s.
    Averaging over every start position instead overweights the positions inside long accepted runs,
    which a decode passes over in one round (it predicted 2.7-3.0x for lookup where 1.2x was measured)."""
    tokens, costs, s = [], [], 0
    while s < n:
        t, c = round_at(s)
        tokens.append(t)
        costs.append(c)
        s += max(1, round(t))
    return tokens, costs


def tokens_per_round(accept: list[float], gamma: int) -> float:
    """Expected tokens per round over the rounds a decode makes (walk): 1 + Σ_i Π_{j<i} β_{s+j} from
    each round's start s (the last round near the end only sees the positions left)."""
    if not accept:
        return 1.0
    tokens, _ = walk(len(accept), lambda s: (1 + expected_accepted_from_positions(accept[s : s + gamma]), 0.0))
    return statistics.fmean(tokens)


DRAFTED = 4  # tokens per timed quantized draft (c is its time per token)
GREEDY = SamplingParams(temperature=0)


@torch.inference_mode()
def time_costs(
    model: DecoderModel,
    cache: PagedKVCache,
    context: list[int],
    draft_layers: list[int],
    gammas: list[int],
    repeats: int = 7,
    heads: dict | None = None,
    copies: dict[str, DecoderModel] | None = None,
    lookup: bool = False,
) -> tuple[float, dict[str, float], dict[str, dict[str, float]]]:
    """Times, at a context of len(context) tokens: a full plain step; a draft step per N (layers [0, N)
    + head + argmax; a trained draft head where `heads` has one); a verification per (N, γ) (the last
    draft's pass through [0, N), then layers [N, L) over γ + 1 tokens, head and argmax). Sources that
    verify from layer 0 (each quantized copy in `copies`: its greedy draft's time per token, drafted as a
    round drafts a lone row; lookup: the match itself) get v for every γ up to the largest, since lookup
    drafts fewer tokens where its match ends.
    -> (full step seconds, c per source, v per source per γ)."""
    seq = cache.allocate()
    try:
        model.forward(torch.tensor([context]), cache, [seq])
        base = seq.length

        def once(fn) -> float:
            start = time.perf_counter()
            fn()
            seconds = time.perf_counter() - start
            cache.truncate(seq, base)
            return seconds

        def step() -> torch.Tensor:
            return forward(1, 0, model.num_layers, head=True)

        def ratio(fn) -> float:
            # each sample against a full step timed right beside it: this VM's speed drifts by +-15 %
            return statistics.median(once(fn) / once(step) for _ in range(repeats))

        def forward(tokens: int, start: int, end: int, head: bool, net: DecoderModel = model) -> torch.Tensor:
            b = cache.prepare([seq], [tokens])
            h = net.forward(torch.full((1, tokens), 17), cache, start=start, end=end, batch=b)
            if net is not model:
                return argmax(net.logits(h))
            if head and end in (heads or {}):
                return argmax(heads[end].draft(h, b, cache))
            # the target's head as a greedy round runs it (its argmax alone: DecoderModel.greedy); a sampled
            # round computes every logit, so its c is somewhat below the one timed here
            return model.greedy(h) if head else h

        def drafted(copy: DecoderModel) -> None:
            # DRAFTED greedy tokens as a round drafts them (QuantizedDrafter: one native call for a lone
            # greedy row, ~10 % less than a step through decoder.forward; sampled rows take that path).
            drafter = QuantizedDrafter(copy)
            drafter.propose(model, cache, RoundInput([seq], [17], [GREEDY], [None], [DRAFTED], drafter))

        def verify(n: int, gamma: int) -> None:
            forward(1, 0, n, head=False)  # the last draft token's pass through [0, N)
            x = torch.zeros(1, gamma + 1, model.config.hidden_size, dtype=model.dtype)
            h = model.forward(x, cache, [seq], start=n, starts=[base])
            model.greedy(h)

        once(step)  # warm-up
        full = statistics.median(once(step) for _ in range(repeats))
        c = {str(n): ratio(lambda: forward(1, 0, n, head=True)) for n in draft_layers}
        v = {str(n): {str(g): ratio(lambda: verify(n, g)) for g in gammas} for n in draft_layers}
        if copies or lookup:
            from_zero = {
                str(g): ratio(lambda: forward(g + 1, 0, model.num_layers, head=True)) for g in range(1, max(gammas) + 1)
            }
            for name, copy in (copies or {}).items():
                c[name] = ratio(lambda: drafted(copy)) / DRAFTED
                v[name] = from_zero
            if lookup:
                c["lookup"] = ratio(lambda: match(context, 3, max(gammas)))
                v["lookup"] = from_zero
        return full, c, v
    finally:
        cache.free(seq)


# ---- from records to a profile -------------------------------------------------------------------------


@dataclass
class BucketEstimate:
    category: str
    length_bucket: str
    temperature: float
    positions: int
    alpha: dict[str, float]  # source -> mean acceptance per drafted token
    tokens_per_round: dict[str, dict[str, float]]  # source -> γ -> expected tokens per round
    speedup: dict[str, dict[str, float]]  # source -> γ -> predicted speedup

    def best(self) -> tuple[str, int, float]:
        """(source, γ, predicted speedup): a source is an exit depth N ("12") or a drafter name."""
        n, g = max(((n, g) for n in self.speedup for g in self.speedup[n]), key=lambda k: self.speedup[k[0]][k[1]])
        return n, int(g), self.speedup[n][g]


def spec_config(source: str, gamma: int) -> SpecConfig:
    """The configuration a calibrated source names: an exit depth (the head there if one is loaded)
    or a drafter over the model's full depth."""
    return SpecConfig(int(source), gamma) if source.isdigit() else SpecConfig(None, gamma, source)


def costs_at(costs: dict, tokens: float) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """(c, v) at a context of `tokens`: linear between the contexts they were timed at (`costs["at"]`),
    the nearest one's beyond them; costs timed at one context only are the same at any."""
    at = costs.get("at") or [costs]
    lo, hi = at[0], at[-1]
    if hi["tokens"] <= lo["tokens"]:
        return lo["c"], lo["v"]
    w = min(1.0, max(0.0, (tokens - lo["tokens"]) / (hi["tokens"] - lo["tokens"])))
    c = {k: lo["c"][k] + w * (hi["c"][k] - lo["c"][k]) for k in lo["c"]}
    v = {k: {g: lo["v"][k][g] + w * (hi["v"][k][g] - lo["v"][k][g]) for g in lo["v"][k]} for k in lo["v"]}
    return c, v


def estimate_buckets(
    records: list[AcceptanceRecord],
    c: dict[str, float],
    v: dict[str, dict[str, float]],
    at: Callable[[float], tuple[dict, dict]] | None = None,
) -> list[BucketEstimate]:
    """Groups records by (category, length bucket, temperature), plus 'all' rows across categories
    and lengths, and predicts every (source, γ) per group: E / (γ·c + v) for drafts that run every
    round, and for lookup (which drafts only where it matches, as many tokens as its match gives) and
    the hybrid (lookup where the whole n-gram recurs, else its quantized copy, hybrid.FALLBACK) the
    ratio of mean tokens to mean cost over the rounds a decode makes (walk). `at(tokens)`: the (c, v)
    of a group whose decoding runs at a mean context of `tokens` (its prompts plus half their
    continuations), else c and v for every group."""
    groups: dict[tuple, list[AcceptanceRecord]] = {}
    for r in records:
        for cat in (r.category, "all"):
            for lb in (r.length_bucket, "all"):
                groups.setdefault((cat, lb, r.temperature), []).append(r)
    gammas = list(next(iter(v.values())))  # the calibrated γs (the exits' list, or 1..max)
    fallback = FALLBACK if FALLBACK in c else None  # what the engine's hybrid drafts with
    out = []
    for (cat, lb, t), recs in sorted(groups.items(), key=lambda kv: (kv[0][2], kv[0][0], kv[0][1])):
        weights = [len(next(iter(r.accept.values()))) for r in recs]
        here = at(statistics.fmean(r.prompt_tokens + w / 2 for r, w in zip(recs, weights))) if at else (c, v)
        out.append(_estimate(cat, lb, t, recs, weights, *here, gammas, fallback))
    return out


def _estimate(
    cat: str,
    lb: str,
    t: float,
    recs: list[AcceptanceRecord],
    weights: list[int],
    c: dict[str, float],
    v: dict[str, dict[str, float]],
    gammas: list[str],
    fallback: str | None,
) -> BucketEstimate:
    """One group's estimate (estimate_buckets) with its costs c and v; weights: each record's positions."""
    total = sum(weights)
    alpha, tpr, speed = {}, {}, {}
    for n in (n for n in c if n != "lookup"):
        alpha[n] = sum(sum(r.accept[n]) for r in recs) / total if total else 0.0
        tpr[n], speed[n] = {}, {}
        for g in gammas:
            e = sum(w * tokens_per_round(r.accept[n], int(g)) for r, w in zip(recs, weights)) / total if total else 1.0
            tpr[n][g] = e
            speed[n][g] = e / (int(g) * c[n] + v[n][g])
    if "lookup" in c and all(r.lookup for r in recs):
        for name, other in (("lookup", None), ("hybrid", fallback)):
            if name == "hybrid" and (other is None or not all(r.hybrid for r in recs)):
                continue
            tpr[name], speed[name] = {}, {}
            runs = [r.lookup if name == "lookup" else r.hybrid for r in recs]
            for g in gammas:
                tokens, cost = _mixed_rounds(recs, runs, int(g), c, v, other)
                tpr[name][g], speed[name][g] = tokens, tokens / cost
        drafted = [b for r in recs for run in r.lookup for b in run[:1]]
        alpha["lookup"] = sum(drafted) / len(drafted) if drafted else 0.0
    return BucketEstimate(cat, lb, t, total, alpha, tpr, speed)


def _mixed_rounds(
    recs: list[AcceptanceRecord], runs: list[list[list[float]]], gamma: int, c: dict, v: dict, fallback: str | None
) -> tuple[float, float]:
    """(mean tokens per round, mean cost per round in full steps) over the rounds a decode makes (walk):
    the lookup run where it matches (runs[i]: record i's β per start position; up to γ drafts; cost v
    of that many), else the fallback's γ drafts, or a plain step (cost 1) without a fallback."""

    def round_at(r: AcceptanceRecord, run: list[float], s: int) -> tuple[float, float]:
        run = run[:gamma]
        if run:
            return 1 + expected_accepted_from_positions(run), len(run) * c["lookup"] + v["lookup"][str(len(run))]
        if fallback is not None:
            accepted = expected_accepted_from_positions(r.accept[fallback][s : s + gamma])
            return 1 + accepted, gamma * c[fallback] + v[fallback][str(gamma)]
        return 1.0, 1.0

    tokens, costs = [], []
    for r, rr in zip(recs, runs):
        t, k = walk(len(rr), lambda s, r=r, rr=rr: round_at(r, rr[s], s))
        tokens += t
        costs += k
    return (statistics.fmean(tokens), statistics.fmean(costs)) if tokens else (1.0, 1.0)


def confidence_threshold(records: list[AcceptanceRecord], n: str, c: float) -> float:
    """Adaptive draft stop: the top-probability cutoff τ that maximizes Σ over kept drafts of
    (acceptance - c), i.e. keeps drafting only while a draft is expected to earn its cost."""
    pairs = sorted((tp, a) for r in records for tp, a in zip(r.top_prob.get(n, []), r.accept.get(n, [])))
    if not pairs:
        return 0.0
    best_gain, best_tau, gain = sum(a - c for _, a in pairs), 0.0, sum(a - c for _, a in pairs)
    for tp, a in pairs:  # raising τ past tp drops this draft
        gain -= a - c
        if gain > best_gain:
            best_gain, best_tau = gain, math.nextafter(tp, 1.0)  # stop below τ: this draft and lower go
    return best_tau


# ---- the whole run -----------------------------------------------------------------------------------


@dataclass
class CalibrationPlan:
    draft_layers: list[int]
    gammas: list[int]
    temperatures: list[float]
    new_tokens: int = 64
    batch_size: int = 16  # prompts generated together
    validate_prompts: int = 4  # prompts timed (decoding) per validated configuration (2 let noise flip a verdict)
    seed: int = 0
    quantized: tuple[str, ...] = ("int4",)  # the model's own weights at these formats draft too
    lookup: bool = True  # context lookup, and the hybrid of lookup with hybrid.FALLBACK (when in `quantized`)
    ngram: int = 3


def calibrate(engine, questions: list[dict], plan: CalibrationPlan, partial_path=None, progress=None):
    """-> (Profile, records, bucket estimates). `questions` are Spec-Bench style dicts (question_id,
    category, turns). Records already in `partial_path` (JSON lines) are reused, new ones appended,
    so an interrupted run resumes where it stopped."""
    model = engine.model
    limit = min(model.config.max_position_embeddings, engine.max_model_len)
    encoded = {str(q["question_id"]): engine.encode(q["turns"][0]) for q in questions}
    skipped = [q for q in questions if len(encoded[str(q["question_id"])]) + plan.new_tokens + 1 > limit]
    questions = [q for q in questions if q not in skipped]
    if not questions:
        raise SelfspecError(f"every prompt is longer than the model's context ({limit} tokens) allows")
    longest = max(len(encoded[str(q["question_id"])]) for q in questions)
    # A cache of its own, sized for one batch of continuations (the engine's serves validation runs).
    cache = model.new_cache(plan.batch_size * (longest + plan.new_tokens + 2))
    done = _load_partial(partial_path)
    heads = {str(n): _head_id(h) for n, h in engine.heads.items()}
    if done and done.get("__heads__", {}) != heads:  # records measured with other draft heads do not resume
        raise SelfspecError(
            f"{partial_path} was measured with draft heads {done.get('__heads__', {})}, this run has {heads}: "
            "delete it or write the profile elsewhere"
        )
    # Nor do costs timed with other kernels: a resumed run once kept the costs of the `codes` backend (v =
    # 3.1 steps at γ = 8) in a profile that then named `amx` (1.4).
    kernels = {**machine_key(), "backend": model.kernels.backend, "native": native.source_key()}
    if done and done.get("__kernels__", kernels) != kernels:
        raise SelfspecError(
            f"{partial_path} was timed with other kernels or on another machine ({done['__kernels__']}; here "
            f"{kernels}): delete it or write the profile elsewhere"
        )
    if not done:
        _append_partial(partial_path, {"__heads__": heads})
        _append_partial(partial_path, {"__kernels__": kernels})
    done.pop("__heads__", None)
    done.pop("__kernels__", None)
    costs = done.pop("__costs__", None)
    copies = {name: engine.draft_model(name) for name in plan.quantized}
    if costs is None:
        # At a short prompt's context and at the longest prompt's: a step's attention grows with the
        # context, and a draft step pays it as a full step does, so c and v differ between the two.
        short = encoded[str(questions[0]["question_id"])]
        long = max((encoded[str(q["question_id"])] for q in questions), key=len)
        timed = []
        for context in [short, long] if len(long) >= 2 * len(short) else [short]:
            full, c, v = time_costs(
                model,
                cache,
                context,
                plan.draft_layers,
                plan.gammas,
                heads=engine.heads,
                copies=copies,
                lookup=plan.lookup,
            )
            timed.append({"tokens": len(context), "full_step_seconds": full, "c": c, "v": v})
        costs = {**timed[0], "at": timed}
        _append_partial(partial_path, {"__costs__": costs})
    c, v = costs["c"], costs["v"]
    records = []
    todo = [(q, t) for t in plan.temperatures for q in questions]
    bar = progress(total=len(todo), desc="calibrating") if progress else None
    for t in plan.temperatures:
        pending = [q for q in questions if _key(q, t) not in done]
        records += [AcceptanceRecord(**done[_key(q, t)]) for q in questions if _key(q, t) in done]
        if bar:
            bar.update(len(questions) - len(pending))
        for first in range(0, len(pending), plan.batch_size):
            chunk = pending[first : first + plan.batch_size]
            prompts = [encoded[str(q["question_id"])] for q in chunk]
            conts = _continuations(engine, cache, prompts, t, plan)
            for q, prompt, cont in zip(chunk, prompts, conts):
                accept, top, plain, p = teacher_forced_acceptance(
                    model, cache, prompt, cont, plan.draft_layers, t, engine.heads, copies
                )
                rec = AcceptanceRecord(str(q["question_id"]), q["category"], len(prompt), t, accept, top, plain)
                if plan.lookup:
                    rec.lookup = lookup_acceptance(prompt, cont, p, max(plan.gammas), plan.ngram)
                    rec.hybrid = lookup_acceptance(prompt, cont, p, max(plan.gammas), plan.ngram, plan.ngram)
                records.append(rec)
                _append_partial(partial_path, {_key(q, t): rec.__dict__})
                if bar:
                    bar.update(1)
    if bar:
        bar.close()
    estimates = estimate_buckets(records, c, v, lambda tokens: costs_at(costs, tokens))
    validation = _validate(engine, questions, estimates, plan)
    profile = _profile(engine, plan, costs, records, estimates, validation)
    overall = _overall(estimates, min(plan.temperatures))
    best, gamma, _ = overall.best()
    prompts = [encoded[str(q["question_id"])] for q in questions]
    profile.max_batch_size, profile.batching = batch_limit(engine, prompts, spec_config(best, gamma), plan)
    profile.skipped_prompts = [str(q["question_id"]) for q in skipped]
    profile.draft_heads = _head_summary(engine.heads, records, plan)
    return profile, records, estimates


def _head_id(head) -> str:
    """A draft head's identity for resuming: kind, depth, vocabulary and a checksum of its weights."""
    total = sum(float(p.double().abs().sum()) for p in head.adapter.parameters())
    return f"{head.kind}@{head.draft_layers}/v{head.vocab_subset}/{total:.6e}"


def _head_summary(heads: dict, records: list[AcceptanceRecord], plan: CalibrationPlan) -> dict:
    """Per depth with a draft head: its kind and the acceptance with and without it, per temperature."""
    out = {}
    for n, head in heads.items():
        if n not in plan.draft_layers:
            continue
        rows = {}
        for t in plan.temperatures:
            recs = [r for r in records if r.temperature == t and str(n) in r.plain_exit]
            total = sum(len(r.accept[str(n)]) for r in recs) or 1
            rows[f"{t:g}"] = {
                "alpha_with_head": sum(sum(r.accept[str(n)]) for r in recs) / total,
                "alpha_plain_exit": sum(sum(r.plain_exit[str(n)]) for r in recs) / total,
            }
        out[str(n)] = {"kind": head.kind, "vocab_subset": head.vocab_subset, "acceptance": rows}
    return out


def _key(q: dict, t: float) -> str:
    return f"{q['question_id']}@{t:g}"


def _load_partial(path) -> dict:
    out = {}
    if path and Path(path).is_file():
        for line in Path(path).read_text().splitlines():
            if line.strip():
                out.update(json.loads(line))
    return out


def _append_partial(path, item: dict) -> None:
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(item) + "\n")


def _continuations(
    engine, cache, prompts: list[list[int]], temperature: float, plan: CalibrationPlan
) -> list[list[int]]:
    """The model's own responses (sampled at the bucket's temperature, cut after EOS)."""
    model = engine.model
    seqs = [cache.allocate() for _ in prompts]
    try:
        for seq, p in zip(seqs, prompts):
            model.prefill(cache, seq, p[:-1])
        params = SamplingParams(temperature=temperature)
        gens = [make_generator(plan.seed + i) for i in range(len(prompts))]
        outs = generate_batch(model, cache, seqs, [p[-1] for p in prompts], params, None, gens, plan.new_tokens)
    finally:
        for seq in seqs:
            cache.free(seq)
    cut = []
    for o in outs:
        end = next((i for i, t in enumerate(o) if t in engine.eos_token_ids), len(o) - 1)
        cut.append(o[: end + 1])
    return cut


def _validate(engine, questions, estimates: list[BucketEstimate], plan: CalibrationPlan) -> list[dict]:
    """Speculative vs plain decodes (interleaved; their decoding time) for every category the prediction
    switches on, and, at T = 0, for each γ at the best depth (the measured side of the speedup-vs-γ plot)."""
    overall = _overall(estimates, min(plan.temperatures))
    best, _, _ = overall.best()
    jobs = [(overall, best, g) for g in plan.gammas if str(g) in overall.speedup[best]]
    # Per category, not per prompt length: a length bucket holds too few prompts to time on its own.
    jobs += [(e, *e.best()[:2]) for e in estimates if e.best()[2] >= 1.0 and e.length_bucket == "all"]
    out = []
    for est, n, g in jobs:
        spec = spec_config(n, g)
        chosen = [
            q
            for q in questions
            if est.category in ("all", q["category"])
            and est.length_bucket in ("all", length_bucket(len(engine.encode(q["turns"][0]))))
        ][: plan.validate_prompts]
        params = SamplingParams(
            temperature=est.temperature, max_tokens=plan.new_tokens * 2, ignore_eos=True, seed=plan.seed
        )
        ratios = []
        for i, q in enumerate(chosen):
            ids = engine.encode(q["turns"][0])
            runs = [None, spec]
            times = {}
            for config in runs if i % 2 == 0 else runs[::-1]:
                # Decoding time, the prediction's scope: the prompt's prefill is the same work either way
                # and, on a long prompt, would pull the ratio towards 1 whatever the drafts did.
                times[config is not None] = engine.generate(ids, params, speculation=config).stats.decode_seconds
            ratios.append(times[False] / times[True])
        out.append(
            {
                "category": est.category,
                "length_bucket": est.length_bucket,
                "temperature": est.temperature,
                "source": n,
                "draft_layers": spec.draft_layers,
                "drafter": spec.drafter,
                "gamma": g,
                "predicted_speedup": est.speedup[str(n)][str(g)],
                "measured_speedup": statistics.median(ratios),
                "prompts": len(chosen),
            }
        )
    return out


BATCH_SIZES = (2, 4, 8)  # the batch sizes batch_limit times
BATCH_GAMMAS = (2, 4)  # the γ batch_limit also tries below a request alone's best (a batch verifies B * (γ + 1) rows)
SHORT_PROMPT = 256  # tokens: batch_limit's prompts, a chat turn's length rather than a document's
BATCH_TRIALS = 3  # batches of other prompts per size, each timed plain and speculative; their median ratio counts
# A size pays when its median is at least this: the server's batches mix arrival times, prompt lengths and
# prefill chunks, which lockstep batches do not (bf16 on a 2-core Xeon with AMX: one lockstep batch of 4
# measured 1.35x, the server at 4 clients 0.91-1.07x in five runs of benchmarks/serving.py).
BATCH_MARGIN = 1.1


def batch_limit(engine, encoded: list[list[int]], spec: SpecConfig, plan: CalibrationPlan) -> tuple[int, list[dict]]:
    """-> (the profile's max_batch_size, the measurements). B requests stepped together, continuous
    batching's unit (engine.step_batch), speculative with `spec`'s drafter against plain, in alternating
    order, on their decoding time, at `spec`'s γ (a request alone's best) and at each smaller one of
    BATCH_GAMMAS: a batch's verification pays for every row's γ + 1 tokens together, so its best γ is
    often smaller (fp32 on an AMD EPYC Zen 3: 4 requests at γ 8 1.00x, at γ 2 1.30x). Each size is timed
    on BATCH_TRIALS batches of different prompts and keeps the γ of the best median ratio (what
    policy.batch_gamma caps a batch at): one batch's ratio swung from 0.64x to 1.04x between trials on a
    VM whose speed drifts. A batch of plain steps already uses the compute a single stream leaves idle,
    so the gain of speculation shrinks with B. The limit is the largest size before the first one whose
    best median is below BATCH_MARGIN; a size whose requests would not fit the engine's cache is not
    measured, and neither is any above it. `encoded`: the calibration prompts' token ids; the batches
    take the short ones."""
    prompts = [ids for ids in encoded if len(ids) <= SHORT_PROMPT] or encoded[:1]
    params = SamplingParams(
        temperature=min(plan.temperatures), max_tokens=plan.new_tokens, ignore_eos=True, seed=plan.seed
    )
    top = spec.num_speculative_tokens
    gammas = sorted({g for g in BATCH_GAMMAS if g < top} | {top})
    runs = [None, *(replace(spec, num_speculative_tokens=g) for g in gammas)]  # None: plain
    limit, out = 1, []
    for i, size in enumerate(BATCH_SIZES):
        batches = [[prompts[(t * size + j) % len(prompts)] for j in range(size)] for t in range(BATCH_TRIALS)]
        need = max(sum(len(ids) + params.max_tokens + top + 2 for ids in batch) for batch in batches)
        if need > engine.cache.capacity_tokens:
            break
        trials: dict[int, list[float]] = {g: [] for g in gammas}
        for t, batch in enumerate(batches):
            seconds = {}
            for run in runs if (i + t) % 2 == 0 else runs[::-1]:
                seconds[run] = _batch_seconds(engine, batch, params, run or spec, run is not None)
            for run in runs[1:]:
                trials[run.num_speculative_tokens].append(seconds[None] / seconds[run])
        ratios = {g: statistics.median(r) for g, r in trials.items()}
        gamma = max(ratios, key=ratios.get)
        out.append(
            {
                "batch_size": size,
                "drafter": spec.drafter,
                "gamma": gamma,
                "measured_speedup": ratios[gamma],
                "by_gamma": {str(g): r for g, r in ratios.items()},
                "trials": {str(g): r for g, r in trials.items()},
            }
        )
        if ratios[gamma] < BATCH_MARGIN:
            break
        limit = size
    return limit, out


def _batch_seconds(engine, batch: list[list[int]], params: SamplingParams, spec: SpecConfig, speculate: bool) -> float:
    """Decoding time of `batch` stepped together to the end (after the step that prefills every row)."""
    reqs = [engine.add_request(ids, params, spec) for ids in batch]
    try:
        engine.step_batch(reqs)  # the prompts' prefill and each first token: the same work either way
        start = time.perf_counter()
        while live := [r for r in reqs if not r.finished]:
            engine.step_batch(live, speculate=speculate)
        return time.perf_counter() - start
    finally:
        for r in reqs:
            engine.release(r)


def _overall(estimates: list[BucketEstimate], temperature: float) -> BucketEstimate:
    """The all-categories, all-lengths estimate at `temperature`."""
    return next(e for e in estimates if (e.category, e.length_bucket, e.temperature) == ("all", "all", temperature))


def _profile(engine, plan, costs, records, estimates, validation):
    measured = {
        (v["category"], v["length_bucket"], v["temperature"], v["source"], v["gamma"]): v["measured_speedup"]
        for v in validation
    }
    buckets = []
    for e in estimates:
        n, g, s = e.best()
        config = spec_config(n, g)
        buckets.append(
            BucketChoice(
                e.category,
                e.length_bucket,
                e.temperature,
                e.positions,
                e.alpha,
                config.draft_layers,
                g,
                s,
                measured.get((e.category, e.length_bucket, e.temperature, n, g)),
                config.drafter,
            )
        )
    overall = {b.temperature: b for b in buckets if b.category == "all" and b.length_bucket == "all"}
    t0 = overall[min(plan.temperatures)]
    paying = [t for t, b in sorted(overall.items()) if (b.measured_speedup or b.predicted_speedup) >= 1.0]
    estimate0 = _overall(estimates, t0.temperature)
    source = estimate0.best()[0]
    depths = {n: x for n, x in estimate0.speedup.items() if n.isdigit()}
    best = int(max(depths, key=lambda n: max(depths[n].values()))) if depths else None
    # The adaptive stop applies to drafts that run the model every token (not lookup's).
    tau = 0.0
    if source in costs["c"] and source != "lookup":
        first = [r for r in records if r.temperature == min(plan.temperatures)]
        tau = confidence_threshold(first, source, costs["c"][source])
    return Profile(
        model=engine.name,
        fingerprint=engine.model.fingerprint,
        num_layers=engine.model.num_layers,
        dtype=str(engine.model.dtype).replace("torch.", ""),
        machine={
            **machine_info(),
            "backend": engine.model.kernels.backend,
            "weights": weight_format(engine.model.kernels.weights),
        },
        temperatures=list(plan.temperatures),
        draft_layers=list(plan.draft_layers),
        draft_cost=costs["c"],
        verify_cost=costs["v"],
        cost_contexts=[
            {"tokens": a["tokens"], "draft_cost": a["c"], "verify_cost": a["v"]} for a in costs.get("at", [])
        ],
        buckets=buckets,
        knee=knee({n: a for n, a in t0.alpha.items() if n.isdigit()}),
        best_draft_layers=best,
        temperature_threshold=max(paying) if paying else 0.0,
        confidence_threshold=tau if paying else 0.0,
        validation=validation,
    )


def knee(alpha: dict[str, float]) -> int:
    """The knee of acceptance vs draft depth: the depth farthest from the chord between the first and
    the last depth (the "kneedle" rule), i.e. where acceptance turns from flat to rising (or back)."""
    depths = sorted(int(n) for n in alpha)
    if len(depths) < 3:
        return depths[-1]
    (x0, y0), (x1, y1) = (depths[0], alpha[str(depths[0])]), (depths[-1], alpha[str(depths[-1])])
    chord = lambda x: y0 + (y1 - y0) * (x - x0) / (x1 - x0)  # noqa: E731
    return max(depths, key=lambda n: abs(chord(n) - alpha[str(n)]))


def machine_info() -> dict:
    """The machine a profile was measured on: CPU model, ISA flags (hashed), threads, torch."""
    return {
        **machine_key(),
        "platform": platform.platform(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }
