"""Structured outputs through the offline API on the embedded SmolLM2: every JSON output
parses and validates against its schema (jsonschema), regex outputs fullmatch, choice outputs
are one of the choices; bad grammars and tokenizer-less models fail clearly; matchers are
released when requests finish or are aborted. Also the n > 1 seed edge case."""
import json
import re

import pytest

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

from sparseserve import SamplingParams  # noqa: E402
from sparseserve.structured import StructuredOutputsParams  # noqa: E402
from sparseserve.validation import INT64_MAX, INT64_MIN, ParamError  # noqa: E402

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city"],
          "properties": {"name": {"type": "string", "maxLength": 20},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]}}}
ASK = [{"role": "user", "content": "Describe a person called Ann as JSON."}]


def _generate(llm, so, n=1, temperature=0.0, max_tokens=60, chat=True):
    p = SamplingParams(temperature=temperature, seed=11, n=n, max_tokens=max_tokens, structured_outputs=so)
    if chat:
        return llm.chat(ASK, p, use_tqdm=False)[0]
    return llm.generate("A person, as JSON:", p, use_tqdm=False)[0]


def test_json_schema_validates(smollm2_llm):
    for chat, temperature, n in ((True, 0.0, 1), (True, 1.0, 3), (False, 0.8, 2)):
        out = _generate(smollm2_llm, StructuredOutputsParams(json=PERSON), n, temperature, chat=chat)
        for o in out.outputs:
            assert o.finish_reason == "stop", o.text
            jsonschema.validate(json.loads(o.text), PERSON)
    assert not smollm2_llm.engine.runner.grammars


def test_dict_and_json_object(smollm2_llm):
    out = _generate(smollm2_llm, {"json": json.dumps(PERSON)})  # dict form, schema as text
    jsonschema.validate(json.loads(out.outputs[0].text), PERSON)
    out = smollm2_llm.chat([{"role": "user", "content": "Reply with a JSON object with one key, ok."}],
                           SamplingParams(temperature=0, max_tokens=120,
                                          structured_outputs=StructuredOutputsParams(json_object=True)),
                           use_tqdm=False)[0].outputs[0]
    if out.finish_reason == "stop":
        assert isinstance(json.loads(out.text), dict)
    else:  # cut by max_tokens: still a prefix of a JSON object
        assert out.text.startswith("{")


def test_regex_and_choice(smollm2_llm):
    pattern = r"[0-9]{3}-[a-z]{2,6}"
    for temperature in (0.0, 1.0):
        out = _generate(smollm2_llm, StructuredOutputsParams(regex=pattern), n=2, temperature=temperature)
        for o in out.outputs:
            assert re.fullmatch(pattern, o.text), o.text
            assert o.finish_reason == "stop"
    choices = ["yes", "no", "it depends \"quoted\""]
    out = _generate(smollm2_llm, StructuredOutputsParams(choice=choices), n=3, temperature=1.0)
    assert all(o.text in choices for o in out.outputs)



def test_min_tokens_with_a_grammar(smollm2_llm):
    """min_tokens + grammar (worker/min_tokens.py): while the grammar can go on, EOS stays masked
    and the output grows inside the grammar; once it can only end, the request ends ("stop")
    before min_tokens, and the output is always valid."""
    llm, eos = smollm2_llm, smollm2_llm.get_tokenizer().eos_token_id
    ask = [{"role": "user", "content": "What is the capital of France? One word."}]
    so = StructuredOutputsParams(regex="[A-Za-z]+")
    def params(k):
        return SamplingParams(temperature=0, max_tokens=24, min_tokens=k, structured_outputs=so)
    base = llm.chat(ask, params(0), use_tqdm=False)[0].outputs[0]
    assert base.finish_reason == "stop" and base.token_ids[-1] == eos  # the model ends it early
    k = len(base.token_ids) + 2
    longer = llm.chat(ask, params(k), use_tqdm=False)[0].outputs[0]
    assert len(longer.token_ids) >= k and eos not in longer.token_ids[:k]
    assert re.fullmatch("[A-Za-z]+", longer.text), longer.text
    choice = llm.chat([{"role": "user", "content": "Is Paris in France?"}],
                      SamplingParams(temperature=0, max_tokens=10, min_tokens=8,
                                     structured_outputs=StructuredOutputsParams(choice=["yes", "no"])),
                      use_tqdm=False)[0].outputs[0]
    assert choice.text in ("yes", "no") and choice.finish_reason == "stop"
    assert len(choice.token_ids) < 8 and not llm.engine.runner.grammars

