"""Every bad input answers an OpenAI-style error with the right status, and the server keeps
serving afterwards (fast: a fake engine with the LLMEngine contract)."""
from __future__ import annotations

import json

import httpx
import pytest

from tests.server.helpers import assert_openai_error

CHAT = [{"role": "user", "content": "hi"}]

# (endpoint, raw body or JSON object, expected param)
BAD = [
    ("/v1/completions", "{not json", None),
    ("/v1/completions", "", None),
    ("/v1/completions", "[1, 2]", None),
    ("/v1/completions", {"max_tokens": 4}, "prompt"),
    ("/v1/completions", {"prompt": 5}, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "8"}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -3}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "temperature": -0.5}, "temperature"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": "x", "top_k": -2}, "top_k"),
    ("/v1/completions", {"prompt": "x", "n": 0}, "n"),
    ("/v1/completions", {"prompt": "x", "n": 17}, "n"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, "stream"),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, "stop"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"prompt": "y" * 400}, "prompt"),               # > max_model_len
    ("/v1/completions", {"prompt": "y" * 200, "max_tokens": 100}, "max_tokens"),  # prompt + max_tokens
    ("/v1/completions", {"prompt": [1, 2, 99999]}, "prompt"),           # token id out of vocab
    ("/v1/completions", {"prompt": "x", "frequency_penalty": 2.5}, "frequency_penalty"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": -3}, "presence_penalty"),
    ("/v1/completions", {"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"99999": 1}}, "logit_bias"),  # out of vocab
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [99999]}, "stop_token_ids"),
    ('/v1/completions', '{"prompt": "x", "temperature": NaN}', "temperature"),
    ('/v1/completions', '{"prompt": "x", "temperature": Infinity}', "temperature"),
    ('/v1/completions', '{"prompt": "x", "top_p": NaN}', "top_p"),
    ("/v1/completions", {"prompt": "x", "seed": 2 ** 64}, "seed"),
    ("/v1/completions", {"prompt": "x", "seed": -(2 ** 63) - 1}, "seed"),
    ("/v1/completions", {"prompt": "x", "min_tokens": 9, "max_tokens": 4}, "min_tokens"),
    ("/v1/completions", {"prompt": "x", "min_tokens": -1}, "min_tokens"),
    ("/v1/completions", {"prompt": "x", "min_p": 1.5}, "min_p"),
    ("/v1/completions", {"prompt": "x", "best_of": 1, "n": 2}, "best_of"),
    ("/v1/completions", {"prompt": "x", "best_of": 2, "stream": True}, "best_of"),
    ("/v1/completions", {"prompt": "x", "best_of": 17}, "best_of"),
    ("/v1/completions", {"prompt": ["a"] * 20, "n": 16}, "prompt"),      # prompts x n > 256
    ('/v1/completions', '{"prompt": "a\\udfffb"}', "prompt"),           # lone surrogate
    ('/v1/completions', '{"prompt": ["ok", "a\\ud800"]}', "prompt.1"),
    ('/v1/completions', '{"prompt": "x", "stop": ["\\udfff"]}', "stop.0"),
    ("/v1/chat/completions", "{", None),
    ("/v1/chat/completions", {"model": "fake-model"}, "messages"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": "hi"}, "messages"),
    ("/v1/chat/completions", {"messages": [{"content": "hi"}]}, "messages.0.role"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 0}, "max_tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": -1}, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "temperature": -1}, "temperature"),
    ("/v1/chat/completions", {"messages": CHAT, "n": 1000}, "n"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": None}]}, "messages.0.content"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, "messages.0.content"),
    ("/v1/chat/completions", {"messages": CHAT, "min_tokens": 5, "max_completion_tokens": 2},
     "min_tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 0}, "max_completion_tokens"),
    ('/v1/chat/completions', '{"messages": [{"role": "user", "content": "a\\udfffb"}]}',
     "messages.0.content"),
    ('/v1/chat/completions',
     '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}]}',
     "messages.0.content.0.text"),
    ('/v1/chat/completions', '{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}',
     "temperature"),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 3}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 50}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "z" * 400}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "x"}]}, "messages"),  # template error
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages.0.content"),
]


@pytest.fixture(scope="module")
def server():
    from sparseserve.server.api import create_app
    from tests.server.conftest import ServerThread
    from tests.server.fake_engine import FakeEngine

    engine = FakeEngine(max_model_len=256)
    srv = ServerThread(create_app(engine)).start()
    yield srv, engine
    srv.stop()


