"""The OpenAI-compatible HTTP API and ``/metrics``, served by the frontend actor beside gRPC.

FastAPI on uvicorn, run as a task on the frontend's own event loop, so a request here goes
through exactly the pipeline a gRPC ``Generate`` does (``FrontendCore.validate -> admit ->
stream``). Routes:

    GET  /health                 200 while serving, 503 when shutting down (no token needed)
    GET  /metrics                Prometheus exposition (metrics.py)
    GET  /v1/models              the one served model
    POST /v1/completions         text or token-id prompt; SSE with "stream": true
    POST /v1/chat/completions    chat template applied; reasoning_content apart from content

Errors use OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``: 400 bad field,
401 token, 404 unknown model or route, 409 request id in use, 413 body too large, 429 queue full,
503 shutting down / nothing can serve. A token (``frontend.auth``) guards /metrics always and
/v1 when ``auth.inference`` is on (``TokenGate``, before the body is read).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .errors import Refused
from .openai_format import (FINISH_NAMES, ChatCompletionRequest, ChatTemplate, CompletionRequest,
                            ReasoningSplitter, completion_prompt, extras, split_reasoning, to_generate_request,
                            usage)

_STATUS = {"invalid_argument": 400, "not_found": 404, "already_exists": 409, "resource_exhausted": 429,
           "unavailable": 503, "unauthenticated": 401, "too_large": 413}
_TYPE = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error", 409: "conflict_error",
         413: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable"}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": _TYPE.get(status, "api_error"), "param": param,
                                   "code": code}}, status_code=status)


def _refused(e: Refused) -> JSONResponse:
    return error_response(_STATUS.get(e.code, 500), e.message, _param(e.field), e.code)


def _param(field: str | None) -> str | None:
    """The OpenAI field behind a GenerateRequest field: ``sampling.top_p`` -> ``top_p``, ``prompt.text`` -> ``prompt``."""
    if field is None:
        return None
    if field.startswith("sampling."):
        return field.split(".", 1)[1]
    return field.split(".", 1)[0]


class BodyLimit:
    """ASGI middleware: bodies over ``limit`` bytes get 413, whether declared (Content-Length) or
    counted as they arrive (chunked). The body is read here first (it is small: the limit is
    ``limits.max_message_bytes``) and handed to the app whole; later ``receive`` calls (a client
    hanging up) go straight through."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await self._too_large(scope, receive, send)
        chunks, size = [], 0
        while True:
            msg = await receive()
            if msg["type"] != "http.request":            # gone before the body arrived
                return
            chunks.append(msg.get("body", b""))
            size += len(chunks[-1])
            if size > self.limit:
                return await self._too_large(scope, receive, send)
            if not msg.get("more_body", False):
                break
        replayed = False

        async def body_then_receive():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()
        await self.app(scope, body_then_receive, send)

    async def _too_large(self, scope, receive, send):
        resp = error_response(413, f"request body exceeds limits.max_message_bytes ({self.limit} bytes)",
                              None, "too_large")
        await resp(scope, receive, send)


class TokenGate:
    """ASGI middleware: ``/metrics`` (and ``/v1`` when ``inference``) need the bearer token; checked
    before anything else, the body included, so a caller without it learns nothing more."""

    def __init__(self, app, token: str, inference: bool):
        from .auth import TokenCheck
        self.app, self.check = app, TokenCheck(token)
        self.prefixes = ("/metrics", "/v1") if inference else ("/metrics",)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith(self.prefixes):
            if not self.check.ok(dict(scope["headers"]).get(b"authorization")):
                from .auth import UNAUTHENTICATED_MESSAGE
                return await error_response(401, UNAUTHENTICATED_MESSAGE, None, "invalid_api_key")(scope, receive, send)
        await self.app(scope, receive, send)


