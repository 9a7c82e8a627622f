"""Key codes on a few channels per page (``keycode2-c8``, ``keycode2-c4``,
``sparse/keycode_channels.py``): the summaries decode to what index() saw, score() equals the
explicit token-logit computation over the decoded keys, the widest channels find the token a
page mean hides, and the engine under forced offload == everything resident."""
import pytest
import torch

from sparseserve.sparse import get_algorithm_class
from sparseserve.sparse.keycodes import unpack_codes
from tests.kvcache.test_offload_engine import (check_forced_offload_equals_resident,  # noqa: F401
                                               model_dir)

ALGOS = ["keycode2-c8", "keycode2-c4", "keycode2-c2"]


def _indexed(algo, keys, num_tokens):
    """The algorithm (page 32) and its summaries of pages ``keys`` [P, 32, D]."""
    P, ps, D = keys.shape
    a = get_algorithm_class(algo)(ps, 8, 1, 2)
    s = a.make_summaries(P + 1, D)
    a.index(keys, torch.arange(P, dtype=torch.int32), num_tokens, s, None)
    return a, s


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("D", [16, 64, 128])
def test_summaries_decode_what_index_saw(algo, D):
    g = torch.Generator().manual_seed(D)
    keys = torch.randn(5, 32, D, generator=g) * torch.rand(1, 1, D, generator=g) * 4
    ntok = torch.tensor([32, 1, 17, 32, 31], dtype=torch.int32)
    a, s = _indexed(algo, keys, ntok)
    r = a.coded_channels(D)
    assert r == max(4, -(-(D // a.channel_divisor) // 4) * 4)
    for p, n in enumerate(ntok.tolist()):
        k = keys[p, :n]
        # the int8 mean: within half a step (absmax / 127) of the true mean
        assert s["kmean"].dtype == torch.int8
        mean = s["kmean"][p].float() * s["kscale"][p]
        assert (mean - k.mean(0)).abs().max() <= k.mean(0).abs().max() / 254 + 1e-6
        chan = unpack_codes(s["chan"][p], 8)
        width = k.amax(0) - k.amin(0)
        # the r widest channels of this page, in channel order
        assert torch.equal(chan, width.topk(r).indices.sort().values)
        assert torch.equal(s["klo"][p], k.amin(0)[chan]) and torch.equal(s["khi"][p], k.amax(0)[chan])
        approx = a.approx_keys(s, torch.tensor([p]))[0, :n]      # [n, D]
        other = torch.ones(D, dtype=torch.bool)
        other[chan] = False
        assert torch.allclose(approx[:, other], mean[other].expand(n, -1), atol=1e-5)
        # 2-bit levels: within an eighth of the range of every coded key
        err = (approx[:, chan] - k[:, chan]).abs()
        assert (err <= width[chan] / 8 + 1e-5).all()


@pytest.mark.parametrize("algo", ALGOS)
def test_score_equals_explicit_token_logits(algo):
    """score() (logits from the page mean plus the coded channels' deviations, never a
    decoded key tensor) == per head a softmax-mass over q . approx key of every token."""
    g = torch.Generator().manual_seed(3)
    P, D, B, Hkv, G, W = 54, 64, 3, 2, 3, 20
    keys = torch.randn(P, 32, D, generator=g) * torch.rand(1, 1, D, generator=g) * 3
    a, s = _indexed(algo, keys, torch.full((P,), 32, dtype=torch.int32))
    q = torch.randn(B, Hkv * G, D, generator=g)
    pt = torch.stack([torch.randperm(P, generator=g)[:W] for _ in range(B * Hkv)]).view(B, Hkv, W)
    num_pages = torch.tensor([[20, 17], [1, 20], [9, 4]], dtype=torch.int32)
    got = a.score(q, pt.int(), num_pages, None, s, None)
    kh = a.approx_keys(s, pt.long())                             # [B, Hkv, W, 32, D]
    scale = D ** -0.5
    x = torch.einsum("bhgd,bhwtd->bhgwt", q.view(B, Hkv, G, D), kh) * scale
    want = a.from_token_logits(x, num_pages, scale)
    fin = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got), fin) and torch.equal(got[~fin], want[~fin])
    assert torch.allclose(got[fin], want[fin], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("algo", ALGOS)
def test_widest_channels_find_the_token_a_page_mean_hides(algo):
    """Page 1 holds one token far along channel 5 (its mean along it is small); page 2 holds
    32 moderately aligned tokens. The true attention mass of a query along channel 5 is in
    page 1; the page means rank page 2 first, the coded channel ranks page 1 first."""
    D = 64
    keys = torch.zeros(8, 32, D)  # sink page 0 and local pages 6, 7 are kept anyway
    keys[:, :, 10:] = 0.01 * torch.randn(8, 32, D - 10, generator=torch.Generator().manual_seed(0))
    keys[1, 7, 5] = 12.0
    keys[2, :, 5] = 1.5
    a, s = _indexed(algo, keys, torch.full((8,), 32, dtype=torch.int32))
    q = torch.zeros(1, 1, D)
    q[0, 0, 5] = 8.0
    pt = torch.arange(8, dtype=torch.int32).view(1, 1, 8)
    num_pages = torch.tensor([[8]], dtype=torch.int32)
    scale = D ** -0.5
    true_lse = torch.logsumexp(torch.einsum("d,ptd->pt", q[0, 0], keys) * scale, dim=-1)
    assert true_lse[1] > true_lse[2]
    mean_lse = (keys.mean(1) @ q[0, 0]) * scale + torch.log(torch.tensor(32.0))
    assert mean_lse[2] > mean_lse[1]  # a page-mean summary ranks them the other way
    sel = a.score(q, pt, num_pages, None, s, None)[0, 0]
    assert sel[1] > sel[2]


@pytest.mark.parametrize("algo", ALGOS)
def test_forced_offload_equals_resident(model_dir, algo):  # noqa: F811
    check_forced_offload_equals_resident(model_dir, algo)
