"""Token log-probabilities in OpenAI's two shapes: /v1/completions' {tokens, token_logprobs,
top_logprobs, text_offset} and /v1/chat/completions' {"content": [{token, logprob, bytes,
top_logprobs}]}. Token strings come from the engine's tokenizer, one token at a time."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from functools import lru_cache

from ..decoding.sampling import TokenLogprob

FLOOR = -9999.0  # OpenAI's stand-in for log(0): JSON has no -Infinity
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte fallback


def _gpt2_byte_decoder() -> dict[str, int]:
    """Byte-level BPE (GPT-2 and its descendants) spells each byte as one printable character; this
    maps those characters back to the bytes."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


class TokenTexts:
    """Each token's bytes (exact, also for a token that holds part of a UTF-8 character) and its text
    (those bytes decoded, U+FFFD for an incomplete character)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self._byte_level = type(decoder).__name__ == "ByteLevel"
        self._byte_of = _gpt2_byte_decoder()
        self.bytes = lru_cache(maxsize=1 << 16)(self._bytes)

    def _bytes(self, token_id: int) -> bytes:
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if piece is None:
            return b""
        if self._byte_level and all(c in self._byte_of for c in piece):
            return bytes(self._byte_of[c] for c in piece)
        if m := _BYTE_TOKEN.fullmatch(piece):
            return bytes([int(m.group(1), 16)])
        return piece.replace("\u2581", " ").encode("utf-8")  # SentencePiece's word-start mark is a space

    def text(self, token_id: int) -> str:
        return self.bytes(token_id).decode("utf-8", errors="replace")


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else FLOOR


class CompletionLogprobs:
    """/v1/completions' logprobs object for one choice, chunk by chunk: text_offset continues across
    chunks from where the choice's text starts (after an echoed prompt)."""

    def __init__(self, texts: TokenTexts, offset: int = 0) -> None:
        self.texts, self.offset = texts, offset
        self.total = self._empty()

    @staticmethod
    def _empty() -> dict:
        return {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}

    def add(self, entries: Sequence[TokenLogprob]) -> dict:
        """The object for these tokens (one streamed chunk); also accumulated into `total`."""
        part = self._empty()
        for e in entries:
            token = self.texts.text(e.token_id)
            # OpenAI: "up to logprobs + 1 elements": the alternatives and the chosen token
            top = {self.texts.text(t): _finite(lp) for t, lp in e.top}
            top.setdefault(token, _finite(e.logprob))
            for key, value in (
                ("tokens", token),
                ("token_logprobs", _finite(e.logprob)),
                ("top_logprobs", top),
                ("text_offset", self.offset),
            ):
                part[key].append(value)
                self.total[key].append(value)
            self.offset += len(token)
        return part


class ChatLogprobs:
    """/v1/chat/completions' logprobs object for one choice, chunk by chunk."""

    def __init__(self, texts: TokenTexts) -> None:
        self.texts = texts
        self.content: list[dict] = []

    @property
    def total(self) -> dict:
        return {"content": self.content, "refusal": None}

    def _one(self, token_id: int, logprob: float) -> dict:
        raw = self.texts.bytes(token_id)
        return {"token": raw.decode("utf-8", errors="replace"), "logprob": _finite(logprob), "bytes": list(raw)}

    def add(self, entries: Sequence[TokenLogprob]) -> dict:
        """The object for these tokens (one streamed chunk); also accumulated into `total`."""
        part = [
            {**self._one(e.token_id, e.logprob), "top_logprobs": [self._one(t, lp) for t, lp in e.top]} for e in entries
        ]
        self.content.extend(part)
        return {"content": part, "refusal": None}