def build_app(core) -> FastAPI:
    from thinkserve.workers.loader import resolve_model_path

    app = FastAPI(title="thinkserve", docs_url=None, redoc_url=None, openapi_url=None)
    model_name = core.cfg.model
    tok = core.tokenizer
    template = ChatTemplate(resolve_model_path(core.cfg.model))
    created = int(time.time())

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, exc: RequestValidationError):
        err = exc.errors()[0]
        loc = err["loc"][1:]                                   # [0] is "body"
        param = loc[0] if loc and isinstance(loc[0], str) and err["type"] != "json_invalid" else None
        where = ".".join(str(x) for x in loc) if param else ""
        return error_response(400, f"{where}: {err['msg']}" if where else err["msg"], param, "invalid_value")

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail))

    @app.get("/health")
    async def health():
        if core._stopping:
            return error_response(503, "shutting down")
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        from prometheus_client import CONTENT_TYPE_LATEST
        return Response(await core.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "thinkserve", "max_model_len": core.model_limits.max_model_len}]}

    async def start(body, prompt):
        """Check the model, validate and admit: a JSONResponse error or the RequestState."""
        if body.model != model_name:
            return error_response(404, f"model: {body.model!r} is not served here; GET /v1/models lists {model_name!r}",
                                  "model", "model_not_found")
        try:
            return core.admit(core.validate(to_generate_request(body, prompt)), None)
        except Refused as e:
            return _refused(e)

    @app.post("/v1/completions")
    async def completions(request: Request, body: CompletionRequest):
        try:
            prompt = completion_prompt(body)
        except ValueError as e:
            return error_response(400, str(e), "prompt", "invalid_value")
        req = await start(body, prompt)
        if isinstance(req, JSONResponse):
            return req
        rid, stamp = f"cmpl-{req.request_id}", int(time.time())
        head = {"id": rid, "object": "text_completion", "created": stamp, "model": model_name}
        if body.stream:
            async def events():
                async with contextlib.aclosing(core.stream(req)) as stream:
                    async for msg in stream:
                        for d in msg.deltas:
                            choice = {"index": d.index, "text": d.text, "logprobs": None,
                                      "finish_reason": FINISH_NAMES.get(d.finish_reason)}
                            yield {**head, "choices": [choice]}
                        if msg.HasField("final"):
                            yield {**head, "choices": [], "usage": usage(msg) if body.include_usage() else None,
                                   "thinkserve": extras(msg)}
            return _sse(core, req, events())
        final = await _collect(core, req, request)
        if isinstance(final, JSONResponse):
            return final
        choices = [{"index": b.index, "text": b.text, "logprobs": None,
                    "finish_reason": FINISH_NAMES.get(b.finish_reason), "answer": b.answer or None,
                    "token_ids": list(b.token_ids)} for b in final.final.branches]
        return {**head, "choices": choices, "usage": usage(final), "thinkserve": extras(final)}

    @app.post("/v1/chat/completions")
    async def chat(request: Request, body: ChatCompletionRequest):
        try:
            prompt = template.render(body.messages)
        except ValueError as e:
            return error_response(400, str(e), "messages", "invalid_value")
        req = await start(body, prompt)
        if isinstance(req, JSONResponse):
            return req
        thinking = tok.think_start_id is not None and req.prompt_token_ids[-1:] == (tok.think_start_id,)
        rid, stamp = f"chatcmpl-{req.request_id}", int(time.time())
        head = {"id": rid, "object": "chat.completion.chunk", "created": stamp, "model": model_name}
        if body.stream:
            async def events():
                splitters = [ReasoningSplitter(thinking) for _ in range(body.n)]
                for i in range(body.n):
                    yield {**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                "finish_reason": None}]}
                async with contextlib.aclosing(core.stream(req)) as stream:
                    async for msg in stream:
                        for d in msg.deltas:
                            done = d.finish_reason != 0
                            reasoning, content = splitters[d.index].feed(d.text, final=done)
                            delta = {k: v for k, v in (("reasoning_content", reasoning), ("content", content)) if v}
                            if delta or done:
                                yield {**head, "choices": [{"index": d.index, "delta": delta,
                                                            "finish_reason": FINISH_NAMES.get(d.finish_reason)}]}
                        if msg.HasField("final"):
                            yield {**head, "choices": [],
                                   "usage": usage(msg, _reasoning_tokens(tok, msg)) if body.include_usage() else None,
                                   "thinkserve": extras(msg)}
            return _sse(core, req, events())
        final = await _collect(core, req, request)
        if isinstance(final, JSONResponse):
            return final
        choices = []
        for b in final.final.branches:
            reasoning, content = split_reasoning(b.text, thinking)
            choices.append({"index": b.index, "message": {"role": "assistant", "content": content,
                                                          "reasoning_content": reasoning},
                            "finish_reason": FINISH_NAMES.get(b.finish_reason), "logprobs": None,
                            "answer": b.answer or None, "token_ids": list(b.token_ids)})
        return {**head, "object": "chat.completion", "choices": choices,
                "usage": usage(final, _reasoning_tokens(tok, final)), "thinkserve": extras(final)}

    return app


