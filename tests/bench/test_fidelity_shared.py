"""bench/fidelity_shared.py's shared-text attention reads only what the rows attend: in the
first pass over a text (TailHarness.run_tail), a chunk's rows run before the later tail
tokens are stored, and the CPU KV cache is torch.empty -- those slots hold whatever the
allocator left, NaN when an earlier test in the process freed NaN-filled tensors
(tests/bench/test_fidelity_keycode_sparq.py failed so under xdist)."""
from types import SimpleNamespace

import torch

from sparseserve.bench.fidelity_shared import SharedText
from sparseserve.kernels import ref


def test_attend_ignores_slots_not_written_yet():
    ps, hkv, G, D, N, base = 4, 2, 2, 8, 22, 1   # a text of 22 tokens in 6 pages per head
    nb = -(-N // ps)
    g = torch.Generator().manual_seed(0)
    P = base + nb * hkv + 1
    k = torch.randn(P, ps, D, generator=g)
    v = torch.randn(P, ps, D, generator=g)
    seq_lens = torch.tensor([10, 12, 13])          # rows at positions 9..12: 13 tokens stored
    tok = torch.arange(nb * ps).view(nb, 1, ps)    # the text's token of each page slot
    pages = base + torch.arange(nb).view(nb, 1) * hkv + torch.arange(hkv)   # [nb, Hkv]
    for cache in (k, v):
        cache[pages] = torch.where((tok >= 13).unsqueeze(-1), float("nan"), cache[pages])
    shared = SharedText(SimpleNamespace(k=[k], v=[v], page_size=ps), hkv, N, D ** -0.5, base)
    shared.set_rows(seq_lens)
    B = seq_lens.shape[0]
    q = torch.randn(B, hkv * G, D, generator=g)
    table = pages.t().unsqueeze(0).expand(B, hkv, nb).to(torch.int32).contiguous()
    num_pages = (-(-seq_lens // ps)).view(-1, 1).expand(B, hkv).to(torch.int32).contiguous()
    last = (seq_lens - (num_pages[:, 0].long() - 1) * ps).to(torch.int32)

    def fallback(*a):
        raise AssertionError("the rows are the shared text's: no fallback")

    got = shared.attend(q, k, v, table, num_pages, last, D ** -0.5, fallback=fallback)
    want = ref.paged_decode_attention(q, k, v, table, num_pages, last, D ** -0.5)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.isfinite(shared.page_mass(0, q)).all()
