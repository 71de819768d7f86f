"""OpenAI-compatible HTTP server: /v1/completions, /v1/chat/completions (JSON or SSE streaming),
/v1/models, /health, /metrics. Requests go to the continuous-batching scheduler, which runs in its
own thread; results come back to the event loop through per-request queues."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse

from ..decoding.engine import Engine
from ..decoding.policy import SpecOverride
from ..decoding.sampling import SamplingParams
from ..errors import SelfspecError
from .metrics import Metrics
from .protocol import (
    SSE_DONE,
    ApiError,
    ChatBody,
    CompletionBody,
    Reply,
    _Common,
    error_body,
    error_response,
    invalid_body,
    model_list,
    sse,
)
from .scheduler import Event, QueueFull, Scheduler, Submission


def create_app(
    engine: Engine, *, served_model_name: str | None = None, max_batch_size: int = 16, max_waiting: int = 64
) -> FastAPI:
    metrics = Metrics()
    scheduler = Scheduler(engine, max_batch_size=max_batch_size, max_waiting=max_waiting, metrics=metrics)
    service = Service(engine, scheduler, metrics, served_model_name or engine.name)
    app = FastAPI(title="selfspec", version="0.1.0", lifespan=_lifespan)
    app.state.service = service
    app.state.scheduler, app.state.metrics, app.state.engine = scheduler, metrics, engine
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.include_router(_router)
    return app


class Service:
    """Everything a request needs beyond its body, so the route handlers can stay one-liners."""

    def __init__(self, engine: Engine, scheduler: Scheduler, metrics: Metrics, name: str) -> None:
        self.engine, self.scheduler, self.metrics, self.name = engine, scheduler, metrics, name

    # ---- request -> token ids ---------------------------------------------------------------------------
    def prompt_ids(self, body: CompletionBody) -> list[int]:
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            if len(prompt) != 1:
                raise ApiError(400, f"prompt holds {len(prompt)} strings: send one prompt per request", "prompt")
            prompt = prompt[0]
        if not prompt or (isinstance(prompt, str) and not prompt.strip()):
            raise ApiError(400, "prompt is empty", "prompt")
        if isinstance(prompt, str):
            return self.engine.tokenizer(prompt).input_ids
        vocab = self.engine.model.config.vocab_size
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise ApiError(400, f"prompt token ids must lie in [0, {vocab})", "prompt")
        return list(prompt)

    def chat_ids(self, body: ChatBody) -> list[int]:
        messages = [{"role": m.role, "content": m.content} for m in body.messages]
        try:
            return self.engine.encode(messages)
        except SelfspecError as e:
            raise ApiError(400, str(e), "messages") from None
        except Exception as e:  # a chat template that refuses this conversation (roles out of order, ...)
            raise ApiError(400, f"the chat template rejected these messages: {e}", "messages") from None

    # ---- request -> decoding settings -------------------------------------------------------------------
    def sampling_params(self, body: _Common, chat: bool) -> SamplingParams:
        if body.model != self.name:
            raise ApiError(
                400,
                f"model {body.model!r} is not served here; this server serves {self.name!r}",
                "model",
                "model_not_found",
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
            # SamplingParams names the field first ("top_p=..."), which is also the body's field name
            param = str(e).split("=", 1)[0]
            raise ApiError(400, str(e), param) from None

    def speculation(self, body: _Common):
        o = body.speculative
        if o is None:
            return "auto"
        try:
            override = SpecOverride(o.enabled, o.draft_layers, o.num_speculative_tokens, o.drafter, o.ngram)
        except ValueError as e:
            raise ApiError(400, f"speculative: {e}", "speculative") from None
        num_layers = self.engine.model.num_layers
        if o.draft_layers is not None and not 1 <= o.draft_layers < num_layers:
            raise ApiError(
                400,
                f"speculative.draft_layers={o.draft_layers}: use 1..{num_layers - 1}",
                "speculative.draft_layers",
            )
        return override

    # ---- scheduling and the response --------------------------------------------------------------------
    async def serve(self, body: _Common, ids: list[int], chat: bool):
        # validate everything before submitting, so a rejected request never occupies the scheduler
        params = self.sampling_params(body, chat)
        speculation = self.speculation(body)
        limit = self.engine.max_model_len
        if len(ids) >= limit:
            raise ApiError(
                400,
                f"prompt has {len(ids)} tokens but the context holds {limit}: shorten it",
                "messages" if chat else "prompt",
                "context_length_exceeded",
            )
        sub, queue = self._submit(ids, params, speculation, body.category)
        reply = Reply.new(self.name, chat)
        if body.stream:
            include_usage = bool((body.stream_options or {}).get("include_usage"))
            return StreamingResponse(self._stream(sub, queue, reply, include_usage), media_type="text/event-stream")
        return await self._collect(sub, queue, reply)

    def _submit(self, ids, params, speculation, category) -> tuple[Submission, asyncio.Queue[Event]]:
        # the scheduler emits from its own thread: hop back onto this event loop before touching the queue
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Event] = asyncio.Queue()
        sub = Submission(ids, params, lambda ev: loop.call_soon_threadsafe(queue.put_nowait, ev), speculation, category)
        try:
            self.scheduler.submit(sub)
        except QueueFull as e:
            raise ApiError(
                429, str(e), code="overloaded", kind="rate_limit_error", headers={"Retry-After": "1"}
            ) from None
        except SelfspecError as e:
            raise ApiError(400, str(e)) from None
        return sub, queue

    async def _collect(self, sub: Submission, queue: asyncio.Queue[Event], reply: Reply) -> dict:
        try:
            text, reason, stats = [], None, None
            while reason is None:
                ev = await queue.get()
                if ev.error:
                    kind = "invalid_request_error" if ev.status == 400 else "server_error"
                    raise ApiError(ev.status, ev.error, kind=kind)
                text.append(ev.text)
                reason, stats = ev.finish_reason, ev.stats
        except asyncio.CancelledError:  # the client disconnected: free its blocks
            self.scheduler.cancel(sub)
            raise
        return reply.completion("".join(text), reason, stats)

    async def _stream(self, sub: Submission, queue: asyncio.Queue[Event], reply: Reply, include_usage: bool):
        finished = False
        try:
            if reply.chat:
                yield sse(reply.chunk(None, None, role=True))
            while True:
                ev = await queue.get()
                if ev.error:
                    # the 200 and its headers are already sent: the error can only travel as a chunk
                    yield sse(error_body(ev.error, "server_error"))
                    break
                if ev.text:
                    yield sse(reply.chunk(ev.text, None))
                if ev.finish_reason is not None:
                    yield sse(reply.chunk(None if reply.chat else "", ev.finish_reason))
                    if include_usage:
                        yield sse(reply.usage_chunk(ev.stats))
                    break
            finished = True
            yield SSE_DONE
        finally:
            if not finished:  # the client went away mid-stream: free its blocks
                self.scheduler.cancel(sub)


# ---- app wiring ---------------------------------------------------------------------------------------
# Module-level handlers reach the per-app Service through request.app, so one router serves every app.
_router = APIRouter()


def _service(request: Request) -> Service:
    return request.app.state.service


@asynccontextmanager
async def _lifespan(app: FastAPI):
    scheduler = app.state.service.scheduler
    scheduler.start()
    yield
    scheduler.stop()


async def _api_error(_: Request, e: ApiError):
    return error_response(e)


async def _validation_error(_: Request, e: RequestValidationError):
    return error_response(invalid_body(e.errors()))


@_router.get("/health")
async def health():
    return {"status": "ok"}


@_router.get("/metrics")
async def prometheus(request: Request):
    service = _service(request)
    service.metrics.observe_load(service.scheduler)
    return Response(service.metrics.render(), media_type="text/plain; version=0.0.4")


@_router.get("/v1/models")
async def models(request: Request):
    return model_list(_service(request).name)


@_router.post("/v1/completions")
async def completions(body: CompletionBody, request: Request):
    service = _service(request)
    return await service.serve(body, service.prompt_ids(body), chat=False)


@_router.post("/v1/chat/completions")
async def chat(body: ChatBody, request: Request):
    service = _service(request)
    return await service.serve(body, service.chat_ids(body), chat=True)
