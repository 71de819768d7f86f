"""Per-request statistics: decode timings and speculation counted per round (per drafted position
too), reported in `--json`, the server's usage and Prometheus metrics."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from .round import RoundResult


@dataclass
class SpecStats:
    """Speculation counted per round: a round drafts γ tokens and emits accepted + 1."""

    draft_layers: int | None  # None: a drafter that runs no layers (lookup)
    num_speculative_tokens: int
    drafter: str = "exit"  # the drafter's name (see decoding/drafter.py)
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    drafted_per_position: list[int] = field(default_factory=list)  # [γ] rounds that drafted position i
    accepted_per_position: list[int] = field(default_factory=list)  # [γ] rounds that kept draft i
    draft_seconds: float = 0.0  # the sequential draft steps
    verify_seconds: float = 0.0  # verification, acceptance and rollback
    full_steps: int = 0  # plain one-token steps of the same request (the first step is one)
    full_step_seconds: float = 0.0

    def __post_init__(self) -> None:
        self.drafted_per_position = self.drafted_per_position or [0] * self.num_speculative_tokens
        self.accepted_per_position = self.accepted_per_position or [0] * self.num_speculative_tokens

    def record(self, result: RoundResult, row: int = 0) -> None:
        accepted, gamma = result.num_accepted[row], result.drafted[row]
        self.rounds += 1
        self.drafted += gamma
        self.accepted += accepted
        for i in range(gamma):  # a round near the length limit drafts fewer than γ
            self.drafted_per_position[i] += 1
            self.accepted_per_position[i] += i < accepted
        self.draft_seconds += result.draft_seconds
        self.verify_seconds += result.verify_seconds

    def merge(self, other: "SpecStats") -> "SpecStats":
        """Sum of two requests' counters (same γ), for aggregated reports."""
        out = SpecStats(self.draft_layers, self.num_speculative_tokens, self.drafter)
        for name in (
            "rounds",
            "drafted",
            "accepted",
            "draft_seconds",
            "verify_seconds",
            "full_steps",
            "full_step_seconds",
        ):
            setattr(out, name, getattr(self, name) + getattr(other, name))
        out.drafted_per_position = [a + b for a, b in zip(self.drafted_per_position, other.drafted_per_position)]
        out.accepted_per_position = [a + b for a, b in zip(self.accepted_per_position, other.accepted_per_position)]
        return out

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_tokens_per_round(self) -> float:
        return 1 + self.accepted / self.rounds if self.rounds else 0.0

    @property
    def draft_cost_ratio(self) -> float:
        """c: wall time of one draft step / one full plain step, both measured in this run."""
        if not (self.drafted and self.full_steps):
            return 0.0
        return (self.draft_seconds / self.drafted) / (self.full_step_seconds / self.full_steps)

    @property
    def verify_cost_ratio(self) -> float:
        """Wall time of one verification (layers [N, L) over γ + 1 tokens, acceptance, rollback) / one
        full plain step. Self-speculation verifies with only L - N layers, so this is often below 1."""
        if not (self.rounds and self.full_steps):
            return 0.0
        return (self.verify_seconds / self.rounds) / (self.full_step_seconds / self.full_steps)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["verify_cost_ratio"] = self.verify_cost_ratio
        d["acceptance_rate"] = self.acceptance_rate
        d["mean_tokens_per_round"] = self.mean_tokens_per_round
        d["draft_cost_ratio"] = self.draft_cost_ratio
        d["acceptance_per_position"] = [
            a / n if n else 0.0 for a, n in zip(self.accepted_per_position, self.drafted_per_position)
        ]
        return d


@dataclass
class DecodeStats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    steps: int = 0  # decoding steps (forwards of the full model after prefill)
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0  # wall time inside decoding steps
    time_to_first_token: float = 0.0
    spec: SpecStats | None = None  # None for plain decoding
    spec_policy: str = ""  # why this request speculates (or not), as decided by the policy
    weights: str = ""  # the linears' weight format (float32, bfloat16, int8, int4)
    backend: str = ""  # the kernel backend that ran them (kernels/)
    ops: str = ""  # the glue between them: "fused" (kernels/native.c) or "eager" (torch), see model/ops.py

    def record_step(self, result: RoundResult, row: int, seconds: float, *, alone: bool) -> None:
        """Counts one round of this request (row `row` of `result`, which took `seconds`). A plain
        step run `alone` (no drafter in its round) is the reference a draft's cost c is taken against."""
        if self.spec is not None:
            if result.drafted[row]:
                self.spec.record(result, row)
            elif alone:
                self.spec.full_steps += 1
                self.spec.full_step_seconds += seconds
        self.decode_seconds += seconds
        if self.steps == 0:
            self.time_to_first_token = self.prefill_seconds + seconds
        self.steps += 1

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.decode_seconds if self.decode_seconds else 0.0

    @property
    def prompt_tokens_per_second(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["spec"] = self.spec.to_dict() if self.spec else None
        d["tokens_per_second"] = self.tokens_per_second
        d["prompt_tokens_per_second"] = self.prompt_tokens_per_second
        return d


def snapshot(stats: DecodeStats) -> DecodeStats:
    if stats.spec is None:
        return replace(stats)
    spec = replace(
        stats.spec,
        drafted_per_position=list(stats.spec.drafted_per_position),
        accepted_per_position=list(stats.spec.accepted_per_position),
    )
    return replace(stats, spec=spec)
