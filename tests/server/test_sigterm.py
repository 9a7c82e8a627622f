"""SIGTERM: stop accepting, finish in-flight requests (exit 0) or, past the shutdown timeout,
cut them with a final answer (SSE error event + [DONE]; 503 JSON) and exit 3; free every page;
no traceback in the log. Runs the real `serve_app` path in a subprocess around the fake engine."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.server.conftest import free_port
from tests.server.helpers import sse_events

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def start(port: int, timeout: float) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "tests.server.run_fake_server", str(port), str(timeout)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 60
    while True:
        assert proc.poll() is None, proc.stdout.read()
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        assert time.time() < deadline, "server did not come up"
        time.sleep(0.1)


def stream_in_thread(port: int, max_tokens: int, started: threading.Event, result: dict) -> threading.Thread:
    def run():
        lines = []
        try:
            with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                              json={"prompt": "x", "max_tokens": max_tokens, "stream": True}) as r:
                for line in r.iter_lines():
                    lines.append(line)
                    started.set()
        except httpx.HTTPError as e:
            result["error"] = e
        result["lines"] = lines
        started.set()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def post_in_thread(port: int, max_tokens: int, result: dict) -> threading.Thread:
    def run():
        try:
            result["response"] = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                                            json={"prompt": "x", "max_tokens": max_tokens})
        except httpx.HTTPError as e:
            result["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


@pytest.mark.parametrize("timeout,max_tokens,finishes", [(30.0, 40, True), (1.0, 250, False)],
                         ids=["in-flight-finishes", "past-timeout-cut"])
def test_sigterm_graceful_exit(timeout, max_tokens, finishes):
    port = free_port()
    proc = start(port, timeout)
    try:
        started, result, plain = threading.Event(), {}, {}
        t = stream_in_thread(port, max_tokens, started, result)
        t2 = post_in_thread(port, max_tokens, plain)
        assert started.wait(30)
        time.sleep(0.2)  # the non-streaming request is in the engine too
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        with pytest.raises(httpx.TransportError):  # no longer accepting
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
        out, _ = proc.communicate(timeout=60)
        t.join(30)
        t2.join(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "EXIT pages 4096/4096 unfinished=0" in out, out
    assert "Traceback" not in out and "CancelledError" not in out, out
    events = sse_events(result["lines"])  # ends with [DONE] in both cases
    if finishes:
        assert proc.returncode == 0, out
        assert events[-1]["choices"][0]["finish_reason"] == "length"
        assert sum(len(ev["choices"][0]["text"].encode()) for ev in events) > 0
        assert plain["response"].status_code == 200
        assert plain["response"].json()["choices"][0]["finish_reason"] == "length"
    else:  # cut: a final error event, a shaped 503, a non-zero exit code
        assert proc.returncode == 3, out
        assert any("text" in (ev.get("choices") or [{}])[0] for ev in events[:-1])
        err = events[-1]["error"]
        assert err["code"] == "server_shutting_down" and err["type"] == "server_error"
        resp = plain["response"]
        assert resp.status_code == 503, resp.text
        assert resp.json()["error"]["code"] == "server_shutting_down"
        assert "cut" in out  # the log says why the exit code is not 0
