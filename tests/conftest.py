import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import json  # noqa: E402
import shutil  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from selfspec.data import DEV_SET  # noqa: E402  (the Spec-Bench dev prompts, shipped in the package)


def dev_prompts(n: int, *, per_category: int = 1) -> list[str]:
    """First-turn questions from n different Spec-Bench dev categories."""
    seen: dict[str, int] = {}
    out = []
    for line in DEV_SET.read_text().splitlines():
        q = json.loads(line)
        if seen.get(q["category"], 0) < per_category:
            seen[q["category"]] = seen.get(q["category"], 0) + 1
            out.append(q["turns"][0])
        if len(out) == n:
            break
    return out


def tiny_hf_model(model_type: str = "llama", seed: int = 0, **overrides):
    """A small random transformers model of the given family (fp32, eval mode)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    base = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    base.update(overrides)
    config = AutoConfig.for_model(model_type, **base)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32).eval()
    with torch.no_grad():  # default init leaves norms at 1 and biases at 0: randomize them so they count
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    return model


@pytest.fixture(scope="session")
def default_checkpoint() -> Path:
    from selfspec.model.loader import resolve_checkpoint

    return resolve_checkpoint("default")


@pytest.fixture(scope="session")
def default_engine():
    from selfspec import Engine

    return Engine.from_pretrained("default", dtype="float32")


@pytest.fixture(scope="session")
def int4_engine():
    """The default model with its GGUF's own 4-bit codes in the linears (float32 activations)."""
    from selfspec import Engine

    return Engine.from_pretrained("default", dtype="float32", weights="int4")


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory, default_checkpoint) -> Path:
    """A random 4-layer llama with the default model's tokenizer, saved as a checkpoint directory."""
    out = tmp_path_factory.mktemp("tiny-llama")
    model = tiny_hf_model(
        "llama",
        vocab_size=49152,
        tie_word_embeddings=True,
        eos_token_id=2,
        initializer_range=0.3,  # varied text
    )
    model.save_pretrained(out, safe_serialization=True)
    for f in default_checkpoint.iterdir():
        if f.name.startswith("tokenizer") or f.name.endswith(".jinja"):
            shutil.copy(f, out / f.name)
    return out


@pytest.fixture(scope="session")
def tiny_engine(tiny_checkpoint):
    from selfspec import Engine

    return Engine.from_pretrained(str(tiny_checkpoint), dtype="float32")


@pytest.fixture(scope="session")
def small_vocab_model():
    """A random 4-layer llama over 12 tokens: small enough to enumerate exact joint distributions."""
    from selfspec.model.config import ModelConfig
    from selfspec.model.decoder import build_model

    hf = tiny_hf_model("llama", vocab_size=12, num_hidden_layers=4, initializer_range=0.4, seed=5)
    return build_model(ModelConfig.from_hf(hf.config.to_dict()), hf.state_dict().get, torch.float32)
