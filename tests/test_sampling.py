import math

import pytest
import torch

from selfspec.decoding.sampling import SamplingParams, make_generator, process_logits, sample_rows

BAD = [
    ({"temperature": -0.5}, "temperature=-0.5"),
    ({"temperature": float("nan")}, "temperature=nan"),
    ({"temperature": "hot"}, "temperature='hot'"),
    ({"top_k": -1}, "top_k=-1"),
    ({"top_k": 2.5}, "top_k=2.5"),
    ({"top_p": 0.0}, "top_p=0.0"),
    ({"top_p": 1.5}, "top_p=1.5"),
    ({"seed": -3}, "seed=-3"),
    ({"max_tokens": 0}, "max_tokens=0"),
    ({"max_tokens": True}, "max_tokens=True"),
    ({"stop": ("",)}, "stop=''"),
    ({"stop_token_ids": (-1,)}, "stop_token_ids entry -1"),
    ({"ignore_eos": "yes"}, "ignore_eos='yes'"),
]


@pytest.mark.parametrize("kwargs,needle", BAD)
def test_invalid_params_name_the_value(kwargs, needle):
    with pytest.raises(ValueError) as e:
        SamplingParams(**kwargs)
    assert needle in str(e.value)
    assert "use" in str(e.value)  # and say what to do instead


def test_valid_params_normalize_stop():
    p = SamplingParams(temperature=0, stop="###", stop_token_ids=[7])
    assert p.stop == ("###",) and p.stop_token_ids == (7,) and p.greedy


def test_greedy_is_one_hot_argmax():
    logits = torch.tensor([[0.1, 3.0, -1.0, 2.9]])
    probs = process_logits(logits, SamplingParams(temperature=0))
    assert probs.tolist() == [[0.0, 1.0, 0.0, 0.0]]
    ids, probs = sample_rows(logits, [SamplingParams(temperature=0)], [None])
    assert ids.tolist() == [1] and probs is None  # greedy rows skip the probabilities


def test_temperature_top_k_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]]))
    p = process_logits(logits, SamplingParams(temperature=1.0))
    torch.testing.assert_close(p, torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]]))
    p = process_logits(logits, SamplingParams(temperature=1.0, top_k=2))
    torch.testing.assert_close(p, torch.tensor([[5 / 7, 2 / 7, 0, 0, 0]]))
    # top_p=0.8 keeps the smallest prefix whose mass reaches 0.8: 0.5 + 0.2 + 0.15
    p = process_logits(logits, SamplingParams(temperature=1.0, top_p=0.8))
    torch.testing.assert_close(p, torch.tensor([[0.5, 0.2, 0.15, 0, 0]]) / 0.85)
    p = process_logits(logits, SamplingParams(temperature=0.5))
    expected = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]) ** 2
    torch.testing.assert_close(p[0], expected / expected.sum())


def test_sampling_follows_distribution_and_seed():
    """60k draws: total-variation distance to the target below 0.02 (the expected TV of an exact sampler is
    ~0.004 here; 0.02 is over 10 standard deviations away, so a false failure has probability < 1e-9)."""
    target = torch.tensor([0.4, 0.3, 0.2, 0.05, 0.05])
    n = 60000
    logits = torch.log(target)[None].expand(n, -1)
    params = SamplingParams(temperature=1.0, seed=123)
    gens = [make_generator(params.seed + i) for i in range(n)]  # one generator per row, as in decoding
    ids, _ = sample_rows(logits, [params] * n, gens)
    freq = torch.bincount(ids, minlength=5).float() / ids.numel()
    assert 0.5 * (freq - target).abs().sum() < 0.02
    again, _ = sample_rows(logits, [params] * n, [make_generator(params.seed + i) for i in range(n)])
    assert torch.equal(ids, again)


def test_top_p_never_empties_the_distribution():
    logits = torch.tensor([[10.0, 0.0, 0.0]])
    p = process_logits(logits, SamplingParams(temperature=1.0, top_p=1e-6))
    assert p[0, 0] == 1.0 and math.isclose(float(p.sum()), 1.0)


# ---- edge cases: never NaN -----------------------------------------------------------------------------


