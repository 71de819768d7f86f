"""Runtime speculation policy: per request, speculate with which N and γ, or not at all, and why.
Decisions come from a calibration profile when one is loaded; every decision carries a reason that
the request's stats report as `spec_policy`."""

from __future__ import annotations

from dataclasses import dataclass, replace

from .profile import Profile, machine_differences
from .round import EXIT_DRAFTERS, SpecConfig
from .sampling import SamplingParams

DEFAULT_TEMPERATURE_THRESHOLD = 0.7  # brief §5: above ~0.7 acceptance usually falls below break-even


@dataclass(frozen=True)
class SpecOverride:
    """A request's own say: force speculation on or off, and/or pick N and γ."""

    enabled: bool | None = None
    draft_layers: int | None = None
    num_speculative_tokens: int | None = None
    drafter: str | None = None  # one of round.DRAFTERS; None: the profile's (or, forced without one, hybrid)
    ngram: int | None = None  # lookup/hybrid suffix length

    def __post_init__(self) -> None:
        if self.enabled is not None and not isinstance(self.enabled, bool):
            raise ValueError(f"enabled={self.enabled!r} is invalid: use true, false or leave it unset")
        SpecConfig(  # validates the values that are set
            1 if self.draft_layers is None else self.draft_layers,
            1 if self.num_speculative_tokens is None else self.num_speculative_tokens,
            self.drafter or "auto",
            3 if self.ngram is None else self.ngram,
        )


Speculation = SpecConfig | SpecOverride | str | bool | None  # "auto" (the policy), None/False (off), a config


@dataclass(frozen=True)
class PolicyDecision:
    config: SpecConfig | None  # None: plain decoding
    reason: str
    confidence_threshold: float = 0.0  # adaptive draft stop (0 = draft all γ tokens)
    policy_gamma: bool = False  # γ is the policy's (not the request's): batched rounds may cap it (batch_gamma)


