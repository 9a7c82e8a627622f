"""Hugging Face checkpoints: a directory with config.json and *.safetensors shards.

Also home of the parameter naming contract every loader yields: the names and shapes of
transformers' LlamaForCausalLM / MistralForCausalLM / Qwen2ForCausalLM state_dict.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Iterator

import torch

from sparseserve.config import ModelConfig

# Buffers some older checkpoints saved next to the parameters; they carry no weights.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def expected_weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter name a model of `config` needs, with its shape (transformers' layout:
    Linear weights are [out_features, in_features]). lm_head only when not tied."""
    hidden, inter, vocab = config.hidden_size, config.intermediate_size, config.vocab_size
    q_out = config.num_attention_heads * config.head_dim
    kv_out = config.num_key_value_heads * config.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes[p + "self_attn.q_proj.weight"] = (q_out, hidden)
        shapes[p + "self_attn.k_proj.weight"] = (kv_out, hidden)
        shapes[p + "self_attn.v_proj.weight"] = (kv_out, hidden)
        shapes[p + "self_attn.o_proj.weight"] = (hidden, q_out)
        if config.attention_bias:
            shapes[p + "self_attn.q_proj.bias"] = (q_out,)
            shapes[p + "self_attn.k_proj.bias"] = (kv_out,)
            shapes[p + "self_attn.v_proj.bias"] = (kv_out,)
        shapes[p + "mlp.gate_proj.weight"] = (inter, hidden)
        shapes[p + "mlp.up_proj.weight"] = (inter, hidden)
        shapes[p + "mlp.down_proj.weight"] = (hidden, inter)
        shapes[p + "input_layernorm.weight"] = (hidden,)
        shapes[p + "post_attention_layernorm.weight"] = (hidden,)
    shapes["model.norm.weight"] = (hidden,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (vocab, hidden)
    return shapes


def describe_mismatch(
    where: str,
    expected: dict[str, tuple[int, ...]],
    found: dict[str, tuple[int, ...]],
    unexpected: list[str],
) -> str | None:
    """A readable error text for missing / wrongly shaped / unexpected tensors, or None if all match."""
    missing = [n for n in expected if n not in found]
    wrong = [f"{n}: checkpoint {found[n]} != config {expected[n]}"
             for n in expected if n in found and tuple(found[n]) != expected[n]]
    if not (missing or wrong or unexpected):
        return None

    def head(items: list[str]) -> str:
        return ", ".join(items[:12]) + (f", ... ({len(items)} in all)" if len(items) > 12 else "")

    parts = [f"The weights in {where} do not match the model config."]
    if missing:
        parts.append(f"Missing tensors: {head(missing)}.")
    if wrong:
        parts.append(f"Wrong shapes: {head(wrong)}.")
    if unexpected:
        parts.append(f"Unexpected tensors: {head(unexpected)}.")
    parts.append("Check that config.json belongs to these weights and that the checkpoint is a "
                 "complete, unquantized Llama/Mistral/Qwen2 model.")
    return " ".join(parts)


def load_hf_config(directory: str, name: str) -> ModelConfig:
    """ModelConfig from `directory`/config.json; stop tokens also from generation_config.json.

    Instruct checkpoints often list their end-of-turn token (e.g. Llama-3's <|eot_id|>) only in
    generation_config.json; generation must stop there too, as in transformers' generate()."""
    with open(os.path.join(directory, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    config = ModelConfig.from_hf_dict(cfg, name=name)
    gen_path = os.path.join(directory, "generation_config.json")
    if os.path.isfile(gen_path):
        with open(gen_path, encoding="utf-8") as f:
            gen_eos = json.load(f).get("eos_token_id")
        gen_ids = gen_eos if isinstance(gen_eos, (list, tuple)) else ([] if gen_eos is None else [gen_eos])
        merged = tuple(dict.fromkeys([*config.eos_token_ids, *(int(i) for i in gen_ids)]))
        config = dataclasses.replace(config, eos_token_ids=merged)
    return config


def safetensors_files(directory: str) -> list[str]:
    """The shard files of the checkpoint in `directory` (absolute paths, in load order).

    With model.safetensors.index.json only the shards it names count: Mistral repositories
    ship a second copy of the weights (consolidated.safetensors, other names) next to them."""
    index_path = os.path.join(directory, "model.safetensors.index.json")
    if os.path.isfile(index_path):
        with open(index_path, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map", {})
        names = sorted(set(weight_map.values()))
        absent = [n for n in names if not os.path.isfile(os.path.join(directory, n))]
        if absent:
            raise FileNotFoundError(
                f"{index_path} names shard files that are not in {directory}: {absent}. "
                "The download is incomplete; fetch the missing shards.")
    else:
        names = sorted(n for n in os.listdir(directory) if n.endswith(".safetensors"))
        if any(not n.startswith("consolidated") for n in names):
            names = [n for n in names if not n.startswith("consolidated")]
    return [os.path.join(directory, n) for n in names]


def plan_safetensors(directory: str, config: ModelConfig) -> list[tuple[str, list[str]]]:
    """Check the checkpoint's tensor names and shapes against `config` by reading only the
    safetensors headers; return, per shard file, the tensor names to load from it.

    Raises ValueError listing missing, wrongly shaped, duplicated or unexpected tensors, so a
    model never half-loads. A tied checkpoint may still store lm_head.weight; it is skipped."""
    from safetensors import safe_open

    files = safetensors_files(directory)
    if not files:
        raise ValueError(
            f"No *.safetensors files in {directory}. sparseserve loads safetensors checkpoints "
            "(or a .gguf file); convert .bin/.pt weights with transformers' save_pretrained(..., "
            "safe_serialization=True), or pass --load-format dummy for random weights.")
    expected = expected_weight_shapes(config)
    found: dict[str, tuple[int, ...]] = {}
    owner: dict[str, str] = {}
    plan: list[tuple[str, list[str]]] = []
    unexpected: list[str] = []
    for path in files:
        take = []
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                if name in owner:
                    raise ValueError(f"Tensor {name} is stored twice: in {owner[name]} and in {path}.")
                owner[name] = path
                if name.endswith(_IGNORED_SUFFIXES) or (name == "lm_head.weight" and config.tie_word_embeddings):
                    continue
                if name not in expected:
                    unexpected.append(name)
                    continue
                found[name] = tuple(f.get_slice(name).get_shape())
                take.append(name)
        plan.append((path, take))
    error = describe_mismatch(directory, expected, found, unexpected)
    if error:
        raise ValueError(error)
    return plan


def iter_safetensors(directory: str, config: ModelConfig,
                     shard=None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, CPU tensor in the stored dtype), one shard open at a time.

    Validates the whole checkpoint first (headers only), so an incomplete checkpoint raises
    when this is called, before any tensor is read. shard(name, full_shape) -> (dim, start,
    end) | None: read only that slice of each tensor from the file (get_slice), never all."""
    plan = plan_safetensors(directory, config)  # eager: errors raise at call time, not at first next()
    return _stream_safetensors(plan, shard)


def _stream_safetensors(plan: list[tuple[str, list[str]]],
                        shard=None) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for path, names in plan:
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in names:
                if shard is None:
                    yield name, f.get_tensor(name)
                    continue
                sl = f.get_slice(name)
                spec = shard(name, tuple(sl.get_shape()))
                if spec is None:
                    yield name, sl[:]
                elif spec[0] == 0:
                    yield name, sl[spec[1]:spec[2]]
                else:
                    yield name, sl[:, spec[1]:spec[2]]
