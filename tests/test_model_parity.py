"""Our decoder forward against transformers on tiny random configs (fp32): full-prompt logits, cached
one-token decoding, hidden states at exit layers, and batched vs single-sequence forwards."""

import pytest
import torch

from selfspec.model.config import ModelConfig
from selfspec.model.decoder import DecoderModel, build_model

from .conftest import tiny_hf_model

CONFIGS = {
    "llama": ("llama", {}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "llama-bias": ("llama", {"attention_bias": True}),
    "llama-rope-linear": ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}),
    "llama-rope-llama3": (
        "llama",
        {
            "rope_theta": 500000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
    ),
    "llama-rope-yarn": (
        "llama",
        {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}},
    ),
    "qwen2": ("qwen2", {"tie_word_embeddings": True}),
    "mistral-sliding": ("mistral", {"sliding_window": 7}),
}


def ours(hf, dtype=torch.float32) -> DecoderModel:
    state = hf.state_dict()
    return build_model(ModelConfig.from_hf(hf.config.to_dict()), state.get, dtype)


def run(model: DecoderModel, cache, seq, tokens: list[int], end: int | None = None) -> torch.Tensor:
    h = model.forward(torch.tensor([tokens]), cache, [seq], end=end)
    return h if end is not None else model.logits(h)


@pytest.fixture(params=list(CONFIGS))
def pair(request):
    family, overrides = CONFIGS[request.param]
    hf = tiny_hf_model(family, **overrides)
    return hf, ours(hf)


@torch.inference_mode()
def test_prefill_logits_match(pair):
    hf, model = pair
    tokens = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(1))
    ref = hf(tokens).logits[0]
    cache = model.new_cache(64, block_size=4)
    got = run(model, cache, cache.allocate(), tokens[0].tolist())[0]
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-5)


@torch.inference_mode()
def test_cached_decode_matches(pair):
    hf, model = pair
    tokens = torch.randint(0, 256, (1, 30), generator=torch.Generator().manual_seed(2))
    ref = hf(tokens).logits[0]  # [30, vocab]
    cache = model.new_cache(64, block_size=4)
    seq = cache.allocate()
    got = [run(model, cache, seq, tokens[0, :10].tolist())[0]]  # a prompt chunk, then token by token
    got += [run(model, cache, seq, [t])[0] for t in tokens[0, 10:].tolist()]
    torch.testing.assert_close(torch.cat(got), ref, atol=2e-5, rtol=1e-5)
    assert seq.length == 30


@torch.inference_mode()
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_hidden_states_at_exit_layers(family):
    hf = tiny_hf_model(family, num_hidden_layers=6)
    model = ours(hf)
    tokens = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(3))
    ref = hf(tokens, output_hidden_states=True).hidden_states  # [i] = input of layer i
    for exit_layer in (1, 3, 5):
        cache = model.new_cache(32, block_size=8)
        got = run(model, cache, cache.allocate(), tokens[0].tolist(), end=exit_layer)
        torch.testing.assert_close(got, ref[exit_layer], atol=1e-5, rtol=1e-5)


@torch.inference_mode()
def test_layer_ranges_compose():
    """Running [0, k) then [k, L) equals running [0, L): the draft/verify split is a plain cut."""
    hf = tiny_hf_model("llama")
    model = ours(hf)
    tokens = list(range(5, 25))
    cache = model.new_cache(64, block_size=4)
    whole = run(model, cache, cache.allocate(), tokens)
    seq = cache.allocate()
    batch = cache.prepare([seq], [len(tokens)])
    h = model.forward(torch.tensor([tokens]), cache, end=2, batch=batch)
    h = model.forward(h, cache, start=2, batch=batch)
    assert torch.equal(model.logits(h), whole)


@torch.inference_mode()
def test_batched_forward_matches_single():
    hf = tiny_hf_model("qwen2")
    model = ours(hf)
    prompts = [list(range(3, 20)), list(range(40, 45)), list(range(100, 111))]
    cache = model.new_cache(128, block_size=4)
    singles = []
    for p in prompts:
        seq = cache.allocate()
        singles.append((run(model, cache, seq, p[:-1]), run(model, cache, seq, p[-1:])[0, -1]))
    seqs = [cache.allocate() for _ in prompts]
    width = max(len(p) - 1 for p in prompts)
    tokens = torch.tensor([p[:-1] + [0] * (width - len(p) + 1) for p in prompts])
    logits = model.logits(model.forward(tokens, cache, seqs, counts=[len(p) - 1 for p in prompts]))
    for b, p in enumerate(prompts):
        torch.testing.assert_close(logits[b, : len(p) - 1], singles[b][0][0], atol=1e-5, rtol=1e-5)
    step = model.logits(model.forward(torch.tensor([[p[-1]] for p in prompts]), cache, seqs))  # different lengths
    for b in range(3):
        torch.testing.assert_close(step[b, 0], singles[b][1], atol=1e-5, rtol=1e-5)


@torch.inference_mode()
def test_bfloat16_tracks_float32():
    hf = tiny_hf_model("llama")
    tokens = list(range(10, 42))
    ref = hf(torch.tensor([tokens])).logits[0]
    model = ours(hf, torch.bfloat16)
    cache = model.new_cache(64)
    got = run(model, cache, cache.allocate(), tokens)[0]
    assert got.dtype == torch.float32  # logits always come back in float32
    assert (got - ref).abs().max() < 0.05 * ref.abs().max()
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() > 0.8


@pytest.mark.parametrize("weights", ["float32", "int4"])
@pytest.mark.parametrize("model_type", ["llama", "mistral"])
@torch.inference_mode()
def test_k_token_pass_equals_k_single_steps_bit_for_bit(weights, model_type):
    """What lossless fp32 verification rests on: a pass over k new tokens (verification) computes each
    position to the same bits as k one-token passes (plain decoding), with the kernels chosen here,
    through every layer, attention (and a sliding window) included; and a batch of one-token steps
    equals each step alone."""
    from selfspec.kernels.choice import plan

    hf = tiny_hf_model(model_type, **({"sliding_window": 6} if model_type == "mistral" else {}))
    config = ModelConfig.from_hf(hf.config.to_dict())
    model = build_model(config, hf.state_dict().get, torch.float32, plan(torch.float32, weights))
    assert all(type(lin).row_exact for lin in model.linears())
    cache = model.new_cache(256, block_size=4)
    seqs = [cache.allocate() for _ in range(2)]
    for seq, prompt in zip(seqs, (list(range(3, 20)), list(range(50, 59)))):
        model.forward(torch.tensor([prompt]), cache, [seq])
    base = [s.length for s in seqs]
    tokens = [7, 100, 12, 250, 3]
    steps = [model.logits(model.forward(torch.tensor([[t]]), cache, [seqs[0]]))[0, 0] for t in tokens]
    cache.truncate(seqs[0], base[0])
    verify = model.logits(model.forward(torch.tensor([tokens]), cache, [seqs[0]]))[0]
    assert all(torch.equal(verify[i], steps[i]) for i in range(len(tokens)))
    cache.truncate(seqs[0], base[0])
    alone = [model.logits(model.forward(torch.tensor([[9]]), cache, [s]))[0, 0] for s in seqs]
    for s, n in zip(seqs, base):
        cache.truncate(s, n)
    batched = model.logits(model.forward(torch.tensor([[9], [9]]), cache, seqs))[:, 0]
    assert torch.equal(batched[0], alone[0]) and torch.equal(batched[1], alone[1])
