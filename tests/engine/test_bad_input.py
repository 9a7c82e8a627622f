"""Bad input raises a clear error naming the problem and the fix; nothing is left behind."""
import json

import pytest

from sparseserve import LLM, SamplingParams
from sparseserve.engine.args import EngineArgs


@pytest.fixture(scope="module")
def llm(tiny_model_dirs):
    return LLM(tiny_model_dirs["llama-gqa"][0], page_size=16, max_model_len=128)


@pytest.mark.parametrize("kwargs, words", [
    (dict(max_tokens=-1), "max_tokens"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(temperature=-0.1), "temperature"),
    (dict(top_k=-5), "top_k"),
    (dict(min_p=2.0), "min_p"),
    (dict(n=0), "n must"),
    (dict(logprobs=1000), "logprobs"),
])
def test_invalid_sampling_params(kwargs, words):
    with pytest.raises(ValueError, match=words):
        SamplingParams(**kwargs)


def test_prompt_too_long_and_empty(llm):
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate({"prompt_token_ids": [5] * 128}, SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="empty"):
        llm.generate({"prompt_token_ids": []})
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate("text needs a tokenizer")
    with pytest.raises(ValueError, match=r"\[0, 320\)"):
        llm.generate({"prompt_token_ids": [5, 999]})
    # a failed batch leaves nothing queued and no page held
    with pytest.raises(ValueError):
        llm.generate([{"prompt_token_ids": [5, 6]}, {"prompt_token_ids": [5] * 500}])
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.num_free_pages() == llm.engine.num_total_pages()
    out = llm.generate({"prompt_token_ids": [5] * 120}, SamplingParams(max_tokens=50))
    assert out[0].outputs[0].finish_reason == "length"
    assert len(out[0].outputs[0].token_ids) == 8  # capped by max_model_len


def test_unknown_model_path():
    with pytest.raises(FileNotFoundError, match="/no/such/model"):
        LLM("/no/such/model")


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": 10,
        "hidden_size": 8, "num_attention_heads": 2, "num_hidden_layers": 1}))
    with pytest.raises(ValueError, match="(?i)unsupported.*architecture"):
        LLM(str(tmp_path))


def test_kv_capacity_errors(tiny_model_dirs):
    path = tiny_model_dirs["llama-gqa"][0]
    with pytest.raises(ValueError, match="kv_cache_memory_bytes"):
        EngineArgs(model=path, max_model_len=1000,
                   kv_cache_memory_bytes=100_000).create_engine_config()
    with pytest.raises(ValueError, match="page_size"):
        EngineArgs(model=path, page_size=24).create_engine_config()


def test_sliding_window_models_are_capped(tmp_path):
    cfg = {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "vocab_size": 64,
           "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
           "num_key_value_heads": 2, "num_hidden_layers": 1, "max_position_embeddings": 8192,
           "sliding_window": 256}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="sliding-window"):
        EngineArgs(model=str(tmp_path), load_format="dummy", max_model_len=1024,
                   kv_cache_memory_bytes=1 << 24).create_engine_config()
    ok, _ = EngineArgs(model=str(tmp_path), load_format="dummy", max_model_len=256,
                       kv_cache_memory_bytes=1 << 24).create_engine_config()
    assert ok.model.sliding_window == 256 and ok.model.architecture == "mistral"
