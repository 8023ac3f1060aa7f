"""The OpenAI-compatible HTTP server (FastAPI): ``/v1/chat/completions``, ``/v1/models``, ``/health``, ``/metrics``.

Handlers validate a request (:mod:`pask.serving.protocol`; 4xx with an OpenAI error body on bad
input), check it against the KV capacity and hand it to the decode thread
(:class:`~pask.serving.worker.Worker`), then await its end or stream its tokens as server-sent
events (``chat.completion.chunk`` objects, ending with ``data: [DONE]``). A client that
disconnects cancels its request, streamed or not: its cache rows are freed at the next step boundary.

:class:`Limits` holds the controls (``pask serve`` options; docs/serving.md, "Limits and
controls"), checked in this order: the API key of ``/v1/*`` (401), a JSON Content-Type on POST
(415), the body size, from Content-Length and then as the body arrives (413), the queue of
requests not yet decoding (429 with ``Retry-After``), validation (400 / 404), a live decode
thread (503) and the deadline from arrival (504; a stream that already began ends with an error
event instead). Parsing, chat templating, tokenisation and grammar compilation run in a worker
thread, never on the event loop, so ``/health`` answers while a large body is processed.
"""

from __future__ import annotations

import asyncio
import hmac
import math
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.datastructures import Headers
from starlette.requests import ClientDisconnect

from pask.errors import PaskError
from pask.meta.selection import Constraints
from pask.meta.selector import MetaSelector
from pask.runtime.capacity import CapacityError
from pask.runtime.models import LoadedModel
from pask.runtime.scheduler import Job, Scheduler
from pask.serving.metrics import Metrics
from pask.serving.protocol import (
    DEFAULT_MAX_TOKENS,
    ChatRequest,
    RequestError,
    attach_tagging,
    build_chat_request,
    chunk,
    completion_body,
    finish_reason,
    parse_body,
    sse,
    tool_calls_of,
    usage,
)
from pask.serving.worker import Worker
from pask.tasks.function_calling import TOOL_CALL_OPEN

MAX_BODY_BYTES = 1 << 20  # 1 MiB: ~250k tokens of text, far above the served models' contexts
MAX_QUEUE = 64  # requests accepted but not yet decoding
REQUEST_TIMEOUT_S = 300.0
RETRY_AFTER_S = 2  # the Retry-After of a 429
DISCONNECT_POLL_S = 0.25  # how often a non-streaming handler checks that its client is still there


@dataclass
class Limits:
    """The server's limits and access controls (read at every request; docs/serving.md, "Limits and controls").

    ``max_body_bytes``: larger bodies get 413. ``max_queue``: requests accepted but not yet
    decoding (being validated or waiting for admission); one more gets 429. ``request_timeout``:
    seconds from arrival to the last token (None or 0: no deadline); past it the request is
    cancelled (504, or an error event in a stream). ``api_key``: when set, ``/v1/*`` needs
    ``Authorization: Bearer <key>`` (401). ``docs``: serve ``/docs``, ``/redoc`` and
    ``/openapi.json`` (read when the app is created).
    """

    max_body_bytes: int = MAX_BODY_BYTES
    max_queue: int = MAX_QUEUE
    request_timeout: float | None = REQUEST_TIMEOUT_S
    api_key: str | None = None
    docs: bool = False

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1:
            raise PaskError(f"--max-body-bytes must be >= 1, got {self.max_body_bytes}")
        if self.max_queue < 1:
            raise PaskError(f"--max-queue must be >= 1, got {self.max_queue}")
        if self.request_timeout is not None and not self.request_timeout >= 0:
            raise PaskError(f"--request-timeout must be >= 0 (0: no deadline), got {self.request_timeout}")
        if self.api_key is not None and not self.api_key.strip():
            raise PaskError("the API key is empty")


