"""The acceptance rule on stub distributions: exact outcomes for never / always / partial acceptance,
and a statistical check that rejection-sampled tokens follow the target distribution."""

import pytest
import torch

from selfspec.decoding.acceptance import PLACEHOLDER, greedy_accept, native_rejection_sample, rejection_sample
from selfspec.decoding.sampling import SamplingParams, process_rows, sample_rows
from selfspec.kernels import native


def one_hot(ids, vocab=8):
    return torch.nn.functional.one_hot(torch.tensor(ids), vocab).float()


def test_greedy_always_never_partial():
    drafts = [[5, 6, 7], [5, 6, 7], [5, 6, 7]]
    targets = [[5, 6, 7, 1], [2, 6, 7, 1], [5, 6, 3, 1]]
    assert greedy_accept(drafts, targets) == ([[5, 6, 7, 1], [2], [5, 6, 3]], [3, 0, 2])


def test_greedy_rows_accept_at_most_their_own_drafts():
    """Rows of a batch padded to the longest draft: each judges only its own drafts, and the target at its
    own γ_b is its bonus; a row with none is a plain step."""
    drafts = [[5, 6], [], [5, 6, 7]]
    targets = [[5, 6, 0, 1], [9, 0, 0, 1], [5, 6, 7, 1]]
    assert greedy_accept(drafts, targets) == ([[5, 6, 0], [9], [5, 6, 7, 1]], [2, 0, 3])


def test_sampled_always_accepts_when_p_equals_q():
    g = torch.Generator().manual_seed(0)
    q = torch.softmax(torch.randn(4, 3, 8, generator=g), -1)
    p = torch.cat([q, torch.softmax(torch.randn(4, 1, 8, generator=g), -1)], dim=1)
    drafts = torch.multinomial(q.view(-1, 8), 1, generator=g).view(4, 3)
    r = rejection_sample(drafts, q, p, g)
    assert r.num_accepted.tolist() == [3, 3, 3, 3]
    assert torch.equal(r.output_ids[:, :3], drafts)


def test_sampled_never_accepts_outside_target_support_and_recovers_exactly():
    q = one_hot([[1, 2, 3]])  # the draft is sure of 1, 2, 3
    p = one_hot([[4, 5, 6, 7]])  # the target puts no mass on them
    r = rejection_sample(torch.tensor([[1, 2, 3]]), q, p, torch.Generator().manual_seed(1))
    assert r.num_accepted.tolist() == [0]
    assert r.output_ids.tolist() == [[4, PLACEHOLDER, PLACEHOLDER, PLACEHOLDER]]  # residual = p's one-hot


def test_sampled_partial_acceptance_exact_tokens():
    q = one_hot([[1, 2, 3]])
    p = one_hot([[1, 2, 6, 7]])  # agrees on the first two drafts, certain of 6 at the third
    r = rejection_sample(torch.tensor([[1, 2, 3]]), q, p, [torch.Generator().manual_seed(2)])
    assert r.num_accepted.tolist() == [2]
    assert r.output_ids.tolist() == [[1, 2, 6, PLACEHOLDER]]
    r = rejection_sample(torch.tensor([[1, 2, 6]]), one_hot([[1, 2, 6]]), p, None)
    assert r.tokens(0) == [1, 2, 6, 7]  # all accepted: the bonus comes from p's last position


def _one_position_frequencies(p, q, n, seed):
    """n independent one-token rounds -> empirical distribution of the emitted token."""
    g = torch.Generator().manual_seed(seed)
    drafts = torch.multinomial(q, n, replacement=True, generator=g).view(n, 1)
    r = rejection_sample(drafts, q.expand(n, 1, -1), torch.stack([p, p]).expand(n, 2, -1), g)
    return torch.bincount(r.output_ids[:, 0], minlength=p.numel()), r


