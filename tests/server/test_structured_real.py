"""Structured outputs and prompt logprobs on a real server over the embedded SmolLM2 (CPU),
through the real `openai` client and plain HTTP: response_format json_schema / json_object,
vLLM's structured_outputs and guided_json / guided_regex / guided_choice on both endpoints;
every JSON output validates against its schema (jsonschema), regexes fullmatch, choices are
choices; bad grammars are 400s naming the field; echo + logprobs and prompt_logprobs equal
LLM.generate's; matchers are released after aborted streams."""
from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import pytest

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

from tests.server.helpers import assert_openai_error, sse_events  # noqa: E402

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "population"],
          "properties": {"city": {"type": "string", "maxLength": 24},
                         "population": {"type": "integer", "minimum": 0, "maximum": 99999999}}}
CHAT = [{"role": "user", "content": "Give the largest city of France and its population as JSON."}]
PROMPT = "The largest city of France, as JSON:"


@pytest.fixture(scope="module")
def smollm2_server():
    from sparseserve import LLM
    from sparseserve.server.api import create_app
    from tests.server.conftest import ServerThread

    llm = LLM(max_model_len=1024, max_num_seqs=8, max_num_batched_tokens=16)  # chunked prefill
    app = create_app(llm.engine)
    srv = ServerThread(app).start()
    client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)
    yield {"srv": srv, "app": app, "client": client, "model": llm.engine.model_name, "llm": llm}
    srv.stop()


def _post(s, path, body):
    return httpx.post(s["srv"].base_url + path, json={"model": s["model"], **body}, timeout=300)


def _grammars(s) -> int:
    eng = s["app"].state.engine
    return asyncio.run(eng.call(lambda e: len(e.runner.grammars)))


def test_chat_response_format_json_schema(smollm2_server):
    s = smollm2_server
    r = s["client"].chat.completions.create(
        model=s["model"], messages=CHAT, max_tokens=60, temperature=0.7, seed=1, n=3,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}})
    for c in r.choices:
        assert c.finish_reason == "stop", c.message.content
        jsonschema.validate(json.loads(c.message.content), SCHEMA)


def test_chat_json_object_and_stream(smollm2_server):
    s = smollm2_server
    stream = s["client"].chat.completions.create(
        model=s["model"], messages=[{"role": "user", "content": "Reply with a JSON object with one key, ok."}],
        max_tokens=120, temperature=0, stream=True, response_format={"type": "json_object"})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    if chunks[-1].choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:
        assert text.startswith("{")


def test_completions_guided_fields(smollm2_server):
    s = smollm2_server
    c = s["client"].completions
    r = c.create(model=s["model"], prompt=PROMPT, max_tokens=60, temperature=0, extra_body={"guided_json": SCHEMA})
    assert r.choices[0].finish_reason == "stop", r.choices[0].text
    jsonschema.validate(json.loads(r.choices[0].text), SCHEMA)
    r = c.create(model=s["model"], prompt=PROMPT, max_tokens=60, temperature=0.5, seed=2,
                 extra_body={"response_format": {"type": "json_schema",
                                                 "json_schema": {"name": "x", "schema": SCHEMA}}})
    assert r.choices[0].finish_reason == "stop", r.choices[0].text
    jsonschema.validate(json.loads(r.choices[0].text), SCHEMA)
    pattern = r"(Paris|Lyon), [0-9]{1,7}"
    r = c.create(model=s["model"], prompt=PROMPT, max_tokens=20, temperature=1.0, n=3, seed=5,
                 extra_body={"guided_regex": pattern})
    assert all(re.fullmatch(pattern, ch.text) for ch in r.choices), [ch.text for ch in r.choices]
    choices = ["Paris", "Marseille", "Lyon"]
    r = c.create(model=s["model"], prompt=[PROMPT, "Pick one:"], max_tokens=10, temperature=1.0, n=2,
                 extra_body={"guided_choice": choices})
    assert len(r.choices) == 4 and all(ch.text in choices for ch in r.choices)
    r = c.create(model=s["model"], prompt=PROMPT, max_tokens=10, temperature=0,
                 extra_body={"structured_outputs": {"choice": choices}})
    assert r.choices[0].text in choices


def test_completion_stream_guided_regex(smollm2_server):
    s = smollm2_server
    with httpx.stream("POST", s["srv"].base_url + "/v1/completions", timeout=300,
                      json={"model": s["model"], "prompt": PROMPT, "max_tokens": 20, "stream": True,
                            "guided_regex": "[A-Z][a-z]{2,8}!"}) as resp:
        events = sse_events(resp.iter_lines())
    text = "".join(e["choices"][0]["text"] for e in events if e.get("choices"))
    assert re.fullmatch("[A-Z][a-z]{2,8}!", text), text


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"messages": CHAT, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objecttt"}}}},
     "response_format.json_schema.schema"),
    ("/v1/chat/completions", {"messages": CHAT, "response_format": {"type": "json_schema"}},
     "response_format.json_schema"),
    ("/v1/chat/completions", {"messages": CHAT, "response_format": {"type": "yaml"}}, "response_format.type"),
    ("/v1/completions", {"prompt": PROMPT, "guided_regex": "(("}, "guided_regex"),
    ("/v1/completions", {"prompt": PROMPT, "guided_json": "{not json"}, "guided_json"),
    ("/v1/completions", {"prompt": PROMPT, "guided_choice": []}, "guided_choice"),
    ("/v1/completions", {"prompt": PROMPT, "structured_outputs": {"grammar": "start: foo"}},
     "structured_outputs.grammar"),
    ("/v1/completions", {"prompt": PROMPT, "guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
])
def test_bad_grammars_are_400_naming_the_field(smollm2_server, path, body, param):
    assert_openai_error(_post(smollm2_server, path, body), 400, param=param)


def test_echo_with_logprobs_and_prompt_logprobs(smollm2_server):
    s = smollm2_server
    r = _post(s, "/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "echo": True,
                                     "logprobs": 2})
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    ids = s["llm"].get_tokenizer().encode(PROMPT)
    assert len(lp["tokens"]) == len(ids) + 3
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    r2 = _post(s, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 2})
    plp = r2.json()["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(ids)
    for i in range(1, len(ids)):
        assert lp["token_logprobs"][i] == pytest.approx(plp[i][str(ids[i])]["logprob"], abs=1e-5)
        assert len(lp["top_logprobs"][i]) >= 2


def test_aborted_streams_release_matchers(smollm2_server):
    s = smollm2_server
    for _ in range(3):
        with httpx.stream("POST", s["srv"].base_url + "/v1/completions", timeout=300,
                          json={"model": s["model"], "prompt": PROMPT, "max_tokens": 200, "stream": True,
                                "guided_json": {"type": "array", "items": {"type": "string"}}}) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    break  # the client goes away mid-stream
    deadline = time.time() + 30
    while _grammars(s) and time.time() < deadline:
        time.sleep(0.2)
    assert _grammars(s) == 0


def test_no_tokenizer_is_400(tiny_model_dirs):
    from sparseserve import LLM
    from sparseserve.server.api import create_app
    from tests.server.conftest import ServerThread

    llm = LLM(tiny_model_dirs["llama-gqa"][0], max_model_len=128)
    srv = ServerThread(create_app(llm.engine)).start()
    try:
        r = httpx.post(srv.base_url + "/v1/completions", timeout=60,
                       json={"prompt": [1, 2, 3], "max_tokens": 2, "guided_regex": "a+"})
        err = assert_openai_error(r, 400, param="guided_regex")
        assert "tokenizer" in err["message"]
    finally:
        srv.stop()
