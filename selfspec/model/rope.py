"""Rotary position embeddings: inverse frequencies for each scaling variant, and their cos/sin tables."""

from __future__ import annotations

import math

import torch

from .config import RopeConfig


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> tuple[torch.Tensor, float]:
    """Returns (inv_freq [head_dim // 2] float32, attention scaling applied to cos/sin)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    p = rope.params
    if rope.rope_type == "default":
        return inv_freq, 1.0
    if rope.rope_type == "linear":
        return inv_freq / p["factor"], 1.0
    if rope.rope_type == "llama3":
        return _llama3(inv_freq, p), 1.0
    if rope.rope_type == "yarn":
        return _yarn(rope.theta, head_dim, p)
    raise AssertionError(rope.rope_type)  # RopeConfig validated the type


def _llama3(inv_freq: torch.Tensor, p: dict) -> torch.Tensor:
    # Llama 3.1: long wavelengths are divided by `factor`, short ones kept, the band between blended.
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_ctx = p["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
    return torch.where(medium, blended, scaled)


def _yarn(theta: float, dim: int, p: dict) -> tuple[torch.Tensor, float]:
    # YaRN (arXiv 2309.00071): interpolate low frequencies, extrapolate high ones, ramp between.
    factor = p["factor"]
    old_ctx = p["original_max_position_embeddings"]
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = p.get("attention_factor")
    if attention is None:
        if p.get("mscale") and p.get("mscale_all_dim"):
            attention = mscale(factor, p["mscale"]) / mscale(factor, p["mscale_all_dim"])
        else:
            attention = mscale(factor)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_ctx / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2, device="cpu").float() / dim)
    extrapolation_weight = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_weight) + (1.0 / pos_freqs) * extrapolation_weight
    return inv_freq, float(attention)


class RopeTable:
    """cos/sin per position, grown on demand. The sin table carries the sign of rotate_half, so that
    rope(x) = x * cos + roll(x, head_dim / 2) * sin_signed, bit-identical to x*cos + rotate_half(x)*sin."""

    def __init__(self, rope: RopeConfig, head_dim: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        self.inv_freq, self.scaling = inverse_frequencies(rope, head_dim)  # on the CPU, see _grow
        self.dtype = dtype
        self.device = torch.device(device)
        self.half = head_dim // 2
        self.cos = torch.empty(0, head_dim, dtype=dtype, device=self.device)  # [positions, head_dim]
        self.sin_signed = torch.empty(0, head_dim, dtype=dtype, device=self.device)

    def _grow(self, n: int) -> None:
        # Computed on the CPU whatever the device, then moved: the tables are then the same bits on every
        # device (a GPU's cos/sin round differently), and growing is rare (doubling, 256 at least).
        n = max(n, 2 * self.cos.shape[0], 256)
        freqs = torch.arange(n, dtype=torch.float32, device="cpu")[:, None] * self.inv_freq[None, :]  # [n, hd/2]
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos = (emb.cos() * self.scaling).to(self.dtype).to(self.device)
        sin = (emb.sin() * self.scaling).to(self.dtype)
        self.sin_signed = torch.cat([-sin[:, : self.half], sin[:, self.half :]], dim=-1).to(self.device)

    def reserve(self, positions: int) -> None:
        """Makes the tables cover positions [0, positions) (before a CUDA graph capture, which may not grow them)."""
        if positions > self.cos.shape[0]:
            self._grow(positions)

    def lookup(self, positions: torch.Tensor, needed: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B, S] -> cos, sin_signed, each [B, S, 1, head_dim] (broadcast over heads). `needed`:
        1 + the largest position when the caller knows it (reading it from a GPU tensor waits for the GPU)."""
        needed = int(positions.max()) + 1 if needed is None else needed
        if needed > self.cos.shape[0]:
            self._grow(needed)
        return self.cos[positions].unsqueeze(2), self.sin_signed[positions].unsqueeze(2)


def apply_rope_(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> None:
    """Rotates x [B, S, heads, head_dim] in place (the non-interleaved "rotate_half" convention)."""
    rotated = torch.roll(x, x.shape[-1] // 2, dims=-1).mul_(sin_signed)
    x.mul_(cos).add_(rotated)
