"""Kernel backends: each against the dense float reference (tolerances per format), row-exactness
where a backend claims it, fallback with a reason when one is missing, the backend choice cache
keyed by machine, and 4-bit GGUF codes against the GGUF's own dequantized weights."""

import json

import pytest
import torch

from selfspec.kernels import (
    BACKENDS,
    Int4,
    NativeCodes,
    NativeFloat,
    NativeInt4,
    NativeInt4Dot,
    OneDNN,
    native,
    native_float,
)
from selfspec.kernels import choice as kernel_choice
from selfspec.kernels.base import EXACT_ROWS
from selfspec.kernels.choice import plan
from selfspec.kernels.int4 import quantize
from selfspec.model.gguf import decode, unpermute_rows

# max |y - y_ref| / max |y_ref| per (backend, activation dtype): float32 rounding, bf16 activations,
# int8 per-channel codes, int4 group-32 codes (against the float weight, not its own dequantized form)
TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2, "int8": 3e-2, "int4": 0.25}
FORMAT = {
    "int8": "int8",
    "native8": "int8",
    "native8i8": "int8",
    "int4": "int4",
    "native4": "int4",
    "native4i8": "int4",
}


def weight(out=96, inn=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(out, inn, generator=g) * 0.05, torch.randn(out, generator=g)


def cases():
    for name, backend in BACKENDS.items():
        for dtype in (torch.float32, torch.bfloat16):
            why = backend.unavailable(dtype)
            marks = [pytest.mark.skip(reason=why)] if why else []
            yield pytest.param(name, dtype, marks=marks, id=f"{name}-{str(dtype)[6:]}")


@pytest.mark.parametrize("rows", [7, EXACT_ROWS + 9])  # a step's few rows; a prompt's many (a GEMM path)
@pytest.mark.parametrize("name,dtype", list(cases()))
def test_backend_matches_the_dense_reference(name, dtype, rows):
    w, b = weight()
    lin = BACKENDS[name](w, b, dtype)
    x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(1)).to(dtype)
    r = torch.randn(rows, 96, generator=torch.Generator().manual_seed(2)).to(dtype)
    y = lin(x, residual=r)
    ref = x.float() @ w.t() + b + r.float()
    key = FORMAT.get(name, str(dtype)[6:])
    assert y.dtype == dtype and y.shape == (rows, 96)
    assert (y.float() - ref).abs().max() / ref.abs().max() < TOLERANCE[key]
    # The weight it really multiplies by, whatever its stored form.
    deq = lin.dequantized()
    assert deq.shape == (96, 128)
    assert (deq - w).abs().max() / w.abs().max() < TOLERANCE[key]


@pytest.mark.parametrize("name,dtype", list(cases()))
def test_row_exact_backends_give_a_row_the_same_bits_for_any_row_count(name, dtype):
    backend = BACKENDS[name]
    w, b = weight(out=960, inn=576)
    lin = backend(w, b, dtype)
    x = torch.randn(EXACT_ROWS, 576, generator=torch.Generator().manual_seed(3)).to(dtype)
    ks = (2, 5, 9, 16, EXACT_ROWS)  # up to the longest pass that must be exact
    same = all(torch.equal(lin(x[:k])[i], lin(x[i : i + 1])[0]) for k in ks for i in range(k))
    if backend.row_exact:
        assert same, f"{name} claims row-exactness but a row's bits depend on the row count"


def test_int4_packs_its_codes_exactly():
    """Codes, scales and zeros go in; the kernel multiplies by (q - 8) * scale + zero (in bfloat16)."""
    w, _ = weight(out=64, inn=128)
    codes, scale, zero = quantize(w, 32)
    lin = Int4.from_codes(codes, scale, zero, None, torch.float32)
    s, z = (t.bfloat16().float().repeat_interleave(32, 1) for t in (scale, zero))  # the kernel's scales: bf16
    expected = (codes.float() - 8) * s + z  # the kernel also rounds its output to bf16: within 2^-8 of it
    torch.testing.assert_close(lin.dequantized(), expected, rtol=2**-8, atol=1e-5)
    with pytest.raises(ValueError, match="group=48"):
        Int4(w, None, torch.float32, group=48)


