"""Offline batched decoding for calibration, draft training and statistical checks: many sequences
advance together through plain or speculative rounds (the scheduler for serving lives elsewhere)."""

from __future__ import annotations

import torch

from ..decoding.drafter import Drafter, ExitDrafter
from ..decoding.round import RoundInput, SpecConfig, run_round
from ..decoding.sampling import SamplingParams
from ..model.cache import PagedKVCache, SequenceKV
from ..model.decoder import DecoderModel


@torch.inference_mode()
def generate_batch(
    model: DecoderModel,
    cache: PagedKVCache,
    seqs: list[SequenceKV],
    last: list[int],
    params: SamplingParams,
    config: SpecConfig | None,
    generators: list[torch.Generator | None],
    new_tokens: int,
    drafter: Drafter | None = None,
    prompts: list[list[int]] | None = None,
) -> list[list[int]]:
    """Advances every sequence (its cache holding all but `last[b]`) until each has new_tokens more
    tokens; EOS is not special. Rows that finish early keep running with the rest. With a `config`,
    rounds draft with `drafter` (default: the plain exit at the config's depth). `prompts`: each row's
    tokens up to and including last[b], the context a lookup drafter searches (default: last[b])."""
    rows = len(seqs)
    if config is not None and drafter is None:
        drafter = ExitDrafter(config.draft_layers)
    gammas = [config.num_speculative_tokens if config else 0] * rows
    tokens: list[list[int]] = [[] for _ in range(rows)]
    while min(len(t) for t in tokens) < new_tokens:
        inputs = [t[-1] if t else last[b] for b, t in enumerate(tokens)]
        history = [(prompts[b] if prompts else [last[b]]) + t for b, t in enumerate(tokens)]
        step = RoundInput(
            seqs, inputs, [params] * rows, generators, gammas, drafter if config else None, history=history
        )
        for t, new in zip(tokens, run_round(model, cache, step).tokens):
            t += new
    return [t[:new_tokens] for t in tokens]
