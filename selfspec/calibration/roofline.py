"""Is decoding memory-bound here? Measures read bandwidth, the bytes a decode step must read, the
measured step, and the cost of a forward over k tokens relative to one (brief §1).

Also where the last-level cache ends: reads run at about twice memory's bandwidth while what they
read fits in it, and a step's weights, a draft's weights and heads and the KV cache together are near
that size on the default model (on a 2-core Xeon VM with AMX: ~100 MB read at 43-54 GB/s, more at
20-24 GB/s, though lscpu said 300 MB; see benchmarks/bandwidth.c), so whether they fit sets their cost."""

from __future__ import annotations

import statistics
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import torch

from ..kernels import native
from ..model.decoder import DecoderModel, LayerWeights

BANDWIDTH_BYTES = 1 << 30  # 1 GiB: far larger than any cache level
CACHE_SIZES_MB = (8, 16, 32, 48, 64, 96, 128, 192, 256)  # reads timed to find the last-level cache's end
CACHE_SPEEDUP = 1.4  # a size read at least this much faster than memory is held in the cache


@dataclass
class Roofline:
    bandwidth_gb_s: float  # read bandwidth (a large tensor sum)
    weight_bytes: int  # bytes of weights one decode step reads
    bound_ms: float  # weight_bytes / bandwidth: the fastest a step can be
    step_ms: float  # a measured one-token decode step
    step_over_bound: float
    k_costs: dict[int, float]  # k -> forward over k tokens / forward over 1 token
    linear_ms: float = 0.0  # the step minus other_ms
    other_ms: float = 0.0  # the step with every linear writing zeros: norms, RoPE, cache writes, attention, Python
    weights: str = ""  # the linears' weight format
    backends: dict[str, int] | None = None  # kernel backend -> how many linears it runs
    row_exact: bool = False  # every linear gives a row the same bits whatever the row count
    memory_bytes: int = 0  # the model's weights in memory: linears, norms and the embedding
    kernel_notes: list[str] | None = None  # fallbacks and measurements behind the backend choice
    cache_curve: dict[int, float] | None = None  # MB read -> GB/s
    cache_mb: int = 0  # the largest size read from the last-level cache (cache_edge; 0: none measured)
    cache_bandwidth_gb_s: float = 0.0  # the median GB/s of the sizes up to cache_mb

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def in_cache(self) -> bool | None:
        """Whether a step's weights fit in the last-level cache (None: no cache found)."""
        return self.weight_bytes <= self.cache_mb * 2**20 if self.cache_mb else None


def _samples(fn, repeats: int) -> list[float]:
    """Seconds of `repeats` calls of fn, after one untimed call."""
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return samples


def _median_time(fn, repeats: int) -> float:
    return statistics.median(_samples(fn, repeats))


