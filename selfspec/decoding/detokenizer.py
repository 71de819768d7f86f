"""Incremental detokenization with stop strings: turns a growing list of token ids into text deltas
that never split a UTF-8 character and never show the start of a stop string."""

from __future__ import annotations

CONTEXT_TOKENS = 5  # prompt tokens decoded ahead of the output, so a leading space survives SentencePiece


class TextStream:
    def __init__(self, tokenizer, prompt_ids: list[int], stop: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids[-CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1  # chars that may begin a stop string
        self.text = ""  # all decoded output text (truncated at a stop string once one is found)
        self.emitted = 0  # characters of `text` already handed out
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def push(self, token_id: int) -> str:
        """Adds one token; returns the text now safe to show (may be empty)."""
        if self.stopped:
            return ""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):  # U+FFFD: an unfinished UTF-8 byte run
            before = len(self.text)
            self.text += full[len(prefix) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            self._find_stop(max(0, before - self.hold))
        safe = len(self.text) if self.stopped else max(self.emitted, len(self.text) - self.hold)
        return self._emit(safe)

    def flush(self) -> str:
        """At the end of generation: everything not yet shown."""
        return self._emit(len(self.text))

    def _find_stop(self, search_from: int) -> None:
        hits = [i for i in (self.text.find(s, search_from) for s in self.stop) if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True

    def _emit(self, upto: int) -> str:
        delta = self.text[self.emitted : upto]
        self.emitted = max(self.emitted, upto)
        return delta
