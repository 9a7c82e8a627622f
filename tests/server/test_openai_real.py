"""The real `openai` client against a server running the real engine on the embedded
SmolLM2-135M (CPU). The model loads once: the offline `LLM` computes reference outputs, then
its engine is handed to the server, so "greedy output == LLM.generate" compares the same
weights and the same engine."""
from __future__ import annotations

import asyncio
import json
import re
import threading
import time

import httpx
import pytest

openai = pytest.importorskip("openai")

from tests.server.helpers import assert_openai_error, metric, metric_samples  # noqa: E402

PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
MAX_TOKENS = 12
MAX_MODEL_LEN = 1024
PENALTIES = dict(frequency_penalty=1.5, presence_penalty=0.5, repetition_penalty=1.2)


@pytest.fixture(scope="module")
def real():
    from sparseserve import LLM, SamplingParams
    from sparseserve.server.api import create_app
    from tests.server.conftest import ServerThread

    llm = LLM(max_model_len=MAX_MODEL_LEN)
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    ref = {
        "completion": llm.generate([PROMPT], greedy, use_tqdm=False)[0],
        "chat": llm.chat(CHAT, greedy, use_tqdm=False)[0],
        "stop": llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop=["\n"]),
                             use_tqdm=False)[0],
        "penalized": llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, **PENALTIES),
                                  use_tqdm=False)[0],
    }
    app = create_app(llm.engine)
    srv = ServerThread(app).start()
    client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)
    model = llm.engine.model_name
    yield {"srv": srv, "app": app, "client": client, "model": model, "ref": ref, "engine": llm.engine}
    srv.stop()


def pages(real) -> tuple[int, int]:
    """(free, total) pages, read on the engine-loop thread (the engine is not thread-safe)."""
    async_engine = real["app"].state.engine

    async def read():
        return await async_engine.call(lambda e: (e.num_free_pages(), e.num_total_pages()))
    return asyncio.run(read())


def test_models_and_health(real):
    models = real["client"].models.list()
    assert [m.id for m in models.data] == [real["model"]]
    assert httpx.get(real["srv"].base_url + "/health").status_code == 200


