"""The default model (SmolLM2-135M-Instruct from the embedded GGUF) against transformers."""

import pytest
import torch

from selfspec import SamplingParams

from .conftest import dev_prompts

NEW_TOKENS = 64


@pytest.fixture(scope="module")
def hf_default(default_checkpoint):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(default_checkpoint), dtype=torch.float32).eval()


@pytest.mark.parametrize("prompt", dev_prompts(4))
def test_greedy_matches_transformers(default_engine, hf_default, prompt):
    ids = default_engine.encode(prompt)
    with torch.inference_mode():
        out = hf_default.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)
    expected = out[0, len(ids) :].tolist()
    result = default_engine.generate(ids, SamplingParams(temperature=0, max_tokens=NEW_TOKENS))
    assert result.token_ids == expected[: len(result.token_ids)]
    assert len(result.token_ids) == NEW_TOKENS or result.finish_reason == "stop"


def test_cache_is_reused_on_second_load(default_checkpoint, monkeypatch):
    from selfspec.model import loader

    def boom(*a, **k):
        raise AssertionError("dequantized the GGUF again")

    monkeypatch.setattr(loader, "_dequantize_into", boom)
    assert loader.resolve_checkpoint("default") == default_checkpoint
    assert (default_checkpoint / "model.safetensors").is_file()


def test_chat_template_and_eos(default_engine):
    ids = default_engine.encode("Say hello.")
    text = default_engine.tokenizer.decode(ids)
    assert text.startswith("<|im_start|>system") and text.endswith("<|im_start|>assistant\n")
    assert default_engine.tokenizer.convert_tokens_to_ids("<|im_end|>") in default_engine.eos_token_ids
    result = default_engine.generate("Say hello.", SamplingParams(temperature=0, max_tokens=200))
    assert result.finish_reason == "stop" and result.text.strip()


def test_stop_string_ends_text_before_it(default_engine):
    full = default_engine.generate("What is the capital of France?", SamplingParams(temperature=0, max_tokens=30))
    assert "Paris" in full.text
    cut = default_engine.generate(
        "What is the capital of France?", SamplingParams(temperature=0, max_tokens=30, stop=("Paris",))
    )
    assert cut.finish_reason == "stop" and cut.text == full.text[: full.text.index("Paris")]


def test_int4_weights_are_the_gguf_codes(default_engine, int4_engine):
    """Q4_1 codes loaded straight into the int4 layout (scale d, zero m + 8d) multiply by the values
    transformers dequantizes the GGUF to, up to the bfloat16 rounding of the scales and zeros (the
    kernel's); the Q8_0 embedding, re-quantized for the LM head, is within int4's error."""
    for i in (0, 29):
        ours, ref = int4_engine.model.layers[i], default_engine.model.layers[i]
        for name in ("qkv", "o", "gate_up", "down"):
            a, b = getattr(ours, name).dequantized(), getattr(ref, name).dequantized()
            # bf16 keeps 8 significant bits: scales and zeros are rounded to it, and so is the kernel's
            # output (measured: max 0.6%, mean 0.23% of the weights' scale); wrong codes, groups or row
            # order would be off by the weights' own size
            assert (a - b).abs().max() <= 2**-6 * b.abs().max()
            assert (a - b).abs().mean() <= 2**-8 * b.abs().mean()
    head = int4_engine.model.head.dequantized() - default_engine.model.head_weight
    assert head.abs().max() < 0.2 * default_engine.model.head_weight.abs().max()
