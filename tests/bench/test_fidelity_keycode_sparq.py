"""benchmarks/fidelity_keycode_channels.py's SparQ-style variant (``keycode2-sparq-r<R>``):
with every channel it scores pages as keycode2 does, it decodes the deviations on the channels
where the query group has the largest |q| (the page mean elsewhere), and its shared-text twin
(fast mode) equals the engine path."""
import importlib
import os
import sys

import pytest
import torch

from sparseserve.sparse import base as sparse_base
from sparseserve.sparse import get_algorithm_class

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def mod():
    """The benchmark module (it registers its variants); unregistered afterwards so that no
    other test sees them."""
    from sparseserve.bench import fidelity_tail

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    before = set(sparse_base._REGISTRY), list(fidelity_tail._FAST_TWINS)
    try:
        m = importlib.import_module("fidelity_keycode_channels")
        yield m
    finally:
        sys.path.remove(os.path.join(ROOT, "benchmarks"))
        sys.modules.pop("fidelity_keycode_channels", None)
        for name in set(sparse_base._REGISTRY) - before[0]:
            del sparse_base._REGISTRY[name]
        fidelity_tail._FAST_TWINS[:] = before[1]


def _indexed(cls, keys):
    P, ps, D = keys.shape
    a = cls(ps, 8, 1, 2)
    s = a.make_summaries(P + 1, D)
    a.index(keys, torch.arange(P, dtype=torch.int32), torch.full((P,), ps, dtype=torch.int32),
            s, None)
    return a, s


def _case(seed=3, P=40, D=64, B=3, Hkv=2, G=3, W=20):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(P, 32, D, generator=g) * torch.rand(1, 1, D, generator=g) * 3 + \
        torch.randn(P, 1, D, generator=g)
    q = torch.randn(B, Hkv * G, D, generator=g)
    pt = torch.stack([torch.randperm(P, generator=g)[:W] for _ in range(B * Hkv)]).view(B, Hkv, W)
    num_pages = torch.tensor([[20, 17], [1, 20], [9, 4]], dtype=torch.int32)
    return keys, q, pt.int(), num_pages


def test_every_channel_equals_keycode2(mod):
    """R = D: q . mean + q . (k^ - mean) = q . k^, keycode2's score (ref.code_page_bounds)."""
    keys, q, pt, num_pages = _case()
    kc, ks = _indexed(get_algorithm_class("keycode2"), keys)
    want = kc.score(q, pt, num_pages, None, ks, None)
    for full in (type("R64", (mod.KeyCodeSparQ,), {"channels": 64}),
                 type("RAll", (mod.KeyCodeSparQ,), {"channels": None})):
        a, s = _indexed(full, keys)
        for n in ("kmin", "kmax", "codes"):  # keycode2's summaries, bit for bit
            assert torch.equal(s[n], ks[n])
        got = a.score(q, pt, num_pages, None, s, None)
        fin = torch.isfinite(want)
        assert torch.equal(torch.isfinite(got), fin) and torch.equal(got[~fin], want[~fin])
        assert torch.allclose(got[fin], want[fin], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("algo", ["keycode2-sparq-r8", "keycode2-sparq-r16",
                                  "keycode2-sparq-w16"])
def test_channels_are_the_top_abs_q_ones(mod, algo):
    """The chosen channels are the R largest sum_g |q_gc| of each (request, KV head) (-w: times
    the channel's kmax - kmin summed over the row's pages before its last), and the score is
    the token mass over keys that are the page mean except on those channels."""
    R = int(algo[-2:].lstrip("rw"))
    keys, q, pt, num_pages = _case(seed=R)
    B, Hq, D = q.shape
    Hkv = pt.shape[1]
    a, s = _indexed(get_algorithm_class(algo), keys)
    qg = q.view(B, Hkv, Hq // Hkv, D)
    chosen = a.chosen(qg, a.row_width(s, pt.long(), num_pages))
    assert chosen.shape == (B, Hkv, R)
    for b in range(B):
        for h in range(Hkv):
            w = [sum(abs(float(qg[b, h, g, c])) for g in range(Hq // Hkv)) for c in range(D)]
            if a.by_width:
                n = int(num_pages[b, h]) - 1
                if n == 0:  # no width: every weight 0, any choice (the one page is kept)
                    continue
                kp = keys[pt[b, h, :n].long()]                     # the row's pages but the last
                wid = (kp.amax(1) - kp.amin(1)).sum(0)
                w = [w[c] * float(wid[c]) for c in range(D)]
            top = sorted(range(D), key=lambda c: -w[c])[:R]
            assert set(chosen[b, h].tolist()) == set(top)
    # explicit: per (request, head) approximate keys = mean, keycode2's decoded key on `chosen`
    mean = a.page_mean(s, pt.long())                               # [B, Hkv, W, D]
    kh = a.approx_keys(s, pt.long())                               # [B, Hkv, W, 32, D]
    m = torch.zeros(B, Hkv, D, dtype=torch.bool).scatter_(-1, chosen, True).view(B, Hkv, 1, 1, D)
    approx = torch.where(m, kh, mean.unsqueeze(-2))
    x = torch.einsum("bhgd,bhwtd->bhgwt", qg, approx) * D ** -0.5
    want = a.from_token_logits(x, num_pages, D ** -0.5)
    got = a.score(q, pt, num_pages, None, s, None)
    fin = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got), fin)
    assert torch.allclose(got[fin], want[fin], rtol=1e-4, atol=1e-5)
    # and it is not keycode2's: the other channels' deviations are dropped
    kc, ks = _indexed(get_algorithm_class("keycode2"), keys)
    assert not torch.allclose(got[fin], kc.score(q, pt, num_pages, None, ks, None)[fin],
                              rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("algo", ["keycode2-sparq-r16", "keycode2-sparq-w16"])
def test_fast_path_equals_engine_path(mod, algo):
    from sparseserve import LLM
    from sparseserve.bench.fidelity_metrics import compare_logits
    from sparseserve.bench.fidelity_tail import Setting, TailHarness
    from sparseserve.bench.texts import load_texts

    llm = LLM(max_num_seqs=32, max_model_len=1024, kv_cache_memory_bytes=64 << 20)
    h = TailHarness(llm.engine.runner, chunk_rows=32)
    text = load_texts(llm.get_tokenizer(), 600, 1)[0]
    prep = h.prefill(text.token_ids, 600 - 64, algorithms=(algo,))
    setting = Setting(algo, 128, 1, 1)
    fast = h.run_tail(prep, setting, fast=True)
    ref = h.run_tail(prep, setting, fast=False)
    # a near-tied page score may flip (tests/bench/test_fidelity.py)
    off = (fast.logits - ref.logits).abs().amax(-1) > 2e-3
    assert int(off.sum()) <= 2, f"rows off: {off.nonzero().flatten().tolist()}"
    assert compare_logits(ref.logits, fast.logits)["top1"] == 1.0
    assert fast.recall["recall"] == pytest.approx(ref.recall["recall"], abs=1e-3)
