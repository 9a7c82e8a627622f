"""Streaming semantics, disconnects, overload, a dead engine loop and metrics, against the
fake engine (fast, deterministic)."""
from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.server.helpers import assert_openai_error, metric, metric_samples, sse_events

CHAT = [{"role": "user", "content": "hi"}]


def stream_post(base_url: str, path: str, body: dict) -> list:
    with httpx.Client(base_url=base_url, timeout=30) as c:
        with c.stream("POST", path, json={**body, "stream": True}) as r:
            assert r.status_code == 200, r.read()
            assert r.headers["content-type"].startswith("text/event-stream")
            return sse_events(r.iter_lines())


def wait_until(cond, timeout=10.0):
    deadline = time.time() + timeout
    while not cond():
        assert time.time() < deadline, "condition not reached"
        time.sleep(0.02)


def test_completion_stream_equals_non_stream(start_fake_server):
    srv, engine = start_fake_server()
    body = {"prompt": ["one", "two"], "max_tokens": 24, "n": 2, "temperature": 0}
    full = httpx.post(srv.base_url + "/v1/completions", json=body, timeout=30).json()
    assert [c["index"] for c in full["choices"]] == [0, 1, 2, 3]
    assert full["usage"]["completion_tokens"] == 4 * 24
    assert full["usage"]["prompt_tokens"] == 2 * 4  # <bos> + 3 bytes each
    events = stream_post(srv.base_url, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
    texts: dict[int, str] = {}
    finish = {}
    for ev in events[:-1]:
        assert ev["object"] == "text_completion" and ev["usage"] is None
        for ch in ev["choices"]:
            assert "\ufffd" not in ch["text"]  # no broken UTF-8 at chunk edges
            texts[ch["index"]] = texts.get(ch["index"], "") + ch["text"]
            if ch["finish_reason"]:
                finish[ch["index"]] = ch["finish_reason"]
    assert events[-1]["choices"] == [] and events[-1]["usage"] == full["usage"]
    assert texts == {c["index"]: c["text"] for c in full["choices"]}
    assert finish == {i: "length" for i in range(4)}
    assert any(ord(ch) > 127 for ch in texts[0])  # the script has multi-byte characters
    assert engine.num_free_pages() == engine.num_total_pages()


def test_stop_string_never_streams_past_the_stop(start_fake_server):
    srv, _ = start_fake_server()
    # greedy output of prompt "a" starts inside the script; "ok." appears within ~30 chars
    body = {"prompt": "a", "max_tokens": 60, "temperature": 0, "stop": ["ok."]}
    full = httpx.post(srv.base_url + "/v1/completions", json=body).json()["choices"][0]
    assert full["finish_reason"] == "stop" and full["stop_reason"] == "ok."
    assert "ok" not in full["text"][-3:]
    events = stream_post(srv.base_url, "/v1/completions", body)
    streamed = "".join(ch["text"] for ev in events for ch in ev["choices"])
    assert streamed == full["text"]


def test_chat_stream_role_first_usage_last(start_fake_server):
    srv, _ = start_fake_server()
    body = {"messages": CHAT, "max_tokens": 10, "n": 2, "temperature": 0}
    full = httpx.post(srv.base_url + "/v1/chat/completions", json=body).json()
    assert full["object"] == "chat.completion"
    events = stream_post(srv.base_url, "/v1/chat/completions",
                         {**body, "stream_options": {"include_usage": True}})
    first = {}
    texts = {0: "", 1: ""}
    for ev in events[:-1]:
        assert ev["object"] == "chat.completion.chunk"
        for ch in ev["choices"]:
            first.setdefault(ch["index"], ch["delta"])
            texts[ch["index"]] += ch["delta"].get("content") or ""
    assert first == {0: {"role": "assistant", "content": ""}, 1: {"role": "assistant", "content": ""}}
    assert texts == {c["index"]: c["message"]["content"] for c in full["choices"]}
    assert events[-1]["choices"] == [] and events[-1]["usage"] == full["usage"]
    assert full["usage"]["completion_tokens"] == 20


def test_logprobs_shapes(start_fake_server):
    srv, _ = start_fake_server()
    r = httpx.post(srv.base_url + "/v1/completions",
                   json={"prompt": "abc", "max_tokens": 5, "logprobs": 2, "temperature": 0}).json()
    lp = r["choices"][0]["logprobs"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 5
    # (two byte-tokens of one multi-byte character both decode to U+FFFD and share a key)
    assert all(1 <= len(t) <= 2 for t in lp["top_logprobs"]) and lp["token_logprobs"][0] == -0.25
    assert any(len(t) == 2 for t in lp["top_logprobs"])
    assert lp["text_offset"] == sorted(lp["text_offset"])
    r = httpx.post(srv.base_url + "/v1/chat/completions",
                   json={"messages": CHAT, "max_tokens": 4, "logprobs": True, "top_logprobs": 3}).json()
    content = r["choices"][0]["logprobs"]["content"]
    assert len(content) == 4
    for item in content:
        assert set(item) == {"token", "logprob", "bytes", "top_logprobs"}
        assert len(item["top_logprobs"]) == 3
    events = stream_post(srv.base_url, "/v1/chat/completions",
                         {"messages": CHAT, "max_tokens": 4, "logprobs": True})
    streamed = [t for ev in events for ch in ev["choices"] for t in ((ch["logprobs"] or {}).get("content") or [])]
    assert len(streamed) == 4 and all(t["top_logprobs"] == [] for t in streamed)


def test_models_version_health(start_fake_server):
    srv, _ = start_fake_server(served_model_names=["alias", "other"])
    models = httpx.get(srv.base_url + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["alias", "other"]
    assert models["data"][0]["max_model_len"] == 256
    assert httpx.get(srv.base_url + "/version").json()["version"]
    assert httpx.get(srv.base_url + "/health").status_code == 200
    r = httpx.post(srv.base_url + "/v1/completions", json={"model": "other", "prompt": "x", "max_tokens": 1})
    assert r.json()["model"] == "other"


async def _stream_then_drop(base_url: str, body: dict, keep_chunks: int) -> int:
    async with httpx.AsyncClient(base_url=base_url, timeout=30) as c:
        async with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            n = 0
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    n += 1
                    if n >= keep_chunks:
                        return n  # leaving the block closes the connection mid-stream
    return n


def test_disconnect_mid_stream_aborts_and_frees_pages(start_fake_server):
    srv, engine = start_fake_server(engine_kwargs={"step_delay": 0.02})
    asyncio.run(_stream_then_drop(srv.base_url, {"prompt": "long", "max_tokens": 200}, keep_chunks=3))
    wait_until(lambda: engine.num_free_pages() == engine.num_total_pages() and not engine._reqs)
    samples = metric_samples(httpx.get(srv.base_url + "/metrics").text)
    assert metric(samples, "sparseserve:request_success_total", finished_reason="abort") == 1
    assert httpx.get(srv.base_url + "/health").status_code == 200


def test_disconnect_non_streaming_aborts(start_fake_server):
    srv, engine = start_fake_server(engine_kwargs={"step_delay": 0.05})
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(srv.base_url + "/v1/completions", json={"prompt": "x", "max_tokens": 200}, timeout=0.5)
    wait_until(lambda: not engine._reqs)
    assert engine.num_free_pages() == engine.num_total_pages()


def test_max_waiting_requests_503(start_fake_server):
    srv, engine = start_fake_server(engine_kwargs={"max_num_seqs": 1, "step_delay": 0.05},
                                    max_waiting_requests=1)

    async def run():
        async with httpx.AsyncClient(base_url=srv.base_url, timeout=30) as c:
            body = {"prompt": "x", "max_tokens": 30}
            first = asyncio.create_task(c.post("/v1/completions", json=body))   # running
            await asyncio.sleep(0.3)
            second = asyncio.create_task(c.post("/v1/completions", json=body))  # waiting
            await asyncio.sleep(0.3)
            third = await c.post("/v1/completions", json=body)                 # over the limit
            return third, await first, await second

    third, first, second = asyncio.run(run())
    err = assert_openai_error(third, 503)
    assert "waiting" in err["message"]
    assert first.status_code == 200 and second.status_code == 200
    assert httpx.post(srv.base_url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code == 200


def test_dead_engine_loop_health_503(start_fake_server):
    srv, engine = start_fake_server(engine_kwargs={"step_delay": 0.05})

    async def run():
        async with httpx.AsyncClient(base_url=srv.base_url, timeout=30) as c:
            async with c.stream("POST", "/v1/completions",
                                json={"prompt": "x", "max_tokens": 100, "stream": True}) as r:
                lines = []
                async for line in r.aiter_lines():
                    if line:
                        lines.append(line)
                    if len(lines) == 2:
                        engine.fail_next_step = True
                return lines

    lines = asyncio.run(run())
    events = sse_events(lines)
    assert "error" in events[-1] and events[-1]["error"]["code"] == "engine_dead"
    r = httpx.get(srv.base_url + "/health")
    assert r.status_code == 503 and "injected engine failure" in r.json()["error"]["message"]
    assert_openai_error(httpx.post(srv.base_url + "/v1/completions", json={"prompt": "x"}), 503)


def test_metrics_move(start_fake_server):
    srv, _ = start_fake_server()
    before = metric_samples(httpx.get(srv.base_url + "/metrics").text)
    assert metric(before, "sparseserve:num_requests_running") == 0
    for name in ("prompt_tokens_total", "generation_tokens_total", "num_preemptions_total",
                 "kv_cache_hits_total", "kv_cache_misses_total", "kv_bytes_loaded_total",
                 "kv_bytes_saved_total", "kv_pages_loaded_total",
                 "num_requests_waiting_for_slots", "estimated_working_set_slots"):
        assert metric(before, "sparseserve:" + name) == 0
    httpx.post(srv.base_url + "/v1/completions", json={"prompt": "abc", "max_tokens": 7}, timeout=30)
    httpx.post(srv.base_url + "/v1/chat/completions", json={"messages": CHAT, "max_tokens": 3}, timeout=30)
    after = metric_samples(httpx.get(srv.base_url + "/metrics").text)
    m = lambda name, **kw: metric(after, "sparseserve:" + name, model_name="fake-model", **kw)  # noqa: E731
    assert m("generation_tokens_total") == 10
    assert m("prompt_tokens_total") == 4 + 24
    assert m("request_success_total", finished_reason="length") == 2
    assert m("time_to_first_token_seconds_count") == 2
    assert m("e2e_request_latency_seconds_count") == 2
    assert m("request_queue_time_seconds_count") == 2
    assert m("inter_token_latency_seconds_count") == 6 + 2
    assert m("request_generation_tokens_sum") == 10
    assert m("kv_cache_hits_total") > 0 and m("kv_bytes_loaded_total") > 0
    assert m("kv_pages_loaded_total") > 0
    assert m("num_requests_running") == 0 and m("num_requests_waiting") == 0
    for gauge in ("kv_cache_usage_perc", "host_kv_cache_usage_perc"):
        assert m(gauge) == 0.0


def test_token_id_prompts_and_continuous_usage(start_fake_server):
    srv, _ = start_fake_server()
    r = httpx.post(srv.base_url + "/v1/completions",
                   json={"prompt": [[0, 100, 101], [0, 102]], "max_tokens": 3}).json()
    assert r["usage"] == {"prompt_tokens": 5, "completion_tokens": 6, "total_tokens": 11}
    events = stream_post(srv.base_url, "/v1/completions",
                         {"prompt": [0, 100, 101], "max_tokens": 4,
                          "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    running = [ev["usage"]["completion_tokens"] for ev in events[:-1]]
    assert running == sorted(running) and running[-1] == 4
    assert events[-1]["usage"]["completion_tokens"] == 4


def test_text_deltas_hold_back_possible_stop_prefix():
    from sparseserve.server.streaming import TextDeltas

    d = TextDeltas(["STOP"])
    assert d.text_delta("abcdef", False) == "abc"   # "def" could start "STOP"... held back
    assert d.text_delta("abcdefS", False) == "d"
    # the engine cut the stop string that began in text it had returned: nothing is retracted
    assert d.text_delta("abcdef", True) == "ef"
    assert TextDeltas(None).text_delta("xyz", False) == "xyz"


def test_dead_engine_fails_non_streaming_request_with_503(start_fake_server):
    srv, engine = start_fake_server(engine_kwargs={"step_delay": 0.05})

    async def run():
        async with httpx.AsyncClient(base_url=srv.base_url, timeout=30) as c:
            task = asyncio.create_task(c.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 100}))
            await asyncio.sleep(0.3)
            engine.fail_next_step = True
            return await task

    err = assert_openai_error(asyncio.run(run()), 503, code="engine_dead")
    assert "injected engine failure" in err["message"]