def q4_blocks(kind: str, d: torch.Tensor, m: torch.Tensor, q: torch.Tensor):
    """GGUF Q4_0 / Q4_1 raw rows from per-block d, m [out, blocks] and codes [out, blocks * 32]."""
    out, blocks = d.shape
    qs = q.view(out, blocks, 32).to(torch.uint8)
    packed = qs[..., :16] | (qs[..., 16:] << 4)  # element j low nibble, j + 16 high nibble
    parts = [d.half().view(torch.uint8).view(out, blocks, 2)]
    if kind == "Q4_1":
        parts.append(m.half().view(torch.uint8).view(out, blocks, 2))
    return torch.cat(parts + [packed], -1).reshape(out, -1).numpy()


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_gguf_q4_blocks_decode_to_the_same_values(kind):
    g = torch.Generator().manual_seed(5)
    out, blocks = 32, 4
    d = (torch.rand(out, blocks, generator=g) * 0.1).half().float()
    m = (torch.randn(out, blocks, generator=g) * 0.1).half().float()
    q = torch.randint(0, 16, (out, blocks * 32), generator=g)
    codes, scale, zero = decode(q4_blocks(kind, d, m, q), kind)
    assert torch.equal(codes.long(), q)  # the same 4-bit codes
    expected = d.repeat_interleave(32, 1) * (q.float() - (8 if kind == "Q4_0" else 0))
    if kind == "Q4_1":
        expected += m.repeat_interleave(32, 1)
    assert torch.equal(scale, d) and torch.allclose(zero, m + 8 * d if kind == "Q4_1" else torch.zeros_like(d))
    lin = Int4.from_codes(codes, scale, zero, None, torch.float32)
    assert (lin.dequantized() - expected).abs().max() <= 2**-7 * expected.abs().max()  # bf16 scales


def test_unpermute_rows_undoes_llama_cpp_order():
    heads, dim = 3, 4
    hf = torch.arange(heads * 2 * dim)
    llama_cpp = hf.view(heads, 2, dim).transpose(1, 2).reshape(-1)  # what convert_hf_to_gguf writes
    assert torch.equal(llama_cpp[unpermute_rows(len(hf), heads)], hf)


def test_missing_backend_falls_back_with_a_reason(monkeypatch):
    monkeypatch.setattr(OneDNN, "unavailable", classmethod(lambda cls, dtype: "no oneDNN in this build"))
    for float_native in (NativeFloat, NativeCodes):
        monkeypatch.setattr(float_native, "unavailable", classmethod(lambda cls, dtype: "no C compiler"))
    p = plan(torch.float32)
    assert p.backend == "dense" and not p.row_exact
    assert any("no oneDNN in this build" in r for r in p.reasons)
    assert any("no row-exact float32 backend" in r for r in p.reasons)
    for native4 in (NativeInt4, NativeInt4Dot):
        monkeypatch.setattr(native4, "unavailable", classmethod(lambda cls, dtype: "no C compiler"))
    p = plan(torch.float32, "int4")
    assert p.weights == "int4" and p.backend == "int4"
    assert p.reasons == ["native4i8: no C compiler", "native4: no C compiler"]
    monkeypatch.setattr(Int4, "unavailable", classmethod(lambda cls, dtype: "no int4 kernel"))
    p = plan(torch.float32, "int4")
    assert p.weights == "float32" and p.backend == "dense"
    assert p.reasons[0].startswith("int4 weights unavailable (native4i8: no C compiler; native4: no C compiler;")


def test_plan_rejects_bad_requests():
    with pytest.raises(ValueError, match="weights='int3' is invalid"):
        plan(torch.float32, "int3")
    with pytest.raises(ValueError, match="use --dtype bfloat16"):
        plan(torch.float32, "bfloat16")
    with pytest.raises(ValueError, match="backend='native' is invalid for int4 weights"):
        plan(torch.float32, "int4", backend="native")


@pytest.mark.parametrize("weights,backend", [("int4", "native4"), ("int4", "int4"), ("int8", "native8i8")])
def test_a_quantized_backend_can_be_forced(weights, backend):
    """Benchmarks compare the quantized backends side by side (decode.py's dtype:weights:backend)."""
    if BACKENDS[backend].unavailable(torch.float32):
        pytest.skip(BACKENDS[backend].unavailable(torch.float32))
    p = plan(torch.float32, weights, backend=backend)
    assert (p.weights, p.backend, p.reasons) == (weights, backend, ["forced by the caller"])


