"""The FastAPI application: OpenAI routes, /health, /version, /metrics, API-key check, a
request-body size limit (413) and OpenAI-shaped errors for every failure (400 for bad input
instead of FastAPI's 422).

`create_app(engine, ...)` takes an `LLMEngine` (or anything with its interface) and wraps it
in an `AsyncLLMEngine` whose loop thread starts now and stops at application shutdown.
"""
from __future__ import annotations

import hmac
import logging
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response

import sparseserve
from sparseserve.server.async_engine import AsyncLLMEngine
from sparseserve.server.body_limit import BodyLimitMiddleware
from sparseserve.server.errors import APIError, error_body, unauthorized, validation_error
from sparseserve.server.limits import ServerLimits
from sparseserve.server.metrics import ServerMetrics
from sparseserve.server.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from sparseserve.server.serving import ServingContext
from sparseserve.server.serving_chat import create_chat_completion
from sparseserve.server.serving_completions import create_completion
from sparseserve.server.serving_tokenize import (DetokenizeRequest, TokenizeRequest, detokenize,
                                                 tokenize)

logger = logging.getLogger("sparseserve.server")


def create_app(engine: Any, *, served_model_names: Optional[list[str]] = None,
               api_key: Optional[str] = None, max_waiting_requests: Optional[int] = None,
               limits: Optional[ServerLimits] = None, chat_template: Optional[str] = None,
               shutdown_timeout_s: float = 30.0) -> FastAPI:
    """`limits` (see `server.limits`) bound n, sequences per request, the body size and the
    tokenizer pool; `shutdown_timeout_s` bounds the engine-loop join at application shutdown."""
    limits = limits or ServerLimits()
    if isinstance(engine, AsyncLLMEngine):
        async_engine = engine
    else:
        names = served_model_names or [getattr(engine, "model_name", None) or "default"]
        metrics = ServerMetrics(names[0], max_model_len=int(engine.max_model_len))
        metrics.start_from(engine.get_stats())  # count from here: not the start-up warm-up
        async_engine = AsyncLLMEngine(engine, metrics=metrics, max_waiting_requests=max_waiting_requests)
    ctx = ServingContext(async_engine, served_model_names, limits=limits, chat_template=chat_template)
    async_engine.start()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        async_engine.shutdown(timeout=shutdown_timeout_s)
        ctx.close()

    app = FastAPI(title="sparseserve OpenAI-compatible API", version=sparseserve.__version__,
                  lifespan=lifespan)
    app.state.ctx = ctx
    app.state.engine = async_engine
    _install_error_handlers(app)
    if api_key:
        _install_api_key(app, api_key)
    app.add_middleware(BodyLimitMiddleware, max_bytes=limits.max_request_body_bytes)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        return await create_completion(ctx, body, raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        return await create_chat_completion(ctx, body, raw)

    @app.post("/tokenize")
    async def tokenize_endpoint(body: TokenizeRequest) -> dict:
        return await tokenize(ctx, body)

    @app.post("/detokenize")
    async def detokenize_endpoint(body: DetokenizeRequest) -> dict:
        return await detokenize(ctx, body)

    @app.get("/v1/models")
    async def models() -> dict:
        cards = [ModelCard(id=name, root=ctx.model_name, max_model_len=ctx.max_model_len)
                 for name in ctx.served_model_names]
        return ModelList(data=cards).model_dump()

    @app.get("/health")
    async def health() -> Response:
        reason = async_engine.dead_reason
        if reason is not None:
            return JSONResponse(error_body(f"The engine is not running: {reason}", "server_error",
                                           code="engine_dead"), status_code=503)
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict:
        return {"version": sparseserve.__version__}

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        registry = getattr(async_engine.metrics, "registry", None)
        data = generate_latest(registry) if registry is not None else b""
        return Response(data, media_type=CONTENT_TYPE_LATEST)

    return app


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def bad_request(_: Request, exc: RequestValidationError) -> JSONResponse:
        err = validation_error(list(exc.errors()))
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        code = "request_too_large" if exc.status_code == 413 else None
        return JSONResponse(error_body(str(exc.detail), kind, code=code), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def internal(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error while serving a request")
        return JSONResponse(error_body(f"Internal server error: {type(exc).__name__}: {exc}",
                                       "server_error"), status_code=500)


def _install_api_key(app: FastAPI, api_key: str) -> None:
    app.add_middleware(APIKeyMiddleware, api_key=api_key)


class APIKeyMiddleware:
    """Pure ASGI middleware (streaming and disconnect detection stay untouched): every /v1
    route needs `Authorization: Bearer <key>`; /health, /version and /metrics stay open."""

    def __init__(self, app: Any, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope.get("method") != "OPTIONS" \
                and scope.get("path", "").startswith("/v1"):
            got = b""
            for name, value in scope.get("headers", []):
                if name == b"authorization":
                    got = value
                    break
            if not hmac.compare_digest(got, self.expected):
                err = unauthorized()
                await JSONResponse(err.body(), status_code=err.status)(scope, receive, send)
                return
        await self.app(scope, receive, send)
