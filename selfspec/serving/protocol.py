"""The OpenAI wire format as this server speaks it: request bodies, error bodies, and the response and
SSE chunk objects. Nothing here touches the engine or the scheduler."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator

SSE_DONE = "data: [DONE]\n\n"


# ---- request bodies -----------------------------------------------------------------------------------
class SpeculativeOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    enabled: bool | None = None
    draft_layers: int | None = None
    num_speculative_tokens: int | None = None
    drafter: str | None = None
    ngram: int | None = None


class _Common(BaseModel):
    # OpenAI clients send fields this server does not use (user, logit_bias=None, ...): ignore those,
    # but check the type of every field it does use.
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
    speculative: SpeculativeOptions | None = None
    category: str | None = None  # a Spec-Bench-like task name for the calibration profile's buckets


class CompletionBody(_Common):
    prompt: str | list[int] | list[str]


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
            return "".join(p["text"] for p in v)
        return v


class ChatBody(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None


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


def error_response(e: ApiError) -> JSONResponse:
    return JSONResponse(error_body(e.message, e.kind, e.param, e.code), status_code=e.status, headers=e.headers)


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


def usage(stats) -> dict:
    if stats is None:
        return {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
    spec = stats.spec
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.generated_tokens,
        "total_tokens": stats.prompt_tokens + stats.generated_tokens,
        "draft_tokens": spec.drafted if spec else 0,
        "accepted_tokens": spec.accepted if spec else 0,
        "spec_policy": stats.spec_policy,
    }


def sse(obj: dict) -> str:
    return "data: " + json.dumps(obj) + "\n\n"


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

    def completion(self, text: str, reason: str | None, stats) -> dict:
        choice: dict[str, Any] = {"index": 0, "finish_reason": reason, "logprobs": None}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        obj = "chat.completion" if self.chat else "text_completion"
        return {**self._head(obj), "choices": [choice], "usage": usage(stats)}

    def chunk(self, text: str | None, reason: str | None, role: bool = False) -> dict:
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
            choice = {"index": 0, "delta": delta, "finish_reason": reason, "logprobs": None}
        else:
            choice = {"index": 0, "text": text or "", "finish_reason": reason, "logprobs": None}
        return {**self._head(self._chunk_object), "choices": [choice]}

    def usage_chunk(self, stats) -> dict:
        return {**self._head(self._chunk_object), "choices": [], "usage": usage(stats)}