class Refusal(Exception):
    """A request refused before or instead of decoding: status, OpenAI-style error body, metrics outcome."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        code: str | None = None,
        outcome: str = "rejected",
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.kind, self.code, self.outcome, self.headers = status, kind, code, outcome, headers

    def response_body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": None, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.response_body(), status_code=self.status, headers=self.headers)


def _timeout(seconds: float | None) -> Refusal:
    return Refusal(
        504,
        f"the request did not finish within the server's deadline of {seconds:g} s",
        "timeout_error",
        "request_timeout",
        "timeout",
    )


@dataclass
class Service:
    """What the app serves: one model, its scheduler (behind the decode thread), the metrics and the limits."""

    lm: LoadedModel
    worker: Worker
    default_max_tokens: int = DEFAULT_MAX_TOKENS
    limits: Limits = field(default_factory=Limits)
    selector: MetaSelector | None = None  # each request's configuration is chosen (pask serve --policy meta)
    preparing: int = field(default=0, init=False)  # requests past the queue check, not yet handed to the worker

    @property
    def scheduler(self) -> Scheduler:
        return self.worker.scheduler

    @property
    def metrics(self) -> Metrics:
        return self.worker.metrics

    @classmethod
    def build(cls, lm: LoadedModel, policy_factory: Callable, capacity_tokens: int | None = None, **kw) -> Service:
        """A scheduler and its worker (not started) for ``lm``; ``kw``: Scheduler options, default_max_tokens,
        limits (a :class:`Limits`; default: ``Limits()``) and selector (a
        :class:`~pask.meta.selector.MetaSelector`: ``policy_factory`` is then its union probe, and every
        request gets the policy chosen for it)."""
        default = kw.pop("default_max_tokens", DEFAULT_MAX_TOKENS)
        limits = kw.pop("limits", None) or Limits()
        selector = kw.pop("selector", None)
        if selector is not None:
            policy_factory = selector.probe
        scheduler = Scheduler(lm, policy_factory, capacity_tokens, **kw)
        metrics = Metrics(model=lm.name, policy=scheduler.policy_name)
        return cls(lm, Worker(scheduler, metrics), default, limits, selector)

    def queue_depth(self) -> int:
        """Requests accepted and not yet decoding: being validated, or waiting for admission."""
        return self.preparing + self.worker.waiting()

    def prepare(self, body: dict) -> ChatRequest:
        """Validate a body, fit max_tokens to the capacity, attach tagging (RequestError on bad input)."""
        tok, sch = self.lm.tokenizer, self.scheduler
        with sch.tokenizer_lock:
            chat = build_chat_request(body, tok, self.lm.name, self.default_max_tokens)
        r = chat.request
        if not chat.max_tokens_given:  # the default shrinks to what the capacity and the context allow
            limits = [r.max_new_tokens, sch.capacity.max_new_tokens(len(r.prompt_ids))]
            if sch.max_context is not None:
                limits.append(sch.max_context - len(r.prompt_ids))
            r.max_new_tokens = max(1, min(x for x in limits if x is not None))
            r.close_margin = min(r.close_margin, r.max_new_tokens // 4)
        try:
            sch.check(len(r.prompt_ids), r.max_new_tokens)
        except CapacityError as e:
            raise RequestError(str(e), param="messages", code="context_length_exceeded") from None
        if chat.limits is not None and self.selector is None:
            raise RequestError(
                "'pask' limits choose a KV configuration per request, and this server runs one policy "
                f"({sch.policy_name}); start it with --policy meta",
                param="pask",
            )
        if sch.needs_tags:
            with sch.tokenizer_lock:
                attach_tagging(chat, tok)
        if self.selector is not None:
            given = Constraints(**chat.limits) if chat.limits is not None else None
            chat.choice = self.selector.choose(r.prompt_ids, r.prompt_labels, given)
        return chat

    def open(self, chat: ChatRequest):
        """Hand a prepared request to the decode thread (with its chosen policy on a meta server)."""
        policy = None
        if chat.choice is not None:
            policy = self.selector.policy(chat.choice.candidate)
            self.metrics.chose(chat.choice.candidate)
        return self.worker.open(chat.id, chat.request, policy)


class _Guard:
    """ASGI middleware: the API key of ``/v1/*`` (401), a JSON Content-Type on POST (415), a
    Content-Length over the limit (413), all before the app reads anything."""

    def __init__(self, app, service: Service) -> None:
        self.app, self.service = app, service

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            try:
                self.check(scope)
            except Refusal as e:
                self.service.metrics.count(e.outcome)
                await e.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def check(self, scope) -> None:
        lim, headers = self.service.limits, Headers(scope=scope)
        path = scope["path"]
        if lim.api_key and (path == "/v1" or path.startswith("/v1/")):
            scheme, _, given = headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), lim.api_key.encode()):
                raise Refusal(
                    401,
                    "missing or incorrect API key: send 'Authorization: Bearer <key>'",
                    code="invalid_api_key",
                    outcome="unauthorized",
                    headers={"WWW-Authenticate": "Bearer"},
                )
        if scope["method"] != "POST":
            return
        media = headers.get("content-type", "").split(";")[0].strip().lower()
        if media != "application/json":
            raise Refusal(
                415, f"Content-Type must be application/json, got '{media or 'none'}'", code="unsupported_media_type"
            )
        length = headers.get("content-length")
        if length is not None:
            if not length.strip().isdigit():
                raise Refusal(400, f"bad Content-Length '{length}'")
            if int(length) > lim.max_body_bytes:
                raise _too_large(lim.max_body_bytes)


def _too_large(limit: int) -> Refusal:
    return Refusal(413, f"the request body is over the server's limit of {limit} bytes", code="request_too_large")


async def _read_body(http: HttpRequest, limit: int) -> bytes:
    """The body, refused (413) as soon as it grows past ``limit`` (chunked bodies have no Content-Length)."""
    parts, size = [], 0
    async for part in http.stream():
        size += len(part)
        if size > limit:
            raise _too_large(limit)
        parts.append(part)
    return b"".join(parts)


def create_app(service: Service) -> FastAPI:
    """The FastAPI app; its lifespan starts and stops the decode thread. ``service.limits`` is read
    at every request, except ``docs`` (read here)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        service.worker.start()
        yield
        await asyncio.to_thread(service.worker.stop)

    docs = service.limits.docs
    app = FastAPI(
        title="pask",
        lifespan=lifespan,
        docs_url="/docs" if docs else None,
        redoc_url="/redoc" if docs else None,
        openapi_url="/openapi.json" if docs else None,
    )
    app.add_middleware(_Guard, service=service)
    name = service.lm.name

    def error(e: RequestError) -> JSONResponse:
        service.metrics.count("rejected")
        return JSONResponse(e.body(), status_code=e.status)

    def refused(e: Refusal) -> JSONResponse:
        service.metrics.count(e.outcome)
        return e.response()

    @app.get("/health")
    async def health() -> JSONResponse:
        """200 while the decode thread runs, 503 once it is dead."""
        alive = service.worker.alive
        body = {
            "status": "ok" if alive else "unavailable",
            "model": name,
            "policy": service.scheduler.policy_name,
            "decode_thread": "alive" if alive else "dead",
            "queued": service.queue_depth(),
        }
        return JSONResponse(body, status_code=200 if alive else 503)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "pask"}]}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(service.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.post("/v1/chat/completions")
    async def chat_completions(http: HttpRequest):
        lim, loop = service.limits, asyncio.get_running_loop()
        timeout = lim.request_timeout or None
        deadline = loop.time() + timeout if timeout else math.inf
        try:
            if service.queue_depth() >= lim.max_queue:
                raise Refusal(
                    429,
                    f"the server's queue is full ({lim.max_queue} requests waiting); retry later",
                    "rate_limit_error",
                    "queue_full",
                    "overloaded",
                    {"Retry-After": str(RETRY_AFTER_S)},
                )
            service.preparing += 1
            try:
                async with asyncio.timeout_at(None if math.isinf(deadline) else deadline):
                    raw = await _read_body(http, lim.max_body_bytes)
                    # parsing, templating, tokenising, grammar compilation: in a thread, off the event loop
                    chat = await asyncio.to_thread(lambda: service.prepare(parse_body(raw)))
            except TimeoutError:
                raise _timeout(timeout) from None
            except ClientDisconnect:
                service.metrics.count("cancelled")
                return Response(status_code=499)
            finally:
                service.preparing -= 1
            if not service.worker.alive:
                raise Refusal(503, "the decode thread is not running", "server_error", "unavailable", "unavailable")
        except RequestError as e:
            return error(e)
        except Refusal as e:
            return refused(e)
        job, events = service.open(chat)
        if chat.stream:
            body = _stream(service, chat, job, events, deadline, timeout)
            return StreamingResponse(body, media_type="text/event-stream")
        try:
            end = await _await_end(http, events, deadline)
        except asyncio.CancelledError:
            service.worker.cancel(job.id)
            raise
        if end == "disconnected":  # nobody reads the answer: free the rows now
            service.worker.cancel(job.id)
            return Response(status_code=499)
        if end == "timeout":
            service.worker.cancel(job.id, "timeout")
            return _timeout(timeout).response()
        if job.stop == "error":
            return JSONResponse({"error": {"message": job.error, "type": "server_error"}}, status_code=500)
        extra = {
            "stop_reason": job.stop,
            "budget": job.budget,
            "tpot_ms": round(job.tpot_ms, 3),
            "step_ms": round(job.step_ms, 3),
            "prefill_ms": round(job.prefill_ms, 3),
        }
        if chat.choice is not None:
            extra["meta"] = chat.choice.to_json()
        return completion_body(chat, name, job.result.text, job.stop, len(job.generated), extra)

    return app


async def _next_event(events: asyncio.Queue, until: float) -> tuple | None:
    """The next worker event, or None once the loop's clock reaches ``until``."""
    if math.isinf(until):
        return await events.get()
    try:
        async with asyncio.timeout_at(until):
            return await events.get()
    except TimeoutError:
        return None


async def _await_end(http: HttpRequest, events: asyncio.Queue, deadline: float) -> str:
    """Wait for a job's end: ``done``, ``timeout`` (past ``deadline``) or ``disconnected`` (the client left)."""
    loop = asyncio.get_running_loop()
    next_poll = loop.time() + DISCONNECT_POLL_S
    while True:
        now = loop.time()
        if now >= deadline:
            while not events.empty():  # it may have ended just now
                if events.get_nowait()[0] == "done":
                    return "done"
            return "timeout"
        if now >= next_poll:
            if await http.is_disconnected():
                return "disconnected"
            next_poll = now + DISCONNECT_POLL_S
        item = await _next_event(events, min(next_poll, deadline))
        if item is not None and item[0] == "done":
            return "done"


async def _stream(
    service: Service,
    chat: ChatRequest,
    job: Job,
    events: asyncio.Queue,
    deadline: float = math.inf,
    timeout: float | None = None,
) -> AsyncIterator[str]:
    """Server-sent events of one request; a disconnect (cancellation) cancels the job; past
    ``deadline`` the job is cancelled and the stream ends with an error event and ``[DONE]``."""
    name, tok, lock = service.lm.name, service.lm.tokenizer, service.scheduler.tokenizer_lock

    def decode_locked(ids: list[int]) -> str:
        with lock:
            return tok.decode(ids, skip_special_tokens=False)

    async def decode(ids: list[int]) -> str:
        if lock.acquire(blocking=False):  # the usual case: decode here, a thread hop per token costs more
            try:
                return tok.decode(ids, skip_special_tokens=False)
            finally:
                lock.release()
        return await asyncio.to_thread(decode_locked, list(ids))  # another thread tokenises: do not block the loop

    # text | json stream content; tools buffer until the end; auto decides on the first characters
    mode = {"text": "content", "json": "content", "tools": "calls"}.get(chat.mode, "undecided")
    ids: list[int] = []
    sent = ""
    done = False
    try:
        yield sse(chunk(chat, name, {"role": "assistant", "content": ""}))
        while True:
            item = await _next_event(events, deadline)
            if item is None:
                done = True
                service.worker.cancel(job.id, "timeout")
                yield sse(_timeout(timeout).response_body())
                yield sse("[DONE]")
                return
            kind, value = item
            if kind == "done":
                done = True
                break
            ids.append(value)
            if mode == "calls":
                continue
            text = await decode(ids)
            if mode == "undecided":
                if TOOL_CALL_OPEN.startswith(text):
                    continue  # may still become a tool call
                mode = "calls" if text.startswith(TOOL_CALL_OPEN) else "content"
            if mode == "content" and not text.endswith("\ufffd") and len(text) > len(sent):
                yield sse(chunk(chat, name, {"content": text[len(sent) :]}))
                sent = text
        if job.stop == "error":
            yield sse({"error": {"message": job.error, "type": "server_error"}})
            yield sse("[DONE]")
            return
        text = job.result.text
        calls = tool_calls_of(text) if mode in ("calls", "undecided") else None
        if calls:
            for i, call in enumerate(calls):
                yield sse(chunk(chat, name, {"tool_calls": [{"index": i, **call}]}))
        elif len(text) > len(sent):
            yield sse(chunk(chat, name, {"content": text[len(sent) :]}))
        meta = {"pask": {"meta": chat.choice.to_json()}} if chat.choice is not None else {}
        yield sse(chunk(chat, name, {}, finish_reason(job.stop, calls), **meta))
        if chat.include_usage:
            yield sse(chunk(chat, name, None, usage=usage(len(chat.request.prompt_ids), len(job.generated))))
        yield sse("[DONE]")
    finally:
        if not done:
            service.worker.cancel(job.id)


def serve(service: Service, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> None:
    """Run the app with uvicorn until interrupted."""
    import uvicorn

    uvicorn.run(create_app(service), host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)


@contextmanager
def serve_in_thread(service: Service, start_timeout: float = 60, log_level: str = "warning") -> Iterator[str]:
    """The app on a free loopback port, uvicorn in a daemon thread, for the block; yields its base
    URL (``http://127.0.0.1:PORT``). Used by the load benchmark and the tests."""
    import socket
    import threading
    import time

    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(service), host="127.0.0.1", port=port, log_level=log_level))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + start_timeout
    while not server.started and time.time() < deadline and thread.is_alive():
        time.sleep(0.05)
    try:
        if not server.started:
            raise PaskError(f"the server did not start within {start_timeout:g} s")
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(60)
