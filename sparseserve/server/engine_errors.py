"""Errors the engine loop hands to the HTTP side (`errors.py` turns them into OpenAI shapes)."""
from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine loop has stopped (crashed or shut down)."""


class ServerShutdownError(EngineDeadError):
    """The server's shutdown timeout passed while this request was still running: it was cut."""


class EngineOverloadedError(RuntimeError):
    def __init__(self, num_waiting: int, limit: int) -> None:
        super().__init__(f"{num_waiting} requests waiting (limit {limit})")
        self.num_waiting = num_waiting
        self.limit = limit
