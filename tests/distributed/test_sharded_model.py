"""The sharded model (model/parallel.py) on gloo: TP=2 ranks, each loading only its slices,
compute the same logits as the single-process model (safetensors and dummy weights)."""
import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

from sparseserve.config import ModelConfig
from sparseserve.model.llama import LlamaForCausalLM
from sparseserve.model.parallel import TensorParallel, check_tp_divisible

T = 23


class DenseCausal:
    """A page-free attention context: causal GQA attention over the step's own tokens."""

    def attention(self, layer, q, k, v):
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True)
        return out.transpose(0, 1)


def _build(path, tp, dummy):
    from sparseserve.model.loader import iter_weights, load_model_config, resolve_model_source
    src = resolve_model_source(path, "dummy" if dummy else "auto")
    mc = load_model_config(src)
    model = LlamaForCausalLM(mc, max_positions=128, tp=tp)
    if dummy:
        model.init_dummy_weights(0)
    else:
        model.load_weights(iter_weights(src, mc, shard=model.weight_shard))
    return model.eval(), mc


def _logits(model, mc):
    ids = torch.arange(T) * 7 % mc.vocab_size
    with torch.inference_mode():
        h = model.embed(ids)
        h = model.run_layers(h, torch.arange(T), DenseCausal(), 0, model.num_layers)
        return model.compute_logits(h)


def _rank(rank, size, port, path, dummy, result):
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=size)
    try:
        model, mc = _build(path, TensorParallel(rank, size), dummy)
        logits = _logits(model, mc)
        if rank == 0:
            torch.save(logits, result)
    finally:
        dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("kind,dummy", [("llama-gqa", False), ("llama-mha", True),
                                        ("qwen2", False)])
def test_tp2_logits_equal_tp1(tiny_model_dirs, tmp_path, kind, dummy):
    path = tiny_model_dirs[kind][0]
    ref_model, mc = _build(path, None, dummy)
    ref = _logits(ref_model, mc)
    result = str(tmp_path / "logits.pt")
    mp.start_processes(_rank, args=(2, _free_port(), path, dummy, result), nprocs=2,
                       start_method="spawn")
    got = torch.load(result)
    assert got.shape == ref.shape == (T, mc.vocab_size)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_indivisible_heads_error_says_what_to_do():
    mc = ModelConfig("llama", vocab_size=320, hidden_size=64, intermediate_size=128,
                     num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=16)
    with pytest.raises(ValueError, match=r"num_key_value_heads = 2.*among \[1, 2\]"):
        check_tp_divisible(mc, 4)
    check_tp_divisible(mc, 2)