def test_completion_greedy_equals_llm_generate(real):
    ref = real["ref"]["completion"]
    r = real["client"].completions.create(model=real["model"], prompt=PROMPT, max_tokens=MAX_TOKENS,
                                          temperature=0)
    assert r.choices[0].text == ref.outputs[0].text
    assert r.choices[0].finish_reason == ref.outputs[0].finish_reason
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert r.usage.completion_tokens == len(ref.outputs[0].token_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_completion_stream_with_usage(real):
    ref = real["ref"]["completion"]
    stream = real["client"].completions.create(model=real["model"], prompt=PROMPT, max_tokens=MAX_TOKENS,
                                               temperature=0, stream=True,
                                               stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == ref.outputs[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == \
        [ref.outputs[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref.outputs[0].token_ids)
    assert chunks[-1].usage.prompt_tokens == len(ref.prompt_token_ids)


def test_chat_greedy_equals_llm_chat_stream_and_not(real):
    ref = real["ref"]["chat"]
    client, model = real["client"], real["model"]
    r = client.chat.completions.create(model=model, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == ref.outputs[0].text
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert r.usage.completion_tokens == len(ref.outputs[0].token_ids)
    chunks = list(client.chat.completions.create(model=model, messages=CHAT, max_tokens=MAX_TOKENS,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref.outputs[0].text
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def test_stop_and_logprobs(real):
    client, model, ref = real["client"], real["model"], real["ref"]["stop"]
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                  stop=["\n"], logprobs=2)
    assert r.choices[0].text == ref.outputs[0].text and "\n" not in r.choices[0].text
    assert r.choices[0].finish_reason == ref.outputs[0].finish_reason
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens
    assert all(x <= 0 for x in lp.token_logprobs) and all(1 <= len(t) <= 3 for t in lp.top_logprobs)
    c = client.chat.completions.create(model=model, messages=CHAT, max_tokens=4, temperature=0,
                                       logprobs=True, top_logprobs=2)
    content = c.choices[0].logprobs.content
    assert len(content) == c.usage.completion_tokens and all(len(t.top_logprobs) == 2 for t in content)
    assert "".join(t.token for t in content) == c.choices[0].message.content


def test_sampling_n_seed_top_k_top_p(real):
    client, model = real["client"], real["model"]
    kw = dict(model=model, prompt=PROMPT, max_tokens=6, temperature=0.9, top_p=0.9, n=2, seed=1234,
              extra_body={"top_k": 40})
    a = client.completions.create(**kw)
    assert sorted(c.index for c in a.choices) == [0, 1]
    assert 2 <= a.usage.completion_tokens <= 12
    b = client.completions.create(**kw)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # seeded: reproducible


def test_bad_input_on_real_engine(real):
    base, model = real["srv"].base_url, real["model"]
    long_prompt = "hello " * (MAX_MODEL_LEN + 10)
    err = assert_openai_error(httpx.post(base + "/v1/completions", json={"model": model, "prompt": long_prompt}),
                              400, param="prompt", code="context_length_exceeded")
    assert str(MAX_MODEL_LEN) in err["message"]
    assert_openai_error(httpx.post(base + "/v1/completions", json={"model": "gpt-4o", "prompt": "x"}),
                        404, param="model", code="model_not_found")
    with pytest.raises(openai.NotFoundError):
        real["client"].completions.create(model="gpt-4o", prompt=PROMPT, max_tokens=2)
    body = '{"prompt": "a\\udfffb", "max_tokens": 2}'  # a lone surrogate: 400, not 500
    r = httpx.post(base + "/v1/completions", content=body, headers={"content-type": "application/json"})
    assert_openai_error(r, 400, param="prompt", code="invalid_unicode")
    with pytest.raises(openai.BadRequestError):
        real["client"].completions.create(model=model, prompt=PROMPT, max_tokens=0)
    with pytest.raises(openai.BadRequestError):
        real["client"].chat.completions.create(model=model, messages=CHAT, temperature=-1)


def test_penalties_logit_bias_echo_best_of(real):
    client, model, ref = real["client"], real["model"], real["ref"]
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                  frequency_penalty=PENALTIES["frequency_penalty"],
                                  presence_penalty=PENALTIES["presence_penalty"],
                                  extra_body={"repetition_penalty": PENALTIES["repetition_penalty"]})
    assert r.choices[0].text == ref["penalized"].outputs[0].text  # == LLM.generate, same params
    assert ref["penalized"].outputs[0].text != ref["completion"].outputs[0].text
    tok_id = ref["completion"].outputs[0].token_ids[0]
    forced = client.completions.create(model=model, prompt=PROMPT, max_tokens=3, temperature=0,
                                       logit_bias={str(tok_id + 1): 100})
    assert forced.usage.completion_tokens == 3
    chat = client.chat.completions.create(model=model, messages=CHAT, max_tokens=3, temperature=0,
                                          logit_bias={str(tok_id + 1): 100}, logprobs=True)
    toks = [t.token for t in chat.choices[0].logprobs.content]
    assert len(toks) == 3 and len(set(toks)) == 1  # the biased token, every time
    assert forced.choices[0].text == toks[0] * 3
    # echo: the prompt, then the completion
    e = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, echo=True)
    assert e.choices[0].text == PROMPT + ref["completion"].outputs[0].text
    es = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                   echo=True, stream=True)
    assert "".join(c.choices[0].text for c in es if c.choices) == e.choices[0].text
    # best_of: the n most likely of best_of samples, by cumulative logprob
    b = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=1.0, seed=3,
                                  n=2, best_of=4, logprobs=0)
    assert [c.index for c in b.choices] == [0, 1]
    sums = [sum(c.logprobs.token_logprobs) for c in b.choices]
    assert sums[0] >= sums[1]
    g = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                  best_of=3)
    assert [c.text for c in g.choices] == [ref["completion"].outputs[0].text]
    assert g.choices[0].logprobs is None  # not asked for: not returned
    assert pages(real)[0] == pages(real)[1]


def test_small_request_completes_while_a_5mb_prompt_is_rejected(real):
    base, model = real["srv"].base_url, real["model"]
    result = {}

    def huge():
        t0 = time.time()
        result["r"] = httpx.post(base + "/v1/completions", timeout=120,
                                 json={"model": model, "prompt": "lorem ipsum " * (5 * 1024 * 1024 // 12)})
        result["s"] = time.time() - t0

    t = threading.Thread(target=huge)
    t.start()
    small = real["client"].completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0)
    t.join(120)
    assert small.choices[0].finish_reason in ("length", "stop")
    assert_openai_error(result["r"], 400, param="prompt", code="context_length_exceeded")
    assert result["s"] < 10, f"rejecting the 5 MB prompt took {result['s']:.1f} s"
    assert pages(real)[0] == pages(real)[1]


async def _client(client, model: str, i: int, disconnect: bool) -> str:
    stream = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": f"Count to ten, run {i}."}],
        max_tokens=40 if disconnect else 8, temperature=0, stream=True)
    got = 0
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            got += 1
            if disconnect and got >= 2:
                await stream.close()  # drop the connection mid-stream
                return "dropped"
        if chunk.choices and chunk.choices[0].finish_reason:
            return chunk.choices[0].finish_reason
    return "no-finish"


def test_32_concurrent_streams_quarter_disconnect(real):
    base = real["srv"].base_url
    before = metric_samples(httpx.get(base + "/metrics").text)
    done_before = metric(before, "sparseserve:request_success_total")

    async def run():
        client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=300,
                                    http_client=httpx.AsyncClient(limits=httpx.Limits(max_connections=64)))
        try:
            return await asyncio.gather(*[_client(client, real["model"], i, disconnect=(i % 4 == 0))
                                          for i in range(32)])
        finally:
            await client.close()

    results = asyncio.run(run())
    assert results.count("dropped") == 8
    assert all(r in ("length", "stop") for i, r in enumerate(results) if i % 4), results

    deadline = time.time() + 60
    while True:  # every request is finished or aborted, every page back in its pool
        after = metric_samples(httpx.get(base + "/metrics").text)
        settled = metric(after, "sparseserve:request_success_total") - done_before == 32
        free, total = pages(real)
        if settled and free == total and metric(after, "sparseserve:num_requests_running") == 0:
            break
        assert time.time() < deadline, (free, total, metric(after, "sparseserve:request_success_total"))
        time.sleep(0.2)
    assert metric(after, "sparseserve:request_success_total", finished_reason="abort") - \
        metric(before, "sparseserve:request_success_total", finished_reason="abort") == 8
    assert httpx.get(base + "/health").status_code == 200
    r = real["client"].completions.create(model=real["model"], prompt=PROMPT, max_tokens=2, temperature=0)
    assert r.choices[0].text


CITY = {"type": "object", "required": ["city"], "additionalProperties": False,
        "properties": {"city": {"type": "string", "maxLength": 12}}}
# structured outputs in the soak: (path, body, check of a finished (stop) output's text)
SOAK_STRUCTURED = [
    ("/v1/completions", {"prompt": "Is the sky blue? Answer:", "guided_choice": ["yes", "no"]},
     lambda text: text in ("yes", "no")),
    ("/v1/completions", {"prompt": "A year:", "guided_regex": "[0-9]{2,4}", "min_tokens": 3},
     lambda text: re.fullmatch("[0-9]{3,4}", text)),  # min_tokens: at least 3 digit tokens
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "A city, as JSON."}],
                              "max_tokens": 12, "response_format": {
                                  "type": "json_schema", "json_schema": {"name": "c", "schema": CITY}}},
     lambda text: json.loads(text).keys() == {"city"}),
]