def test_lark_grammar(smollm2_llm):
    grammar = 'start: "color: " COLOR\nCOLOR: "red" | "green" | "blue"'
    out = _generate(smollm2_llm, StructuredOutputsParams(grammar=grammar))
    assert re.fullmatch(r"color: (red|green|blue)", out.outputs[0].text)


@pytest.mark.parametrize("so, field", [
    (StructuredOutputsParams(json={"type": "objecttt"}), "structured_outputs.json"),
    (StructuredOutputsParams(regex="(("), "structured_outputs.regex"),
    (StructuredOutputsParams(grammar="start: foo"), "structured_outputs.grammar"),
    (StructuredOutputsParams(regex="((", source="guided_regex"), "guided_regex"),
])
def test_bad_grammar_is_a_param_error(smollm2_llm, so, field):
    with pytest.raises(ParamError) as e:
        _generate(smollm2_llm, so)
    assert e.value.param == field and "could not be compiled" in str(e.value)
    assert not smollm2_llm.engine.has_unfinished_requests() and not smollm2_llm.engine.runner.grammars


@pytest.mark.parametrize("value, field", [
    ({}, "structured_outputs"), ({"json": {}, "regex": "a"}, "structured_outputs"),
    ({"choice": []}, "structured_outputs.choice"), ({"choice": ["a", 1]}, "structured_outputs.choice"),
    ({"json": "{not json"}, "structured_outputs.json"), ({"regexp": "a"}, "structured_outputs"),
    ("json", "structured_outputs"),
])
def test_bad_structured_outputs_shape(value, field):
    with pytest.raises(ParamError) as e:
        SamplingParams(structured_outputs=value)
    assert e.value.param == field


def test_abort_releases_matchers(smollm2_llm):
    eng = smollm2_llm.engine
    p = SamplingParams(max_tokens=50, n=2, structured_outputs=StructuredOutputsParams(json=PERSON))
    eng.add_request("abort-me", "Hello", p)
    eng.step()
    assert len(eng.runner.grammars) == 2
    eng.abort_request("abort-me")
    assert not eng.runner.grammars and not eng.has_unfinished_requests()


def test_model_without_tokenizer_is_rejected(tiny_model_dirs):
    from sparseserve import LLM
    llm = LLM(tiny_model_dirs["llama-gqa"][0], load_format="dummy", max_model_len=128)
    assert llm.get_tokenizer() is None
    with pytest.raises(ParamError) as e:
        llm.generate({"prompt_token_ids": [1, 2, 3]},
                     SamplingParams(structured_outputs=StructuredOutputsParams(regex="a+")), use_tqdm=False)
    assert e.value.param == "structured_outputs.regex" and "tokenizer" in str(e.value)


def test_n_with_seed_near_int64_limits(smollm2_llm):
    from sparseserve.engine.llm_engine import child_seed
    assert child_seed(INT64_MAX, 1) == INT64_MIN and child_seed(INT64_MIN, 2) == INT64_MIN + 2
    assert len({child_seed(INT64_MAX - 1, i) for i in range(4)}) == 4
    for seed in (INT64_MAX, INT64_MAX - 1, INT64_MIN):
        p = SamplingParams(temperature=1.0, n=3, seed=seed, max_tokens=4)
        a = smollm2_llm.generate("Hi", p, use_tqdm=False)[0]
        b = smollm2_llm.generate("Hi", p, use_tqdm=False)[0]
        assert len(a.outputs) == 3 and [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