@pytest.mark.parametrize("path,body,param", BAD, ids=[f"{p}:{json.dumps(b)[:40]}" for p, b, _ in BAD])
def test_bad_input_is_400_with_openai_error(server, path, body, param):
    srv, _ = server
    with httpx.Client(base_url=srv.base_url, timeout=30) as c:
        if isinstance(body, str):
            r = c.post(path, content=body, headers={"content-type": "application/json"})
        else:
            r = c.post(path, json=body)
        err = assert_openai_error(r, 400)
        if param is not None:
            assert err["param"] == param, err
        assert err["type"] == "invalid_request_error"
        # still serving
        ok = c.post("/v1/completions", json={"prompt": "ok", "max_tokens": 2})
        assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("path,body", [("/v1/completions", {"prompt": "x", "model": "gpt-4"}),
                                       ("/v1/chat/completions", {"messages": CHAT, "model": "nope"})])
def test_unknown_model_is_404_model_not_found(server, path, body):
    srv, _ = server
    err = assert_openai_error(httpx.post(srv.base_url + path, json=body), 404, param="model",
                              code="model_not_found")
    assert "fake-model" in err["message"]


def test_openai_client_raises_not_found_for_unknown_model(server):
    openai = pytest.importorskip("openai")
    srv, _ = server
    client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="x", max_tokens=2)


def test_every_error_param_is_set(server):
    """min_p / min_tokens / token-id errors name their field (they used to say null)."""
    srv, _ = server
    for body, param in [({"prompt": "x", "min_p": -1}, "min_p"),
                        ({"prompt": "x", "min_tokens": 99, "max_tokens": 3}, "min_tokens"),
                        ({"prompt": [5, 100000]}, "prompt")]:
        assert_openai_error(httpx.post(srv.base_url + "/v1/completions", json=body), 400, param=param)


def test_context_length_message_is_vllm_like(server):
    srv, _ = server
    r = httpx.post(srv.base_url + "/v1/completions", json={"prompt": "y" * 200, "max_tokens": 100})
    err = assert_openai_error(r, 400, param="max_tokens", code="context_length_exceeded")
    assert "maximum context length is 256" in err["message"]


def test_unknown_route_and_method_use_error_shape(server):
    srv, _ = server
    assert_openai_error(httpx.get(srv.base_url + "/v1/nothing"), 404)
    assert_openai_error(httpx.get(srv.base_url + "/v1/completions"), 405)


def test_bad_input_leaves_no_engine_state(server):
    srv, engine = server
    # a multi-prompt request whose second prompt is too long adds nothing to the engine
    r = httpx.post(srv.base_url + "/v1/completions", json={"prompt": ["fine", "y" * 400]})
    assert_openai_error(r, 400, param="prompt")
    assert engine.num_free_pages() == engine.num_total_pages()


def test_api_key(start_fake_server):
    srv, _ = start_fake_server(api_key="sekret")
    with httpx.Client(base_url=srv.base_url, timeout=30) as c:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"}):
            r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers=headers)
            assert_openai_error(r, 401, code="invalid_api_key")
            assert_openai_error(c.get("/v1/models", headers=headers), 401)
        good = {"Authorization": "Bearer sekret"}
        assert c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers=good).status_code == 200
        assert c.get("/v1/models", headers=good).status_code == 200
        # operational endpoints stay open (like vLLM)
        assert c.get("/health").status_code == 200
        assert c.get("/metrics").status_code == 200
        assert c.get("/version").status_code == 200


def test_api_key_from_env_and_flags(monkeypatch):
    import argparse

    from sparseserve.server.serve_cli import add_serve_args

    parser = argparse.ArgumentParser()
    add_serve_args(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve", "some/model", "--port", "9", "--api-key", "k",
                              "--served-model-name", "a", "b", "--max-waiting-requests", "3",
                              "--max-model-len", "512", "--max-num-seqs", "4"])
    assert (args.model_tag, args.port, args.api_key, args.served_model_name) == ("some/model", 9, "k", ["a", "b"])
    assert (args.max_waiting_requests, args.max_model_len, args.max_num_seqs) == (3, 512, 4)
    assert args.host == "127.0.0.1"
    defaults = parser.parse_args(["serve"])
    assert defaults.port == 8000 and defaults.model_tag is None and defaults.api_key is None
