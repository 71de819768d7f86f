"""Which backend runs the model's linears: the weight format the user asked for, on the fastest
backend that keeps the target exact, measured once per machine and cached.

`weights`: `auto` (the activation dtype's own float format), `float32`, `bfloat16`, `int8`, `int4`.
For float formats, backends that are row-exact (see base.Linear) come first: fp32 greedy speculative
output must equal plain greedy output bit for bit. Among several candidates the timing decides, and
that choice is cached under the model cache keyed by the CPU model, its ISA flags, the thread count
and the torch version, so another machine or torch build measures again.

On a GPU the CPU-only backends do not apply (oneDNN's prepacked weights and the int8 / int4 CPU kernels
are CPU formats): float weights run on `dense` (F.linear on cuBLAS, in the activations' dtype), int8 and
int4 as their notes say (kernels/int8.py, kernels/int4.py); nothing there is row-exact (`_cuda_plan`)."""

from __future__ import annotations

import hashlib
import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from . import native
from .base import Linear
from .cache import cpu as cache_cpu
from .cache import isa, legacy_isa
from .dense import Dense
from .int4 import Int4
from .int8 import CUDA_NOTE as INT8_CUDA_NOTE
from .int8 import Int8
from .native_codes import NativeCodes
from .native_dot import NativeInt4Dot, NativeInt8Dot
from .native_float import NativeFloat
from .native_int4 import NativeInt4
from .native_int8 import NativeInt8
from .native_tiles import NativeTiles
from .onednn import OneDNN

WEIGHTS = ("auto", "float32", "bfloat16", "int8", "int4")
FLOAT_FORMATS = {"float32": torch.float32, "bfloat16": torch.bfloat16}
FLOAT_BACKENDS = (OneDNN, NativeTiles, NativeCodes, NativeFloat, Dense)  # preference order when nothing was measured
QUANTIZED = {"int8": (NativeInt8Dot, NativeInt8, Int8), "int4": (NativeInt4Dot, NativeInt4, Int4)}
TIMED_ROWS = (1, 5)  # a plain step and a γ = 4 verification
REPEATS = 15  # timed passes per backend and row count
# Float32 bytes of the copies of the sample weight a timing cycles through: past the last-level cache, as a
# step's weights are. Timed alone, the default model's 3.5 MB gate_proj ran from the cache, where float32
# panels (0.042 ms) beat its 4-bit codes (0.044 ms); the model's 538 MB step streams them, and there the
# codes took 0.3x the panels' time (AMD EPYC Zen 4, 2 threads).
STREAMED = 256 << 20
# Only native.c's linears let a layer run as one native call (ops.Fused.layer), which a per-linear timing
# does not see. On a 2-core Xeon (AVX-512), torch's int4 won that timing at 0.94x native4i8's time in
# float32 and 0.73x in bfloat16, and then made the int4 draft cost 0.70 and 0.98 of a full step, against
# 0.38 with native4i8 in float32. So another backend must take under NATIVE_MARGIN of the fastest native
# one's time to be chosen.
NATIVE_MARGIN = 0.5


@dataclass
class KernelPlan:
    weights: str  # the weight format the linears hold: float32, bfloat16, int8, int4
    backend: str  # the backend's name (kernels.BACKENDS)
    row_exact: bool
    reasons: list[str] = field(default_factory=list)  # fallbacks and measurements behind the choice

    def to_dict(self) -> dict:
        return asdict(self)


