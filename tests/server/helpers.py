"""Small helpers shared by the server tests."""
from __future__ import annotations

import json
import time

from prometheus_client.parser import text_string_to_metric_families


def assert_openai_error(resp, status: int, param: str | None = "ANY", code: str | None = "ANY") -> dict:
    assert resp.status_code == status, (resp.status_code, resp.text)
    body = resp.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"], err
    assert isinstance(err["type"], str) and err["type"], err
    if param != "ANY":
        assert err["param"] == param, err
    if code != "ANY":
        assert err["code"] == code, err
    return err


def sse_events(lines) -> list:
    """Parse an SSE body (iterable of lines) into JSON objects; asserts it ends with [DONE]."""
    events, done = [], False
    for line in lines:
        if not line:
            continue
        assert line.startswith("data: "), line
        data = line[len("data: "):]
        assert not done, "data after [DONE]"
        if data == "[DONE]":
            done = True
            continue
        events.append(json.loads(data))
    assert done, "stream did not end with [DONE]"
    return events


def metric_samples(text: str) -> dict:
    """{(sample_name, frozenset(labels.items())): value} from a /metrics body."""
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def metric(samples: dict, name: str, **labels) -> float:
    want = set(labels.items())
    vals = [v for (n, ls), v in samples.items() if n == name and want <= set(ls)]
    assert vals, f"metric {name} {labels} not found"
    return sum(vals)


def wait_healthy(proc, base: str, timeout_s: float, log=lambda: "") -> None:
    """Wait until the server process `proc` answers /health with 200 (asserting it is alive;
    `log()` goes into the failure message)."""
    import httpx

    deadline = time.time() + timeout_s
    while True:
        assert proc.poll() is None, log()
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.time() < deadline, "server did not come up"
        time.sleep(0.25)
