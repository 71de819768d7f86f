"""The `codes` backend (kernels/native_codes.py): float32 weights that are exactly a GGUF's 4-bit or
8-bit codes are kept as those codes and rebuilt in registers, with the bits of `native`'s float32
panels for every row count (and, rounded to bfloat16 where the CPU has AVX512-BF16, of its bfloat16
pair panels); any other weight stays in `native`'s panels."""

import pytest
import torch

from selfspec.kernels import NativeCodes, NativeFloat, native
from selfspec.kernels.choice import KernelPlan
from selfspec.model.config import ModelConfig
from selfspec.model.decoder import build_model

from .conftest import tiny_hf_model
from .test_native import decode

pytestmark = pytest.mark.skipif(native.library() is None, reason=f"native.c unavailable: {native.unavailable()}")
DTYPES = [
    torch.float32,
    pytest.param(
        torch.bfloat16,
        marks=pytest.mark.skipif(
            native.library() is None or not native.library().pairs, reason="bfloat16 codes need AVX512-BF16"
        ),
    ),
]


def dequantized(kind: str, out: int = 80, inn: int = 192, seed: int = 0) -> torch.Tensor:
    """A weight as gguf-py dequantizes a GGUF tensor of `kind` to float32: float16 scales (and offsets),
    codes per group of 32; Q4_1 groups whose largest code is below 15 and a constant group included."""
    g = torch.Generator().manual_seed(seed)
    shape = (out, inn // 32, 1)
    d = (torch.rand(shape, generator=g) * 0.02 + 1e-3).half().float()
    if kind == "Q8_0":
        q = torch.randint(-127, 128, (out, inn // 32, 32), generator=g).float()
        q[..., 0] = 127 * torch.where(torch.rand(shape[:2], generator=g) < 0.5, 1.0, -1.0)  # Q8_0: |q| max 127
        return (q * d).view(out, inn)
    q = torch.randint(0, 16, (out, inn // 32, 32), generator=g).float()
    q[..., 0], q[..., 1] = 0, 15  # the quantizer puts a group's least and largest weights at 0 and 15
    q[:3, :, 1:] = q[:3, :, 1:].clamp(max=12)  # but rounding can leave the largest at 14 or less
    q[3, 0] = 0  # one constant group
    if kind == "Q4_0":
        return (d * (q - 8)).view(out, inn)
    m = (torch.randn(shape, generator=g) * 0.05).half().float()
    return (q * d + m).view(out, inn)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind,codes", [("Q4_1", "codes4"), ("Q4_0", "codes4"), ("Q8_0", "codes8")])
def test_codes_rebuild_the_float_weights_bit_for_bit(kind, codes, dtype):
    w = dequantized(kind)
    lin, ref = NativeCodes(w, None, dtype), NativeFloat(w, None, dtype)  # native rounds w to dtype
    assert lin.kind == (codes if dtype == torch.float32 else f"pair_{codes}")
    assert lin.nbytes < ref.nbytes / ((5 if codes == "codes4" else 3) if dtype == torch.float32 else 1.8)
    rounded = w.to(dtype).float()
    assert torch.equal(lin.dequantized(), rounded)  # what the kernel multiplies by
    assert torch.equal(lin.transposed(), rounded.t())  # what a prompt's GEMM multiplies by
    x = torch.randn(20, w.shape[1], generator=torch.Generator().manual_seed(1)).to(dtype)
    # every tile shape (native.c's panel_span for this machine: 1-8 rows), then 2 tiles streaming
    for rows in (1, 2, 3, 4, 5, 6, 7, 8, 9, 17, 20):
        assert torch.equal(lin.matmul(x[:rows]), ref.matmul(x[:rows])), rows
    prompt = torch.randn(70, w.shape[1]).to(dtype)  # a prompt's rows: the codes' kernel, not a rebuilt GEMM
    assert torch.equal(lin.matmul(prompt), native.NativeLinear.matmul(ref, prompt))
    if dtype == torch.bfloat16:  # bfloat16 in and out in one C call (linear_act): widen, kernel, round
        assert torch.equal(lin.matmul(prompt), lin.matmul_float32(prompt).bfloat16())


def test_a_weight_that_never_was_quantized_stays_on_native_panels():
    w = torch.randn(48, 64, generator=torch.Generator().manual_seed(2))
    lin = NativeCodes(w, None, torch.float32)
    assert lin.kind == "float32"
    x = torch.randn(3, 64)
    assert torch.equal(lin.matmul(x), NativeFloat(w, None, torch.float32).matmul(x))
    # One weight off by one ulp is no longer codes: nothing is approximated
    near = dequantized("Q4_1", out=16, inn=64)
    near[5, 7] = torch.nextafter(near[5, 7], torch.tensor(1.0))
    assert NativeCodes(near, None, torch.float32).kind == "float32"
    assert NativeCodes(dequantized("Q4_1", out=16, inn=64)[:, :48], None, torch.float32).kind == "float32"  # no groups
    assert NativeCodes.unavailable(torch.float16) is not None
    if native.library().pairs:  # in bfloat16: native's pair panels
        lin = NativeCodes(w, None, torch.bfloat16)
        assert lin.kind == "bfloat16_pairs" and torch.equal(lin.dequantized(), w.bfloat16().float())
    else:
        assert "AVX512-BF16" in NativeCodes.unavailable(torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES)
@torch.inference_mode()
def test_a_model_of_codes_decodes_with_the_bits_of_native_panels(dtype):
    """A tiny model whose linears are Q4_1 / Q8_0 values (a float32 checkpoint, loaded in `dtype`):
    decoding steps and a verification pass on the codes give the logits of `native`'s panels bit for
    bit, so its speculative output equals plain output as the panels' does."""
    hf = tiny_hf_model("llama", num_attention_heads=4, num_key_value_heads=2, hidden_size=128)
    state = hf.state_dict()
    for i, (name, t) in enumerate(sorted(state.items())):
        if name.endswith("proj.weight") or name == "lm_head.weight":
            kind = "Q8_0" if name == "lm_head.weight" else "Q4_1"
            state[name] = dequantized(kind, *t.shape, seed=i)
    config = ModelConfig.from_hf(hf.config.to_dict())
    models = {
        b: build_model(config, state.get, dtype, KernelPlan(str(dtype)[6:], b, True)) for b in ("codes", "native")
    }
    kinds = {lin.kind for layer in models["codes"].layers for lin in layer.linears()}
    pair = "" if dtype == torch.float32 else "pair_"
    assert kinds == {f"{pair}codes4"} and models["codes"].head.kind == f"{pair}codes8"
    prompt = torch.randint(0, 256, (20,), generator=torch.Generator().manual_seed(2)).tolist()
    (steps, verified, tokens), (steps_f, verified_f, tokens_f) = (
        decode(m, m.ops, prompt, 6, 4) for m in models.values()
    )
    assert torch.equal(steps, steps_f) and torch.equal(verified, verified_f) and tokens == tokens_f
    assert torch.equal(verified, steps[-4:])