def plan(
    dtype: torch.dtype,
    weights: str = "auto",
    *,
    sample: torch.Tensor | None = None,
    cache: Path | None = None,
    backend: str | None = None,
    device: torch.device | str = "cpu",
) -> KernelPlan:
    """The weight format and backend for activations of `dtype` on `device`. `sample`: a weight
    [out, in] of the model to time candidates on; `cache`: where measured choices are kept; `backend`:
    a backend forced by name (benchmarks compare `dense`, the reference, with the chosen one, and the
    quantized backends with each other)."""
    if weights not in WEIGHTS:
        raise ValueError(f"weights={weights!r} is invalid: use one of {', '.join(WEIGHTS)}")
    name = str(dtype).replace("torch.", "")
    if weights in FLOAT_FORMATS and FLOAT_FORMATS[weights] != dtype:
        raise ValueError(
            f"weights={weights} with dtype {name}: float weights run in their own dtype (use --dtype {weights})"
        )
    if torch.device(device).type != "cpu":
        return _cuda_plan(dtype, weights, backend, torch.device(device))
    if weights in QUANTIZED and backend is not None:
        return _forced(backend, QUANTIZED[weights], dtype, weights)
    if weights in QUANTIZED:
        reasons = [f"{b.name}: {why}" for b in QUANTIZED[weights] if (why := b.unavailable(dtype))]
        usable = [b for b in QUANTIZED[weights] if not b.unavailable(dtype)]
        if usable:
            return _fastest(weights, usable, dtype, sample, cache, reasons)
        fallback = _float_plan(dtype, sample, cache)
        fallback.reasons.insert(0, f"{weights} weights unavailable ({'; '.join(reasons)}): running {name} weights")
        return fallback
    if backend is not None:
        return _forced(backend, FLOAT_BACKENDS, dtype, name)
    return _float_plan(dtype, sample, cache)


def _forced(backend: str, candidates: tuple[type[Linear], ...], dtype: torch.dtype, weights: str) -> KernelPlan:
    """The backend the caller named, if it runs `weights` with `dtype` activations here."""
    forced = {b.name: b for b in candidates}.get(backend)
    if forced is None:
        raise ValueError(
            f"backend={backend!r} is invalid for {weights} weights: use one of {[b.name for b in candidates]}"
        )
    why = forced.unavailable(dtype)
    if why:
        raise ValueError(f"backend {backend} cannot run {weights} weights with {dtype} activations here: {why}")
    return KernelPlan(weights, forced.name, forced.row_exact, ["forced by the caller"])


def _cuda_plan(dtype: torch.dtype, weights: str, backend: str | None, device: torch.device) -> KernelPlan:
    """On a GPU: float weights on dense, int8 / int4 on their CUDA paths; none of them row-exact."""
    name = str(dtype).replace("torch.", "")
    if backend not in (None, Dense.name):
        raise ValueError(f"backend {backend} cannot run on {device.type}: {OneDNN.unavailable(dtype, device)}")
    not_exact = (
        f"not row-exact on {device.type}: a k-row verification may take another cuBLAS / SDPA kernel than a "
        "1-row step, so fp32 speculative output may differ from plain output at near-ties"
    )
    if weights == "int8":
        return KernelPlan("int8", Int8.name, False, [INT8_CUDA_NOTE, not_exact])
    if weights == "int4":
        return KernelPlan("int4", Int4.name, False, [Int4.cuda_note(dtype, device), not_exact])
    why = f"{device.type}: dense (F.linear on cuBLAS) in {name}; {OneDNN.name}: {OneDNN.unavailable(dtype, device)}"
    return KernelPlan(name, Dense.name, False, [why, not_exact])


def _float_plan(dtype: torch.dtype, sample: torch.Tensor | None, cache: Path | None) -> KernelPlan:
    name = str(dtype).replace("torch.", "")
    reasons, usable = [], []
    for backend in FLOAT_BACKENDS:
        why = backend.unavailable(dtype)
        if why:
            reasons.append(f"{backend.name}: {why}")
        else:
            usable.append(backend)
    exact = [b for b in usable if b.row_exact] or usable
    if not any(b.row_exact for b in usable):
        reasons.append(
            f"no row-exact {name} backend here: speculative output may differ from plain output at near-ties"
        )
    return _fastest(name, exact, dtype, sample, cache, reasons)