def test_measured_choice_is_cached_per_machine(tmp_path, monkeypatch):
    """Two usable backends are timed once; the cached timing is reused on the same machine and
    measured again when the machine key (CPU, flags, threads, torch version) changes."""
    calls = []

    def timed(linears, rows, dtype):
        calls.append(type(linears[0]).name)
        return {"onednn": 2.0, "codes": 3.0, "native": 3.0, "dense": 1.0}[type(linears[0]).name]

    monkeypatch.setattr(kernel_choice, "_pass_ms", timed)
    monkeypatch.setattr(kernel_choice.Dense, "row_exact", True)  # both exact: the timing decides
    cache = tmp_path / "kernels.json"
    sample = torch.randn(64, 32)
    first = plan(torch.float32, sample=sample, cache=cache)
    assert first.backend == "dense" and calls and any("measured" in r for r in first.reasons)
    measured = len(calls)
    assert plan(torch.float32, sample=sample, cache=cache).backend == "dense"
    assert len(calls) == measured  # from the cache
    stored = json.loads(cache.read_text())
    assert all(json.loads(k)["torch"] == torch.__version__ for k in stored)
    key = kernel_choice.machine_key()
    monkeypatch.setattr(kernel_choice, "machine_key", lambda: {**key, "torch": "0.0.0-other"})
    plan(torch.float32, sample=sample, cache=cache)
    assert len(calls) == 2 * measured  # another torch version measures again


def test_backends_are_timed_in_interleaved_rounds(tmp_path, monkeypatch):
    """Each round times every backend once (1 and 5 rows) before the next round starts, so a drift of the
    machine's speed weighs on all of them alike: a machine slowing down as it measures does not
    favour the backend timed first."""
    order, clock = [], iter(range(10**6))
    monkeypatch.setattr(
        kernel_choice, "_pass_ms", lambda linears, rows, dtype: order.append(type(linears[0]).name) or next(clock)
    )
    monkeypatch.setattr(kernel_choice.Dense, "row_exact", True)
    plan(torch.float32, sample=torch.randn(64, 32), cache=tmp_path / "kernels.json")
    names = list(dict.fromkeys(order))
    per_round = len(names) * len(kernel_choice.TIMED_ROWS)
    assert len(names) > 1 and len(order) == per_round * kernel_choice.REPEATS
    assert order[:per_round] == order[per_round : 2 * per_round]  # round 2 repeats round 1's order
    assert order[: len(kernel_choice.TIMED_ROWS)] == [names[0]] * len(kernel_choice.TIMED_ROWS)


@pytest.mark.parametrize(("dense_ms", "chosen"), [(2.0, "native"), (1.4, "dense")])
def test_a_backend_outside_native_c_must_win_by_a_margin(tmp_path, monkeypatch, dense_ms, chosen):
    """Only native linears run a layer as one native.c call, which a per-linear timing does not see:
    dense at 2.0 ms does not displace native at 3.0 ms (over NATIVE_MARGIN of it), at 1.4 ms it does."""
    if NativeFloat.unavailable(torch.float32):
        pytest.skip(NativeFloat.unavailable(torch.float32))
    times = {"onednn": 9.0, "codes": 3.1, "native": 3.0, "dense": dense_ms}
    monkeypatch.setattr(kernel_choice, "_pass_ms", lambda linears, rows, dtype: times[type(linears[0]).name])
    monkeypatch.setattr(kernel_choice.Dense, "row_exact", True)  # all exact: the timing decides
    p = plan(torch.float32, sample=torch.randn(64, 32), cache=tmp_path / "kernels.json")
    assert p.backend == chosen and any("outside native.c" in r for r in p.reasons)


def test_a_shape_the_backend_cannot_pack_runs_dense_and_says_so():
    """int4 packs 16 output rows at a time: a 250-token vocabulary's LM head runs on dense, the other
    linears stay int4, and the plan records it (and no longer claims row-exactness)."""
    from selfspec.model.config import ModelConfig
    from selfspec.model.decoder import build_model

    from .conftest import tiny_hf_model

    hf = tiny_hf_model("llama", vocab_size=250)
    torch_int4 = kernel_choice.KernelPlan("int4", "int4", True)  # torch's kernel (native4 takes any row count)
    model = build_model(ModelConfig.from_hf(hf.config.to_dict()), hf.state_dict().get, torch.float32, torch_int4)
    assert type(model.head).name == "dense" and all(type(lin).name == "int4" for lin in model.layers[0].linears())
    assert any("250x64 weight runs on dense" in r for r in model.kernels.reasons) and not model.kernels.row_exact
    cache = model.new_cache(16)
    assert model.logits(model.forward(torch.tensor([[1, 2, 3]]), cache, [cache.allocate()])).shape[-1] == 250


