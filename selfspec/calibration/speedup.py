"""The speedup model of speculative decoding (brief §3).

α = per-token acceptance probability, γ = draft length, c = cost of one draft step / one full forward,
v = cost of one verification / one full forward (1 in the classic two-model setting; self-speculation
verifies with layers [N, L) only, so v is often lower).

    E[tokens per round] = (1 - α^(γ+1)) / (1 - α)
    cost per round      = γ·c + v            (in full forwards)
    speedup             = overhead · E / (γ·c + v)

`overhead` discounts what the formula leaves out (cache, mask and rollback work): ~0.8 in practice."""

from __future__ import annotations

from dataclasses import dataclass


def expected_tokens_per_round(alpha: float, gamma: int) -> float:
    if alpha >= 1.0:
        return gamma + 1.0
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def expected_accepted_from_positions(accept_probs: list[float]) -> float:
    """Per-position acceptance probabilities β_1..β_γ (each given the previous ones accepted) ->
    expected accepted drafts Σ_i Π_{j<=i} β_j."""
    total, run = 0.0, 1.0
    for beta in accept_probs:
        run *= beta
        total += run
    return total


@dataclass(frozen=True)
class Estimate:
    alpha: float
    gamma: int
    c: float
    verify_cost: float
    overhead: float

    @property
    def tokens_per_round(self) -> float:
        return expected_tokens_per_round(self.alpha, self.gamma)

    @property
    def cost_per_round(self) -> float:
        return self.gamma * self.c + self.verify_cost

    @property
    def speedup(self) -> float:
        return self.overhead * self.tokens_per_round / self.cost_per_round

    def to_dict(self) -> dict:
        return {
            "alpha": self.alpha,
            "gamma": self.gamma,
            "c": self.c,
            "verify_cost": self.verify_cost,
            "overhead": self.overhead,
            "tokens_per_round": self.tokens_per_round,
            "cost_per_round": self.cost_per_round,
            "speedup": self.speedup,
        }


def estimate(alpha: float, gamma: int, c: float, verify_cost: float = 1.0, overhead: float = 1.0) -> Estimate:
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha={alpha} is invalid: use a probability in [0, 1]")
    if gamma < 1:
        raise ValueError(f"gamma={gamma} is invalid: use an integer >= 1")
    if c < 0 or verify_cost <= 0:
        raise ValueError(f"c={c}, verify_cost={verify_cost}: use c >= 0 and verify_cost > 0")
    if not 0 < overhead <= 1.0:
        raise ValueError(f"overhead={overhead} is invalid: use a factor in (0, 1]")
    return Estimate(alpha, gamma, c, verify_cost, overhead)


def best_gamma(
    alpha: float, c: float, verify_cost: float = 1.0, overhead: float = 1.0, max_gamma: int = 16
) -> Estimate:
    return max((estimate(alpha, g, c, verify_cost, overhead) for g in range(1, max_gamma + 1)), key=lambda e: e.speedup)
