"""``keycode2-sparq`` (``sparse/keycode_sparq.py``), the engine form of the evaluation variant
``keycode2-sparq-w16`` (benchmarks/fidelity_keycode_channels.py): its summaries are keycode2's
(codes channel-major) plus the variant's int8 mean, its scores and selections equal the
variant's on the same inputs (GQA and MHA, rows of 1 to 20 pages) in both summary layouts
(the per-channel records, the default, and the first layout: the same scores bit for bit, the
same bytes stored at bf16, fewer sectors read), teacher-forced SmolLM2
logits through both are the same, and on SmolLM2 a budget covering every page gives dense's
tokens and logprobs. (tests/sparse/test_sparse_engine.py runs it against dense on the tiny
model with every other algorithm; test_new_algorithms_offload.py under forced offload.)"""
import importlib
import os
import sys

import pytest
import torch

from sparseserve import LLM, SamplingParams
from sparseserve.sparse import base as sparse_base
from sparseserve.sparse import get_algorithm_class
from sparseserve.sparse.base import SparseAlgorithm
from sparseserve.sparse.keycodes import unpack_codes

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def variant():
    """The evaluation variant's class (the benchmark module registers its variants; they are
    unregistered afterwards so that no other test sees them)."""
    from sparseserve.bench import fidelity_tail

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    before = set(sparse_base._REGISTRY), list(fidelity_tail._FAST_TWINS)
    try:
        importlib.import_module("fidelity_keycode_channels")
        yield get_algorithm_class("keycode2-sparq-w16")
    finally:
        sys.path.remove(os.path.join(ROOT, "benchmarks"))
        sys.modules.pop("fidelity_keycode_channels", None)
        for name in set(sparse_base._REGISTRY) - before[0]:
            del sparse_base._REGISTRY[name]
        fidelity_tail._FAST_TWINS[:] = before[1]


def _indexed(cls, keys, ntok=None, **attrs):
    P, ps, D = keys.shape
    a = cls(ps, 8, 1, 2)
    for key, val in attrs.items():  # e.g. records=False: keycode2-sparq's first layout
        setattr(a, key, val)
    s = a.make_summaries(P + 1, D, keys.dtype)
    ntok = torch.full((P,), ps, dtype=torch.int32) if ntok is None else ntok
    a.index(keys, torch.arange(P, dtype=torch.int32), ntok, s, None)
    return a, s


