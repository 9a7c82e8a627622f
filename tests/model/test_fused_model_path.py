"""The model's fused-kernel path (kernels/fused_layer_ops.py: add + RMSNorm, in-place RoPE,
silu*up; the residual carried apart between layers) against its torch path: logits of a
prefill and a few decode steps of a tiny random Llama, in bf16 and fp32; run_layers over two
layer ranges == over all of them. On CPU tensors the fused path is forced (Triton's
interpreter); on a GPU it is the default for CUDA tensors (compiled)."""
import pytest
import torch

from sparseserve.config import ModelConfig
from sparseserve.model.layers import fused_ok
from sparseserve.model.llama import LlamaForCausalLM

from tests.conftest import DEVICE

PROMPT, DECODES = 23, 3


class CachedCausal:
    """A page-free attention context with a KV cache: causal GQA attention of the step's
    queries over every token stored so far (a step's tokens come after the stored ones)."""

    def __init__(self):
        self.k, self.v = {}, {}

    def attention(self, layer, q, k, v):
        k = torch.cat([self.k.get(layer, k[:0]), k]) if layer in self.k else k.clone()
        v = torch.cat([self.v.get(layer, v[:0]), v]) if layer in self.v else v.clone()
        self.k[layer], self.v[layer] = k, v
        t, n = q.shape[0], k.shape[0]
        rep = q.shape[1] // k.shape[1]
        kf, vf = (x.float().repeat_interleave(rep, 1).transpose(0, 1) for x in (k, v))
        ar = torch.arange(n, device=q.device)
        mask = ar.view(1, n) <= ar[n - t:].view(t, 1)
        out = torch.nn.functional.scaled_dot_product_attention(
            q.float().transpose(0, 1), kf, vf, attn_mask=mask)
        return out.transpose(0, 1).to(q.dtype)


def tiny_model(dtype, kv_heads=2, bias=False):
    cfg = ModelConfig.from_hf_dict(dict(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=96, hidden_size=72,
        intermediate_size=100, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=kv_heads, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
        max_position_embeddings=128, attention_bias=bias), name="tiny")
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in its dtype, as the runner does: the fused q/k/v
    try:                            # and gate/up weight views stay views (a .to() splits them)
        with torch.device(DEVICE):
            model = LlamaForCausalLM(cfg, max_positions=128).eval()
    finally:
        torch.set_default_dtype(default)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))  # drawn on the CPU:
            else:                                                    # the same on any device
                p.copy_(0.15 * torch.randn(p.shape, generator=g))
    return model, cfg


def run(model, fused, ids, segments=None):
    """fp32 logits [1 + DECODES, vocab]: the prompt's last token's, then each greedy decode's
    (the tokens chosen by this run)."""
    model.fused_ops = fused
    ctx, out = CachedCausal(), []
    L = model.num_layers
    with torch.inference_mode():
        h = model.embed(ids)
        pos = torch.arange(len(ids), device=ids.device)
        for a, b in segments or [(0, L)]:
            h = model.run_layers(h, pos, ctx, a, b)
        logits = model.compute_logits(h[-1:])
        out.append(logits)
        for i in range(DECODES):
            tok = logits.argmax(-1)
            pos = torch.tensor([len(ids) + i], device=ids.device)
            h = model.run_layers(model.embed(tok), pos, ctx, 0, L)
            logits = model.compute_logits(h)
            out.append(logits)
    return torch.cat(out).cpu()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kv_heads,bias", [(2, False), (4, True)])  # GQA; MHA with qkv bias
def test_fused_path_matches_torch_path(dtype, kv_heads, bias):
    model, cfg = tiny_model(dtype, kv_heads, bias)
    a, m = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert fused_ok(a.qkv_weight, [a.q_proj, a.k_proj, a.v_proj])
    assert fused_ok(m.gate_up_weight, [m.gate_proj, m.up_proj])
    ids = (torch.arange(PROMPT) * 7 % cfg.vocab_size).to(DEVICE)
    h = model.embed(ids)
    assert model.use_fused_ops(h) == h.is_cuda  # default: fused on CUDA tensors only
    want = run(model, False, ids)
    got = run(model, True, ids)
    assert model.use_fused_ops(h)
    assert torch.equal(got.argmax(-1), want.argmax(-1))  # the same greedy tokens
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(got, want, rtol=0, atol=0.05 * want.abs().max().item())
    # layer-segmented: run_layers returns the full residual stream at every range boundary
    seg = run(model, True, ids, segments=[(0, 1), (1, 3)])
    torch.testing.assert_close(seg, got, rtol=0, atol=0)


def test_fused_path_with_separate_projections():
    """Once q/k/gate weights are replaced (a reload, a `.to()`) they no longer alias their fused
    buffers (fused_ok False): the fused path rotates q and k apart, silu*up from two GEMMs."""
    model, cfg = tiny_model(torch.bfloat16)
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        for lin in (a.q_proj, a.k_proj, m.gate_proj):
            lin.weight = torch.nn.Parameter(lin.weight.detach().clone())
    a = model.model.layers[0].self_attn
    assert not fused_ok(a.qkv_weight, [a.q_proj, a.k_proj, a.v_proj])
    ids = (torch.arange(PROMPT) * 5 % cfg.vocab_size).to(DEVICE)
    want, got = run(model, False, ids), run(model, True, ids)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    torch.testing.assert_close(got, want, rtol=0, atol=0.05 * want.abs().max().item())
