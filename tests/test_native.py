"""The fused glue ops (kernels/native.c through model/ops.Fused) against the eager torch reference:
each op alone, whole forwards on tiny models (float32 and bfloat16, sliding windows, GQA, padded
batches), row-exactness (a k-row pass gives each row the bits of a 1-row step), and the fallback to
eager with its reason when the library cannot be built."""

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from selfspec.kernels import native
from selfspec.kernels.choice import plan
from selfspec.kernels.native_dot import NativeInt4Dot, NativeInt8Dot
from selfspec.kernels.native_int2 import NativeInt2Dot
from selfspec.kernels.native_shared import SharedCodes
from selfspec.model.config import ModelConfig
from selfspec.model.decoder import build_model
from selfspec.model.ops import Eager, Fused

from .conftest import tiny_hf_model

pytestmark = pytest.mark.skipif(native.library() is None, reason=f"native ops unavailable: {native.unavailable()}")

# max |fused - eager| / max |eager|: float32 rounding (reduction order, exp polynomial), bfloat16 steps
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> bool:
    a, b = a.float(), b.float()
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-12)) <= TOLERANCE[dtype]


def tiny(family="llama", dtype=torch.float32, **overrides):
    hf = tiny_hf_model(family, num_attention_heads=4, num_key_value_heads=2, hidden_size=128, **overrides)
    # native.c's linears whatever a timing would pick: at these shapes oneDNN can win it (seen on an AVX2
    # EPYC), and `layers` runs native linears only
    kernels = plan(dtype, backend="native") if native.library() is not None else None
    return build_model(ModelConfig.from_hf(hf.config.to_dict()), hf.state_dict().get, dtype, kernels)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_norm_and_silu_mul_match_torch(dtype):
    g = torch.Generator().manual_seed(0)
    h, y, w = (torch.randn(5, 200, generator=g).to(dtype) for _ in range(3))
    s, x = native.library().add_norm(h, y, w[0], 1e-6)
    assert torch.equal(s, h + y)
    assert close(x, F.rms_norm(h + y, (200,), w[0], 1e-6), dtype)
    _, x = native.library().add_norm(h, None, w[0], 1e-6)
    assert close(x, F.rms_norm(h, (200,), w[0], 1e-6), dtype)
    gate_up = torch.randn(5, 2 * 203, generator=g).to(dtype) * 30  # exp's range ends and an odd tail
    gate, up = gate_up.float().chunk(2, dim=-1)
    assert close(native.library().silu_mul(gate_up), F.silu(gate) * up, dtype)


