import json

import pytest

from selfspec.errors import ModelLoadError
from selfspec.model.loader import load, parse_dtype, resolve_checkpoint


def test_missing_path(tmp_path):
    with pytest.raises(ModelLoadError, match="not found"):
        resolve_checkpoint(str(tmp_path / "nope"))


def test_directory_without_weights(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ModelLoadError, match="safetensors"):
        resolve_checkpoint(str(tmp_path))
    (tmp_path / "config.json").unlink()
    with pytest.raises(ModelLoadError, match="no config.json"):
        resolve_checkpoint(str(tmp_path))


def test_unsupported_architecture_names_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="unsupported model_type 'gpt2'.*llama, mistral, qwen2"):
        load(str(tmp_path))


def test_bad_gguf(tmp_path):
    f = tmp_path / "junk.gguf"
    f.write_bytes(b"not a gguf at all")
    with pytest.raises(ModelLoadError, match="not a readable GGUF"):
        resolve_checkpoint(str(f))


def test_other_file_types_rejected(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="neither a .gguf file nor a checkpoint directory"):
        resolve_checkpoint(str(f))


def test_dtype_parsing():
    assert str(parse_dtype("bfloat16")) == "torch.bfloat16"
    with pytest.raises(ValueError, match="float16.*float32, bfloat16"):
        parse_dtype("float16")


def test_checkpoint_dir_loads(tiny_checkpoint):
    loaded = load(str(tiny_checkpoint))
    assert loaded.model.num_layers == 4 and loaded.model.config.model_type == "llama"
    assert loaded.tokenizer.eos_token == "<|im_end|>"
