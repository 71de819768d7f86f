"""The `amx` backend (kernels/native_tiles.py): bfloat16 linears on AMX tiles, where the CPU has
AMX-BF16 and Linux grants the tile state. The weights are `codes`' (4-bit codes in pair order, 8-bit
ones, or pair panels), each row's bits are the same for any row count, an 8-bit head's greedy argmax is
its full logits', a tiny model's decoding steps and its verification pass agree bit for bit, and
elsewhere the backend says why it is unavailable."""

import pytest
import torch

from selfspec.kernels import NativeCodes, NativeTiles, native
from selfspec.kernels.base import EXACT_ROWS
from selfspec.kernels.choice import KernelPlan
from selfspec.kernels.native_codes import TILE_GREEDY_ROWS
from selfspec.model.config import ModelConfig
from selfspec.model.decoder import build_model

from .conftest import tiny_hf_model
from .test_codes import dequantized
from .test_native import decode

TILES = native.library() is not None and native.library().tiles
needs_tiles = pytest.mark.skipif(not TILES, reason=f"no AMX tiles here: {NativeTiles.unavailable(torch.bfloat16)}")


def test_unavailable_says_why(monkeypatch):
    assert "bfloat16" in NativeTiles.unavailable(torch.float32)
    if native.library() is None:
        return
    monkeypatch.setattr(native.library(), "pairs", True)  # else the pair panels' reason comes first (Zen 3)
    monkeypatch.setattr(native.library(), "tiles", False)
    monkeypatch.setattr(native.library(), "tiles_why", "no AMX-BF16 on this CPU (or the C compiler lacks it)")
    assert "AMX" in NativeTiles.unavailable(torch.bfloat16)


@needs_tiles
@pytest.mark.parametrize(("kind", "tiled"), [("Q4_1", "tile_codes4"), ("Q4_0", "tile_codes4"), (None, "tile_pairs")])
def test_tiles_multiply_the_bfloat16_weights_and_keep_rows_exact(kind, tiled):
    w = dequantized(kind, out=80, inn=192) if kind else torch.randn(80, 192, generator=torch.Generator().manual_seed(4))
    lin = NativeTiles(w, None, torch.bfloat16)
    assert lin.kind == tiled
    rounded = w.bfloat16().float()
    assert torch.equal(lin.dequantized(), rounded) and torch.equal(lin.transposed(), rounded.t())
    x = torch.randn(EXACT_ROWS + 6, 192, generator=torch.Generator().manual_seed(1)).bfloat16()
    y = lin.matmul_float32(x)
    ref = x.float() @ rounded.t()
    assert (y - ref).abs().max() / ref.abs().max() < 1e-5  # float32 sums of exact bfloat16 products
    one = torch.cat([lin.matmul_float32(x[i : i + 1]) for i in range(EXACT_ROWS)])
    for rows in (2, 5, 16, 17, 33, EXACT_ROWS):  # one tile, a tile and a row, several tiles (16 rows each)
        assert torch.equal(lin.matmul_float32(x[:rows]), one[:rows]), rows
    # bfloat16 in and out in one C call (linear_act): the float32 path's sums rounded as torch rounds them
    assert torch.equal(lin.matmul(x), y.bfloat16()) and torch.equal(lin.matmul(x[:1]), one[:1].bfloat16())
    if kind:  # the tiles' sums are not codes' vdpbf16ps sums (another order within a pair), but close
        codes = NativeCodes(w, None, torch.bfloat16).matmul_float32(x)
        assert (codes - y).abs().max() / ref.abs().max() < 1e-5


@needs_tiles
def test_eight_bit_codes_run_on_the_tiles_greedy_head_included():
    """An 8-bit head (Q8_0) on the tiles: row-exact, and its greedy head (the int8 bounding pass, then the
    candidates' logits on the tiles) picks the full logits' argmax for up to TILE_GREEDY_ROWS rows and
    declines more (test_greedy_head runs its cases on this backend too)."""
    w = dequantized("Q8_0", out=1000, inn=192)
    lin = NativeTiles(w, None, torch.bfloat16)
    assert lin.kind == "tile_codes8" and torch.equal(lin.dequantized(), w.bfloat16().float())
    x = torch.randn(9, 192, generator=torch.Generator().manual_seed(5)).bfloat16()
    one = torch.cat([lin.matmul_float32(x[i : i + 1]) for i in range(9)])
    assert torch.equal(lin.matmul_float32(x), one)
    if native.library().greedy:  # up to TILE_GREEDY_ROWS rows; past them every logit on the tiles is cheaper
        assert torch.equal(lin.argmax(x[:TILE_GREEDY_ROWS]), native.argmax(lin.matmul(x[:TILE_GREEDY_ROWS]).float()))
        assert lin.argmax(x[: TILE_GREEDY_ROWS + 1]) is None


@needs_tiles
@torch.inference_mode()
def test_a_model_on_tiles_verifies_with_the_bits_of_its_steps():
    """A tiny bfloat16 model whose linears are Q4_1 values, on the tiles: a 4-token verification pass
    gives the logits of the 4 steps before it bit for bit (so its speculative greedy output is its plain
    output), after a prompt's pass of over EXACT_ROWS rows (on the tiles too); and the steps' logits stay
    within bfloat16 rounding of `codes`' fed the same tokens."""
    hf = tiny_hf_model("llama", num_attention_heads=4, num_key_value_heads=2, hidden_size=128)
    state = hf.state_dict()
    for i, (name, t) in enumerate(sorted(state.items())):
        if name.endswith("proj.weight") or name == "lm_head.weight":
            state[name] = dequantized("Q8_0" if name == "lm_head.weight" else "Q4_1", *t.shape, seed=i)
    config = ModelConfig.from_hf(hf.config.to_dict())
    model = build_model(config, state.get, torch.bfloat16, KernelPlan("bfloat16", "amx", True))
    assert {lin.kind for layer in model.layers for lin in layer.linears()} == {"tile_codes4"}
    assert model.head.kind == "tile_codes8"
    prompt = torch.randint(0, 256, (EXACT_ROWS + 10,), generator=torch.Generator().manual_seed(2)).tolist()
    steps, verified, tokens = decode(model, model.ops, prompt, 6, 4)
    assert torch.equal(verified, steps[-4:])
    codes = build_model(config, state.get, torch.bfloat16, KernelPlan("bfloat16", "codes", True))
    steps_c, _, _ = decode(codes, codes.ops, prompt, 6, 4, follow=tokens)
    assert (steps.float() - steps_c.float()).abs().max() < 0.1  # the same model, other rounding
