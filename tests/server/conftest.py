"""Server test helpers: run an app under uvicorn in a background thread on a free port."""
from __future__ import annotations

import socket
import threading
import time

import pytest

uvicorn = pytest.importorskip("uvicorn")
pytest.importorskip("fastapi")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerThread:
    """uvicorn.Server in a daemon thread (no signal handlers there); `stop()` is a graceful
    shutdown that also runs the app's lifespan shutdown (engine loop stop)."""

    def __init__(self, app, port: int | None = None) -> None:
        self.app = app
        self.port = port or free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                lifespan="on", timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self) -> "ServerThread":
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.time() > deadline:
                raise RuntimeError("server did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


@pytest.fixture
def start_fake_server():
    """start_fake_server(engine_kwargs={}, **create_app_kwargs) -> (ServerThread, FakeEngine)."""
    from sparseserve.server.api import create_app
    from tests.server.fake_engine import FakeEngine

    servers = []

    def start(engine_kwargs=None, **app_kwargs):
        engine = FakeEngine(**(engine_kwargs or {}))
        srv = ServerThread(create_app(engine, **app_kwargs)).start()
        servers.append(srv)
        return srv, engine

    yield start
    for srv in servers:
        srv.stop()