CASES = {
    "q equals p": ([0.5, 0.2, 0.1, 0.1, 0.05, 0.05], [0.5, 0.2, 0.1, 0.1, 0.05, 0.05]),
    "q disjoint from p": ([0.6, 0.4, 0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.3, 0.3, 0.2, 0.2]),
    "q zero where p positive": ([0.3, 0.3, 0.2, 0.1, 0.05, 0.05], [0.5, 0.5, 0.0, 0.0, 0.0, 0.0]),
    "q flatter than p": ([0.7, 0.1, 0.1, 0.05, 0.05, 0.0], [1 / 6] * 6),
    "q sharper than p": ([0.2, 0.2, 0.2, 0.2, 0.1, 0.1], [0.9, 0.02, 0.02, 0.02, 0.02, 0.02]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_rejection_sampling_follows_target(case):
    """200k rounds per case. The chi-square test against the exact target has a false-failure
    probability of 1e-4 per case (seeds are fixed, so the outcome is reproducible)."""
    from scipy import stats

    p, q = (torch.tensor(x, dtype=torch.float32) for x in CASES[case])
    n = 200_000
    counts, r = _one_position_frequencies(p, q, n, seed=list(CASES).index(case))
    support = p > 0
    assert counts[~support].sum() == 0  # never a token the target excludes
    observed = counts[support].double()
    expected = p[support].double() / p[support].double().sum() * observed.sum()
    assert stats.chisquare(observed.numpy(), expected.numpy()).pvalue > 1e-4
    tv = 0.5 * (counts.double() / n - p.double()).abs().sum()
    assert tv < 0.01
    # acceptance equals sum(min(p, q)), the overlap of the two distributions
    overlap = torch.minimum(p, q).sum().item()
    assert abs(r.num_accepted.double().mean().item() - overlap) < 0.01


def test_tiny_temperature_acceptance_is_greedy_acceptance():
    """Target and draft processed at a temperature that once gave NaN: rejection sampling of the drafts
    (each the draft's argmax) emits exactly what greedy acceptance of the same logits does."""
    from selfspec.decoding.sampling import SamplingParams, process_logits

    g = torch.Generator().manual_seed(3)
    target = torch.randn(64, 4, 8, generator=g) * 3  # [B, γ + 1, vocab]
    draft = target[:, :3] + torch.randn(64, 3, 8, generator=g)  # [B, γ, vocab], often the same argmax
    params = SamplingParams(temperature=1e-45)
    p, q = process_logits(target, params), process_logits(draft, params)
    assert torch.isfinite(p).all() and torch.isfinite(q).all()
    drafts = draft.argmax(-1)
    sampled = rejection_sample(drafts, q, p, [torch.Generator().manual_seed(i) for i in range(64)])
    tokens, accepted = greedy_accept(drafts.tolist(), target.argmax(-1).tolist())
    assert sampled.rows() == (tokens, accepted) and 0 < sum(accepted) < 64 * 3


PROCESSED = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_p=0.8),
    SamplingParams(temperature=1.3, top_k=5),
    SamplingParams(temperature=0),  # a greedy row among sampled ones
    SamplingParams(temperature=0.9, top_k=20, top_p=0.9),
    SamplingParams(temperature=2.0),
]


@pytest.mark.skipif(native.library() is None, reason="native.c unavailable")
@pytest.mark.parametrize("seed", range(4))
def test_native_acceptance_is_rejection_samples(seed):
    """native.c's accept_drafts (what a CPU round runs) keeps the same drafts and emits the same last
    token as rejection_sample on the processed distributions, from the same generators: rows of every
    processing, drafts with their own q, point masses (lookup's), fewer drafts than γ, and none."""
    vocab, gamma = 50, 4
    g = torch.Generator().manual_seed(seed)
    rows = len(PROCESSED)
    logits = torch.randn(rows, gamma + 1, vocab, generator=g) * 3
    p = process_rows(logits, PROCESSED)  # [B, γ + 1, vocab]
    # drafts: q near p (so that some are kept), each token drawn from its q; row 1 and 4: point masses
    counts = [4, 4, 2, 4, 0, 3]
    drafts, probs = [], []
    for b, n in enumerate(counts):
        q = torch.softmax(p[b, :n].clamp_min(1e-9).log() + torch.randn(n, vocab, generator=g) * 0.5, -1)
        d = torch.multinomial(q, 1, generator=g)[:, 0].tolist() if n else []
        drafts.append(d)
        probs.append([] if b in (1, 4) else list(q))

    def generators():
        return [torch.Generator().manual_seed(100 * seed + b) for b in range(rows)]

    ids = torch.tensor([d + [0] * (gamma - len(d)) for d in drafts])
    fast = native_rejection_sample(ids, torch.tensor(counts), probs, logits, PROCESSED, generators())
    q = torch.zeros(rows, gamma, vocab)
    for b, d in enumerate(drafts):
        for i, t in enumerate(d):
            q[b, i] = probs[b][i] if probs[b] else one_hot([t], vocab)[0]
    reference = rejection_sample(ids, q, p, generators(), torch.tensor(counts))
    assert fast.num_accepted.tolist() == reference.num_accepted.tolist()
    assert fast.rows()[0] == reference.rows()[0]
    assert 0 < sum(fast.num_accepted.tolist()) < sum(counts)  # some kept, some not


@pytest.mark.skipif(native.library() is None, reason="native.c unavailable")
def test_native_plain_sampling_is_inverse_cdf():
    """A row of no drafts samples its token as sample_rows does, from the same generators."""
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(len(PROCESSED), 1, 300, generator=g) * 2
    for seed in range(20):
        gens = [torch.Generator().manual_seed(seed * 10 + b) for b in range(len(PROCESSED))]
        rows = len(PROCESSED)
        none = torch.zeros(rows, 0, dtype=torch.long), torch.zeros(rows, dtype=torch.long)
        fast = native_rejection_sample(*none, [[]] * rows, logits, PROCESSED, gens)
        gens = [torch.Generator().manual_seed(seed * 10 + b) for b in range(len(PROCESSED))]
        ids, _ = sample_rows(logits[:, 0], PROCESSED, gens)
        assert fast.output_ids[:, 0].tolist() == ids.tolist()
