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