class SpecPolicy:
    def __init__(
        self,
        profile: Profile | None = None,
        *,
        temperature_threshold: float | None = None,
        min_max_tokens: int | None = None,
        max_batch_size: int | None = None,
        backend: str | None = None,
    ) -> None:
        """`backend`: the kernel backend of the model's linears (a profile timed on another one is foreign)."""
        self.profile = profile
        p = profile
        self.temperature_threshold = (
            temperature_threshold
            if temperature_threshold is not None
            else (p.temperature_threshold if p else DEFAULT_TEMPERATURE_THRESHOLD)
        )
        self.min_max_tokens = min_max_tokens if min_max_tokens is not None else (p.min_max_tokens if p else 16)
        self.max_batch_size = max_batch_size if max_batch_size is not None else (p.max_batch_size if p else 8)
        self.foreign = foreign(p, backend) if p else None  # why the profile's costs may not hold here (None: they do)

    def allows_batch(self, batch_size: int) -> bool:
        """Speculation pays only while compute sits idle: off above max_batch_size requests."""
        return batch_size <= self.max_batch_size

    def resolve(
        self,
        speculation: Speculation,
        *,
        num_layers: int,
        prompt_tokens: int,
        params: SamplingParams,
        category: str | None = None,
    ) -> PolicyDecision:
        """Whether and how a request speculates: `speculation` is "auto" (decided from the profile),
        None / False (plain), a SpecConfig (exactly that), or a SpecOverride (the request's say)."""
        if speculation is None or speculation is False:
            return PolicyDecision(None, "off: disabled by the request")
        if isinstance(speculation, SpecConfig):
            speculation.check(num_layers)
            return PolicyDecision(speculation, f"on: requested ({describe(speculation)})")
        if speculation is True:
            speculation = SpecOverride(enabled=True)
        elif speculation == "auto":
            speculation = SpecOverride()
        elif not isinstance(speculation, SpecOverride):
            raise ValueError(
                f"speculation={speculation!r} is invalid: use 'auto', None, a SpecConfig or a SpecOverride"
            )
        decision = self.decide(
            num_layers=num_layers,
            prompt_tokens=prompt_tokens,
            temperature=params.temperature,
            max_tokens=params.max_tokens,
            category=category,
            override=speculation,
        )
        if decision.config is not None:
            decision.config.check(num_layers)
            if speculation.num_speculative_tokens is None:
                decision = replace(decision, policy_gamma=True)
        return decision

    def batch_gamma(self, batch_size: int) -> int | None:
        """The best γ calibration measured for batches of `batch_size` speculating requests (the
        profile's `batching`: the smallest measured batch at least this large), or None when it measured none.
        Each bucket's γ was chosen for a request alone; a batch's verification pays for its rows' γ
        together (fp32 serving, 4 clients: the buckets' own γ 5-8 gave 93.8 tok/s, γ 5 for all 118.8)."""
        if self.profile is None or batch_size < 2:
            return None
        measured = sorted((b["batch_size"], b["gamma"]) for b in self.profile.batching if b.get("gamma"))
        return next((g for size, g in measured if size >= batch_size), measured[-1][1] if measured else None)

    def decide(
        self,
        *,
        num_layers: int,
        prompt_tokens: int,
        temperature: float,
        max_tokens: int,
        category: str | None = None,
        override: SpecOverride | None = None,
    ) -> PolicyDecision:
        """The profile's decision for one request (after the request's own override)."""
        o = override or SpecOverride()
        if o.enabled is False:
            return PolicyDecision(None, "off: disabled by the request")
        if o.enabled or o.draft_layers is not None or o.drafter is not None:
            return self._forced(o, num_layers, prompt_tokens, temperature, category)
        if temperature > self.temperature_threshold:
            return PolicyDecision(None, f"off: temperature {temperature:g} > threshold {self.temperature_threshold:g}")
        if max_tokens < self.min_max_tokens:
            return PolicyDecision(None, f"off: max_tokens {max_tokens} < {self.min_max_tokens}, too short to pay")
        if self.profile is None:
            return PolicyDecision(None, "off: no calibration profile for this model and dtype (run selfspec calibrate)")
        b = self.profile.bucket(category, prompt_tokens, temperature)
        if b is None:
            return PolicyDecision(None, "off: the profile has no bucket for this request")
        name = f"{b.category}/{b.length_bucket}/T={b.temperature:g}"
        speedup = b.measured_speedup if b.measured_speedup is not None else b.predicted_speedup
        kind = "measured" if b.measured_speedup is not None else "predicted"
        config = SpecConfig(b.draft_layers, b.gamma, b.drafter)
        if speedup < 1.0:
            return PolicyDecision(None, f"off: bucket {name} {kind} {speedup:.2f}x at best ({describe(config)})")
        reason = f"on: bucket {name} {kind} {speedup:.2f}x with {describe(config)}"
        if self.foreign:
            if b.drafter != "lookup":  # a draft that runs the model costs what this machine makes it cost
                return PolicyDecision(None, f"off: {self.foreign}; run selfspec calibrate here ({reason[4:]} there)")
            reason += f" ({self.foreign}; lookup runs no model to draft)"
        return PolicyDecision(config, reason, self.profile.confidence_threshold)

    def _forced(
        self, o: SpecOverride, num_layers: int, prompt_tokens: int, temperature: float, category
    ) -> PolicyDecision:
        b = self.profile.bucket(category, prompt_tokens, temperature) if self.profile else None
        drafter = o.drafter or (b.drafter if b else "hybrid" if o.draft_layers is None else "auto")
        n = o.draft_layers
        if n is None and drafter in EXIT_DRAFTERS:
            n = b.draft_layers if b and b.draft_layers else num_layers // 2
        same = b is not None and b.drafter == drafter and n == b.draft_layers
        gamma = o.num_speculative_tokens or (b.gamma if same else 4)
        config = SpecConfig(n, gamma, drafter, o.ngram or 3)
        return PolicyDecision(config, f"on: requested ({describe(config)})")


def describe(config: SpecConfig) -> str:
    """'drafter, N=.., gamma=..' as decisions and reports name a configuration."""
    n = "" if config.draft_layers is None else f" N={config.draft_layers},"
    return f"{config.drafter},{n} gamma={config.num_speculative_tokens}"


def foreign(profile: Profile, backend: str | None = None) -> str | None:
    """How the profile's machine (or backend) differs from this one in what sets its costs (None: it does not)."""
    diffs = machine_differences(profile.machine, backend)
    return "the profile was measured with " + ", ".join(diffs) if diffs else None
