"""OpenAI-compatible HTTP server: /v1/completions, /v1/chat/completions (JSON or SSE streaming),
/v1/models, /health, /metrics. Requests go to the continuous-batching scheduler, which runs in its
own thread; results come back to the event loop through per-request queues."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from contextlib import asynccontextmanager
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..decoding.engine import Engine
from ..decoding.policy import SpecOverride
from ..decoding.sampling import SamplingParams
from ..errors import SelfspecError
from .metrics import Metrics
from .scheduler import Event, QueueFull, Scheduler, Submission


# ---- request bodies -----------------------------------------------------------------------------------
class SpeculativeOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    enabled: bool | None = None
    draft_layers: int | None = None
    num_speculative_tokens: int | None = None
    drafter: str | None = None


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


def _error_response(e: ApiError) -> JSONResponse:
    body = {"error": {"message": e.message, "type": e.kind, "param": e.param, "code": e.code}}
    return JSONResponse(body, status_code=e.status, headers=e.headers)


# ---- the app ------------------------------------------------------------------------------------------
def create_app(
    engine: Engine, *, served_model_name: str | None = None, max_batch_size: int = 16, max_waiting: int = 64
) -> FastAPI:
    metrics = Metrics()
    scheduler = Scheduler(engine, max_batch_size=max_batch_size, max_waiting=max_waiting, metrics=metrics)
    name = served_model_name or engine.name

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        scheduler.start()
        yield
        scheduler.stop()

    app = FastAPI(title="selfspec", version="0.1.0", lifespan=lifespan)
    app.state.scheduler, app.state.metrics, app.state.engine = scheduler, metrics, engine

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, e: ApiError):
        return _error_response(e)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError):
        first = e.errors()[0]
        loc = [str(x) for x in first.get("loc", []) if x != "body"]
        if first.get("type") == "json_invalid":
            return _error_response(ApiError(400, f"malformed JSON body: {first.get('msg')}", code="invalid_json"))
        where = ".".join(loc) or "body"
        return _error_response(ApiError(400, f"{where}: {first.get('msg')}", param=where))

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        metrics.observe_load(scheduler)
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "selfspec"}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, request: Request):
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            if len(prompt) != 1:
                raise ApiError(400, f"prompt holds {len(prompt)} strings: send one prompt per request", "prompt")
            prompt = prompt[0]
        if not prompt or (isinstance(prompt, str) and not prompt.strip()):
            raise ApiError(400, "prompt is empty", "prompt")
        if isinstance(prompt, str):
            ids = engine.tokenizer(prompt).input_ids
        else:
            vocab = engine.model.config.vocab_size
            if min(prompt) < 0 or max(prompt) >= vocab:
                raise ApiError(400, f"prompt token ids must lie in [0, {vocab})", "prompt")
            ids = list(prompt)
        return await _serve(body, ids, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatBody, request: Request):
        messages = [{"role": m.role, "content": m.content} for m in body.messages]
        try:
            ids = engine.encode(messages)
        except SelfspecError as e:
            raise ApiError(400, str(e), "messages") from None
        except Exception as e:  # a chat template that refuses this conversation (roles out of order, ...)
            raise ApiError(400, f"the chat template rejected these messages: {e}", "messages") from None
        return await _serve(body, ids, request, chat=True)

    def _params(body: _Common, chat: bool) -> SamplingParams:
        if body.model != name:
            raise ApiError(
                400, f"model {body.model!r} is not served here; this server serves {name!r}", "model", "model_not_found"
            )
        if body.n not in (None, 1):
            raise ApiError(400, f"n={body.n} is not supported: use n=1", "n")
        max_tokens = body.max_completion_tokens if chat and body.max_completion_tokens is not None else body.max_tokens
        try:
            return SamplingParams(
                temperature=1.0 if body.temperature is None else body.temperature,
                top_p=1.0 if body.top_p is None else body.top_p,
                top_k=body.top_k or 0,
                seed=body.seed,
                max_tokens=(16 if not chat else 512) if max_tokens is None else max_tokens,
                stop=body.stop or (),
                ignore_eos=body.ignore_eos,
            )
        except ValueError as e:
            param = str(e).split("=", 1)[0]
            raise ApiError(400, str(e), param) from None

    def _speculation(body: _Common):
        o = body.speculative
        if o is None:
            return "auto"
        try:
            override = SpecOverride(o.enabled, o.draft_layers, o.num_speculative_tokens, o.drafter)
        except ValueError as e:
            raise ApiError(400, f"speculative: {e}", "speculative") from None
        if o.draft_layers is not None and not 1 <= o.draft_layers < engine.model.num_layers:
            raise ApiError(
                400,
                f"speculative.draft_layers={o.draft_layers}: use 1..{engine.model.num_layers - 1}",
                "speculative.draft_layers",
            )
        return override

    async def _serve(body: _Common, ids: list[int], request: Request, chat: bool):
        params = _params(body, chat)
        speculation = _speculation(body)
        if len(ids) >= engine.max_model_len:
            raise ApiError(
                400,
                f"prompt has {len(ids)} tokens but the context holds {engine.max_model_len}: shorten it",
                "messages" if chat else "prompt",
                "context_length_exceeded",
            )
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Event] = asyncio.Queue()
        sub = Submission(
            ids, params, lambda ev: loop.call_soon_threadsafe(queue.put_nowait, ev), speculation, body.category
        )
        try:
            scheduler.submit(sub)
        except QueueFull as e:
            raise ApiError(
                429, str(e), code="overloaded", kind="rate_limit_error", headers={"Retry-After": "1"}
            ) from None
        except SelfspecError as e:
            raise ApiError(400, str(e)) from None
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        if body.stream:
            include_usage = bool((body.stream_options or {}).get("include_usage"))
            return StreamingResponse(
                _stream(sub, queue, rid, created, chat, include_usage), media_type="text/event-stream"
            )
        try:
            text, reason, stats = [], None, None
            while reason is None:
                ev = await queue.get()
                if ev.error:
                    kind = "invalid_request_error" if ev.status == 400 else "server_error"
                    raise ApiError(ev.status, ev.error, kind=kind)
                text.append(ev.text)
                reason, stats = ev.finish_reason, ev.stats
        except asyncio.CancelledError:
            scheduler.cancel(sub)
            raise
        choice = {"index": 0, "finish_reason": reason, "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": "".join(text)}
        else:
            choice["text"] = "".join(text)
        return {
            "id": rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": created,
            "model": name,
            "choices": [choice],
            "usage": _usage(stats),
        }

    async def _stream(sub: Submission, queue: asyncio.Queue, rid: str, created: int, chat: bool, include_usage: bool):
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(text: str | None, reason: str | None, role: bool = False) -> str:
            if chat:
                delta = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
                choice = {"index": 0, "delta": delta, "finish_reason": reason, "logprobs": None}
            else:
                choice = {"index": 0, "text": text or "", "finish_reason": reason, "logprobs": None}
            return (
                "data: "
                + json.dumps({"id": rid, "object": obj, "created": created, "model": name, "choices": [choice]})
                + "\n\n"
            )

        finished = False
        try:
            if chat:
                yield chunk(None, None, role=True)
            while True:
                ev = await queue.get()
                if ev.error:
                    err = {"error": {"message": ev.error, "type": "server_error", "param": None, "code": None}}
                    yield "data: " + json.dumps(err) + "\n\n"
                    break
                if ev.text:
                    yield chunk(ev.text, None)
                if ev.finish_reason is not None:
                    yield chunk(None if chat else "", ev.finish_reason)
                    if include_usage:
                        usage = {
                            "id": rid,
                            "object": obj,
                            "created": created,
                            "model": name,
                            "choices": [],
                            "usage": _usage(ev.stats),
                        }
                        yield "data: " + json.dumps(usage) + "\n\n"
                    break
            finished = True
            yield "data: [DONE]\n\n"
        finally:
            if not finished:  # the client went away mid-stream: free its blocks
                scheduler.cancel(sub)

    return app


def _usage(stats) -> dict:
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
