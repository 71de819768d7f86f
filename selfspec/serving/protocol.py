"""The OpenAI wire format as this server speaks it: request bodies, error bodies, and the response and
SSE chunk objects. Nothing here touches the engine or the scheduler."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Callable, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator

SSE_DONE = "data: [DONE]\n\n"


# ---- request bodies -----------------------------------------------------------------------------------
def _valid_utf8(text: str) -> str:
    """A JSON body may carry a lone surrogate ("\\ud800"), which no tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"holds a lone surrogate (U+{ord(text[e.start]):04X}) at character {e.start}") from None
    return text


class SpeculativeOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    enabled: bool | None = None
    draft_layers: int | None = None
    num_speculative_tokens: int | None = None
    drafter: str | None = None
    ngram: int | None = None


class _Common(BaseModel):
    # OpenAI clients send fields this server does not use (user, metadata, ...): ignore those, but
    # check the type of every field it does use, and declare every field it would silently get wrong
    # (see UNSUPPORTED).
    model_config = ConfigDict(extra="ignore", strict=True)
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    seed: int | None = None
    ignore_eos: bool = False
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # vLLM's extension
    logit_bias: dict[str, float] | None = None  # token id (as a JSON key) -> bias
    speculative: SpeculativeOptions | None = None
    category: str | None = None  # a Spec-Bench-like task name for the calibration profile's buckets
    # accepted only at values that ask for nothing (UNSUPPORTED)
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    parallel_tool_calls: Any = None
    response_format: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None


class CompletionBody(_Common):
    prompt: str | list[int] | list[str]
    logprobs: int | None = None  # 0..5: the chosen token's logprob and this many alternatives
    echo: bool | None = None
    best_of: Any = None
    suffix: Any = None

    @field_validator("prompt")
    @classmethod
    def _utf8(cls, v):
        if isinstance(v, str):
            return _valid_utf8(v)
        for p in v:
            if isinstance(p, str):
                _valid_utf8(p)
        return v


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "user", "assistant"]
    content: str | list[dict[str, Any]]

    @field_validator("content")
    @classmethod
    def _text_only(cls, v):
        if isinstance(v, list):
            if not all(p.get("type") == "text" and isinstance(p.get("text"), str) for p in v):
                raise ValueError("only text content parts are supported")
            v = "".join(p["text"] for p in v)
        return _valid_utf8(v)


class ChatBody(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None  # 0..20 alternatives per token, with logprobs=true


MAX_COMPLETION_LOGPROBS = 5  # OpenAI's bound for /v1/completions' logprobs

# Fields this server does not implement -> whether a value asks for nothing (then it is accepted, so
# clients that send defaults keep working); any other value is a 400 naming the field.
UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "tools": lambda v: v is None or v == [],
    "tool_choice": lambda v: v in (None, "none", "auto"),
    "functions": lambda v: v is None or v == [],
    "function_call": lambda v: v in (None, "none", "auto"),
    "parallel_tool_calls": lambda v: v in (None, True),
    "response_format": lambda v: v is None or v == {"type": "text"},
    "best_of": lambda v: v is None or (v == 1 and not isinstance(v, bool)),
    "suffix": lambda v: v in (None, ""),
    "audio": lambda v: v is None,
    "modalities": lambda v: v is None or v == ["text"],
    "prediction": lambda v: v is None,
}


def reject_unsupported(body: _Common) -> None:
    fields = type(body).model_fields
    for name, asks_nothing in UNSUPPORTED.items():
        if name in fields and not asks_nothing(getattr(body, name)):
            raise ApiError(400, f"{name} is not supported by this server", name, "unsupported_parameter")


# ---- errors -------------------------------------------------------------------------------------------
class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
        headers=None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind, self.headers = (
            status,
            message,
            param,
            code,
            kind,
            headers,
        )


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class AsciiJSONResponse(JSONResponse):
    # Starlette's JSONResponse writes non-ASCII as UTF-8, which fails on a lone surrogate that an error
    # message quotes back from the request; \u escapes cannot fail.
    def render(self, content: Any) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode("ascii")


def error_response(e: ApiError) -> JSONResponse:
    return AsciiJSONResponse(error_body(e.message, e.kind, e.param, e.code), status_code=e.status, headers=e.headers)


def invalid_body(errors: Sequence[dict]) -> ApiError:
    """Pydantic's first complaint about a body, as a 400 naming the offending field."""
    first = errors[0]
    loc = [str(x) for x in first.get("loc", []) if x != "body"]
    if first.get("type") == "json_invalid":
        return ApiError(400, f"malformed JSON body: {first.get('msg')}", code="invalid_json")
    where = ".".join(loc) or "body"
    return ApiError(400, f"{where}: {first.get('msg')}", param=where)


# ---- responses ----------------------------------------------------------------------------------------
def model_list(name: str) -> dict:
    return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "selfspec"}]}


def usage(all_stats: Sequence) -> dict:
    """Usage of a request's choices: the prompt counted once (the choices share it), the rest summed."""
    all_stats = [s for s in all_stats if s is not None]
    if not all_stats:
        return {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
    prompt = all_stats[0].prompt_tokens
    generated = sum(s.generated_tokens for s in all_stats)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": generated,
        "total_tokens": prompt + generated,
        "draft_tokens": sum(s.spec.drafted for s in all_stats if s.spec),
        "accepted_tokens": sum(s.spec.accepted for s in all_stats if s.spec),
        "spec_policy": all_stats[0].spec_policy,
    }


def sse(obj: dict) -> str:
    return "data: " + json.dumps(obj) + "\n\n"


@dataclass(frozen=True)
class Choice:
    """One finished choice of a non-streaming response."""

    index: int
    text: str
    finish_reason: str | None
    logprobs: dict | None = None


@dataclass(frozen=True)
class Reply:
    """The header every response object for one request repeats (id, object, created, model), so the
    whole response and each streamed chunk agree on it."""

    id: str
    created: int
    model: str
    chat: bool

    @classmethod
    def new(cls, model: str, chat: bool) -> Reply:
        return cls(f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}", int(time.time()), model, chat)

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    @property
    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def completion(self, choices: Sequence[Choice], usage: dict) -> dict:
        out = []
        for c in choices:
            choice: dict[str, Any] = {"index": c.index, "finish_reason": c.finish_reason, "logprobs": c.logprobs}
            if self.chat:
                choice["message"] = {"role": "assistant", "content": c.text}
            else:
                choice["text"] = c.text
            out.append(choice)
        obj = "chat.completion" if self.chat else "text_completion"
        return {**self._head(obj), "choices": out, "usage": usage}

    def chunk(
        self, index: int, text: str | None, reason: str | None, *, role: bool = False, logprobs: dict | None = None
    ) -> dict:
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
            choice = {"index": index, "delta": delta, "finish_reason": reason, "logprobs": logprobs}
        else:
            choice = {"index": index, "text": text or "", "finish_reason": reason, "logprobs": logprobs}
        return {**self._head(self._chunk_object), "choices": [choice]}

    def usage_chunk(self, usage: dict) -> dict:
        return {**self._head(self._chunk_object), "choices": [], "usage": usage}
