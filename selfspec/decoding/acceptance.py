"""Lossless acceptance of drafted tokens (speculative sampling: Leviathan et al. 2023, Chen et al. 2023).

Terms, as in vLLM's rejection sampler:
- draft tokens: the γ tokens d_1..d_γ proposed by the draft, each sampled from its distribution q_i.
- accepted: the longest prefix of drafts kept; d_i is kept with probability min(1, p_i(d_i) / q_i(d_i)),
  where p_i is the target's distribution at the same position (both after the same temperature,
  top-k and top-p processing).
- recovered token: at the first rejected position k, a token sampled from normalize(max(0, p_k - q_k)).
- bonus token: when all γ drafts are accepted, a token sampled from the target's last distribution.
Every round therefore emits accepted + 1 tokens, distributed exactly as sampling from p would.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from ..kernels import native
from .sampling import SamplingParams, inverse_cdf, uniforms

PLACEHOLDER = -1  # fills output positions past the recovered / bonus token
RESIDUAL_EPS = 1e-7  # below this residual mass p ≈ q: sample the recovered token from p instead


@dataclass
class AcceptanceResult:
    output_ids: torch.Tensor  # [B, γ + 1] accepted drafts, then the recovered or bonus token, then PLACEHOLDER
    num_accepted: torch.Tensor  # [B] accepted drafts per row (0..γ)

    def tokens(self, row: int) -> list[int]:
        return self.output_ids[row, : int(self.num_accepted[row]) + 1].tolist()

    def rows(self) -> tuple[list[list[int]], list[int]]:
        """(tokens per row, accepted per row) as Python lists, read from the device in one go each (a
        round's only waits for the GPU, besides the draft steps')."""
        accepted = self.num_accepted.tolist()
        return [out[: n + 1] for out, n in zip(self.output_ids.tolist(), accepted)], accepted


def _first_rejection(accept: torch.Tensor) -> torch.Tensor:
    """accept [B, γ] bool -> [B] length of the all-True prefix."""
    return accept.long().cumprod(-1).sum(-1)


def _capped(num_accepted: torch.Tensor, max_accepted: torch.Tensor | None) -> torch.Tensor:
    """Rows drafting fewer than γ (padded batches) accept at most their own count."""
    return num_accepted if max_accepted is None else torch.minimum(num_accepted, max_accepted)


def greedy_accept(drafts: list[list[int]], target_ids: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    """Temperature 0, on the host. drafts: per row d_1..d_γb; target_ids: per row the target's argmax at
    each verified position (at least γ_b + 1 of them). Accepted drafts equal the target argmax, so a row
    emits the target argmax up to and including the first mismatch (the recovered token) or the bonus
    position. -> (tokens per row, accepted per row). Python lists: the argmax is read from the device
    once, and a few ints compare faster here than the handful of tensor ops they took (~0.15 ms a round,
    of a ~4 ms int4 step)."""
    tokens, accepted = [], []
    for d, t in zip(drafts, target_ids):
        n = 0
        while n < len(d) and d[n] == t[n]:
            n += 1
        tokens.append(t[: n + 1])
        accepted.append(n)
    return tokens, accepted


def rejection_sample(
    draft_ids: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    generators: torch.Generator | Sequence[torch.Generator | None] | None,
    max_accepted: torch.Tensor | None = None,
) -> AcceptanceResult:
    """draft_ids [B, γ]; draft_probs [B, γ, vocab] (q); target_probs [B, γ + 1, vocab] (p), float32.
    `generators`: one per row (each request keeps its own randomness) or one for the whole batch.
    `max_accepted` [B] (optional): a row with fewer real drafts is padded with q = 0 and capped, so
    that at its cap the residual max(0, p - 0) is p itself: the bonus distribution."""
    batch, gamma = draft_ids.shape
    dev = target_probs.device
    u, u_final = _draws(batch, gamma, generators, max_accepted, dev)  # [B, γ] acceptance tests, [B] the sampling draw
    if gamma == 0:  # plain rows only: sample from p
        none = torch.zeros(batch, dtype=torch.long, device=dev)
        return AcceptanceResult(inverse_cdf(target_probs[:, 0], u_final)[:, None], none)
    p = target_probs[:, :gamma].gather(-1, draft_ids[..., None]).squeeze(-1)  # [B, γ] p_i(d_i)
    q = draft_probs.gather(-1, draft_ids[..., None]).squeeze(-1)  # [B, γ] q_i(d_i) > 0: d_i was drawn from q_i
    num_accepted = _capped(_first_rejection(u * q < p), max_accepted)  # u < p / q, undivided
    rows = torch.arange(batch, device=dev)
    p_k = target_probs[rows, num_accepted]  # [B, vocab] target at the first rejection (or the bonus position)
    q_k = draft_probs[rows, num_accepted.clamp(max=gamma - 1)]  # [B, vocab]
    residual = (p_k - q_k).clamp_min(0)  # [B, vocab]
    mass = residual.sum(-1, keepdim=True)  # [B, 1]
    recover = (num_accepted < gamma)[:, None] & (mass > RESIDUAL_EPS)  # [B, 1]; else sample from p itself
    final = inverse_cdf(torch.where(recover, residual, p_k), u_final)  # [B] recovered or bonus token
    positions = torch.arange(gamma + 1, device=dev)[None, :]  # [1, γ + 1]
    out = torch.where(positions < num_accepted[:, None], F.pad(draft_ids, (0, 1)), PLACEHOLDER)  # [B, γ + 1]
    out[rows, num_accepted] = final
    return AcceptanceResult(out, num_accepted)


def _draws(
    batch: int,
    gamma: int,
    generators: torch.Generator | Sequence[torch.Generator | None] | None,
    max_accepted: torch.Tensor | None,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (u [B, γ], u_final [B]) on `device`. With one generator per row, a row draws only its own γ_b + 1
    numbers (γ_b tests, then the sampling draw), so a seeded request samples the same tokens alone or
    in any batch; padded tests past γ_b are 1 (never accepted, and capped anyway)."""
    if generators is None or isinstance(generators, torch.Generator) or max_accepted is None:
        u = uniforms(batch, gamma + 1, generators, device)  # [B, γ + 1]
        return u[:, :gamma], u[:, gamma]
    u, u_final = torch.ones(batch, gamma, device=device), torch.empty(batch, device=device)
    for b, cap in enumerate(max_accepted.tolist()):  # the caps decide how many numbers each row draws
        r = uniforms(1, cap + 1, [generators[b]], device)[0]  # [γ_b + 1]
        u[b, :cap], u_final[b] = r[:cap], r[cap]
    return u, u_final


