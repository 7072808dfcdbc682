"""The OpenAI-compatible HTTP API, beside gRPC on the same SchedulerThread.

Endpoints: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (streamed as
Server-Sent Events with `"stream": true`, else one JSON body), GET /health, GET /metrics
(Prometheus text). Errors use OpenAI's shape, {"error": {"message", "type", "param", "code"}}:
400 for a bad request (naming the field; also a body that is not JSON or not UTF-8), 401 without
the bearer token when one is configured (everything but /health needs it), 404 for an unknown
model or path, 413 for a body over --max-request-bytes (refused on its Content-Length, else as
soon as the bytes read pass the limit), 429 when --max-waiting-requests requests already wait to
start or the body finds no room within --max-request-bytes-in-flight (coordinator.frontend.request_gate:
the body is read only once it has room), 503 while the model loads or the server drains. Prompts
are tokenized on the tokenizer thread (coordinator.frontend.tokenizer_pool). Request shapes and defaults:
coordinator.frontend.openai_requests.

A streamed request's status is decided before its first byte: the handler waits for the first
round's tokens, so a request the scheduler refuses (context length, KV blocks) still gets a 400.
A client that disconnects, mid-stream or while waiting for a whole response, cancels its request:
coordinator.frontend.request_stream aborts it and its KV blocks are freed on the next round.
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import itertools
import json
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from pathlib import PurePath

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from coordinator.frontend.openai_errors import OpenAIError, invalid
from coordinator.frontend.openai_requests import ChatCompletionRequest, CompletionRequest, build_request, parse
from coordinator.frontend.openai_responses import ResponseShape, usage
from coordinator.frontend.request_gate import QueueFull, RequestBytes, RequestGate
from coordinator.frontend.request_limits import RequestLimits
from coordinator.frontend.request_stream import RequestFailed, stream_request
from coordinator.frontend.tokenizer_pool import TokenizerPool
from coordinator.replicas.scheduler_thread import SchedulerThread
from coordinator.telemetry.prometheus_metrics import CONTENT_TYPE, PrometheusMetrics

UNAUTHORIZED = OpenAIError(401, "missing or wrong API key: send 'Authorization: Bearer <token>'",
                           code="invalid_api_key")
# RequestFailed.kind -> what an HTTP client gets
FAILURE_STATUS = {"unavailable": (503, "service_unavailable"), "deadline": (504, "deadline_exceeded"),
                  "internal": (500, "internal_error")}


def sse(payload: dict | str) -> bytes:
    """One Server-Sent Event: `data: <json>` and a blank line."""
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


def overloaded(error: QueueFull) -> OpenAIError:
    return OpenAIError(429, str(error), code="rate_limit_exceeded", error_type="rate_limit_error")


def failure_error(failure: RequestFailed) -> OpenAIError:
    if failure.kind == "invalid":
        return invalid(failure.message)
    status, code = FAILURE_STATUS.get(failure.kind, FAILURE_STATUS["internal"])
    return OpenAIError(status, failure.message, code=code)


class EventStream(StreamingResponse):
    """A StreamingResponse that always closes its body iterator, even when the client went away
    while the iterator was suspended between events (its cleanup aborts the request)."""

    media_type = "text/event-stream"

    def __init__(self, content) -> None:
        # No caching, and no buffering by proxies (nginx honours X-Accel-Buffering): events must flow.
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


class HttpApi:
    """`app` is the ASGI application; GenerationServer serves it with coordinator.frontend.http_server."""

    def __init__(self, scheduler: SchedulerThread, tokenizers: TokenizerPool, limits: RequestLimits,
                 gate: RequestGate, metrics: PrometheusMetrics, auth_token: str | None = None,
                 warnings: Sequence[str] = ()):
        self.scheduler, self.tokenizers, self.gate, self.metrics = scheduler, tokenizers, gate, metrics
        self.limits = limits
        self.warnings = list(warnings)  # unsafe exposure (ServerConfig.exposure_warnings), shown on /health
        self._expected_auth = f"Bearer {auth_token}".encode() if auth_token else None
        self._ids = itertools.count()
        self._prefix = uuid.uuid4().hex[:8]
        self._created = int(time.time())
        self.app = app = FastAPI(title="specdec", docs_url=None, redoc_url=None, openapi_url=None)
        app.add_exception_handler(OpenAIError, self._openai_error)
        app.add_exception_handler(HTTPException, self._http_error)
        app.add_exception_handler(Exception, self._internal_error)
        app.add_api_route("/health", self.health, methods=["GET"])
        app.add_api_route("/metrics", self.prometheus, methods=["GET"])
        app.add_api_route("/v1/models", self.models, methods=["GET"])
        app.add_api_route("/v1/models/{model:path}", self.model, methods=["GET"])
        app.add_api_route("/v1/completions", self.completions, methods=["POST"])
        app.add_api_route("/v1/chat/completions", self.chat_completions, methods=["POST"])

    # -- errors ---------------------------------------------------------------------------------
    @staticmethod
    async def _openai_error(request: Request, error: OpenAIError) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if error.status == 401 else None
        return JSONResponse(error.body(), status_code=error.status, headers=headers)

    @staticmethod
    async def _http_error(request: Request, error: HTTPException) -> JSONResponse:
        message = f"{request.method} {request.url.path}: {error.detail}"
        return JSONResponse(OpenAIError(error.status_code, message).body(), status_code=error.status_code,
                            headers=getattr(error, "headers", None))

    @staticmethod
    async def _internal_error(request: Request, error: Exception) -> JSONResponse:
        body = OpenAIError(500, f"internal error: {type(error).__name__}: {error}", code="internal_error").body()
        return JSONResponse(body, status_code=500)

    # -- checks, in the order a request meets them ------------------------------------------------
    def _authorize(self, request: Request) -> None:
        if self._expected_auth is None:
            return
        given = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(given, self._expected_auth):
            raise UNAUTHORIZED

    def _not_serving(self) -> str | None:
        """Why requests are refused now, or None."""
        if self.gate.draining:
            return "the server is shutting down; retry on another replica"
        if not self.scheduler.ready.is_set():
            return "the model is still loading; retry shortly"
        return self.scheduler.failure

    def _check_serving(self) -> None:
        reason = self._not_serving()
        if reason is not None:
            raise OpenAIError(503, reason, code="service_unavailable")

    @property
    def model_id(self) -> str:
        """The served model's name: the target as configured (e.g. its directory)."""
        return self.scheduler.scheduler.target_info.model_name or "specdec"

    def _check_model(self, name: str) -> None:
        model = self.model_id
        if name not in (model, PurePath(model).name):
            raise OpenAIError(404, f"the model {name!r} does not exist; this server serves {model!r}", "model",
                              "model_not_found")

    def _body_size(self, request: Request) -> int:
        """The most the body may take: its Content-Length (413 over max_request_bytes) or, without
        one, max_request_bytes."""
        limit = self.limits.max_request_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise OpenAIError(413, self.limits.too_large(int(declared)), code="request_too_large")
        return int(declared) if declared.isdigit() else limit

    async def _json(self, request: Request, room: RequestBytes):
        """The decoded JSON body, read within its `room` among the request bytes in flight; 413 as
        soon as it is known to be over max_request_bytes."""
        limit = self.limits.max_request_bytes
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise OpenAIError(413, self.limits.too_large(len(body)) + " (or more)", code="request_too_large")
        room.shrink(len(body))
        try:
            return json.loads(body)
        except (ValueError, UnicodeDecodeError) as e:
            raise OpenAIError(400, f"the request body is not valid JSON: {e}") from None
        except RecursionError:
            raise OpenAIError(400, "the request body is not valid JSON for this server: nested too deeply") from None

    # -- endpoints ------------------------------------------------------------------------------
    async def health(self) -> JSONResponse:
        reason = self._not_serving()
        extra = {"warnings": self.warnings} if self.warnings else {}
        if reason is None:
            return JSONResponse({"status": "ok", **extra})
        status = "draining" if self.gate.draining else "loading" if not self.scheduler.ready.is_set() else "failed"
        return JSONResponse({"status": status, "message": reason, **extra}, status_code=503)

    async def prometheus(self, request: Request) -> Response:
        self._authorize(request)
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)

    def _model_card(self) -> dict:
        return {"id": self.model_id, "object": "model", "created": self._created, "owned_by": "specdec"}

    async def models(self, request: Request) -> JSONResponse:
        self._authorize(request)
        self._check_serving()
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, request: Request, model: str) -> JSONResponse:
        self._authorize(request)
        self._check_serving()
        self._check_model(model)
        return JSONResponse(self._model_card())

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    # -- generation -----------------------------------------------------------------------------
    async def _generate(self, request: Request, chat: bool) -> Response:
        self._authorize(request)
        self._check_serving()
        size = self._body_size(request)
        try:
            waiting = self.gate.wait_slot()
        except QueueFull as e:
            raise overloaded(e) from None
        try:
            try:
                room = await self.gate.take_bytes(size)
            except QueueFull as e:
                raise overloaded(e) from None
            try:
                parsed = parse(ChatCompletionRequest if chat else CompletionRequest, await self._json(request, room))
                self._check_model(parsed.model)
                req = await self._unless_disconnected(request, build_request(
                    parsed, self.tokenizers, self.limits, f"http-{self._prefix}-{next(self._ids)}",
                    self.scheduler.max_seq_len))
            finally:
                room.release()  # the body and its JSON are dropped; the prompt's text stays only if it fit
        except BaseException:
            waiting.release()
            raise
        if req is None:
            waiting.release()
            return Response(status_code=499)
        shape = ResponseShape(chat, self.model_id)
        updates = stream_request(self.scheduler, req, self.metrics, waiting)
        self.gate.enter()
        handed_over = False  # to the event stream, which then closes the updates and leaves the gate
        try:
            if parsed.stream:
                first = await self._unless_disconnected(request, anext(updates))
                if first is None:
                    return Response(status_code=499)  # nobody is listening any more
                handed_over = True
                return EventStream(self._events(shape, first, updates, len(req.prompt_ids), parsed.include_usage))
            whole = await self._unless_disconnected(request, self._collect(updates))
            if whole is None:
                return Response(status_code=499)
            text, last = whole
            return JSONResponse(shape.body(text, last.finish_reason, usage(last.stats, len(req.prompt_ids))))
        except RequestFailed as failure:
            raise failure_error(failure) from None
        finally:
            if not handed_over:
                await updates.aclose()  # aborts the request unless it finished
                waiting.release()  # a no-op unless the updates were never started
                self.gate.leave()

    @staticmethod
    async def _collect(updates: AsyncIterator) -> tuple[str, object]:
        texts, last = [], None
        async for update in updates:
            texts.append(update.text)
            last = update
        return "".join(texts), last

    @staticmethod
    async def _unless_disconnected(request: Request, awaitable):
        """The awaitable's result, or None (it is cancelled) if the client disconnects first."""
        work = asyncio.ensure_future(awaitable)

        async def disconnected() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass

        watcher = asyncio.ensure_future(disconnected())
        try:
            await asyncio.wait((work, watcher), return_when=asyncio.FIRST_COMPLETED)
            if not work.done() and watcher.exception() is not None:
                return await work  # the watcher broke, not the connection: keep going
        finally:
            for task in (watcher, work):
                if not task.done():
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
        return None if work.cancelled() else work.result()

    async def _events(self, shape: ResponseShape, first, updates: AsyncIterator, prompt_tokens: int,
                      include_usage: bool) -> AsyncIterator[bytes]:
        """The SSE body: one chunk per update with text, the last with finish_reason, optionally a
        usage chunk, then [DONE]. A failure after the first byte becomes an error event."""
        try:
            if shape.chat:
                yield sse(shape.chunk("", first=True))
            update = first
            while True:
                if update.finished:
                    yield sse(shape.chunk(update.text, update.finish_reason))
                    if include_usage:
                        yield sse(shape.usage_chunk(usage(update.stats, prompt_tokens)))
                    break
                if update.text:
                    yield sse(shape.chunk(update.text))
                try:
                    update = await anext(updates)
                except RequestFailed as failure:
                    yield sse(failure_error(failure).body())
                    break
            yield sse("[DONE]")
        finally:
            await updates.aclose()
            self.gate.leave()