def _reasoning_tokens(tok, final) -> int | None:
    """Output tokens up to and including ``</think>``, over every branch (None: no think tokens)."""
    if tok.think_end_id is None:
        return None
    total = 0
    for b in final.final.branches:
        ids = list(b.token_ids)
        total += ids.index(tok.think_end_id) + 1 if tok.think_end_id in ids else len(ids)
    return total


async def _collect(core, req, request: Request):
    """Run the request to its final response; a client that hangs up aborts it."""
    async def run():
        async with contextlib.aclosing(core.stream(req)) as stream:
            async for msg in stream:
                if msg.HasField("final"):
                    return msg

    async def hung_up():
        while (await request.receive())["type"] != "http.disconnect":
            pass
    work, watch = asyncio.ensure_future(run()), asyncio.ensure_future(hung_up())
    try:
        await asyncio.wait((work, watch), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():
            work.cancel()                       # closes the stream: the request is aborted, KV freed
            await asyncio.gather(work, return_exceptions=True)
        core.close(req, delivered=False)        # no-op unless the stream never started
    if work.cancelled():
        return error_response(499, "client closed the request")
    try:
        return work.result()
    except Refused as e:
        return _refused(e)


class _EventStream(StreamingResponse):
    """SSE whose request is closed however the response ends, even before its body started."""

    def __init__(self, body, core, req):
        super().__init__(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._core, self._req = core, req

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._core.close(self._req, delivered=False)      # no-op once the stream closed it


def _sse(core, req, events) -> StreamingResponse:
    """Server-sent events; an error after the stream began is sent as an ``error`` event."""
    async def body():
        async with contextlib.aclosing(events) as it:
            try:
                async for obj in it:
                    yield f"data: {json.dumps(obj)}\n\n"
            except Refused as e:
                yield f"data: {json.dumps({'error': {'message': e.message, 'type': _TYPE.get(_STATUS.get(e.code, 500), 'api_error'), 'param': e.field, 'code': e.code}})}\n\n"
        yield "data: [DONE]\n\n"
    return _EventStream(body(), core, req)


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):
        yield                                   # the actor's signals belong to Ray, not to uvicorn


class HttpServer:
    """uvicorn on the frontend's event loop, on a socket bound here (so port 0 is known at once)."""

    def __init__(self, core):
        self.core = core
        fc = core.cfg.frontend
        app = BodyLimit(build_app(core), core.cfg.limits.max_message_bytes)
        if fc.auth.token is not None:
            app = TokenGate(app, fc.auth.token.get_secret_value(), fc.auth.inference)
        tls = fc.tls
        self.config = uvicorn.Config(app, log_config=None, log_level="warning", access_log=False, lifespan="off",
                                     timeout_graceful_shutdown=2,
                                     ssl_certfile=tls.cert_file if tls else None, ssl_keyfile=tls.key_file if tls else None)
        self.server = _Server(self.config)
        self.task: asyncio.Task | None = None

    async def start(self) -> str:
        fc = self.core.cfg.frontend
        family = socket.AF_INET6 if ":" in fc.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((fc.host, fc.http_port))
        except OSError as e:
            sock.close()
            raise RuntimeError(f"frontend.http_port: cannot bind {fc.host}:{fc.http_port} ({e.strerror})") from None
        port = sock.getsockname()[1]
        self.task = asyncio.get_running_loop().create_task(self.server.serve(sockets=[sock]))
        while not self.server.started:
            if self.task.done():
                self.task.result()              # raises why it could not start (a bad TLS key file, ...)
                raise RuntimeError("frontend: the HTTP server stopped while starting")
            await asyncio.sleep(0.01)
        return f"{fc.host}:{port}"

    async def stop(self) -> None:
        self.server.should_exit = True
        if self.task is not None:
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(self.task, 5.0)
