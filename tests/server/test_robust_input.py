"""Input that used to stall or crash others: huge bodies (413), huge prompts (rejected by a
character bound before tokenizing), slow tokenization (a pool, off the engine thread), lone
surrogates (400 naming the field), prompts x n (bounded)."""
from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.server.helpers import assert_openai_error


def test_body_over_the_limit_is_413_with_content_length_and_chunked(start_fake_server):
    from sparseserve.server.limits import ServerLimits

    srv, engine = start_fake_server(limits=ServerLimits(max_request_body_bytes=1000))
    body = {"prompt": "y" * 2000, "max_tokens": 2}
    err = assert_openai_error(httpx.post(srv.base_url + "/v1/completions", json=body), 413,
                              code="request_too_large")
    assert "--max-request-body-bytes" in err["message"]

    def chunks():  # no Content-Length: the limit is enforced while the body arrives
        data = b'{"prompt": "' + b"y" * 3000 + b'"}'
        for i in range(0, len(data), 256):
            yield data[i:i + 256]

    r = httpx.post(srv.base_url + "/v1/completions", content=chunks(),
                   headers={"content-type": "application/json"})
    assert_openai_error(r, 413, code="request_too_large")
    ok = httpx.post(srv.base_url + "/v1/completions", json={"prompt": "ok", "max_tokens": 2})
    assert ok.status_code == 200, ok.text
    assert engine.num_free_pages() == engine.num_total_pages()


def test_huge_prompt_is_rejected_without_tokenizing(start_fake_server):
    srv, engine = start_fake_server()
    calls = []
    # the server tokenizes with per-thread copies of this tokenizer: count on the class
    cls = type(engine.tokenizer)
    orig = cls.encode

    def counting(self, text, add_special_tokens=True):
        calls.append(len(text))
        return orig(self, text, add_special_tokens)

    cls.encode = counting
    try:
        big = "y" * (2 * 1024 * 1024)
        r = httpx.post(srv.base_url + "/v1/completions", json={"prompt": big}, timeout=60)
        err = assert_openai_error(r, 400, param="prompt", code="context_length_exceeded")
        assert "characters" in err["message"]
        r = httpx.post(srv.base_url + "/v1/chat/completions",
                       json={"messages": [{"role": "user", "content": big}]}, timeout=60)
        assert_openai_error(r, 400, param="messages", code="context_length_exceeded")
        assert not any(n >= len(big) for n in calls), "the huge prompt was tokenized"
    finally:
        cls.encode = orig


def test_slow_tokenization_does_not_block_other_requests(start_fake_server):
    """One prompt that takes 3 s to tokenize; a small request meanwhile finishes at once."""
    srv, engine = start_fake_server()
    cls = type(engine.tokenizer)
    orig = cls.encode

    def slow(self, text, add_special_tokens=True):
        if text.startswith("SLOW"):
            time.sleep(3)
        return orig(self, text, add_special_tokens)

    cls.encode = slow
    try:
        done = {}

        def big():
            done["slow"] = httpx.post(srv.base_url + "/v1/completions",
                                      json={"prompt": "SLOW", "max_tokens": 2}, timeout=60)
        t = threading.Thread(target=big)
        t.start()
        time.sleep(0.3)
        t0 = time.time()
        r = httpx.post(srv.base_url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                       timeout=60)
        small_s = time.time() - t0
        t.join(30)
    finally:
        cls.encode = orig
    assert r.status_code == 200 and done["slow"].status_code == 200
    assert small_s < 2.0, f"the small request waited {small_s:.1f} s behind the slow tokenization"


def test_prompts_times_n_is_bounded(start_fake_server):
    from sparseserve.server.limits import ServerLimits

    srv, engine = start_fake_server(limits=ServerLimits(max_sequences=8))
    r = httpx.post(srv.base_url + "/v1/completions", json={"prompt": ["a", "b", "c"], "n": 3})
    err = assert_openai_error(r, 400, param="prompt")
    assert "3 prompts x n=3 = 9" in err["message"]
    ok = httpx.post(srv.base_url + "/v1/completions", json={"prompt": ["a", "b"], "n": 4, "max_tokens": 2})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 8
    assert engine.num_free_pages() == engine.num_total_pages()


def test_lone_surrogate_in_completion_prompt_leaves_no_traceback(start_fake_server, caplog):
    srv, _ = start_fake_server()
    body = '{"prompt": "a\\udfffb", "max_tokens": 2}'
    r = httpx.post(srv.base_url + "/v1/completions", content=body,
                   headers={"content-type": "application/json"})
    err = assert_openai_error(r, 400, param="prompt", code="invalid_unicode")
    assert "Unicode" in err["message"]
    assert not [rec for rec in caplog.records if rec.exc_info]


@pytest.mark.parametrize("flag,value", [("--max-request-body-bytes", "0"), ("--tokenizer-workers", "0"),
                                        ("--max-seqs-per-request", "-1"), ("--max-n", "0")])
def test_limit_flags_are_checked(flag, value):
    import argparse

    from sparseserve.server.serve_cli import add_serve_args, server_limits

    parser = argparse.ArgumentParser()
    add_serve_args(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve", flag, value])
    with pytest.raises(ValueError, match=flag):
        server_limits(args)
