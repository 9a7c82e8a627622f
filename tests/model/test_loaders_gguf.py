"""Loaders: GGUF files (the embedded SmolLM2 and tiny written ones) and the SmolLM2
tokenizer (HF directories, dummy configs, resolve errors: test_loaders_hf.py)."""
from __future__ import annotations

import os

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize, quantize

from sparseserve.model.loader import (
    ModelSource,
    default_model_path,
    iter_weights,
    load_model_config,
    load_tokenizer,
    resolve_model_source,
)
from tests.model.loader_files import DIMS, T, _hf_state, _write_gguf


# ---------------------------------------------------------------- embedded SmolLM2 GGUF
@pytest.fixture(scope="module")
def smollm():
    """(source, config, {HF name: tensor} for embed/norm and layers 0, 1, 3, 29; None for the rest).
    Read from the GGUF file itself, not the GGUF cache (tests/model/test_gguf_cache.py)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPARSESERVE_GGUF_CACHE", "0")
        source = resolve_model_source(None)
        config = load_model_config(source)
        keep = ("model.embed_tokens.", "model.norm.") + tuple(f"model.layers.{i}." for i in (0, 1, 3, 29))
        return source, config, {n: t if n.startswith(keep) else None
                                for n, t in iter_weights(source, config)}


def test_default_source_is_smollm2(smollm):
    source, c, _ = smollm
    assert source.kind == "gguf" and source.name == "SmolLM2-135M-Instruct" and os.path.isfile(source.path)
    assert source.path == default_model_path() and source.path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    assert (c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (30, 9, 3, 64)
    assert (c.rope_theta, c.tie_word_embeddings, c.max_position_embeddings) == (100000.0, True, 8192)
    assert (c.bos_token_id, c.eos_token_ids) == (1, (2,))


def test_smollm2_weights_equal_transformers_gguf_loading(smollm):
    """transformers' GGUF path (what from_pretrained(dir, gguf_file=...) runs; called directly
    because from_pretrained insists on accelerate for GGUF) against ours."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    source, config, ours = smollm
    directory, filename = os.path.split(source.path)
    hf_config = AutoConfig.from_pretrained(directory, gguf_file=filename)
    for attr in ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_size",
                 "intermediate_size", "vocab_size", "max_position_embeddings", "tie_word_embeddings",
                 "rms_norm_eps", "bos_token_id"):
        assert getattr(config, attr) == getattr(hf_config, attr), attr
    assert config.rope_theta == hf_config.rope_parameters["rope_theta"]
    with torch.device("meta"):
        meta_model = AutoModelForCausalLM.from_config(hf_config)
    theirs = load_gguf_checkpoint(source.path, return_tensors=True, model_to_load=meta_model)["tensors"]

    assert set(ours) == set(meta_model.state_dict()) - {"lm_head.weight"}
    checked = [n for n, t in ours.items() if t is not None]
    assert len(checked) == 2 + 4 * 9
    for name in checked:
        torch.testing.assert_close(ours[name].float(), theirs[name].float(), rtol=1e-6, atol=1e-6, msg=name)


def _rope(x: torch.Tensor, pos: torch.Tensor, theta: float, interleaved: bool) -> torch.Tensor:
    """x [tokens, heads, d]; rotate-half pairs (i, i+d/2) or interleaved pairs (2i, 2i+1)."""
    d = x.shape[-1]
    ang = pos[:, None, None].double() / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    cos, sin = ang.cos(), ang.sin()
    a, b = (x[..., 0::2], x[..., 1::2]) if interleaved else (x[..., : d // 2], x[..., d // 2:])
    ra, rb = a * cos - b * sin, a * sin + b * cos
    return torch.stack((ra, rb), -1).flatten(-2) if interleaved else torch.cat((ra, rb), -1)


def test_smollm2_unpermuted_qk_with_rotate_half_equal_raw_gguf_with_interleaved_rope(smollm):
    """Independent of transformers: attention scores from our weights + HF rotate-half RoPE equal
    those from the file's raw (permuted) weights + llama.cpp's interleaved RoPE."""
    source, config, ours = smollm
    raw = {t.name: torch.from_numpy(dequantize(t.data, t.tensor_type)).double()
           for t in gguf.GGUFReader(source.path).tensors if t.name.startswith(("blk.3.attn_q.", "blk.3.attn_k."))}
    torch.manual_seed(0)
    x, pos = torch.randn(5, config.hidden_size, dtype=torch.float64), torch.arange(5) * 37

    def scores(wq, wk, interleaved):
        q = _rope((x @ wq.T).view(5, 9, 64), pos, config.rope_theta, interleaved)
        k = _rope((x @ wk.T).view(5, 3, 64), pos, config.rope_theta, interleaved)
        return torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(3, dim=1))

    want = scores(raw["blk.3.attn_q.weight"], raw["blk.3.attn_k.weight"], interleaved=True)
    got = scores(*(ours[f"model.layers.3.self_attn.{p}_proj.weight"].double() for p in "qk"), interleaved=False)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)


