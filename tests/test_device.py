"""Device plumbing: an explicit device everywhere, a clear error for CUDA without a GPU, no tensor made
on an implied device in the decoding hot path, and (with a GPU) greedy equality on CUDA."""

import ast
from pathlib import Path

import pytest
import torch

from selfspec import Engine, SamplingParams, SelfspecError, SpecConfig
from selfspec.cli.main import main
from selfspec.device import resolve_device
from selfspec.kernels.choice import plan

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
SAMPLED = SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=24, ignore_eos=True, logprobs=2)
PENALIZED = SamplingParams(
    temperature=0.7, seed=4, max_tokens=16, ignore_eos=True, frequency_penalty=0.5, logit_bias={7: 2.0}
)
CONFIGS = [SpecConfig(2, 3, "exit"), SpecConfig(None, 4, "int4"), SpecConfig(None, 3, "lookup")]
CONFIGS += [SpecConfig(None, 4, "hybrid"), SpecConfig(None, 2, "int8")]
NO_CUDA = not torch.cuda.is_available()


@pytest.fixture(scope="module")
def cpu_engine(tiny_checkpoint):
    return Engine.from_pretrained(str(tiny_checkpoint), device="cpu")


def test_an_explicit_cpu_device_reaches_every_part(cpu_engine):
    e = cpu_engine
    assert e.device == e.model.device == e.cache.device == torch.device("cpu")
    assert all(kv.device.type == "cpu" for kv in e.cache.layers)
    assert e.model.rope.cos.device.type == "cpu"
    req = e.add_request([5, 6, 7], GREEDY, SpecConfig(2, 3, "exit"))
    assert req.generator.device.type == "cpu"
    e.release(req)
    for config in CONFIGS:
        plain = e.generate("hello there", GREEDY, speculation=None)
        assert e.generate("hello there", GREEDY, speculation=config).token_ids == plain.token_ids


def test_no_factory_falls_back_to_the_default_device(cpu_engine):
    """With torch's default device set to "meta", any tensor made without `device=` is a meta tensor,
    and mixing it with the CPU model's tensors fails: every decoding path must still run."""
    e = cpu_engine
    for config in CONFIGS:
        e.drafter(config)  # drafters load their weights outside the check (loading is not the hot path)
    expected = {}
    for params in (GREEDY, SAMPLED, PENALIZED):
        for config in [None, *CONFIGS]:
            expected[params, config] = e.generate("the cat sat", params, speculation=config).token_ids
    with torch.device("meta"):
        for (params, config), ids in expected.items():
            assert e.generate("the cat sat", params, speculation=config).token_ids == ids


HOT_PATH = [
    "model/attention.py",
    "model/cache.py",
    "model/decoder.py",
    "model/rope.py",
    "decoding/acceptance.py",
    "decoding/drafter.py",
    "decoding/engine.py",
    "decoding/head.py",
    "decoding/hybrid.py",
    "decoding/lookup.py",
    "decoding/quantized.py",
    "decoding/round.py",
    "decoding/sampling.py",
    "kernels/dense.py",
    "kernels/int4.py",
    "kernels/int8.py",
    "kernels/native.py",
    "kernels/native_float.py",
    "kernels/native_int4.py",
    "kernels/native_int8.py",
    "model/ops.py",
]
FACTORIES = {"tensor", "zeros", "ones", "empty", "full", "arange", "rand", "randn", "randint", "eye", "linspace"}
FACTORIES |= {"Generator"}
ALLOWED = {("decoding/head.py", "torch.ones(hidden)")}  # an nn.Parameter, moved with the module by build()


def test_tensor_factories_in_the_hot_path_name_their_device():
    root = Path(__file__).resolve().parents[1] / "selfspec"
    missing = []
    for rel in HOT_PATH:
        source = (root / rel).read_text()
        for node in ast.walk(ast.parse(source)):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            f = node.func
            if not (isinstance(f.value, ast.Name) and f.value.id == "torch" and f.attr in FACTORIES):
                continue
            text = ast.get_source_segment(source, node)
            if not any(k.arg == "device" for k in node.keywords) and (rel, text) not in ALLOWED:
                missing.append(f"{rel}:{node.lineno}: {text}")
    assert not missing, "tensor factories without device=:\n" + "\n".join(missing)


def test_kernel_plan_for_cuda_is_dense_and_says_why():
    p = plan(torch.float32, "auto", device="cuda")
    assert (p.backend, p.weights, p.row_exact) == ("dense", "float32", False)
    assert any("CPU format" in r for r in p.reasons) and any("not row-exact" in r for r in p.reasons)
    p8 = plan(torch.bfloat16, "int8", device="cuda")
    assert p8.backend == "int8" and any("_weight_int8pack_mm is CPU/MPS only" in r for r in p8.reasons)
    with pytest.raises(ValueError, match="cannot run on cuda"):
        plan(torch.float32, "auto", backend="onednn", device="cuda")


@pytest.mark.skipif(not NO_CUDA, reason="this machine has CUDA")
def test_cuda_without_a_gpu_is_a_clear_error(capsys):
    with pytest.raises(SelfspecError, match=r"torch.cuda.is_available\(\) is False.*use --device cpu"):
        resolve_device("cuda")
    with pytest.raises(SelfspecError, match="is_available"):  # before the (missing) model is looked up
        Engine.from_pretrained("/no/such/model", device="cuda")
    assert main(["generate", "hi", "--model", "/no/such/model", "--device", "cuda"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("selfspec generate: error: device 'cuda' requested") and "--device cpu" in err
    assert len(err.splitlines()) == 1


def test_unknown_devices_are_refused(capsys):
    with pytest.raises(SelfspecError, match="not supported"):
        resolve_device("mps")
    assert main(["generate", "hi", "--device", "tpu"]) == 2
    assert "--device: invalid choice" in capsys.readouterr().err


def test_cpu_only_commands_refuse_cuda(capsys):
    assert main(["roofline", "--device", "cuda"]) == 2
    assert "runs on the CPU only" in capsys.readouterr().err


@pytest.mark.skipif(NO_CUDA, reason="needs a CUDA device")
def test_greedy_speculative_equals_plain_on_cuda(tiny_checkpoint):
    """fp32 on a GPU: dense cuBLAS is not row-exact, so a difference is allowed only at a near-tie."""
    e = Engine.from_pretrained(str(tiny_checkpoint), device="cuda")
    assert e.model.embed_weight.is_cuda and e.cache.layers[0].is_cuda
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=2)
    for config in CONFIGS:
        for prompt in ("hello", "1 2 3 4 1 2 3 4"):
            plain = e.generate(prompt, params, speculation=None)
            spec = e.generate(prompt, params, speculation=config)
            for i, (a, b) in enumerate(zip(plain.token_ids, spec.token_ids)):
                if a != b:
                    top = plain.logprobs[i].top
                    assert top[0][1] - top[1][1] < 1e-3, f"{config}: differs at {i} beyond a near-tie"
                    break
