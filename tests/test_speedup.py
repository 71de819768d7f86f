import json

import pytest

from selfspec.calibration.speedup import best_gamma, estimate, expected_accepted_from_positions
from selfspec.cli.main import main

# alpha = 0.7, c = 0.3, v = 1: E = (1 - 0.7^(g+1)) / 0.3, cost = 0.3 g + 1, by hand
HAND = {
    1: (1.7, 1.3, 1.307692),
    2: (2.19, 1.6, 1.368750),
    3: (2.533, 1.9, 1.333158),
    4: (2.7731, 2.2, 1.260500),
    5: (2.94117, 2.5, 1.176468),
    6: (3.058819, 2.8, 1.092435),
    7: (3.1411733, 3.1, 1.013282),
    8: (3.19882131, 3.4, 0.940830),
}


@pytest.mark.parametrize("gamma", range(1, 9))
def test_estimate_matches_hand_computation(gamma):
    e = estimate(0.7, gamma, 0.3)
    tokens, cost, speedup = HAND[gamma]
    assert e.tokens_per_round == pytest.approx(tokens, abs=1e-5)
    assert e.cost_per_round == pytest.approx(cost)
    assert e.speedup == pytest.approx(speedup, abs=1e-5)


def test_best_gamma_overhead_and_edges():
    assert best_gamma(0.7, 0.3).gamma == 2
    assert estimate(0.7, 2, 0.3, overhead=0.8).speedup == pytest.approx(0.8 * 1.36875)
    assert estimate(1.0, 4, 0.1).tokens_per_round == 5.0
    assert estimate(0.0, 4, 0.1).tokens_per_round == 1.0
    assert expected_accepted_from_positions([1.0, 0.5, 0.5]) == pytest.approx(1 + 0.5 + 0.25)
    for kwargs, needle in [({"alpha": 1.5}, "alpha=1.5"), ({"gamma": 0}, "gamma=0"), ({"overhead": 0}, "overhead=0")]:
        args = {"alpha": 0.5, "gamma": 2, "c": 0.2, **kwargs}
        with pytest.raises(ValueError, match=needle):
            estimate(**args)


def test_estimate_cli(capsys):
    assert main(["estimate", "--alpha", "0.7", "--gamma", "3", "--c", "0.3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["estimate"]["speedup"] == pytest.approx(1.333158, abs=1e-5)
    assert out["best_gamma"] == 2 and len(out["table"]) == 8
    assert main(["estimate", "--alpha", "0.2", "--gamma", "3", "--c", "0.5"]) == 0
    assert "no gamma pays" in capsys.readouterr().out
    assert main(["estimate", "--alpha", "2", "--gamma", "3", "--c", "0.3"]) == 2
    assert "alpha=2.0 is invalid" in capsys.readouterr().err
