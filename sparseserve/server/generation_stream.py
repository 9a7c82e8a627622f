"""GenerationStream: the asyncio consumer end of one HTTP request's engine requests.

The engine loop thread pushes `(request_id, RequestOutput | Aborted)` items (or an exception
that ends the stream) into the stream's asyncio queue; outputs are cumulative, so a slow
consumer just skips to the newest one per request.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable


@dataclass(frozen=True)
class Aborted:
    """Pushed into a stream when the engine side aborted the request (shutdown, engine abort)."""

    request_id: str


CLOSED = object()  # local end-of-stream marker (the consumer side aborted)


class GenerationStream:
    """Outputs of one HTTP request's engine requests, as `(request_id, RequestOutput | Aborted)`.

    Use it as `async with stream: async for rid, out in stream: ...`; leaving the block (normally,
    by an exception, or by cancellation when the client goes away) aborts whatever is unfinished.
    `abort_fn(request_ids)` is how it aborts (the engine's thread-safe `abort`).
    """

    def __init__(self, abort_fn: Callable[[list[str]], None], request_ids: list[str],
                 sink: asyncio.Queue) -> None:
        self._abort_fn = abort_fn
        self.request_ids = list(request_ids)
        self._unfinished = set(request_ids)
        self._queue = sink

    @property
    def finished(self) -> bool:
        return not self._unfinished

    def abort(self) -> None:
        """Abort every unfinished request of this stream (idempotent, non-blocking)."""
        if self._unfinished:
            self._abort_fn(sorted(self._unfinished))
            self._unfinished.clear()
            self._queue.put_nowait(CLOSED)

    async def __aenter__(self) -> "GenerationStream":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.abort()

    def __aiter__(self) -> AsyncIterator[tuple[str, Any]]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[tuple[str, Any]]:
        while self._unfinished:
            items = [await self._queue.get()]
            while not self._queue.empty():
                items.append(self._queue.get_nowait())
            latest: dict[str, Any] = {}
            for item in items:
                if item is CLOSED:
                    return
                if isinstance(item, BaseException):
                    self._unfinished.clear()
                    raise item
                rid, out = item
                latest[rid] = out
            for rid, out in latest.items():
                if rid not in self._unfinished:
                    continue
                if isinstance(out, Aborted) or out.finished:
                    self._unfinished.discard(rid)
                yield rid, out