def _soak_body(i: int, model: str) -> tuple[str, dict]:
    """Request i of the soak: completions / chat, penalties, logit_bias, echo, best_of, n,
    min_tokens, structured outputs (choice, regex + min_tokens, JSON schema)."""
    kind = i % 7
    body = {"model": model, "max_tokens": 6, "temperature": 0.8, "seed": i}
    if kind == 0:
        return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": f"Hi {i}"}],
                                        "presence_penalty": 1.0, "frequency_penalty": 0.5}
    if kind == 1:
        return "/v1/completions", {**body, "prompt": f"{i} apples and", "repetition_penalty": 1.3}
    if kind == 2:
        return "/v1/completions", {**body, "prompt": "Once upon a time", "logit_bias": {"13": 5}, "n": 2}
    if kind == 3:
        return "/v1/completions", {**body, "prompt": "The sky is", "echo": True, "best_of": 2}
    if kind == 4:
        return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "Name a colour."}]}], "logprobs": True, "top_logprobs": 2}
    if kind == 5:
        return "/v1/completions", {**body, "prompt": f"Number {i}:", "min_tokens": 2}
    path, extra, _ = SOAK_STRUCTURED[(i // 7) % len(SOAK_STRUCTURED)]
    return path, {**body, **extra}


def _check_structured(path: str, body: dict, data: dict) -> int:
    """A finished structured output of the soak is valid for its constraint; -> outputs checked."""
    checked = 0
    for path_, extra, check in SOAK_STRUCTURED:
        if path_ == path and all(body.get(k) == v for k, v in extra.items()):
            for c in data["choices"]:
                text = c["text"] if "text" in c else c["message"]["content"]
                if c["finish_reason"] == "stop":
                    assert check(text), (extra, text)
                    checked += 1
    return checked


def test_soak_300_requests_30_percent_disconnects(real, caplog):
    base, model = real["srv"].base_url, real["model"]
    caplog.set_level("WARNING")
    checked: list[int] = []  # structured outputs validated per non-streamed request

    async def one(client: httpx.AsyncClient, sem: asyncio.Semaphore, i: int) -> str:
        path, body = _soak_body(i, model)
        drop = i % 10 < 3
        stream = drop or i % 3 == 0
        if stream:  # best_of cannot stream
            body = {**{k: v for k, v in body.items() if k != "best_of"}, "stream": True}
        async with sem:
            if not stream:
                r = await client.post(path, json=body)
                assert r.status_code == 200, r.text
                checked.append(_check_structured(path, body, r.json()))
                return "ok"
            async with client.stream("POST", path, json=body) as r:
                assert r.status_code == 200, await r.aread()
                n = 0
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        n += 1
                        if drop and n >= 2:
                            return "dropped"  # leaving the block closes the connection
                        if line == "data: [DONE]":
                            return "ok"
            return "no-done"

    async def run() -> list[str]:
        sem = asyncio.Semaphore(16)
        async with httpx.AsyncClient(base_url=base, timeout=300,
                                     limits=httpx.Limits(max_connections=32)) as client:
            return await asyncio.gather(*[one(client, sem, i) for i in range(300)])

    results = asyncio.run(run())
    assert results.count("dropped") == 90 and results.count("ok") == 210, results
    assert sum(checked) >= 10, checked
    deadline = time.time() + 60
    while True:
        m = metric_samples(httpx.get(base + "/metrics").text)
        free, total = pages(real)
        if (free == total and metric(m, "sparseserve:num_requests_running") == 0
                and metric(m, "sparseserve:num_requests_waiting") == 0):
            break
        assert time.time() < deadline, (free, total)
        time.sleep(0.2)
    assert metric(m, "sparseserve:kv_cache_usage_perc") == 0.0
    assert asyncio.run(real["app"].state.engine.call(lambda e: len(e.grammars))) == 0  # no matcher left
    assert not [r for r in caplog.records if r.exc_info or "Traceback" in r.getMessage()], \
        [r.getMessage() for r in caplog.records]


def test_metrics_counters_move(real):
    base = real["srv"].base_url
    before = metric_samples(httpx.get(base + "/metrics").text)
    real["client"].completions.create(model=real["model"], prompt=PROMPT, max_tokens=5, temperature=0,
                                      extra_body={"ignore_eos": True})
    after = metric_samples(httpx.get(base + "/metrics").text)
    d = lambda name, **kw: metric(after, name, **kw) - metric(before, name, **kw)  # noqa: E731
    assert d("sparseserve:generation_tokens_total") == 5
    assert d("sparseserve:prompt_tokens_total") == len(real["ref"]["completion"].prompt_token_ids)
    assert d("sparseserve:request_success_total", finished_reason="length") == 1
    assert d("sparseserve:time_to_first_token_seconds_count") == 1
    assert d("sparseserve:inter_token_latency_seconds_count") == 4
    assert d("sparseserve:e2e_request_latency_seconds_count") == 1
    assert d("sparseserve:request_queue_time_seconds_count") == 1
    assert metric(after, "sparseserve:kv_cache_usage_perc") == 0.0  # idle: nothing resident
