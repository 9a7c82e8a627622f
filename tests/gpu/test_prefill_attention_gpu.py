"""cuDNN whole-prompt prefill attention on the GPU (worker/prefill_attention.py): padded to its
bucket on the plans built at warm-up, it equals unpadded flash SDPA on Llama-3-8B heads at odd
lengths, GQA and MHA, and the runner of a CUDA engine builds it."""
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from sparseserve.worker.prefill_attention import PaddedCausalAttention

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("heads", [(32, 8), (32, 32)])
def test_cudnn_padded_equals_flash(heads):
    hq, hkv = heads
    dev = torch.device("cuda")
    attn = PaddedCausalAttention(hq, hkv, 128, 128 ** -0.5, torch.bfloat16, dev)
    assert attn.warm_up(4608)[-1] == 4608, "cuDNN SDPA unavailable on this GPU"
    for n in (1, 17, 97, 4097):
        g = torch.Generator(device=dev).manual_seed(n)
        q, k, v = (torch.randn(n, h, 128, device=dev, dtype=torch.bfloat16, generator=g)
                   for h in (hq, hkv, hkv))
        out = attn(q, k, v)
        gqa = {"enable_gqa": True} if hq != hkv else {}
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            ref = F.scaled_dot_product_attention(
                q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                is_causal=True, scale=128 ** -0.5, **gqa)[0].transpose(0, 1)
        assert out.shape == (n, hq, 128) and torch.isfinite(out).all()
        torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)