def test_smollm2_tokenizer(smollm, tmp_path):
    source = smollm[0]
    tok = load_tokenizer(source)
    text = "Hello, world! Sparse attention over 1M tokens — café."
    ids = tok(text)["input_ids"]
    assert ids[0] != tok.bos_token_id and tok.decode(ids) == text  # the file says add_bos_token = False
    assert (tok.bos_token_id, tok.eos_token_id, tok.eos_token) == (1, 2, "<|im_end|>")
    messages = [{"role": "user", "content": "What is 2+2?"}]
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    turn = "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    assert prompt.startswith("<|im_start|>system\n") and prompt.endswith(turn)
    prompt_ids = tok(prompt, add_special_tokens=False)["input_ids"]
    assert prompt_ids[0] == 1 and prompt_ids.count(2) == 2  # <|im_start|> / <|im_end|> are single tokens
    # the same tokenizer saved as a HF directory loads through the --tokenizer override
    tok.save_pretrained(tmp_path)
    again = load_tokenizer(ModelSource("dummy", None, "llama-3-8b"), tokenizer=str(tmp_path))
    assert again(text)["input_ids"] == ids and again.eos_token_id == 2
    assert again.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == prompt


# ---------------------------------------------------------------- tiny GGUF files written here (loader_files.py)


@pytest.mark.parametrize("qtype", [T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1], ids=lambda t: t.name)
def test_tiny_gguf_round_trip(tmp_path, qtype):
    state = _hf_state(bias=False, tied=False)
    path = _write_gguf(tmp_path / f"tiny-model.{qtype.name}.gguf", state, qtype)
    source = resolve_model_source(path)
    assert source == ModelSource("gguf", path, "tiny-model")
    config = load_model_config(source)
    assert (config.architecture, config.num_attention_heads, config.num_key_value_heads) == ("llama", 4, 2)
    assert (config.head_dim, config.rope_theta, config.max_position_embeddings) == (16, 50000.0, 512)
    assert config.rms_norm_eps == pytest.approx(1e-6) and not config.tie_word_embeddings
    assert (config.bos_token_id, config.eos_token_ids) == (1, (2, 5))  # eos and eot both stop
    ours = dict(iter_weights(source, config))
    assert set(ours) == set(state)
    for name, x in state.items():
        got, qt = ours[name], (T.F32 if x.ndim == 1 else qtype)  # norms are written as F32
        assert got.dtype == {T.F16: torch.float16, T.BF16: torch.bfloat16}.get(qt, torch.float32), name
        # bit-exact with gguf-py's own round trip (llama.cpp's block formats) ...
        assert torch.equal(got.float(), torch.from_numpy(dequantize(quantize(x, qt), qt))), name
        # and close to the original values, relative to the tensor's range
        tol = {T.F32: 0, T.F16: 1e-3, T.BF16: 1e-2, T.Q8_0: 0.02, T.Q5_0: 0.08, T.Q5_1: 0.08}.get(qt, 0.15)
        assert float((got.float() - torch.from_numpy(x)).abs().max()) <= tol * float(np.abs(x).max()), name


def test_tiny_gguf_qwen2_bias_no_permutation_tied(tmp_path):
    state = _hf_state(bias=True, tied=True)
    path = _write_gguf(tmp_path / "qwen.gguf", state, T.F32, arch="qwen2")
    source = resolve_model_source(path, "gguf")
    config = load_model_config(source)
    assert (config.architecture, config.attention_bias, config.tie_word_embeddings) == ("qwen2", True, True)
    ours = dict(iter_weights(source, config))
    assert set(ours) == set(state) and "lm_head.weight" not in ours
    for name, x in state.items():
        assert torch.equal(ours[name], torch.from_numpy(x)), name


