"""A 4-bit GGUF's own codes, read straight into the int4 layout (kernels/int4.py) without building a
float weight: Q4_1 blocks of 32 hold d, m and 4-bit q with w = d * q + m (scale d, zero m + 8d), Q4_0
blocks hold d and q with w = d * (q - 8) (scale d, zero 0). Other tensor types return None and are
re-quantized from the float weights. Names follow Hugging Face checkpoints, and llama.cpp's row order
of the q/k projections is undone as transformers does for llama and mistral."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from ..kernels.int4 import Int4Codes
from .config import ModelConfig

BLOCK = 32
_GGUF_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
PERMUTED = ("llama", "mistral")  # llama.cpp's converter interleaves the q/k rows for RoPE


def cached_codes(path: Path, config: ModelConfig, store: Path):
    """`codes(hf_name)` for the GGUF at `path`, decoded once and kept in `store` (safetensors), since
    parsing a GGUF's metadata and unpacking its blocks takes seconds on every load otherwise."""
    from safetensors.torch import load_file, save_file

    if not store.is_file():
        codes = GGUFCodes(path, config)
        tensors = {}
        for name in codes.names():
            found = codes(name)
            if found is not None:
                for part, t in zip(("codes", "scale", "zero"), found):
                    tensors[f"{name}.{part}"] = t.contiguous()
        tmp = store.with_suffix(f".{os.getpid()}.partial")  # concurrent first loads do not collide
        save_file(tensors, str(tmp))
        tmp.replace(store)
    tensors = load_file(str(store))

    def get(name: str) -> Int4Codes | None:
        if f"{name}.codes" not in tensors:
            return None
        return tensors[f"{name}.codes"], tensors[f"{name}.scale"], tensors[f"{name}.zero"]

    return get


class GGUFCodes:
    """`codes(hf_name)` -> (codes [out, in] uint8 0..15, scale, zero [out, in / 32]) or None."""

    def __init__(self, path: Path, config: ModelConfig) -> None:
        from gguf import GGUFReader

        self.config = config
        self.tensors = {t.name: t for t in GGUFReader(str(path)).tensors}

    def names(self) -> list[str]:
        """The Hugging Face names of every linear weight this model has."""
        return [f"model.layers.{i}.{module}.weight" for i in range(self.config.num_layers) for module in _GGUF_NAMES]

    def __call__(self, name: str) -> Int4Codes | None:
        parts = name.split(".")  # model.layers.{i}.{module}.{proj}.weight
        if len(parts) != 6 or parts[:2] != ["model", "layers"] or parts[-1] != "weight":
            return None
        module = ".".join(parts[3:5])
        tensor = self.tensors.get(f"blk.{parts[2]}.{_GGUF_NAMES.get(module, '?')}.weight")
        if tensor is None or tensor.tensor_type.name not in ("Q4_0", "Q4_1"):
            return None
        codes, scale, zero = decode(np.asarray(tensor.data), tensor.tensor_type.name)
        heads = {"self_attn.q_proj": self.config.num_heads, "self_attn.k_proj": self.config.num_kv_heads}
        if module in heads and self.config.model_type in PERMUTED:
            order = unpermute_rows(codes.shape[0], heads[module])
            codes, scale, zero = codes[order], scale[order], zero[order]
        return codes, scale, zero


def decode(blocks: np.ndarray, kind: str) -> Int4Codes:
    """Raw rows [out, in / 32 * bytes per block] of Q4_0 / Q4_1 -> (codes, scale, zero)."""
    raw = torch.from_numpy(blocks.copy())
    out = raw.shape[0]
    per_block = 20 if kind == "Q4_1" else 18
    raw = raw.view(out, -1, per_block)  # [out, in / 32, bytes]
    d = raw[..., 0:2].contiguous().view(torch.float16).squeeze(-1).float()  # [out, in / 32]
    qs = raw[..., per_block - 16 :]  # [out, in / 32, 16]: element j in the low nibble, j + 16 in the high
    codes = torch.cat([qs & 0x0F, qs >> 4], dim=-1).reshape(out, -1)  # [out, in]
    if kind == "Q4_1":
        m = raw[..., 2:4].contiguous().view(torch.float16).squeeze(-1).float()
        return codes, d, m + 8 * d
    return codes, d, torch.zeros_like(d)


def unpermute_rows(rows: int, heads: int) -> torch.Tensor:
    """The row order that undoes llama.cpp's q/k permutation: its rows per head are (dim, 2)
    interleaved; Hugging Face keeps (2, dim)."""
    dim = rows // heads // 2
    return torch.arange(rows).view(heads, dim, 2).transpose(1, 2).reshape(-1)
