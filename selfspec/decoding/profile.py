"""Calibration profiles: what `selfspec calibrate` measured for one model, dtype and machine, and what
the runtime policy reads back. Stored as versioned JSON."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..errors import SelfspecError
from ..kernels.choice import machine_key

PROFILE_VERSION = 1
LENGTH_BUCKETS = (64, 256, 1024)  # prompt-token upper bounds; longer prompts fall in the last bucket
PROFILE_DIR = Path(__file__).resolve().parent / "profiles"


def length_bucket(prompt_tokens: int) -> str:
    low = 0
    for high in LENGTH_BUCKETS:
        if prompt_tokens < high:
            return f"{low}-{high - 1}"
        low = high
    return f"{low}+"


def temperature_bucket(temperature: float, calibrated: list[float]) -> float:
    """The calibrated temperature nearest to the request's."""
    return min(calibrated, key=lambda t: (abs(t - temperature), t))


@dataclass
class BucketChoice:
    """Best configuration of one bucket (category x prompt length x temperature)."""

    category: str
    length_bucket: str
    temperature: float
    positions: int  # teacher-forced positions behind the estimate
    alpha: dict[str, float]  # per draft source (N as a string for exits, else the drafter): acceptance per draft
    draft_layers: int | None  # None: a drafter that runs no layers, or all of them
    gamma: int
    predicted_speedup: float
    measured_speedup: float | None = None  # in decoding time, when validated
    drafter: str = "exit"  # round.DRAFTERS


@dataclass
class Profile:
    model: str
    fingerprint: str
    num_layers: int
    dtype: str
    machine: dict
    temperatures: list[float]
    draft_layers: list[int]
    draft_cost: dict[str, float]  # c per N: one draft step / one full step, measured
    verify_cost: dict[str, dict[str, float]]  # v per N per γ: one verification / one full step
    buckets: list[BucketChoice]
    knee: int  # the knee of acceptance vs draft depth at the lowest temperature
    best_draft_layers: int  # the depth with the best predicted speedup at the lowest temperature
    temperature_threshold: float  # above it speculation is off
    min_max_tokens: int = 16  # requests asking for fewer tokens run plain
    max_batch_size: int = 8  # above it speculation is off (compute is no longer idle); calibration measures it
    batching: list[dict] = field(default_factory=list)  # batch size -> its best γ and speculative / plain (batch_limit)
    confidence_threshold: float = 0.0  # adaptive draft stop: end a draft when its top probability falls below
    validation: list[dict] = field(default_factory=list)  # decoding-time measurements behind the choices
    skipped_prompts: list[str] = field(default_factory=list)  # longer than the model's context allows
    draft_heads: dict = field(default_factory=dict)  # N -> the draft head calibrated there, α with and without it
    prompts: list[str] = field(default_factory=list)  # question ids calibrated on
    # draft_cost and verify_cost as timed at each context (tokens); a bucket's estimate reads them at its
    # own mean context (draft_cost, verify_cost: the first, a short prompt's)
    cost_contexts: list[dict] = field(default_factory=list)
    version: int = PROFILE_VERSION

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> "Profile":
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise SelfspecError(f"cannot read profile {path}: {e}") from None
        return cls.from_dict(data, str(path))

    @classmethod
    def from_dict(cls, data: dict, source: str = "profile") -> "Profile":
        version = data.get("version")
        if version != PROFILE_VERSION:
            raise SelfspecError(
                f"{source} has profile version {version!r}; this selfspec reads version {PROFILE_VERSION}: "
                "re-run `selfspec calibrate`"
            )
        try:
            buckets = [BucketChoice(**b) for b in data.pop("buckets")]
            return cls(buckets=buckets, **data)
        except (TypeError, KeyError) as e:
            raise SelfspecError(f"{source} is not a valid selfspec profile ({e})") from None

    def bucket(self, category: str | None, prompt_tokens: int, temperature: float) -> BucketChoice | None:
        """The bucket of a request; an unknown or missing category falls back to the 'all' bucket."""
        t = temperature_bucket(temperature, self.temperatures)
        length = length_bucket(prompt_tokens)
        by_key = {(b.category, b.length_bucket, b.temperature): b for b in self.buckets}
        for key in ((category, length, t), (category, "all", t), ("all", length, t), ("all", "all", t)):
            if key in by_key:
                return by_key[key]
        return None