def _reference_process(logits, params):
    """process_logits as it was before the edge-case fixes: ordinary settings must give these bits."""
    logits = logits.float()
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, -math.inf)
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        mass_before = sorted_p.cumsum(-1) - sorted_p
        sorted_p = sorted_p.masked_fill(mass_before >= params.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


@pytest.mark.parametrize(
    "kwargs", [{}, {"temperature": 0.7}, {"temperature": 1.3, "top_k": 50}, {"top_p": 0.9}, {"temperature": 0.01}]
)
def test_ordinary_settings_are_bit_identical(kwargs):
    logits = torch.randn(3, 5, 1000, generator=torch.Generator().manual_seed(0)) * 4
    params = SamplingParams(**kwargs)
    assert torch.equal(process_logits(logits, params), _reference_process(logits, params))


def _assert_distribution(probs):
    assert torch.isfinite(probs).all() and (probs >= 0).all()
    torch.testing.assert_close(probs.sum(-1), torch.ones(probs.shape[:-1]))


@pytest.mark.parametrize("temperature", [1e-45, 1e-46, 1e-300, 5e-324, 1e-30])
def test_tiny_temperature_is_greedy_up_to_ties(temperature):
    """Temperatures whose scaled logits overflow float32 (or that float32 rounds to 0) gave NaN; now the
    limit: the argmax, and an even split between exactly tied maxima."""
    logits = torch.tensor([[0.5, 3.0, -1.0, 2.9], [-7.0, -2.0, -2.0, -9.0], [1e4, -1e4, float("-inf"), 0.0]])
    probs = process_logits(logits, SamplingParams(temperature=temperature))
    _assert_distribution(probs)
    assert probs.tolist() == [[0, 1, 0, 0], [0, 0.5, 0.5, 0], [1, 0, 0, 0]]
    for top in ({"top_k": 2}, {"top_p": 0.5}, {"top_k": 3, "top_p": 1e-300}):
        _assert_distribution(process_logits(logits, SamplingParams(temperature=temperature, **top)))
    ids, _ = sample_rows(logits, [SamplingParams(temperature=temperature)] * 3, [make_generator(i) for i in range(3)])
    assert ids[0] == 1 and ids[1] in (1, 2) and ids[2] == 0  # never the last vocabulary id by NaN


def test_a_row_that_overflows_does_not_change_its_batch():
    logits = torch.tensor([[0.5, 3.0, -1.0, 2.9], [1e38, 3e38, 0.0, 0.0]])
    params = SamplingParams(temperature=0.5)
    probs = process_logits(logits, params)
    _assert_distribution(probs)
    assert torch.equal(probs[0], _reference_process(logits[:1], params)[0]) and probs[1].tolist() == [0, 1, 0, 0]


@pytest.mark.parametrize("top_p", [1e-300, 5e-324, 1e-46, 1e-8])
def test_top_p_that_rounds_to_zero_keeps_the_top_token(top_p):
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(2))
    probs = process_logits(logits, SamplingParams(top_p=top_p))
    _assert_distribution(probs)
    assert torch.equal(probs.argmax(-1), logits.argmax(-1)) and (probs.max(-1).values == 1).all()


def test_neg_inf_logits_stay_valid_everywhere():
    logits = torch.full((2, 50), float("-inf"))
    logits[0, [3, 17, 40]] = torch.tensor([1.0, 2.0, 0.5])
    logits[1, 49] = -3.0  # one finite token
    for kwargs in ({}, {"temperature": 2.0, "top_k": 10}, {"top_p": 0.3}, {"temperature": 1e-45, "top_p": 0.99}):
        probs = process_logits(logits, SamplingParams(**kwargs))
        _assert_distribution(probs)
        assert (probs[logits == float("-inf")] == 0).all() and probs[1, 49] == 1


def test_top_p_keeps_every_token_tied_at_its_cut():
    """Equal probabilities at the cut all stay (as native.c's draw keeps them), whichever a sort puts first:
    top_p 0.5 over [0.4, 0.2, 0.2, 0.2] keeps 0.4 and the three tied 0.2s, not one of them."""
    logits = torch.log(torch.tensor([[0.4, 0.2, 0.2, 0.2, 1e-9]]))
    p = process_logits(logits, SamplingParams(temperature=1.0, top_p=0.5))
    assert (p[0, :4] > 0).all() and p[0, 4] == 0 and torch.allclose(p[0, 1:4], p[0, 1].expand(3))
