"""LLM.generate / LLM.chat / `sparseserve generate` apply the server's rules
(`sparseserve.validation`): same checks, same messages, nothing queued after a rejection."""
import math

import pytest

from sparseserve import SamplingParams
from sparseserve.validation import INT64_MAX, INT64_MIN, ParamError

BAD_PARAMS = [
    (dict(temperature=math.nan), "temperature"),
    (dict(temperature=math.inf), "temperature"),
    (dict(top_p=math.nan), "top_p"),
    (dict(seed=INT64_MAX + 1), "seed"),
    (dict(seed=INT64_MIN - 1), "seed"),
    (dict(min_tokens=9, max_tokens=4), "min_tokens"),
    (dict(min_p=-0.1), "min_p"),
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=-2.1), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(logit_bias={"x": 1.0}), "logit_bias"),
    (dict(logit_bias={3: math.nan}), "logit_bias"),
    (dict(prompt_logprobs=-1), "prompt_logprobs"),
    (dict(n=True), "n"),
]


@pytest.mark.parametrize("kwargs,param", BAD_PARAMS, ids=[str(k) for k, _ in BAD_PARAMS])
def test_sampling_params_errors_name_the_field(kwargs, param):
    with pytest.raises(ParamError) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param and param in str(e.value)


def test_int64_seed_bounds_are_accepted_and_logit_bias_normalised():
    assert SamplingParams(seed=INT64_MAX).seed == INT64_MAX
    assert SamplingParams(seed=INT64_MIN).seed == INT64_MIN
    p = SamplingParams(logit_bias={"5": 250.0, 7: -1000})
    assert p.logit_bias == {5: 100.0, 7: -100.0}  # clamped like vLLM
    assert SamplingParams(min_tokens=4, max_tokens=4).min_tokens == 4


def test_generate_rejects_before_queueing(smollm2_llm):
    llm = smollm2_llm
    bad = SamplingParams(max_tokens=4)
    bad.temperature = math.nan  # mutated after construction: generate re-validates
    with pytest.raises(ParamError, match="temperature"):
        llm.generate(["a", "b"], [SamplingParams(max_tokens=2), bad])
    with pytest.raises(ParamError, match="logit_bias") as e:
        llm.generate("a", SamplingParams(logit_bias={10 ** 7: 1.0}))
    assert "vocabulary" in str(e.value)
    with pytest.raises(ParamError) as e:
        llm.generate(["fine", "a\udfffb"], SamplingParams(max_tokens=2))
    assert e.value.param == "prompt.1" and e.value.code == "invalid_unicode"
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.num_free_pages() == llm.engine.num_total_pages()


def test_chat_accepts_text_parts_like_the_server(smollm2_llm):
    llm = smollm2_llm
    greedy = SamplingParams(temperature=0, max_tokens=8)
    plain = llm.chat([{"role": "user", "content": "Say hi.\nThen stop."}], greedy)[0]
    parts = llm.chat([{"role": "user", "content": [{"type": "text", "text": "Say hi."},
                                                   {"type": "text", "text": "Then stop."}]}], greedy)[0]
    assert parts.prompt_token_ids == plain.prompt_token_ids  # parts join with "\n", as vLLM does
    assert parts.outputs[0].token_ids == plain.outputs[0].token_ids
    dev = llm.chat([{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "hi"}],
                   greedy)[0]
    sys_ = llm.chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
                    greedy)[0]
    assert dev.prompt_token_ids == sys_.prompt_token_ids


@pytest.mark.parametrize("messages,param", [
    ([{"role": "wizard", "content": "hi"}], "messages.0.role"),
    ([{"role": "user", "content": None}], "messages.0.content"),
    ([{"role": "user"}], "messages.0.content"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
     "messages.0.content"),
    ([], "messages"),
    ([{"role": "user", "content": "a\udfff"}], "messages.0.content"),
])
def test_chat_rejects_what_the_server_rejects(smollm2_llm, messages, param):
    with pytest.raises(ParamError) as e:
        smollm2_llm.chat(messages, SamplingParams(max_tokens=2))
    assert e.value.param == param
    assert not smollm2_llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("argv,words", [
    (["generate", "hi", "--temperature", "nan"], "temperature must be a finite number"),
    (["generate", "hi", "--min-tokens", "9", "--max-tokens", "3"], "min_tokens must be <= max_tokens"),
    (["generate", "hi", "--presence-penalty", "5"], "presence_penalty must be in [-2, 2]"),
])
def test_cli_generate_validates_before_loading_the_model(monkeypatch, capsys, argv, words):
    import sparseserve.engine.llm as llm_mod
    from sparseserve import cli

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the arguments were validated")

    monkeypatch.setattr(llm_mod, "LLM", no_load)
    assert cli.main(argv) == 2
    assert words in capsys.readouterr().err