def machine_differences(machine: dict, backend: str | None = None) -> list[str]:
    """What sets a profile's costs and differs between the machine it was measured on and this one, and
    the kernel backend of the model's linears where `backend` is given (a profile from before the
    profiles named it was measured on `native`, the only float backend `auto` picked then)."""
    here = machine_key()
    # the instruction sets; a profile from before they were told apart per architecture compares the
    # older `isa` (which took x86's fpu and smep too), one from before `isa` every flag
    flags = "instruction_sets" if "instruction_sets" in machine else "isa" if "isa" in machine else "flags"
    units = ("capability",) if "capability" in machine else ()  # the oldest profiles lack it
    diffs = [
        f"{k} {machine.get(k)!r} here {here[k]!r}"
        for k in ("cpu", flags, *units, "threads", "torch")
        if machine.get(k) != here[k]
    ]
    if backend is not None and machine.get("backend", "native") != backend:
        diffs.append(f"backend {machine.get('backend', 'native')!r} here {backend!r}")
    return diffs


def shipped_profiles(fingerprint: str, dtype: str) -> list[Path]:
    """The profiles shipped for a model and dtype, one per machine they were measured on:
    `profiles/<fingerprint>-<dtype>-<machine>.json` (any name for the machine)."""
    return sorted(PROFILE_DIR.glob(f"{fingerprint}-{dtype}-*.json"))


def weight_format(weights: str) -> str:
    """A model's weight format as profiles name it: `float` (the dtype's own: float32, bfloat16) or a
    quantized one (int4, int8), whose steps, verification and drafts cost something else."""
    return weights if weights in ("int4", "int8") else "float"


def weights_of(machine: dict) -> str:
    """The weight format a profile was measured with (weight_format; profiles from before they named it
    were all of float weights)."""
    return machine.get("weights", "float")


def shipped_profile(
    fingerprint: str, dtype: str, backend: str | None = None, weights: str = "float"
) -> "Profile | None":
    """This machine's profile among the shipped ones, else the closest: one of the model's weight format
    (`weights`: float, int4, int8) first, then one timed on this machine's vector units (torch's
    capability: AVX2, AVX512, ...), then the one that differs in the fewest respects (the policy then
    says what differs, and trusts only its lookup buckets). By count alone, a Zen 3 VM with AVX2 took the
    profile of a Zen 4 with AVX-512, both "AMD EPYC" differing in flags."""

    units = machine_key()["capability"]

    def distance(p: Profile) -> tuple[bool, bool, int]:
        other_units = p.machine.get("capability", units) != units
        return weights_of(p.machine) != weights, other_units, len(machine_differences(p.machine, backend))

    found = [Profile.load(p) for p in shipped_profiles(fingerprint, dtype)]
    return min(found, key=distance, default=None)


def find_profile(model, profile: "Profile | str | bool | None") -> "Profile | None":
    """An explicit profile (object or path), none at all (False), else the shipped one for this model,
    dtype and machine (shipped_profile), if any. A profile of another model is refused."""
    if profile is False:
        return None
    if isinstance(profile, Profile):
        found = profile
    elif profile is not None:
        found = Profile.load(profile)
    else:
        dtype = str(model.dtype).replace("torch.", "")
        found = shipped_profile(model.fingerprint, dtype, model.kernels.backend, weight_format(model.kernels.weights))
    if found is not None and found.fingerprint != model.fingerprint:
        raise SelfspecError(
            f"profile for model {found.model!r} (fingerprint {found.fingerprint}) does not match this model "
            f"({model.fingerprint}): calibrate this model with selfspec calibrate"
        )
    return found
