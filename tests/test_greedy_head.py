"""The greedy head (native.c's greedy_codes8, DecoderModel.greedy): a head of 8-bit codes finds each row's
argmax without every logit. An int8 pass bounds every logit, and only the few columns whose bound reaches
the best lower bound get their exact logits. The ids must be those the full logits give, ties to the
lowest index, in float32 and in bfloat16 (where the logits are rounded and tie far more often), on `codes`'
kernels and, where the CPU has AMX, on the tiles (`amx`: its candidates computed on them)."""

import pytest
import torch

from selfspec import SamplingParams
from selfspec.decoding.lookup import LookupDrafter
from selfspec.decoding.round import RoundInput, run_round
from selfspec.kernels import NativeCodes, NativeTiles, native
from selfspec.kernels.choice import KernelPlan
from selfspec.kernels.native_codes import TILE_GREEDY_ROWS
from selfspec.model.config import ModelConfig
from selfspec.model.decoder import build_model

from .conftest import tiny_hf_model
from .test_codes import dequantized

pytestmark = pytest.mark.skipif(
    native.library() is None or not native.library().greedy,
    reason="the greedy head needs native.c with AVX512-VBMI and VNNI",
)


HEADS = [  # (activations, the head's backend)
    pytest.param(torch.float32, NativeCodes, id="float32"),
    pytest.param(
        torch.bfloat16,
        NativeCodes,
        id="bfloat16",
        marks=pytest.mark.skipif(not native.library() or not native.library().pairs, reason="needs AVX512-BF16"),
    ),
    pytest.param(
        torch.bfloat16,
        NativeTiles,
        id="bfloat16-amx",
        marks=pytest.mark.skipif(not native.library() or not native.library().tiles, reason="no AMX tiles here"),
    ),
]


def full(lin: NativeCodes, x: torch.Tensor) -> torch.Tensor:
    """The reference: every logit (in the activations' dtype, as the model's logits are), then argmax."""
    return native.argmax(lin.matmul(x).float())


@pytest.mark.parametrize("dtype,backend", HEADS)
def test_the_argmax_of_random_rows_is_the_full_logits(dtype, backend):
    w = dequantized("Q8_0", out=1000, inn=192)  # 1000 columns: the last panel is part padding
    lin = backend(w, None, dtype)
    assert lin.kind.endswith("codes8")
    g = torch.Generator().manual_seed(3)
    for scale, mean in ((0.01, 0.0), (1.0, 0.0), (30.0, 0.0), (1.0, 2.0)):  # the last: codes' sums far from 0
        x = (torch.randn(17, 192, generator=g) * scale + mean).to(dtype)
        x[:, 5] *= 40  # an outlier channel, as a real model's final norm has: coarse int8 steps there
        for rows in (1, 3, 4, 5, 8, 9, 16, 17):  # blocks of GREEDY_ROWS (8) and a remainder
            if lin.kind.startswith("tile_") and rows > TILE_GREEDY_ROWS:
                assert lin.argmax(x[:rows]) is None  # the tiles' every logit is cheaper: the model takes that
                continue
            assert torch.equal(lin.argmax(x[:rows]), full(lin, x[:rows])), (scale, rows)
    assert lin.argmax(x[0]).shape == () and lin.argmax(x[:4].view(2, 2, 192)).shape == (2, 2)