def decode(
    model, ops, prompt: list[int], steps: int, verify: int, follow: list[int] | None = None
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Greedy steps after `prompt` (or steps fed `follow`'s tokens, so that two paths are compared at
    the same positions even where a bfloat16 near-tie makes their argmaxes differ), then one pass over
    the last `verify` step inputs: (step logits [steps, vocab], pass logits [verify, vocab], the
    greedy tokens)."""
    model.ops = ops
    cache = model.new_cache(512, block_size=4)
    other = cache.allocate()
    cache.reserve(other, 0, 9)  # another sequence's blocks first: this one's are not consecutive
    seq = cache.allocate()
    tokens, logits, greedy = list(prompt), [], list(prompt)
    model.prefill(cache, seq, prompt[:-1])
    for _ in range(steps):
        row = model.logits(model.forward(torch.tensor([tokens[-1:]]), cache, [seq]))[0, -1]
        logits.append(row)
        greedy.append(int(row.argmax()))
        tokens.append(follow[len(tokens)] if follow else greedy[-1])
    cache.truncate(seq, len(tokens) - 1 - verify)
    again = model.logits(model.forward(torch.tensor([tokens[-1 - verify : -1]]), cache, [seq]))[0]
    return torch.stack(logits), again, greedy


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family,overrides", [("llama", {}), ("mistral", {"sliding_window": 7}), ("qwen2", {})])
@torch.inference_mode()
def test_forward_matches_eager_and_rows_are_exact(dtype, family, overrides):
    model = tiny(family, dtype, **overrides)
    assert isinstance(model.ops, Fused)
    prompt = torch.randint(0, 256, (30,), generator=torch.Generator().manual_seed(1)).tolist()
    fused_steps, fused_pass, tokens = decode(model, model.ops, prompt, 12, 5)
    eager_steps, _, eager_tokens = decode(model, Eager(model.config, model.rope), prompt, 12, 5, follow=tokens)
    assert close(fused_steps, eager_steps, dtype)
    if dtype == torch.float32:  # and eager's own argmax is the fused one at every step
        assert tokens == eager_tokens
    # a 5-row pass reproduces the 1-row steps of the same positions bit for bit
    assert torch.equal(fused_pass, fused_steps[-5:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.inference_mode()
def test_long_contexts_keep_rows_exact_on_any_thread_count(dtype):
    """Keys over several of attention's value chunks and two of its spans (the 5-row pass straddles the
    span boundary at key 256), and a kv head's query heads split between threads (3 threads, 4 query
    heads in 2 groups): the steps match eager, a 5-row pass still gives each row its 1-row bits, and the
    thread count changes no bit."""
    model = tiny(dtype=dtype)
    prompt = torch.randint(0, 256, (250,), generator=torch.Generator().manual_seed(3)).tolist()
    threads, runs = torch.get_num_threads(), []
    try:
        for n in (1, 3):
            torch.set_num_threads(n)
            runs.append(decode(model, model.ops, prompt, 8, 5))
    finally:
        torch.set_num_threads(threads)
    (steps, verified, tokens), (steps_3, verified_3, tokens_3) = runs
    assert close(steps, decode(model, Eager(model.config, model.rope), prompt, 8, 5, follow=tokens)[0], dtype)
    assert torch.equal(verified, steps[-5:])
    assert torch.equal(steps, steps_3) and torch.equal(verified, verified_3) and tokens == tokens_3


LAYER_BACKENDS = [
    ("float32", "native", torch.float32),
    ("bfloat16", "native", torch.bfloat16),
    ("int8", "native8", torch.float32),
    ("int8", "native8i8", torch.float32),
    ("int4", "native4", torch.float32),
    ("int4", "native4i8", torch.float32),
    ("int4", "native4i8", torch.bfloat16),
]


@pytest.mark.parametrize(
    "weights,backend,dtype", LAYER_BACKENDS, ids=[f"{b}-{str(d)[6:]}" for _, b, d in LAYER_BACKENDS]
)
@torch.inference_mode()
def test_a_whole_layer_call_gives_the_bits_of_the_separate_calls(weights, backend, dtype, monkeypatch):
    """native.c's `layers` (one call per pass) against the same kernels called op by op from Python:
    decoding steps and a 4-row verification pass, bit for bit."""
    from selfspec.kernels import BACKENDS
    from selfspec.kernels.choice import KernelPlan

    if BACKENDS[backend].unavailable(dtype):
        pytest.skip(BACKENDS[backend].unavailable(dtype))
    hf = tiny_hf_model("llama", num_attention_heads=4, num_key_value_heads=2, hidden_size=128)
    kernels = KernelPlan(weights, backend, True)
    model = build_model(ModelConfig.from_hf(hf.config.to_dict()), hf.state_dict().get, dtype, kernels)
    assert all(lin.spec is not None for layer in model.layers for lin in layer.linears())
    ran = []  # per pass: whether `layers` ran it (the prompt's pass is SDPA's: None)
    whole = model.ops.layers

    def counted(*args):
        out = whole(*args)
        ran.append(out is not None)
        return out

    monkeypatch.setattr(model.ops, "layers", counted)
    prompt = torch.randint(0, 256, (20,), generator=torch.Generator().manual_seed(2)).tolist()
    steps, verified, tokens = decode(model, model.ops, prompt, 6, 4)
    assert sum(ran) == 7  # the steps and the pass: one `layers` call each
    monkeypatch.setattr(model.ops, "layers", lambda *a: None)  # op by op
    separate = decode(model, model.ops, prompt, 6, 4)
    assert torch.equal(steps, separate[0]) and torch.equal(verified, separate[1]) and tokens == separate[2]


@torch.inference_mode()
def test_the_layer_table_follows_a_swapped_linear():
    """`layers` reads weights through a table built once per model: reassigning a layer's linear (as
    tests and benchmarks do) must reach it, or the pass would run the old weights."""
    model = tiny()
    assert all(lin.spec is not None for layer in model.layers for lin in layer.linears())  # `layers` runs
    cache = model.new_cache(64)
    seq = cache.allocate()
    model.prefill(cache, seq, list(range(10, 20)))

    def step() -> torch.Tensor:
        out = model.logits(model.forward(torch.tensor([[7]]), cache, [seq]))
        cache.truncate(seq, 10)
        return out

    before = step()
    layer = model.layers[0]
    layer.o = model.make_linear(torch.zeros(layer.o.out_features, layer.o.in_features))
    after = step()
    assert not torch.equal(before, after)
    model.ops.layers = lambda *a: None  # the same pass op by op: no table involved
    assert torch.equal(after, step())


@torch.inference_mode()
def test_a_padded_batch_gives_each_row_its_single_sequence_bits():
    model = tiny()
    cache = model.new_cache(512, block_size=4)
    seqs = [cache.allocate() for _ in range(3)]
    prompts = [list(range(10, 10 + n)) for n in (9, 14, 5)]
    for seq, p in zip(seqs, prompts):
        model.prefill(cache, seq, p)
    counts = [3, 1, 0]  # sequence 2 sits this pass out: all its rows are padding
    x = torch.tensor([[7, 8, 9], [7, 0, 0], [0, 0, 0]])
    batched = model.logits(model.forward(x, cache, seqs, counts=counts))
    for b, (seq, n) in enumerate(zip(seqs, counts)):
        if n == 0:
            continue
        cache.truncate(seq, len(prompts[b]))
        alone = model.logits(model.forward(x[b : b + 1, :n], cache, [seq]))
        assert torch.equal(batched[b, :n], alone[0])
    assert torch.isfinite(batched).all()


def run_python(code: str, **env: str) -> str:
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, **env}, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


PROBE = "from selfspec.kernels import native; print(native.unavailable())"


def test_without_a_compiler_the_model_runs_eager_and_says_why(tmp_path):
    assert run_python(PROBE, SELFSPEC_NATIVE="0") == "SELFSPEC_NATIVE=0"
    why = run_python(PROBE, CC=str(tmp_path / "no-such-cc"), SELFSPEC_CACHE=str(tmp_path))
    assert why.startswith("building native.c failed") and "no-such-cc" in why


@torch.inference_mode()
def test_the_eager_fallback_is_named_in_the_kernel_plan(monkeypatch):
    monkeypatch.setattr(native, "library", lambda: None)
    monkeypatch.setattr(native, "unavailable", lambda: "no C compiler (cc, gcc or clang) on PATH")
    model = tiny()
    assert isinstance(model.ops, Eager) and not isinstance(model.ops, Fused)
    assert "glue ops: eager (no C compiler (cc, gcc or clang) on PATH)" in model.kernels.reasons


def int8_blocks(x: torch.Tensor) -> torch.Tensor:
    """x [rows, in] as the int8-activation kernels see it: per block of 32, q = round(x * 127 / max|x|)
    (half to even, in float32) times max|x| / 127."""
    b = x.view(x.shape[0], -1, 32)
    amax = b.abs().amax(-1, keepdim=True)
    q = torch.round(b * torch.where(amax > 0, 127 / amax, 0))
    return (q.double() * (amax / 127).double()).view_as(x)


@pytest.mark.skipif(native.library() is None or not native.library().dot_i8, reason="no AVX2 int8 dot products")
@pytest.mark.parametrize("name", ["native4i8", "native8i8"])
@pytest.mark.parametrize("out", [80, 37])  # whole panels of 16 columns, and a last one padded
def test_int8_activation_kernels_compute_the_quantized_product(name, out):
    """The kernel's output is the product of the block-quantized activations with the weights it
    stores, up to float32 rounding: a wrong rounding, block order, panel layout, scale or offset term
    is far off."""
    from selfspec.kernels import BACKENDS

    g = torch.Generator().manual_seed(0)
    w = torch.randn(out, 576, generator=g) * 0.05
    x = torch.randn(6, 576, generator=g)
    x[:, 7] *= 40  # an outlier channel, as LLM activations have: its block's scale is its own
    x[2, 64:96] = 0  # an all-zero block
    lin = BACKENDS[name](w, None, torch.float32)
    assert float((lin.dequantized() - w).abs().max()) < 0.02  # the weights themselves: within a 4-bit step
    expected = int8_blocks(x) @ lin.dequantized().double().t()
    y = lin(x)
    assert float((y.double() - expected).abs().max() / expected.abs().max()) < 1e-5
    assert float((y.double() - x.double() @ lin.dequantized().double().t()).abs().max()) > 1e-4  # it did quantize


def test_argmax_is_torchs_with_ties_infinities_and_nan():
    g = torch.Generator().manual_seed(3)
    for n in (3, 8, 17, 40, 1000, 49151):
        x = torch.randn(6, n, generator=g)
        x[1] = x[1].round()  # ties: the first of equal maxima
        x[2] = float("-inf")
        x[3, n // 2] = float("inf")
        x[4, n - 1] = float("nan")  # NaN wins, as in torch
        x[5, [0, n // 3]] = float("nan")
        assert torch.equal(native.library().argmax(x), x.argmax(-1)), n


def test_the_shortlist_rescores_exactly_the_k_highest():
    """Each row's k highest scores (ties: the lower index) are replaced by x @ weight[i] at their indices
    i, and every other score is left as it was; float32 and bfloat16 weights."""
    g = torch.Generator().manual_seed(4)
    for n, k, dtype in (
        (49152, 32, torch.float32),
        (1000, 8, torch.bfloat16),
        (33, 33, torch.float32),
        (70, 5, torch.float32),
    ):
        coarse = torch.randn(3, n, generator=g)
        coarse[1] = coarse[1].round()  # ties
        coarse[2, 7] = float("nan")  # never shortlisted
        weight, x = torch.randn(n, 40, generator=g).to(dtype), torch.randn(3, 40, generator=g)
        scores = coarse.clone()
        native.library().shortlist(scores, k, x, weight)
        exact = (x @ weight.float().t()).to(dtype).float()  # [3, n], rounded as a bfloat16 target's logits
        for r in range(3):
            c = coarse[r].nan_to_num(nan=-float("inf"))
            order = sorted(range(n), key=lambda i: (-float(c[i]), i))[:k]  # the k highest, lower index first
            rest = torch.ones(n, dtype=torch.bool)
            rest[order] = False
            assert torch.allclose(scores[r, order], exact[r, order], rtol=TOLERANCE[dtype], atol=1e-5), (n, r)
            assert torch.equal(scores[r, order].to(dtype).float(), scores[r, order])  # bfloat16 values there
            assert torch.equal(scores[r, rest].nan_to_num(), coarse[r, rest].nan_to_num()), (n, r)


def test_a_build_without_a_backends_kernel_names_what_it_lacks(monkeypatch):
    lib = native.library()
    for backend, flag, said in (
        (NativeInt4Dot, "dot_i8", "need AVX2"),
        (NativeInt8Dot, "dot_i8", "need AVX2"),
        (NativeInt2Dot, "q2", "AVX-512 BW"),
        (SharedCodes, "shared_codes", "AVX512-VBMI"),
    ):
        monkeypatch.setattr(lib, flag, False)
        assert said in backend.unavailable(torch.float32), backend.name
        monkeypatch.setattr(lib, flag, True)
        assert backend.unavailable(torch.float32) is None, backend.name
        assert "CPU code" in backend.unavailable(torch.float32, "cuda")  # the device is checked first
