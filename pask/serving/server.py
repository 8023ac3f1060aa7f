"""The OpenAI-compatible HTTP server (FastAPI): ``/v1/chat/completions``, ``/v1/models``, ``/health``, ``/metrics``.

Handlers validate a request (:mod:`pask.serving.protocol`; 4xx with an OpenAI error body on bad
input), check it against the KV capacity and hand it to the decode thread
(:class:`~pask.serving.worker.Worker`), then await its end or stream its tokens as server-sent
events (``chat.completion.chunk`` objects, ending with ``data: [DONE]``). A streaming client that
disconnects cancels its request: its cache rows are freed at the next step boundary.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

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


@dataclass
class Service:
    """What the app serves: one model, its scheduler (behind the decode thread) and the metrics."""

    lm: LoadedModel
    worker: Worker
    default_max_tokens: int = DEFAULT_MAX_TOKENS

    @property
    def scheduler(self) -> Scheduler:
        return self.worker.scheduler

    @property
    def metrics(self) -> Metrics:
        return self.worker.metrics

    @classmethod
    def build(cls, lm: LoadedModel, policy_factory: Callable, capacity_tokens: int | None = None, **kw) -> Service:
        """A scheduler and its worker (not started) for ``lm``; ``kw``: Scheduler options and default_max_tokens."""
        default = kw.pop("default_max_tokens", DEFAULT_MAX_TOKENS)
        scheduler = Scheduler(lm, policy_factory, capacity_tokens, **kw)
        metrics = Metrics(model=lm.name, policy=scheduler.policy_name)
        return cls(lm, Worker(scheduler, metrics), default)

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
        if sch.needs_tags:
            with sch.tokenizer_lock:
                attach_tagging(chat, tok)
        return chat


def create_app(service: Service) -> FastAPI:
    """The FastAPI app; its lifespan starts and stops the decode thread."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        service.worker.start()
        yield
        await asyncio.to_thread(service.worker.stop)

    app = FastAPI(title="pask", lifespan=lifespan)
    name = service.lm.name

    def error(e: RequestError) -> JSONResponse:
        service.metrics.count("rejected")
        return JSONResponse(e.body(), status_code=e.status)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "model": name, "policy": service.scheduler.policy_name}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "pask"}]}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(service.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.post("/v1/chat/completions")
    async def chat_completions(http: HttpRequest):
        try:
            chat = service.prepare(parse_body(await http.body()))
        except RequestError as e:
            return error(e)
        job, events = service.worker.open(chat.id, chat.request)
        if chat.stream:
            return StreamingResponse(_stream(service, chat, job, events), media_type="text/event-stream")
        try:
            while (await events.get())[0] != "done":
                pass
        except asyncio.CancelledError:
            service.worker.cancel(job.id)
            raise
        if job.stop == "error":
            return JSONResponse({"error": {"message": job.error, "type": "server_error"}}, status_code=500)
        extra = {
            "stop_reason": job.stop,
            "budget": job.budget,
            "tpot_ms": round(job.tpot_ms, 3),
            "step_ms": round(job.step_ms, 3),
            "prefill_ms": round(job.prefill_ms, 3),
        }
        return completion_body(chat, name, job.result.text, job.stop, len(job.generated), extra)

    return app


async def _stream(service: Service, chat: ChatRequest, job: Job, events: asyncio.Queue) -> AsyncIterator[str]:
    """Server-sent events of one request; a disconnect (cancellation) cancels the job."""
    name, tok, lock = service.lm.name, service.lm.tokenizer, service.scheduler.tokenizer_lock
    # text | json stream content; tools buffer until the end; auto decides on the first characters
    mode = {"text": "content", "json": "content", "tools": "calls"}.get(chat.mode, "undecided")
    ids: list[int] = []
    sent = ""
    done = False
    try:
        yield sse(chunk(chat, name, {"role": "assistant", "content": ""}))
        while True:
            kind, value = await events.get()
            if kind == "done":
                done = True
                break
            ids.append(value)
            if mode == "calls":
                continue
            with lock:
                text = tok.decode(ids, skip_special_tokens=False)
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
        yield sse(chunk(chat, name, {}, finish_reason(job.stop, calls)))
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
