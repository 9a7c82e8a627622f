"""Server-sent events and client-disconnect handling.

* `SSEResponse` streams `data: {json}\\n\\n` events, watches for the client going away while
  it streams (whatever ASGI spec version the server speaks), and always calls `on_close`
  (which aborts the engine requests that are still unfinished) when the response ends.
* `until_disconnected` runs a non-streaming handler and aborts it if the client leaves first.
* `TextDeltas` turns the engine's cumulative text into deltas. While a request runs it holds
  back the last `len(longest stop string) - 1` characters, because the engine may cut a stop
  string that started in text it already returned; so streamed text is always a prefix of
  the final text.
"""
from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator, Awaitable, Callable, Optional

import anyio
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

DONE = "data: [DONE]\n\n"


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


class SSEResponse(StreamingResponse):
    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as tg:
                async def stream() -> None:
                    await self.stream_response(send)
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
        except OSError:  # the socket went away mid-send
            pass
        finally:
            self._on_close()
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                with anyio.CancelScope(shield=True):
                    try:
                        await aclose()
                    except Exception:
                        pass


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnected(request: Request, work: Awaitable[Any],
                             on_disconnect: Callable[[], None]) -> Optional[Any]:
    """Await `work`; if the client disconnects first, cancel it, call `on_disconnect`, return None."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        on_disconnect()
        return None
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            on_disconnect()


class TextDeltas:
    """Per-choice incremental text/token bookkeeping for streaming."""

    def __init__(self, stop: Optional[list[str]]) -> None:
        self.holdback = max((len(s) for s in stop or []), default=1) - 1
        self.sent_chars = 0
        self.sent_tokens = 0
        self.finished = False

    def text_delta(self, text: str, finished: bool) -> str:
        end = len(text) if finished else max(self.sent_chars, len(text) - self.holdback)
        delta = text[self.sent_chars:end]
        self.sent_chars = max(self.sent_chars, end)
        return delta

    def new_token_range(self, num_tokens: int) -> tuple[int, int]:
        start, self.sent_tokens = self.sent_tokens, max(self.sent_tokens, num_tokens)
        return start, self.sent_tokens