@pytest.mark.parametrize("dtype,backend", HEADS)
def test_ties_go_to_the_lowest_index_and_near_ties_to_the_exact_logit(dtype, backend):
    """Columns 37 and 300 are copies of column 200, and 96 columns, each in a panel of its own, differ
    from it by one code at one input: their logits differ from its by one weight step times one
    activation, far less than the int8 pass's error where a block holds an outlier. Only the bounds send
    them all to the exact logits, which alone can order them."""
    w = dequantized("Q8_0", out=2048, inn=128, seed=4)
    d = w[200].view(4, 32).abs().amax(-1) / 127  # column 200's group scales (Q8_0: max |w| = 127 d)
    q = torch.round(w[200] / d.repeat_interleave(32))
    inner = (q.abs() < 126).nonzero()[:, 0]  # codes whose +-1 leaves their group's scale as it is
    near = [16 * p + p % 16 for p in range(30, 126)]
    for j, col in enumerate(near):
        i = int(inner[(7 * j) % len(inner)])
        w[col] = w[200]
        w[col, i] = (q[i] + (1 if j % 2 else -1)) * d[i // 32]
    w[37], w[300] = w[200], w[200]
    lin = backend(w, None, dtype)
    assert lin.kind.endswith("codes8")  # the edits kept every weight a code
    g = torch.Generator().manual_seed(5)
    picked = []
    for trial in range(60):
        x = (w[200] + torch.randn(128, generator=g) * 0.3 * w[200].abs().mean()) * 50
        x[trial % 128] += 400 * w[200].abs().mean()  # an outlier: coarse int8 steps in its block
        x = x.to(dtype)[None]
        want = full(lin, x)
        assert torch.equal(lin.argmax(x), want), trial
        picked.append(int(want))
    assert not {200, 300} & set(picked)  # ties with column 37 go to 37
    won = len(set(picked) & set(near))  # near ties that were the argmax, across panels
    assert won > 10 if dtype == torch.float32 else won >= 1 and 37 in picked  # bfloat16 rounds most to ties
    w[near] = 0
    lin = backend(w, None, dtype)
    x = (w[200] * 50).to(dtype)[None]
    assert int(lin.argmax(x)) == int(full(lin, x)) == 37  # the three equal logits: the lowest index


@pytest.mark.parametrize("dtype,backend", HEADS)
def test_the_bounds_reach_past_a_wrong_int8_ranking(dtype, backend):
    """Column 5 (panel 0) weighs input 1, column 40 (panel 2) input 33, equally. x_1 = 0.980 > x_33 = 0.979
    (equal in bfloat16), but their blocks' outliers (50 and 49.5) make int8 steps of 0.394 and 0.390, which
    round them to 0.787 and 1.169: the int8 pass ranks 40 first by almost its whole error bound, and only
    the full bound (half a step per input) sends panel 0 to the exact logits too."""
    w = torch.zeros(64, 64)
    w[5, 1] = w[40, 33] = 127 / 128  # code 127 at d = 2^-7 (float16 exact); zero groups have d = 0
    ramp = torch.arange(-127, 128, 8)[:30] / 2**14  # column 60: 30 distinct codes (8-bit, not 4-bit ones)
    w[60, 2:32] = w[60, 34:64] = ramp  # away from the inputs x holds: its logit is 0
    lin = backend(w, None, dtype)
    assert lin.kind.endswith("codes8")
    x = torch.zeros(1, 64)
    x[0, 0], x[0, 1], x[0, 32], x[0, 33] = 50.0, 0.980, 49.5, 0.979
    x = x.to(dtype)
    assert int(full(lin, x)) == 5 and int(lin.argmax(x)) == 5


@pytest.mark.parametrize("dtype,backend", HEADS)
def test_rows_it_cannot_bound_take_every_logit(dtype, backend):
    w = dequantized("Q8_0", out=16 * 1025, inn=64, seed=6)  # 1025 panels: one past native.c's GREEDY_PANELS
    lin = backend(w, None, dtype)
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(7))
    x[0] = 0  # every logit 0: every column is a candidate, more panels than a row computes one by one
    x[1, 3] = float("nan")
    x[2, 9] = float("inf")
    x[3, :32] = 1e-38  # a block so small that 1 / its int8 step overflows
    x = x.to(dtype)
    assert torch.equal(lin.argmax(x), full(lin, x))
    assert int(lin.argmax(x[0])) == 0


def test_other_weights_have_no_greedy_argmax():
    assert NativeCodes(dequantized("Q4_1", out=32, inn=64), None, torch.float32).argmax(torch.ones(64)) is None
    assert NativeCodes(torch.randn(32, 64), None, torch.float32).argmax(torch.ones(64)) is None  # float panels


@pytest.mark.parametrize("dtype,backend", HEADS)
@torch.inference_mode()
def test_greedy_rounds_use_the_head_argmax_and_match_plain_decoding(dtype, backend, monkeypatch):
    """A tiny model of codes (Q4_1 layers, a Q8_0 head): DecoderModel.greedy gives logits' argmax for step
    and verification rows, greedy rounds take it instead of the logits, and speculative greedy output
    (lookup drafts) equals plain greedy output."""
    hf = tiny_hf_model("llama", num_attention_heads=4, num_key_value_heads=2, hidden_size=128)
    state = hf.state_dict()
    for i, (name, t) in enumerate(sorted(state.items())):
        if name.endswith("proj.weight") or name == "lm_head.weight":
            state[name] = dequantized("Q8_0" if name == "lm_head.weight" else "Q4_1", *t.shape, seed=i)
    model = build_model(
        ModelConfig.from_hf(hf.config.to_dict()), state.get, dtype, KernelPlan("auto", backend.name, True)
    )
    assert model.head.kind.endswith("codes8")
    h = torch.randn(3, 5, 128, generator=torch.Generator().manual_seed(8)).to(dtype)
    assert torch.equal(model.greedy(h), native.argmax(model.logits(h)))
    calls = []
    head_argmax = model.head.argmax
    monkeypatch.setattr(model.head, "argmax", lambda x: calls.append(x.shape) or head_argmax(x))
    monkeypatch.setattr(type(model), "logits", lambda *a: pytest.fail("a greedy round computed every logit"))
    greedy = SamplingParams(temperature=0)
    prompt = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7]
    outputs = []
    for drafter, gamma in ((None, 0), (LookupDrafter(2), 4)):
        cache = model.new_cache(256, block_size=4)
        seq = cache.allocate()
        model.prefill(cache, seq, prompt[:-1])
        tokens = list(prompt)
        while len(tokens) < len(prompt) + 24:
            step = RoundInput([seq], [tokens[-1]], [greedy], [None], [gamma], drafter, history=[tokens])
            tokens += run_round(model, cache, step).tokens[0]
        outputs.append(tokens[: len(prompt) + 24])
    assert outputs[0] == outputs[1]
    assert (1, 128) in calls and any(s[0] == 1 and s[1] > 1 for s in calls if len(s) == 3)  # steps, verifications