def read_bandwidth(repeats: int = 5) -> float:
    big = torch.ones(BANDWIDTH_BYTES // 4)
    seconds = _median_time(lambda: big.sum(), repeats)
    return BANDWIDTH_BYTES / seconds / 1e9


def cache_curve(repeats: int = 7) -> dict[int, float]:
    """MB -> GB/s reading a tensor of that size again and again (the fastest read: the cache's speed is
    what is asked, and this VM's neighbours only ever slow it)."""
    curve = {}
    for mb in CACHE_SIZES_MB:
        t = torch.ones(mb * 2**20 // 4)
        curve[mb] = mb * 2**20 / min(_samples(t.sum, repeats)) / 1e9  # the untimed first read brings it in
    return curve


def cache_edge(curve: dict[int, float], memory_gb_s: float) -> tuple[int, float]:
    """(the largest size read at least CACHE_SPEEDUP x memory's bandwidth, counting up from the smallest
    until one is not, and the median GB/s up to it); (0, 0.0) where even the smallest is not."""
    held = []
    for mb in sorted(curve):
        if curve[mb] < CACHE_SPEEDUP * memory_gb_s:
            break
        held.append(mb)
    return (held[-1], statistics.median(curve[mb] for mb in held)) if held else (0, 0.0)


def weight_bytes(model: DecoderModel) -> int:
    """Bytes one decoding step reads: every linear in its stored form, and the norms."""
    norms = [layer.attn_norm for layer in model.layers] + [layer.mlp_norm for layer in model.layers]
    norms.append(model.norm_weight)
    return sum(lin.nbytes for lin in model.linears()) + sum(t.numel() * t.element_size() for t in norms)


class ZeroLinear:
    """Stands in for a linear when timing the rest of a step: a zero tensor of its output shape (in
    native.c's whole-layer call, a linear that writes zeros), allocated once per input shape."""

    spec = None

    def __init__(self, lin) -> None:
        self.lin, self.zeros, self.out_features = lin, {}, lin.out_features
        if lin.spec is not None:
            self.spec = native.LinearSpec(native.KINDS["zero"], lin.in_features, lin.out_features)

    def argmax(self, x: torch.Tensor) -> None:
        return None  # a greedy step's head: its zero logits, through __call__

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if x.shape not in self.zeros:
            self.zeros[x.shape] = torch.zeros(*x.shape[:-1], self.out_features, dtype=self.lin.dtype)
        return self.zeros[x.shape] if residual is None else residual + self.zeros[x.shape]


@contextmanager
def zero_linears(model: DecoderModel):
    """Every linear of `model` writes zeros inside the block (the model itself is restored after)."""
    for layer in model.layers:
        for name in LayerWeights.LINEARS:
            setattr(layer, name, ZeroLinear(getattr(layer, name)))
    model.head = ZeroLinear(model.head)
    try:
        yield
    finally:
        for layer in model.layers:
            for name in LayerWeights.LINEARS:
                setattr(layer, name, getattr(layer, name).lin)
        model.head = model.head.lin


@torch.inference_mode()
def measure(model: DecoderModel, context: int = 128, max_k: int = 16, repeats: int = 9) -> Roofline:
    cache = model.new_cache(context + max_k + 16)
    seq = cache.allocate()
    model.forward(torch.arange(context)[None] % model.config.vocab_size, cache, [seq])

    def forward(k: int) -> None:
        h = model.forward(torch.full((1, k), 7), cache, [seq])
        model.greedy(h)  # a greedy step: the head gives its argmax (DecoderModel.greedy)
        cache.truncate(seq, context)

    times = {k: _median_time(lambda: forward(k), repeats) for k in range(1, max_k + 1)}
    with zero_linears(model):
        forward(1)  # each stand-in's zeros, allocated outside the timing
        other_s = _median_time(lambda: forward(1), repeats)
    bandwidth = read_bandwidth()
    curve = cache_curve()
    cache_mb, cache_gb_s = cache_edge(curve, bandwidth)
    nbytes = weight_bytes(model)
    bound = nbytes / (bandwidth * 1e9)
    backends: dict[str, int] = {}
    for lin in model.linears():
        backends[type(lin).name] = backends.get(type(lin).name, 0) + 1
    floats = [model.embed_weight] + ([] if model.head_weight is model.embed_weight else [model.head_weight])
    memory = nbytes + sum(t.numel() * t.element_size() for t in floats)  # + the float tables kept beside
    return Roofline(
        bandwidth_gb_s=bandwidth,
        weight_bytes=nbytes,
        bound_ms=bound * 1e3,
        step_ms=times[1] * 1e3,
        step_over_bound=times[1] / bound,
        k_costs={k: t / times[1] for k, t in times.items()},
        linear_ms=(times[1] - other_s) * 1e3,
        other_ms=other_s * 1e3,
        weights=model.kernels.weights,
        backends=backends,
        row_exact=all(type(lin).row_exact for lin in model.linears()),
        memory_bytes=memory,
        kernel_notes=list(model.kernels.reasons),
        cache_curve={mb: round(v, 1) for mb, v in curve.items()},
        cache_mb=cache_mb,
        cache_bandwidth_gb_s=cache_gb_s,
    )
