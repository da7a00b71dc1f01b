"""The endpoints: POST /v1/completions and /v1/chat/completions (stream: true as server-sent events in OpenAI's
chunk format), GET /v1/models, /health and /metrics. Bodies are parsed by hand rather than with pydantic models so
that every bad input is one 400 naming its field (OpenAI's error object), malformed JSON included."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request as HttpRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse

from specquant.errors import SpecquantError
from specquant.serve.config import ServeConfig
from specquant.serve.metrics import ServerMetrics
from specquant.serve.prefix import PrefixCache
from specquant.serve.requests import CHATML, RequestError, chat_ids_of, parse_request, prompt_ids_of
from specquant.serve.worker import EngineWorker, Job

# how often a non-streaming request checks that its client is still there
DISCONNECT_POLL_S = 0.2


def chat_template_of(tokenizer, option: str) -> str | None:
    """The template chat requests use: the --chat-template option, else the tokenizer's own; None: no chat."""
    if option == "chatml":
        return CHATML
    if option:
        path = Path(option).expanduser()
        if not path.is_file():
            raise SpecquantError(f"chat template {option!r} is not a file; pass a Jinja template file or 'chatml'")
        return path.read_text()
    return getattr(tokenizer, "chat_template", None) or None


def _error(e: RequestError, headers: dict | None = None) -> JSONResponse:
    kind = "invalid_request_error" if e.status < 500 else "server_error"
    return JSONResponse({"error": {"message": str(e), "type": kind, "param": e.param, "code": None}},
                        status_code=e.status, headers=headers)


def create_app(engine, tokenizer, config: ServeConfig, model_name: str, threads: int = 0) -> FastAPI:
    """A FastAPI app over engine (a SpecEngine) and its target's tokenizer; the worker thread runs while the app
    is served (lifespan)."""
    config = config.validate()
    template = chat_template_of(tokenizer, config.chat_template)
    context = engine.target.config.max_position_embeddings
    metrics = ServerMetrics(config.mal_window, config.mal_warn_below)
    prefix = (PrefixCache(engine.target, config.prefix_cache_entries, config.prefix_cache_mib << 20,
                          config.prefix_cache_block, metrics) if config.prefix_cache else None)
    worker = EngineWorker(engine, tokenizer, metrics, config.max_queue, threads, prefix)

    @asynccontextmanager
    async def lifespan(app):
        worker.start()
        yield
        await asyncio.to_thread(worker.stop)

    app = FastAPI(title="specquant", lifespan=lifespan)
    app.state.worker, app.state.metrics = worker, metrics

    @app.get("/health")
    async def health():
        return {"status": "ok" if worker.thread.is_alive() else "engine worker stopped"}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "specquant",
                                            "max_model_len": context}]}

    async def serve(http: HttpRequest, endpoint: str, chat: bool):
        arrival = time.perf_counter()
        try:
            try:
                body = json.loads(await http.body())
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise RequestError(None, f"the body is not valid JSON ({e})") from None
            if isinstance(body, dict) and body.get("model") not in (None, model_name):
                raise RequestError("model", f"model {body['model']!r} is not served here; use {model_name!r}", 404)
            ids_of = ((lambda b: chat_ids_of(b, tokenizer, template)) if chat
                      else (lambda b: prompt_ids_of(b, tokenizer)))
            request = parse_request(body, ids_of, config, context, chat=chat)
        except RequestError as e:
            metrics.requests.labels(endpoint, "invalid").inc()
            return _error(e)
        job = Job(request, endpoint, arrival, asyncio.get_running_loop())
        if not worker.submit(job):
            metrics.requests.labels(endpoint, "rejected").inc()
            return _error(RequestError(None, f"the server's queue is full ({config.max_queue} requests); retry "
                                             f"after {config.retry_after_s} s", 503),
                          headers={"Retry-After": str(config.retry_after_s)})
        first = await _next_event(job, http, worker)
        if first is None:
            return Response(status_code=499)  # the client left while waiting; nobody reads this
        if first[0] == "error":
            return _failure(first[1])
        reply = Reply(chat, model_name)
        if request.stream:
            return StreamingResponse(_sse(job, reply, request.include_usage, worker),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        parts = []
        while (event := await _next_event(job, http, worker)) is not None:
            if event[0] == "text":
                parts.append(event[1])
            elif event[0] == "done":
                return JSONResponse(reply.full("".join(parts), event[1], event[2]))
            else:
                return _failure(event[1])
        return Response(status_code=499)

    @app.post("/v1/completions")
    async def completions(http: HttpRequest):
        return await serve(http, "completions", chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(http: HttpRequest):
        return await serve(http, "chat", chat=True)

    return app


def _failure(e: Exception) -> JSONResponse:
    return _error(e if isinstance(e, RequestError) else RequestError(None, f"the engine failed: {e}", 500))


async def _next_event(job: Job, http: HttpRequest, worker: EngineWorker):
    """The job's next event, or None (job cancelled) once the client disconnected."""
    while True:
        try:
            return await asyncio.wait_for(job.events.get(), DISCONNECT_POLL_S)
        except asyncio.TimeoutError:
            if await http.is_disconnected():
                worker.cancel(job)
                return None


class Reply:
    """OpenAI's response and chunk objects for one request."""

    def __init__(self, chat: bool, model: str):
        self.chat, self.model = chat, model
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def _wrap(self, obj: str, choices: list, usage: dict | None = None) -> dict:
        out = {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}
        if usage is not None:
            out["usage"] = usage
        return out

    def full(self, text: str, finish: str, usage: dict) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": finish}
            return self._wrap("chat.completion", [choice], usage)
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        return self._wrap("text_completion", [choice], usage)

    def chunk(self, text: str | None, finish: str | None = None, first: bool = False) -> dict:
        if self.chat:
            delta = {"role": "assistant", "content": ""} if first else ({} if text is None else {"content": text})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            return self._wrap("chat.completion.chunk", [choice])
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        return self._wrap("text_completion", [choice])

    def usage_chunk(self, usage: dict) -> dict:
        return self._wrap("chat.completion.chunk" if self.chat else "text_completion", [], usage)


def _data(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


async def _sse(job: Job, reply: Reply, include_usage: bool, worker: EngineWorker):
    """The stream's events as SSE. A client that disconnects cancels this generator (Starlette), which cancels
    the job."""
    try:
        if reply.chat:
            yield _data(reply.chunk(None, first=True))
        while True:
            event = await job.events.get()
            if event[0] == "text":
                yield _data(reply.chunk(event[1]))
            elif event[0] == "done":
                yield _data(reply.chunk(None, finish=event[1]))
                if include_usage:
                    yield _data(reply.usage_chunk(event[2]))
                break
            else:  # headers are sent: the error goes in the stream, as OpenAI's servers do
                e = event[1]
                yield _data({"error": {"message": str(e), "type": "server_error", "param": None, "code": None}})
                break
        yield "data: [DONE]\n\n"
    finally:
        worker.cancel(job)  # a no-op once the job has finished