def pairs() -> bool:
    """native.c was built with its bfloat16 pair kernel (AVX512-BF16)."""
    return NativeFloat.unavailable(torch.float32) is None and native.library().pairs


@pytest.mark.skipif(NativeFloat.unavailable(torch.float32) is not None, reason="native.c unavailable")
@pytest.mark.parametrize(
    "dtype, kind",
    [
        (torch.float32, "float32"),
        (torch.bfloat16, "bfloat16"),
        pytest.param(
            torch.bfloat16,
            "bfloat16_pairs",
            marks=pytest.mark.skipif(not pairs(), reason="native.c's pair kernel needs AVX512-BF16"),
        ),
    ],
)
def test_native_float_panels_take_any_width_and_keep_rows_exact(dtype, kind, monkeypatch):
    """native's float weights are packed in panels of 16 output columns, the last one padded: a width
    that is not a multiple of 16 (a 250-token head) computes its real columns only, unpacks to the
    weight, and every tile shape (1-3 rows span several panels, 4-6 one, more rows several row blocks)
    and thread count gives a row the same bits. bfloat16 takes the pair panels where the CPU has
    AVX512-BF16, else the widening ones (forced here by hiding the pair kernel)."""
    if native.library().pairs and kind == "bfloat16":
        monkeypatch.setattr(native.library(), "pairs", False)
    w, _ = weight(out=250, inn=192, seed=4)
    lin = NativeFloat(w, None, dtype)
    shape = (16, 96, 16, 2) if kind == "bfloat16_pairs" else (16, 192, 16)
    assert lin.kind == kind and lin.panels.shape == shape
    assert torch.equal(lin.dequantized(), w.to(dtype).float())
    x = torch.randn(13, 192, generator=torch.Generator().manual_seed(5)).to(dtype)
    ref = x.float() @ w.to(dtype).float().t()
    one = torch.cat([lin(x[i : i + 1]) for i in range(13)])
    assert one.shape == (13, 250) and ((one.float() - ref).abs().max() / ref.abs().max()) < TOLERANCE[str(dtype)[6:]]
    for threads in (1, 2, 3):
        monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
        for k in (2, 3, 4, 6, 7, 8, 12, 13):
            assert torch.equal(lin(x[:k]), one[:k]), (threads, k)
    prompt = torch.randn(EXACT_ROWS + 5, 192, generator=torch.Generator().manual_seed(6))
    assert torch.allclose(lin(prompt.to(dtype)).float(), prompt.to(dtype).float() @ w.to(dtype).float().t(), atol=1e-2)


PROMPT_ROUTES = [(torch.float32, "panels"), (torch.float32, "gemm"), (torch.bfloat16, "panels")]
PROMPT_ROUTES += [(torch.bfloat16, "bf16_gemm"), (torch.bfloat16, "gemm")]


@pytest.mark.skipif(NativeFloat.unavailable(torch.float32) is not None, reason="native.c unavailable")
@pytest.mark.parametrize("dtype,route", PROMPT_ROUTES, ids=[f"{str(d)[6:]}-{r}" for d, r in PROMPT_ROUTES])
def test_a_prompt_takes_the_panels_or_either_gemm(dtype, route, monkeypatch):
    """A prompt's rows go to native.c's panels or to torch's GEMM, whichever native_prompts timed faster,
    and bfloat16 ones on the GEMM to torch's bfloat16 GEMM where bf16_gemm timed it faster, else to the
    float32 one on widened inputs: every way the product of the same weights, rounded once."""
    monkeypatch.setattr(native_float, "native_prompts", lambda dtype: route == "panels")
    monkeypatch.setattr(native_float, "bf16_gemm", lambda: route == "bf16_gemm")
    gemms = []
    monkeypatch.setattr(NativeFloat, "gemm", lambda self, x, gemm=NativeFloat.gemm: gemms.append(1) or gemm(self, x))
    w, _ = weight(out=250, inn=192, seed=4)
    lin = NativeFloat(w, None, dtype)
    x = torch.randn(EXACT_ROWS + 5, 192, generator=torch.Generator().manual_seed(6)).to(dtype)
    ref = x.float() @ w.to(dtype).float().t()
    y = lin(x)
    assert y.dtype == dtype and y.shape == ref.shape and len(gemms) == (route != "panels")
    assert ((y.float() - ref).abs() <= ref.abs() * 2**-8 + 1e-3).all()
    lin(x[:EXACT_ROWS])  # a step's rows: the panels whatever a prompt takes
    assert len(gemms) == (route != "panels")
