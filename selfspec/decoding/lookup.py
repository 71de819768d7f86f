"""Context lookup (prompt lookup / n-gram drafting): the draft is the continuation of the most recent
earlier occurrence of the row's last n tokens in its own prompt and output, tried from n = `ngram`
down to `shortest` (default SHORTEST; the hybrid takes whole n-grams only). Free to draft (no forward
pass), right often where the answer copies its context (RAG, summarization, code edits).

A lookup draft is a point mass: q = onehot(d). The acceptance rule then keeps d with probability
p(d) and recovers from normalize(max(0, p - onehot(d))) — which the round builds for every draft
without its own q (see round._accept), so lossless sampling needs nothing more here."""

from __future__ import annotations

from array import array
from typing import TYPE_CHECKING

from ..model.cache import PagedKVCache
from ..model.decoder import DecoderModel
from .drafter import Draft, Drafter

if TYPE_CHECKING:
    from .round import RoundInput


# The shortest suffix lookup drafts from. On the int4 target's greedy answers to 52 dev prompts (5679
# positions), a 1-token match drafted a right first token 22 % of the time, a 2-token one 53 %, a 3-token
# one 74 %; timed at γ 2 (3 prompts a category, 3 alternations, decoding), backing off to 2 tokens beat
# backing off to 1 in 11 of 13 categories: 1.19x against 1.12x plain on average (whole trigrams: 1.08x).
SHORTEST = 2
WORD = array("i").itemsize  # bytes a token id takes in the search (vocabularies stay below 2**31)


class LookupDrafter(Drafter):
    name = "lookup"

    def __init__(self, ngram: int = 3, shortest: int | None = None) -> None:
        shortest = min(SHORTEST, ngram) if shortest is None else shortest
        if not 1 <= shortest <= ngram:
            raise ValueError(f"shortest={shortest} is invalid: use 1 .. ngram ({ngram})")
        self.ngram, self.shortest = ngram, shortest

    def describe(self) -> dict:
        return {"drafter": self.name, "ngram": self.ngram, "shortest": self.shortest}

    def propose(self, model: DecoderModel, cache: PagedKVCache, step: RoundInput) -> Draft:
        if step.history is None:
            raise ValueError("the lookup drafter needs the rows' token history (RoundInput.history)")
        tokens = [match(h, self.ngram, g, self.shortest) if g > 0 else [] for h, g in zip(step.history, step.gammas)]
        return Draft(tokens, [[] for _ in tokens])


def match(history: list[int], ngram: int, limit: int, shortest: int = 1) -> list[int]:
    """Up to `limit` tokens following the most recent earlier occurrence of history's last n tokens
    (n = ngram .. shortest; the longest suffix that recurs wins); [] when none recurs."""
    if len(history) < 2:
        return []
    # The ids as 4-byte words, searched by bytes.rfind: one C scan per n, where torch's unfold-and-compare
    # took ~0.12 ms a round (of a ~4 ms int4 step) in a dozen small tensor ops. A hit must start on a
    # word; one that does not is skipped by searching again before it.
    data = array("i", history).tobytes()
    for n in range(min(ngram, len(history) - 1), shortest - 1, -1):
        suffix = data[-WORD * n :]
        end = len(data) - WORD  # an occurrence must end before the last token: one token follows it
        while (at := data.rfind(suffix, 0, end)) >= 0:
            if at % WORD == 0:
                after = at // WORD + n  # the first token after the most recent occurrence
                return history[after : after + limit]
            end = at + len(suffix) - 1  # occurrences that start before this one
    return []