def _fastest(
    weights: str,
    candidates: list[type[Linear]],
    dtype: torch.dtype,
    sample: torch.Tensor | None,
    cache: Path | None,
    reasons: list[str],
) -> KernelPlan:
    """The fastest of `candidates` on `sample` (measured, cached; a backend outside native.c counted at
    its time / NATIVE_MARGIN), or the first when nothing is timed."""
    if len(candidates) > 1 and sample is not None:
        timings = _timings(candidates, sample, dtype, cache)
        candidates = sorted(candidates, key=lambda b: timings[b.name] / (1.0 if _native(b) else NATIVE_MARGIN))
        reasons.append("measured ms at 1/5 rows: " + ", ".join(f"{k} {v:.3f}" for k, v in timings.items()))
        if any(map(_native, candidates)) and not all(map(_native, candidates)):
            reasons.append(f"a backend outside native.c must take under {NATIVE_MARGIN}x a native one's time")
    chosen = candidates[0]
    return KernelPlan(weights, chosen.name, chosen.row_exact, reasons)


def machine_key() -> dict:
    """What a cached measurement is valid for."""
    cpu, flags = cache_cpu()

    def digest(text: str) -> str:
        return hashlib.sha256(text.encode()).hexdigest()[:12]

    return {
        "cpu": cpu,
        "flags": digest(flags),
        "isa": digest(legacy_isa(flags)),  # what older profiles compare
        "instruction_sets": digest(isa(flags)),  # the instruction sets alone
        "capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }


def _native(backend: type[Linear]) -> bool:
    """Whether the backend is one of native.c's (they alone let a layer run as one call)."""
    return issubclass(backend, native.NativeLinear)


def _timings(
    backends: list[type[Linear]], sample: torch.Tensor, dtype: torch.dtype, cache: Path | None
) -> dict[str, float]:
    """Mean of the 1-row and 5-row medians (ms) per backend on `sample`, cached per machine."""
    key = {**machine_key(), "dtype": str(dtype), "shape": list(sample.shape), "backends": [b.name for b in backends]}
    key["streamed"] = STREAMED  # timings from before the copies were in-cache ones: measured again
    if any(issubclass(b, native.NativeLinear) for b in backends):
        key["native"] = native.source_key()  # another version of native.c is measured again
    key = json.dumps(key, sort_keys=True)
    stored = _read(cache)
    if key in stored:
        return stored[key]
    copies = min(-(-STREAMED // (sample.numel() * 4)), 128)
    linears = {b.name: [b(sample.clone(), None, dtype) for _ in range(copies)] for b in backends}
    # The backends' passes interleaved, round after round: timed one after another, a drift of this VM's
    # speed (10-30 % within minutes) once made amx, codes and native measure alike (0.105-0.108 ms, where
    # amx took 0.05-0.08 against codes' 0.08-0.12 at other times) and bfloat16 ran on codes, whose
    # verification of 8 tokens cost 3.1 steps against amx's 1.4.
    samples: dict[str, list[list[float]]] = {name: [[] for _ in TIMED_ROWS] for name in linears}
    for _ in range(REPEATS):
        for name, copies_of in linears.items():
            for i, rows in enumerate(TIMED_ROWS):
                samples[name][i].append(_pass_ms(copies_of, rows, dtype))
    result = {name: statistics.fmean(map(statistics.median, per_rows)) for name, per_rows in samples.items()}
    del linears
    if cache is not None:
        stored[key] = result
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps(stored, indent=1))
    return result


def _pass_ms(linears: list[Linear], rows: int, dtype: torch.dtype) -> float:
    """ms of one call, averaged over a pass calling every linear of `linears` (copies of one weight) once,
    so the weights come from memory as a model's do (the first two called before, untimed, to warm up)."""
    x = torch.randn(rows, linears[0].in_features, device=linears[0].device).to(dtype)
    for linear in linears[:2]:
        linear(x)  # warm-up
    start = time.perf_counter()
    for linear in linears:
        linear(x)
    return (time.perf_counter() - start) / len(linears) * 1e3


def _read(cache: Path | None) -> dict:
    if cache is None or not cache.is_file():
        return {}
    try:
        return json.loads(cache.read_text())
    except (OSError, ValueError):
        return {}  # a damaged cache is measured again