def test_tiny_gguf_llama3_rope_freqs_and_mistral_name(tmp_path):
    d, factor, low, high, orig = DIMS["hidden"] // DIMS["heads"], 8.0, 1.0, 4.0, 2048  # all 3 bands occur
    wavelen = 2 * np.pi * 50000.0 ** (np.arange(0, d, 2) / d)  # convert_hf_to_gguf's llama3 rope_factors
    smooth = (orig / wavelen - low) / (high - low)
    factors = np.where(wavelen < orig / high, 1.0,
                       np.where(wavelen > orig / low, factor, 1 / ((1 - smooth) / factor + smooth)))
    assert 1.0 in factors and factor in factors and len(set(factors)) > 2
    path = _write_gguf(tmp_path / "m.gguf", _hf_state(False, True), name="Mistral 7B Instruct",
                       extra=[("rope_freqs.weight", factors.astype(np.float32), None)])
    config = load_model_config(resolve_model_source(path))
    assert config.architecture == "mistral"
    assert config.rope_scaling == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 2048}


def test_q4_k_block_dequantizes_as_llama_cpp_defines(tmp_path):
    """A hand-built Q4_K block: d=0.5, dmin=0.25, every sub-block scale 1 and min 2 -> 0.5*q - 0.5."""
    rng = np.random.default_rng(1)
    rows, cols = DIMS["hidden"], 256  # down_proj [hidden, inter] with inter = one 256-value block
    qs = rng.integers(0, 256, size=(rows, 128), dtype=np.uint8)
    header = np.concatenate([np.array([0.5, 0.25], np.float16).view(np.uint8),
                             np.array([1] * 4 + [2] * 4 + [0x21] * 4, np.uint8)])
    blocks = np.concatenate([np.tile(header, (rows, 1)), qs], axis=1)
    nibbles = np.stack([qs.reshape(rows, 4, 32) & 0xF, qs.reshape(rows, 4, 32) >> 4], axis=2).reshape(rows, cols)
    state = _hf_state(False, True, inter=cols)
    for i in range(DIMS["layers"]):
        state[f"model.layers.{i}.mlp.down_proj.weight"] = (0.5 * nibbles - 0.5).astype(np.float32)
    path = _write_gguf(tmp_path / "k.gguf", {k: v for k, v in state.items() if "layers.1.mlp.down" not in k},
                       extra=[("blk.1.ffn_down.weight", blocks, T.Q4_K)])
    source = resolve_model_source(path)
    ours = dict(iter_weights(source, load_model_config(source)))
    name = "model.layers.1.mlp.down_proj.weight"
    assert torch.equal(ours[name], torch.from_numpy(state[name]))


def test_gguf_errors_unsupported_type_architecture_missing_tensor(tmp_path):
    state = _hf_state(False, True, inter=256)
    del state["model.layers.1.mlp.down_proj.weight"]
    q2k = np.zeros((DIMS["hidden"], 84), np.uint8)  # one 256-value Q2_K block (84 bytes) per row
    path = _write_gguf(tmp_path / "q2.gguf", state, extra=[("blk.1.ffn_down.weight", q2k, T.Q2_K)])
    supported = "Supported types: F32, F16, BF16, Q8_0, Q4_0, Q4_1"
    with pytest.raises(ValueError, match=rf"'blk\.1\.ffn_down\.weight'.*type Q2_K.*{supported}.*llama-quantize"):
        resolve_model_source(path)
    source = ModelSource("gguf", path, "q2")
    with pytest.raises(ValueError, match="Q2_K"):
        iter_weights(source, load_model_config(source))  # raises at the call, yields nothing
    # the architecture alone is fine for dummy weights
    assert resolve_model_source(path, "dummy").kind == "dummy"

    state = _hf_state(False, True)
    with pytest.raises(ValueError, match="Unsupported GGUF architecture 'gpt2'.*llama"):
        resolve_model_source(_write_gguf(tmp_path / "gpt2.gguf", state, arch="gpt2"))
    del state["model.layers.0.self_attn.v_proj.weight"]
    with pytest.raises(ValueError, match=r"Missing tensors: model\.layers\.0\.self_attn\.v_proj\.weight"):
        resolve_model_source(_write_gguf(tmp_path / "partial.gguf", state))
