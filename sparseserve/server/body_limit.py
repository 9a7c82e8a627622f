"""Request-body size limit as pure ASGI middleware (streaming responses and disconnect
detection stay untouched).

A request whose `Content-Length` exceeds `max_bytes`, or whose body grows past it while it is
received (chunked uploads), is answered 413 with an OpenAI-shaped error before any of it is
parsed, so a huge body costs neither JSON parsing nor memory beyond `max_bytes`.
"""
from __future__ import annotations

from typing import Any

from fastapi import HTTPException
from starlette.responses import JSONResponse

from sparseserve.server.errors import payload_too_large


class _TooLarge(HTTPException):
    """Raised from `receive` once the body passes the limit. FastAPI re-raises HTTPExceptions
    from body reading, so the app's HTTPException handler answers it (413, OpenAI shape)."""

    def __init__(self, size: int, limit: int) -> None:
        err = payload_too_large(size, limit)
        err.message = (f"The request body has more than {limit} bytes, the most this server "
                       "accepts (--max-request-body-bytes). Send a shorter prompt.")
        super().__init__(status_code=err.status, detail=err.message)
        self.size = size


class BodyLimitMiddleware:
    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = int(max_bytes)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", []):
            if name == b"content-length":
                try:
                    size = int(value)
                except ValueError:
                    size = 0
                if size > self.max_bytes:
                    await self._reject(scope, receive, send, size)
                    return
                break
        received = 0
        started = False

        async def limited_receive() -> Any:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise _TooLarge(received, self.max_bytes)
            return message

        async def tracking_send(message: Any) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except _TooLarge as e:  # raised outside FastAPI's body reading (e.g. a disconnect watcher)
            if not started:
                await self._reject(scope, receive, send, e.size)

    async def _reject(self, scope: Any, receive: Any, send: Any, size: int) -> None:
        err = payload_too_large(size, self.max_bytes)
        await JSONResponse(err.body(), status_code=err.status,
                           headers={"connection": "close"})(scope, receive, send)
