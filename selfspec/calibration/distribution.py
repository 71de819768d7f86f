"""Checking losslessness on a real model: sample many continuations of one prompt with and without
speculation, score each under the model's own processed distribution, and compare the two samples of
sequence log-likelihoods with a two-sample Kolmogorov-Smirnov test. Samples are generated a chunk of
rows at a time, each row a fork of the prefilled prompt (shared blocks, nothing copied)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from ..decoding.drafter import Drafter
from ..decoding.round import SpecConfig
from ..decoding.sampling import SamplingParams, make_generator, process_logits
from ..model.cache import PagedKVCache
from ..model.decoder import DecoderModel
from .rollout import generate_batch

SIGNIFICANCE = 0.01  # the test's false-alarm rate: a lossless engine fails it 1% of the time


@torch.inference_mode()
def sample_continuations(
    model: DecoderModel,
    cache: PagedKVCache,
    prompt: list[int],
    params: SamplingParams,
    config: SpecConfig | None,
    num_samples: int,
    new_tokens: int,
    seed: int,
    chunk: int = 128,
    drafter: Drafter | None = None,
) -> list[list[int]]:
    """num_samples continuations of exactly new_tokens tokens each (EOS is not special here). Row i
    draws from its own generator seeded with seed + i. `drafter`: what the speculative arm drafts with
    (default: the plain exit at the config's depth)."""
    root = cache.allocate()
    out: list[list[int]] = []
    try:
        model.prefill(cache, root, prompt[:-1])
        for first in range(0, num_samples, chunk):
            rows = min(chunk, num_samples - first)
            seqs = [cache.fork(root) for _ in range(rows)]
            gens = [make_generator(seed + first + i, model.device) for i in range(rows)]
            try:
                out += generate_batch(
                    model, cache, seqs, [prompt[-1]] * rows, params, config, gens, new_tokens, drafter, [prompt] * rows
                )
            finally:
                for s in seqs:
                    cache.free(s)
    finally:
        cache.free(root)
    return out


@torch.inference_mode()
def sequence_logliks(
    model: DecoderModel,
    cache: PagedKVCache,
    prompt: list[int],
    continuations: list[list[int]],
    params: SamplingParams,
    chunk: int = 128,
) -> torch.Tensor:
    """Teacher-forced log-likelihood of each continuation under the processed target distribution
    -> [num_samples] float64."""
    root = cache.allocate()
    out = []
    try:
        model.prefill(cache, root, prompt[:-1])
        for first in range(0, len(continuations), chunk):
            conts = torch.tensor(continuations[first : first + chunk], device=model.device)  # [B, n]
            seqs = [cache.fork(root) for _ in range(conts.shape[0])]
            try:
                lasts = torch.full((conts.shape[0], 1), prompt[-1], device=model.device)  # [B, 1]
                inputs = torch.cat([lasts, conts[:, :-1]], dim=1)  # [B, n]
                probs = process_logits(model.logits(model.forward(inputs, cache, seqs)), params)  # [B, n, vocab]
                picked = probs.gather(-1, conts[..., None]).squeeze(-1).double()  # [B, n]
                out.append(picked.log().sum(-1))
            finally:
                for s in seqs:
                    cache.free(s)
    finally:
        cache.free(root)
    return torch.cat(out)


@dataclass
class DistributionReport:
    samples: int
    new_tokens: int
    statistic: float  # KS distance between the two empirical CDFs of log-likelihood
    pvalue: float
    mean_loglik_plain: float
    mean_loglik_speculative: float
    first_token_pvalue: float  # chi-square homogeneity of the first generated token
    lossless: bool  # both p-values >= SIGNIFICANCE

    def to_dict(self) -> dict:
        return asdict(self)


def compare(
    model: DecoderModel,
    prompt: list[int],
    params: SamplingParams,
    config: SpecConfig,
    samples: int,
    new_tokens: int,
    seed: int = 0,
    chunk: int = 128,
    drafter: Drafter | None = None,
) -> DistributionReport:
    """`drafter`: what the speculative arm drafts with (default: the plain exit at the config's depth)."""
    from scipy import stats

    # A cache of its own: `chunk` forks of the prompt, each with room for a round's overshoot.
    block = 16
    cache = model.new_cache(len(prompt) + chunk * (new_tokens + config.num_speculative_tokens + 2 + 2 * block), block)
    plain = sample_continuations(model, cache, prompt, params, None, samples, new_tokens, seed, chunk)
    specd = sample_continuations(
        model, cache, prompt, params, config, samples, new_tokens, seed + 10**6, chunk, drafter
    )
    ll_plain = sequence_logliks(model, cache, prompt, plain, params, chunk)
    ll_spec = sequence_logliks(model, cache, prompt, specd, params, chunk)
    ks = stats.ks_2samp(ll_plain.numpy(), ll_spec.numpy())
    first = _first_token_pvalue([s[0] for s in plain], [s[0] for s in specd])
    return DistributionReport(
        samples=samples,
        new_tokens=new_tokens,
        statistic=float(ks.statistic),
        pvalue=float(ks.pvalue),
        mean_loglik_plain=float(ll_plain.mean()),
        mean_loglik_speculative=float(ll_spec.mean()),
        first_token_pvalue=first,
        lossless=bool(ks.pvalue >= SIGNIFICANCE and first >= SIGNIFICANCE),
    )


def _first_token_pvalue(a: list[int], b: list[int]) -> float:
    """Chi-square test that two samples of token ids come from one distribution; tokens seen fewer
    than 5 times in total are pooled into one cell."""
    from scipy import stats

    counts: dict[int, list[int]] = {}
    for arm, ids in enumerate((a, b)):
        for t in ids:
            counts.setdefault(t, [0, 0])[arm] += 1
    table, rare = [], [0, 0]
    for c in counts.values():
        if sum(c) >= 5:
            table.append(c)
        else:
            rare = [rare[0] + c[0], rare[1] + c[1]]
    if sum(rare):
        table.append(rare)
    if len(table) < 2:
        return 1.0  # a single outcome on both sides: nothing to tell apart
    return float(stats.chi2_contingency(table).pvalue)
