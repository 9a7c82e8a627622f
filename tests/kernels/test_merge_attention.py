"""The estimated-mass merge (``ref.merge_attention``) against an explicit torch computation:
attention over a page list split into two disjoint parts, each part's output and
log-sum-exp (``ref.paged_decode_lse``) merged, equals attention over the whole list; an
empty estimate (lse = -inf) leaves the exact part unchanged."""
import torch

from sparseserve.kernels import ref

from tests.kernels import close, to_dev


def test_merge_of_two_disjoint_parts_is_attention_over_both():
    gen = torch.Generator().manual_seed(0)
    B, Hq, Hkv, D, ps, W = 3, 6, 2, 16, 16, 12
    P = B * Hkv * W
    q = torch.randn(B, Hq, D, generator=gen)
    k = torch.randn(P, ps, D, generator=gen)
    v = torch.randn(P, ps, D, generator=gen)
    table = torch.randperm(P, generator=gen).view(B, Hkv, W).to(torch.int32)
    last = torch.tensor([1, 9, 16], dtype=torch.int32)
    full_n = torch.full((B, Hkv), W, dtype=torch.int32)
    q, k, v, table, last, full_n = to_dev(q, k, v, table, last, full_n)
    scale = D ** -0.5
    want = ref.paged_decode_attention(q, k, v, table, full_n, last, scale)
    # part A: the last 5 entries (incl. the partial last page); part B: the first 7 (full)
    a_tab, a_n = table[..., 7:].contiguous(), full_n - 7
    b_tab, b_n = table[..., :7].contiguous(), full_n - 5
    full_len = torch.full_like(last, ps)
    o_a = ref.paged_decode_attention(q, k, v, a_tab, a_n, last, scale)
    l_a = ref.paged_decode_lse(q, k, a_tab, a_n, last, scale)
    o_b = ref.paged_decode_attention(q, k, v, b_tab, b_n, full_len, scale)
    l_b = ref.paged_decode_lse(q, k, b_tab, b_n, full_len, scale)
    close(ref.merge_attention(o_a, l_a, o_b, l_b), want, rtol=1e-5, atol=1e-5)
    # explicit: softmax over the concatenated logits
    none = torch.full_like(l_a, float("-inf"))
    assert torch.equal(ref.merge_attention(o_a, l_a, torch.zeros_like(o_a), none), o_a)