def native_rejection_sample(
    draft_ids: torch.Tensor,
    caps: torch.Tensor,
    probs: list[list[torch.Tensor]],
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> AcceptanceResult | None:
    """rejection_sample's rule and draws in one native.c call (accept_drafts), from the target's logits
    [B, γ_max + 1, vocab] (penalized where a row penalizes) instead of every distribution processed
    beforehand: each row's p_i (process_logits' temperature, top-k and top-p) is computed only up to its
    first rejection, and q is read where the draft left it (draft_ids [B, γ_max] padded, caps [B] each
    row's own γ_b; probs per row q_1.. or fewer: the rest are point masses, as lookup's and greedy
    drafts' are). 0.18-0.24 ms a round
    where the torch ops took 1.7-3.3 (ad hoc: one row, γ = 3, 49152 tokens, T = 0.7; another job running
    beside it). A plain row is a row of no drafts.
    None off the CPU or without native.c."""
    lib = native.library() if logits.device.type == "cpu" else None
    if lib is None:
        return None
    rows, width = logits.shape[:2]
    gamma, cpu = width - 1, logits.device
    q = [probs[b][i].float().contiguous() if i < len(probs[b]) else None for b in range(rows) for i in range(gamma)]
    processing = (
        torch.tensor([p.temperature for p in params], dtype=torch.float32, device=cpu),
        torch.tensor([p.top_k for p in params], dtype=torch.long, device=cpu),
        torch.tensor([p.top_p for p in params], dtype=torch.float32, device=cpu),
    )
    u, u_final = _draws(rows, gamma, list(generators), caps, cpu)  # as rejection_sample draws them
    out = torch.full((rows, width), PLACEHOLDER, dtype=torch.long, device=cpu)
    accepted = lib.accept(
        logits.float().contiguous(),
        draft_ids.contiguous(),
        caps,
        q,
        processing,
        u.contiguous(),
        u_final,
        RESIDUAL_EPS,
        out,
    )
    return AcceptanceResult(out, accepted)
