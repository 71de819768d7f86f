"""OpenAI-compatible HTTP server: /v1/completions, /v1/chat/completions (JSON or SSE streaming),
/v1/models, /health, /metrics. Requests go to the continuous-batching scheduler, which runs in its
own thread; results come back to the event loop through per-request queues. Tokenizing runs in a
worker thread of its own, so a long prompt never stalls the event loop."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Callable

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..decoding.engine import Engine
from ..decoding.policy import SpecOverride, Speculation
from ..decoding.sampling import SamplingParams
from ..errors import SelfspecError
from . import params as body_params
from .auth import ApiKeyAuth, protected_paths
from .limits import BodyLimit, Limits
from .logprobs import ChatLogprobs, CompletionLogprobs, TokenTexts
from .metrics import Metrics
from .protocol import (
    SSE_DONE,
    ApiError,
    ChatBody,
    Choice,
    CompletionBody,
    Reply,
    _Common,
    error_body,
    error_response,
    invalid_body,
    model_list,
    reject_unsupported,
    sse,
    usage,
)
from .scheduler import Event, QueueFull, Scheduler, Submission

DISCONNECT_POLL_S = 0.25  # how often a request waiting for tokens checks that its client is still there
FINAL_EVENT_GRACE_S = 5.0  # at shutdown, how long cancelled requests get to send their final event


def create_app(
    engine: Engine,
    *,
    served_model_name: str | None = None,
    max_batch_size: int = 16,
    max_waiting: int = 64,
    max_request_tokens: int | None = None,
    max_body_bytes: int = Limits.max_body_bytes,
    max_messages: int = Limits.max_messages,
    max_message_chars: int | None = None,
    max_n: int = Limits.max_n,
    api_key: str | None = None,
    protect: tuple[str, ...] = (),
    docs: bool = False,
) -> FastAPI:
    """The app. max_request_tokens: the scheduler's cap on prompt + max_tokens per request; the max_*
    limits: see limits.Limits; api_key: Bearer auth on /v1/* and on what `protect` names
    (auth.PROTECTABLE); docs: serve /docs, /redoc and /openapi.json."""
    if protect and not api_key:
        raise ValueError("protecting endpoints needs an API key")
    protected_paths(protect)  # Starlette builds middleware at the first request: fail on a bad name now
    limits = Limits(max_body_bytes, max_messages, max_message_chars, max_n)
    metrics = Metrics()
    scheduler = Scheduler(
        engine,
        max_batch_size=max_batch_size,
        max_waiting=max_waiting,
        max_request_tokens=max_request_tokens,
        metrics=metrics,
    )
    service = Service(engine, scheduler, metrics, served_model_name or engine.name, limits)
    app = FastAPI(
        title="selfspec",
        version="0.1.0",
        lifespan=_lifespan,
        docs_url="/docs" if docs else None,
        redoc_url="/redoc" if docs else None,
        openapi_url="/openapi.json" if docs else None,
    )
    app.state.service = service
    app.state.scheduler, app.state.metrics, app.state.engine = scheduler, metrics, engine
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _internal_error)
    app.include_router(_router)
    app.add_middleware(BodyLimit, max_bytes=limits.max_body_bytes)
    if api_key:  # added last = outermost: a request without the key never gets its body read
        app.add_middleware(ApiKeyAuth, api_key=api_key, protect=tuple(protect))
    return app


class ClientGone(Exception):
    """The client of a non-streaming request disconnected while it waited."""


def shutting_down() -> ApiError:
    return ApiError(503, "the server is shutting down: retry later", code="shutting_down", kind="server_error")


def _event_error(ev: Event) -> ApiError:
    if 400 <= ev.status < 500:
        return ApiError(ev.status, ev.error)
    return ApiError(ev.status if ev.status >= 500 else 500, ev.error, kind="server_error")


@dataclass(eq=False)
class Flight:
    """One request in the scheduler: a submission per choice, and the queue their events arrive on as
    (choice index, Event). The server can put (None, ApiError) there to end the request early."""

    scheduler: Scheduler
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    subs: list[Submission] = field(default_factory=list)
    finished: set[int] = field(default_factory=set)
    checked: float = 0.0  # when the client's connection was last checked (event loop time)

    def emitter(self, index: int) -> Callable[[Event], None]:
        # the scheduler emits from its own thread: hop back onto this event loop before touching the queue
        loop = asyncio.get_running_loop()
        return lambda ev: loop.call_soon_threadsafe(self.queue.put_nowait, (index, ev))

    def abort(self, error: ApiError) -> None:
        self.queue.put_nowait((None, error))
        self.cancel()

    def cancel(self) -> None:
        """Frees the blocks of every choice still running (a no-op for finished ones)."""
        for i, sub in enumerate(self.subs):
            if i not in self.finished:
                self.scheduler.cancel(sub)


@dataclass(frozen=True)
class Plan:
    """What a validated request asks for, beyond its prompt."""

    chat: bool
    params: list[SamplingParams]  # one per choice
    speculation: Speculation
    category: str | None
    stream: bool
    include_usage: bool
    logprobs: bool
    echo: bool


class Service:
    """Everything a request needs beyond its body, so the route handlers can stay one-liners."""

    def __init__(self, engine: Engine, scheduler: Scheduler, metrics: Metrics, name: str, limits: Limits) -> None:
        self.engine, self.scheduler, self.metrics, self.name = engine, scheduler, metrics, name
        self.limits = limits.for_context(engine.max_model_len)
        self.texts = TokenTexts(engine.tokenizer)
        # One worker thread does all prompt tokenizing and chat templating, off the event loop (the
        # Rust tokenizer releases the GIL, so streams keep flowing meanwhile). One, not a pool: a fast
        # tokenizer raises "Already borrowed" when two threads use the same instance at once.
        self.tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="selfspec-tokenize")
        self.flights: set[Flight] = set()
        self.draining = False

    # ---- the two endpoints ------------------------------------------------------------------------------
    async def completions(self, body: CompletionBody, request: Request):
        plan = self.plan(body, chat=False)
        prompt = self._prompt(body)
        tokenizer = self.engine.tokenizer
        ids = (
            await self._in_tokenizer_thread(lambda: tokenizer(prompt).input_ids) if isinstance(prompt, str) else prompt
        )
        echo = ""
        if plan.echo:  # the prompt as text: as sent, or its token ids decoded
            echo = prompt if isinstance(prompt, str) else await self._in_tokenizer_thread(tokenizer.decode, ids)
        return await self.serve(plan, ids, request, echo)

    async def chat(self, body: ChatBody, request: Request):
        plan = self.plan(body, chat=True)
        self.limits.check_messages([m.content for m in body.messages])
        messages = [{"role": m.role, "content": m.content} for m in body.messages]
        ids = await self._in_tokenizer_thread(self._encode_chat, messages)
        return await self.serve(plan, ids, request)

    # ---- request -> plan and token ids ------------------------------------------------------------------
    def plan(self, body: _Common, chat: bool) -> Plan:
        """Every check that needs no tokenizing, cheapest first."""
        if self.draining:
            raise shutting_down()
        if body.model != self.name:
            message = f"model {body.model!r} is not served here; this server serves {self.name!r}"
            raise ApiError(404, message, "model", "model_not_found")
        reject_unsupported(body)
        vocab = self.engine.model.config.vocab_size
        params = body_params.sampling_params(body, chat=chat, vocab_size=vocab, max_n=self.limits.max_n)
        return Plan(
            chat=chat,
            params=params,
            speculation=self.speculation(body),
            category=body.category,
            stream=body.stream,
            include_usage=bool((body.stream_options or {}).get("include_usage")),
            logprobs=params[0].logprobs is not None,
            echo=bool(getattr(body, "echo", False)),
        )

    def _prompt(self, body: CompletionBody) -> str | list[int]:
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            if len(prompt) != 1:
                raise ApiError(400, f"prompt holds {len(prompt)} strings: send one prompt per request", "prompt")
            prompt = prompt[0]
        if not prompt or (isinstance(prompt, str) and not prompt.strip()):
            raise ApiError(400, "prompt is empty", "prompt")
        if isinstance(prompt, str):
            self.limits.check_text(prompt, "prompt")
            return prompt
        vocab = self.engine.model.config.vocab_size
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise ApiError(400, f"prompt token ids must lie in [0, {vocab})", "prompt")
        return list(prompt)

    def _encode_chat(self, messages: list[dict]) -> list[int]:  # in the tokenizer thread
        try:
            return self.engine.encode(messages)
        except SelfspecError as e:
            raise ApiError(400, str(e), "messages") from None
        except Exception as e:  # a chat template that refuses this conversation (roles out of order, ...)
            raise ApiError(400, f"the chat template rejected these messages: {e}", "messages") from None

    async def _in_tokenizer_thread(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.tokenizer_thread, fn, *args)

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

    # ---- scheduling -------------------------------------------------------------------------------------
    async def serve(self, plan: Plan, ids: list[int], request: Request, echo: str = ""):
        limit = self.engine.max_model_len
        if len(ids) >= limit:
            raise ApiError(
                400,
                f"prompt has {len(ids)} tokens but the context holds {limit}: shorten it",
                "messages" if plan.chat else "prompt",
                "context_length_exceeded",
            )
        flight = self._submit(plan, ids)
        reply = Reply.new(self.name, plan.chat)
        try:
            if not plan.stream:
                return await self._collect(flight, plan, reply, request, echo)
            # Wait for the first event before sending the 200: an error the scheduler finds in this
            # request (it cannot fit, ...) is still an HTTP error then, not an SSE chunk.
            first = await self._next(flight, request)
        except ClientGone:
            self._close(flight)
            return Response(status_code=499)  # nobody reads it; uvicorn drops it
        except BaseException:
            self._close(flight)
            raise
        stream = self._stream(flight, plan, reply, first, echo)
        # background: also closes a flight whose stream never started (a client gone at once)
        background = BackgroundTask(self._close, flight)
        return StreamingResponse(stream, media_type="text/event-stream", background=background)

    def _submit(self, plan: Plan, ids: list[int]) -> Flight:
        if self.draining:
            raise shutting_down()
        flight = Flight(self.scheduler)
        try:
            for i, params in enumerate(plan.params):
                sub = Submission(ids, params, flight.emitter(i), plan.speculation, plan.category)
                flight.subs.append(self.scheduler.submit(sub))
        except QueueFull as e:
            flight.cancel()
            raise ApiError(
                429, str(e), code="overloaded", kind="rate_limit_error", headers={"Retry-After": "1"}
            ) from None
        except SelfspecError as e:
            flight.cancel()
            raise ApiError(400, str(e)) from None
        self.flights.add(flight)
        return flight

    def _close(self, flight: Flight) -> None:
        flight.cancel()
        self.flights.discard(flight)

    async def _next(self, flight: Flight, request: Request | None) -> tuple[int, Event]:
        """The next event of any choice. Raises the ApiError an error event stands for, or ClientGone
        when `request`'s client has disconnected (a streaming response learns that from Starlette)."""
        while True:
            if request is None:
                index, item = await flight.queue.get()
            else:
                try:
                    index, item = await asyncio.wait_for(flight.queue.get(), DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    index, item = None, None
                if await self._gone(flight, request):
                    raise ClientGone
                if item is None:
                    continue
            if isinstance(item, ApiError):
                raise item
            if item.error:
                raise _event_error(item)
            if item.finish_reason is not None:
                flight.finished.add(index)
            return index, item

    @staticmethod
    async def _gone(flight: Flight, request: Request) -> bool:
        # at most every DISCONNECT_POLL_S: events may arrive far more often than that
        now = asyncio.get_running_loop().time()
        if now - flight.checked < DISCONNECT_POLL_S:
            return False
        flight.checked = now
        return await request.is_disconnected()

    # ---- responses --------------------------------------------------------------------------------------
    def _logprobs(self, plan: Plan, echo: str) -> CompletionLogprobs | ChatLogprobs | None:
        """One choice's logprobs, built up event by event (None: not asked for)."""
        if not plan.logprobs:
            return None
        return ChatLogprobs(self.texts) if plan.chat else CompletionLogprobs(self.texts, offset=len(echo))

    async def _collect(self, flight: Flight, plan: Plan, reply: Reply, request: Request, echo: str) -> dict:
        n = len(plan.params)
        texts = [[echo] for _ in range(n)]
        logprobs = [self._logprobs(plan, echo) for _ in range(n)]
        reasons, stats = [None] * n, [None] * n
        while len(flight.finished) < n:
            i, ev = await self._next(flight, request)
            texts[i].append(ev.text)
            if logprobs[i]:
                logprobs[i].add(ev.logprobs or [])
            if ev.finish_reason is not None:
                reasons[i], stats[i] = ev.finish_reason, ev.stats
        choices = [
            Choice(i, "".join(texts[i]), reasons[i], logprobs[i].total if logprobs[i] else None) for i in range(n)
        ]
        return reply.completion(choices, usage(stats))

    async def _stream(self, flight: Flight, plan: Plan, reply: Reply, first: tuple[int, Event], echo: str):
        n = len(plan.params)
        logprobs = [self._logprobs(plan, echo) for _ in range(n)]
        stats = [None] * n
        try:
            for i in range(n):
                if plan.chat:
                    yield sse(reply.chunk(i, None, None, role=True))
                if echo:
                    yield sse(reply.chunk(i, echo, None))
            i, ev = first
            while True:
                if ev.text or (logprobs[i] and ev.token_ids):  # tokens whose text is held back still have logprobs
                    lp = logprobs[i].add(ev.logprobs or []) if logprobs[i] else None
                    yield sse(reply.chunk(i, ev.text, None, logprobs=lp))
                if ev.finish_reason is not None:
                    stats[i] = ev.stats
                    yield sse(reply.chunk(i, None if plan.chat else "", ev.finish_reason))
                    if len(flight.finished) == n:
                        break
                i, ev = await self._next(flight, None)
            if plan.include_usage:
                yield sse(reply.usage_chunk(usage(stats)))
        except ApiError as e:
            # the 200 and its headers are already sent: the error can only travel as a chunk
            yield sse(error_body(e.message, e.kind, e.param, e.code))
        finally:
            self._close(flight)  # the client may have gone mid-stream: free its blocks
        yield SSE_DONE

    # ---- shutdown ---------------------------------------------------------------------------------------
    async def drain(self, timeout: float, now: asyncio.Event) -> None:
        """Stops admitting; lets the requests in flight finish for up to `timeout` seconds (or until
        `now` is set); then ends the rest with a final error event, and gives them a moment to send it."""
        self.draining = True
        await self._wait_for_flights(timeout, now)
        for flight in list(self.flights):
            flight.abort(shutting_down())
        await self._wait_for_flights(FINAL_EVENT_GRACE_S)

    async def _wait_for_flights(self, timeout: float, now: asyncio.Event | None = None) -> None:
        deadline = asyncio.get_running_loop().time() + timeout
        while self.flights and asyncio.get_running_loop().time() < deadline and not (now and now.is_set()):
            await asyncio.sleep(0.05)


# ---- app wiring ---------------------------------------------------------------------------------------
# Module-level handlers reach the per-app Service through request.app, so one router serves every app.
_router = APIRouter()


def _service(request: Request) -> Service:
    return request.app.state.service


@asynccontextmanager
async def _lifespan(app: FastAPI):
    service = app.state.service
    service.scheduler.start()
    yield
    service.scheduler.stop()
    service.tokenizer_thread.shutdown(wait=False, cancel_futures=True)


async def _api_error(_: Request, e: ApiError):
    return error_response(e)


async def _validation_error(_: Request, e: RequestValidationError):
    return error_response(invalid_body(e.errors()))


async def _http_error(request: Request, e: StarletteHTTPException):
    # Starlette's own errors (an unknown path, a wrong method), in OpenAI's shape instead of {"detail"}
    message = f"{request.method} {request.url.path}: {e.detail}"
    return error_response(ApiError(e.status_code, message, headers=e.headers))


async def _internal_error(_: Request, e: Exception):
    # Starlette still logs the traceback; the client gets OpenAI's shape, not a plain-text 500
    return error_response(ApiError(500, f"internal error: {type(e).__name__}", kind="server_error"))


@_router.get("/health")
async def health(request: Request):
    if _service(request).draining:  # a load balancer should stop sending requests here
        return error_response(shutting_down())
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
    return await _service(request).completions(body, request)


@_router.post("/v1/chat/completions")
async def chat(body: ChatBody, request: Request):
    return await _service(request).chat(body, request)