def _keys(P, D, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(P, 32, D, generator=g) * torch.rand(1, 1, D, generator=g) * 3 + \
        torch.randn(P, 1, D, generator=g), g


def test_summaries_are_keycode2s_channel_major(variant):
    keys, _ = _keys(5, 64, 0)
    ntok = torch.tensor([32, 1, 17, 32, 31], dtype=torch.int32)
    kc, ks = _indexed(get_algorithm_class("keycode2"), keys, ntok)
    v, vs = _indexed(variant, keys, ntok)
    for records in (True, False):
        a, s = _indexed(get_algorithm_class("keycode2-sparq"), keys, ntok, records=records)
        w = a.views(s)
        assert ("rec" in s.tensors) == records and (w["rec"] is not None) == records
        for n in ("kmin", "kmax"):
            assert torch.equal(w[n], ks[n])
        for n in ("kmean", "kscale"):
            assert torch.equal(w[n], vs[n])
        # channel c's 32 codes in 2 consecutive words == keycode2's token-major codes,
        # transposed
        token_major = unpack_codes(ks["codes"][:5], 2).view(5, 32, 64)
        assert torch.equal(unpack_codes(w["codes"][:5], 2).view(5, 64, 32),
                           token_major.transpose(1, 2))
        assert torch.equal(a.approx_keys(s, torch.arange(5)),
                           kc.approx_keys(ks, torch.arange(5)))
        assert (w["wsum"][:5] == -1).all()
        # 1092 B at bf16 in both layouts (module docstring); fp32 pads the records
        assert a.summary_bytes_per_page(64, 2) == 17 * 64 + 4
        assert a.summary_bytes_per_page(64, 4) == (64 * 32 + 68 if records else 21 * 64 + 4)
        assert sum(t[0].numel() * t.element_size() for t in s.tensors.values()) == \
            a.summary_bytes_per_page(64, 4)  # what make_summaries allocates (fp32 keys)


def test_record_layout_reads_fewer_sectors():
    """The select's expected bytes per page (32-byte sectors, D 128, bf16, R 16): ~642 B from
    the records, ~1048 B from the first layout (docs/results/sparse.md)."""
    a = get_algorithm_class("keycode2-sparq")(32, 64, 1, 2)
    new = a.select_bytes_per_page(128, 2, sectors=True)
    a.records = False
    old = a.select_bytes_per_page(128, 2, sectors=True)
    assert new == pytest.approx(641.8, abs=0.5) and old == pytest.approx(1047.6, abs=0.5)


@pytest.mark.parametrize("G,Hkv", [(3, 2), (1, 3)], ids=["gqa", "mha"])
def test_scores_and_selection_equal_the_evaluation_variant(variant, G, Hkv):
    P, D, B, W = 60, 64, 3, 20
    keys, g = _keys(P, D, 3 + G)
    v, vs = _indexed(variant, keys)
    q = torch.randn(B, Hkv * G, D, generator=g)
    pt = torch.stack([torch.randperm(P, generator=g)[:W] for _ in range(B * Hkv)])
    pt = pt.view(B, Hkv, W).int()
    num_pages = torch.tensor([[20, 17, 6], [1, 20, 2], [9, 4, 13]], dtype=torch.int32)[:, :Hkv]
    a, s = _indexed(get_algorithm_class("keycode2-sparq"), keys)
    first, fs = _indexed(get_algorithm_class("keycode2-sparq"), keys, records=False)
    got = a.score(q, pt, num_pages, None, s, None)
    assert torch.equal(got, first.score(q, pt, num_pages, None, fs, None))
    want = v.score(q, pt, num_pages, None, vs, None)
    fin = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got), fin) and torch.equal(got[~fin], want[~fin])
    assert torch.allclose(got[fin], want[fin], rtol=1e-4, atol=1e-6)
    last = torch.full((B,), 5, dtype=torch.int32)
    sel = a.select(q, pt, num_pages, last, s, None)  # the fused path's spec on CPU
    ref = SparseAlgorithm.select(v, q, pt, num_pages, last, vs, None)
    assert torch.equal(sel.num_pages, ref.num_pages)
    for b in range(B):
        for h in range(Hkv):
            m = int(ref.num_pages[b, h])
            assert set(sel.blocks[b, h, :m].tolist()) == set(ref.blocks[b, h, :m].tolist())
            assert int(sel.blocks[b, h, m - 1]) == int(num_pages[b, h]) - 1


def test_smollm2_teacher_forced_tail_equals_the_evaluation_variant(variant):
    """The fidelity harness on SmolLM2 (head_dim 64: 16 of 64 channels decoded), budget 128:
    the engine algorithm's tail logits are the evaluation variant's."""
    from sparseserve.bench.fidelity_tail import Setting, TailHarness
    from sparseserve.bench.texts import load_texts

    llm = LLM(max_num_seqs=32, max_model_len=1024, kv_cache_memory_bytes=64 << 20)
    h = TailHarness(llm.engine.runner, chunk_rows=32)
    text = load_texts(llm.get_tokenizer(), 600, 1)[0]
    prep = h.prefill(text.token_ids, 600 - 32, algorithms=("keycode2-sparq",
                                                          "keycode2-sparq-w16"))
    got = h.run_tail(prep, Setting("keycode2-sparq", 128, 1, 1))
    want = h.run_tail(prep, Setting("keycode2-sparq-w16", 128, 1, 1))
    # a near-tied page score may flip (tests/bench/test_fidelity.py)
    off = (got.logits - want.logits).abs().amax(-1) > 2e-3
    assert int(off.sum()) <= 2, f"rows off: {off.nonzero().flatten().tolist()}"
    assert got.recall["recall"] == pytest.approx(want.recall["recall"], abs=1e-3)
    assert got.recall["recall"] < 0.999  # the budget really selects


def test_smollm2_full_budget_equals_dense(smollm2_llm):
    prompts = [{"prompt_token_ids": [100 + (i * 37) % 30000 for i in range(n)]}
               for n in (97, 17, 54)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3)
    dense = smollm2_llm.generate(prompts, params, use_tqdm=False)
    llm = LLM(max_num_seqs=4, max_model_len=256, sparse_algorithm="keycode2-sparq",
              token_budget=256, sink_pages=1, local_pages=1)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for got, ref in zip(outs, dense):
        assert got.outputs[0].token_ids == ref.outputs[0].token_ids
        for x, y in zip(got.outputs[0].logprobs, ref.outputs[0].logprobs):
            for t in y:
                assert x[t].logprob == pytest.approx(y[t].logprob, abs=1e-4)
    llm.engine.check_invariants()
