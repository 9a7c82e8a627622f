"""oneDNN pre-packed linears on the CPU (model/cpu_linear.py) against F.linear: odd row
counts, bias, leading dimensions, the plain path for other dtypes and for a weight written
after packing; the model packs exactly the weights its forward uses, and its logits match the
unpacked model's."""
import pytest
import torch
import torch.nn.functional as F

from sparseserve.model import cpu_linear
from sparseserve.model.llama import LlamaForCausalLM
from sparseserve.config import ModelConfig

pytestmark = pytest.mark.skipif(not cpu_linear.available(), reason="torch without oneDNN")


@pytest.mark.parametrize("rows", [1, 17, 54, 97, 2048])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_equals_f_linear(rows, bias):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 40, generator=g)
    b = torch.randn(96, generator=g) if bias else None
    x = torch.randn(rows, 40, generator=g)
    want = F.linear(x, w, b)
    assert cpu_linear.pack(w) and hasattr(w, "cpu_packed")
    torch.testing.assert_close(cpu_linear.linear(x, w, b), want, rtol=1e-5, atol=1e-5)
    x3 = x.view(1, rows, 40)  # leading dimensions are kept
    assert cpu_linear.linear(x3, w, b).shape == (1, rows, 96)


@pytest.mark.parametrize("rows", [1, 17, 2048])
def test_fused_residual_add_and_silu_mul(rows):
    g = torch.Generator().manual_seed(rows + 1)
    gate, up, down = (torch.randn(*s, generator=g) * 0.2 for s in ((48, 24), (48, 24), (24, 48)))
    x = torch.randn(rows, 24, generator=g)
    h = torch.randn(rows, 24, generator=g)
    want_act = F.silu(F.linear(x, gate)) * F.linear(x, up)
    want = h + F.linear(want_act, down)
    assert cpu_linear.silu_mul(x, gate, up) is None  # not packed: the caller's plain path
    for w in (gate, up, down):
        cpu_linear.pack(w)
    h0 = h.clone()
    act = cpu_linear.silu_mul(x, gate, up)
    torch.testing.assert_close(act, want_act, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cpu_linear.linear(act, down, residual=h), want, rtol=1e-5, atol=1e-5)
    assert torch.equal(h, h0)  # the residual is read, not written


def test_plain_path_for_other_dtypes_and_changed_weights():
    g = torch.Generator().manual_seed(0)
    w16 = torch.randn(8, 4, generator=g).to(torch.bfloat16)
    assert not cpu_linear.pack(w16) and not hasattr(w16, "cpu_packed")
    w = torch.randn(8, 4, generator=g)
    x = torch.randn(3, 4, generator=g)
    cpu_linear.pack(w)
    with torch.no_grad():
        w.mul_(2)  # written after packing: the packed copy is stale, so it must not be used
    torch.testing.assert_close(cpu_linear.linear(x, w), F.linear(x, w), rtol=0, atol=0)
    # bf16 input with an fp32 packed weight: the plain path (F.linear raises for mixed dtypes
    # exactly as it would without packing)
    cpu_linear.pack(w)
    with pytest.raises(RuntimeError):
        cpu_linear.linear(x.bfloat16(), w)


def test_model_packs_what_forward_uses_and_logits_match():
    cfg = ModelConfig.from_hf_dict(dict(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=96, hidden_size=32,
        intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=64,
        tie_word_embeddings=True), name="tiny")
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg, max_positions=64).eval()
    model.init_dummy_weights(0)
    h = torch.randn(5, cfg.hidden_size)
    plain = model.compute_logits(h)
    n = model.pack_cpu_linears()
    # per layer: fused qkv, gate, up (two GEMMs with post-ops), o, down; the logits weight
    assert n == 5 * cfg.num_hidden_layers + 1 == len(model.linear_weights())
    torch.testing.assert_close(model.compute_logits(h), plain, rtol=1e-5, atol=1e-5)
