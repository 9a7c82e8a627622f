"""keycode2-sparq's records interleaved in chunks of pages (``kernels/sparq_records.interleave``,
on CUDA with the two-tier cache's 16-page host chunks): the layout is a permutation of the
words (round trip, the writer's offsets), the Triton channel choice and fused select
(Triton's interpreter here) pick exactly the pages they pick on records in their rows — with
the rows in aligned chunks or in random order, a page filled between two selects (the width
cache), GQA and MHA — ``index`` with ``write_ids`` writes where it is told, and the engine
under forced offload gives everything-resident's tokens with the layout forced on."""
import pytest
import torch

from sparseserve.kernels.sparq_records import (deinterleave, interleave, record_word_offsets,
                                               record_words)
from sparseserve.sparse.keycode_sparq import KeyCodeSparQ
from tests.kvcache.test_offload_engine import (PARAMS, SPARSE, assert_same_outputs,  # noqa: F401
                                               model_dir, offload_llm, prompts)

PS, D = 32, 64


def test_interleave_round_trip_and_the_writers_offsets():
    g = torch.Generator().manual_seed(0)
    nr = record_words(2, PS)
    words = torch.randint(-2**31, 2**31 - 1, (48, D * nr), generator=g, dtype=torch.int32)
    inter = interleave(words, nr, 16)
    assert torch.equal(deinterleave(inter, nr, 16), words)
    assert not torch.equal(inter, words)
    rows = torch.tensor([0, 1, 15, 16, 17, 47])
    offs = record_word_offsets(rows, D, nr, 16)
    assert torch.equal(inter.view(-1)[offs], words[rows])
    assert torch.equal(record_word_offsets(rows, D, nr, 1), rows[:, None] * D * nr
                       + torch.arange(D * nr))


def _alg(ri):
    a = KeyCodeSparQ(PS, 8, 1, 2)
    a.interleave = ri
    return a


def _keys(P, seed):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(P, PS, D, generator=g) * torch.rand(1, 1, D, generator=g) * 3 \
        + torch.randn(P, 1, D, generator=g)
    return k.to(torch.bfloat16), g


@pytest.mark.parametrize("G,Hkv,chunked", [(4, 2, True), (4, 2, False), (1, 2, True)])
def test_interleaved_records_select_the_same_pages(G, Hkv, chunked):
    B, n = 2, 97  # rows of 97 pages, the last one partial (17 tokens)
    nch = -(-n // 16)
    P = B * Hkv * nch * 16
    k, g = _keys(P, G * 10 + chunked)
    ntok = torch.full((P,), PS, dtype=torch.int32)
    if chunked:  # each (request, KV head) row: aligned 16-page chunks in random order
        chunks = torch.randperm(P // 16, generator=g).view(B, Hkv, nch)
        table = (chunks[..., None] * 16 + torch.arange(16)).view(B, Hkv, -1)[..., :n]
    else:
        table = torch.randperm(P, generator=g)[:B * Hkv * n].view(B, Hkv, n)
    table = table.to(torch.int32)
    ntok[table[:, :, -1].reshape(-1).long()] = 17
    q = torch.randn(B, Hkv * G, D, generator=g).to(torch.bfloat16)
    num = torch.full((B, Hkv), n, dtype=torch.int32)
    last = torch.full((B,), 17, dtype=torch.int32)
    out = {}
    for ri in (1, 16):
        a = _alg(ri)
        s = a.make_summaries(P + 1, D, torch.bfloat16)
        assert s.interleave == ri and s["rec"].shape[0] % ri == 0
        filled = table[:, :, :-2].reshape(-1)  # the rows' last full page fills later
        a.index(k, filled, ntok[filled.long()], s, None)
        first = a.select_kernel(q, table[..., :-1], num - 1, last, s, backend="triton")
        rest = table[:, :, -2:].reshape(-1)
        a.index(k, rest, ntok[rest.long()], s, None)  # a page filled: the width cache moves
        second = a.select_kernel(q, table, num, last, s, backend="triton")
        out[ri] = (first, second, a.views(s))
    for one, sixteen in zip(out[1][:2], out[16][:2]):
        for x, y in zip(one, sixteen):
            assert torch.equal(x, y)
    for name in ("kmin", "kmax", "codes", "wsum", "kmean", "kscale"):  # incl. the width cache
        # the interleaved records' rows are padded to whole chunks (P + 1 -> P + 16)
        assert torch.equal(out[1][2][name], out[16][2][name][:P + 1]), name


def test_index_writes_at_write_ids_in_either_layout():
    P = 40
    k, g = _keys(P, 3)
    ids = torch.arange(P, dtype=torch.int32)
    ntok = torch.randint(1, PS + 1, (P,), generator=g, dtype=torch.int32)
    dest = torch.randperm(P, generator=g).to(torch.int32)
    dest[5] = -7  # a masked lane (page id < 0 below) goes to the scratch row
    ids[5] = -1
    for ri in (1, 16):
        a = _alg(ri)
        moved = a.make_summaries(P + 1, D, torch.bfloat16)
        a.index(k, ids, ntok, moved, None, write_ids=dest)
        k2 = torch.zeros_like(k)
        k2[dest[ids >= 0].long()] = k[ids >= 0]
        n2 = torch.full((P,), PS, dtype=torch.int32)
        n2[dest[ids >= 0].long()] = ntok[ids >= 0]
        direct = a.make_summaries(P + 1, D, torch.bfloat16)
        a.index(k2, dest[ids >= 0], n2[dest[ids >= 0].long()], direct, None)
        vm, vd = a.views(moved), a.views(direct)
        rows = dest[ids >= 0].long()
        for name in ("kmin", "kmax", "codes", "kmean", "kscale"):
            assert torch.equal(vm[name][rows], vd[name][rows]), (ri, name)


def test_forced_offload_with_interleaved_records_equals_resident(model_dir, monkeypatch):  # noqa: F811
    resident = offload_llm.__globals__["LLM"](model_dir, **dict(SPARSE, sparse_algorithm="keycode2-sparq")
                                              ).generate(prompts(), PARAMS, use_tqdm=False)
    monkeypatch.setattr(KeyCodeSparQ, "interleave", 16)
    llm = offload_llm(model_dir, 32, sparse_algorithm="keycode2-sparq", max_num_batched_tokens=48)
    summaries = next(s for s in llm.engine.runner.sparse.summaries if s is not None)
    assert summaries.interleave == 16
    assert_same_outputs(llm.generate(prompts(), PARAMS, use_tqdm=False), resident)
    stats = llm.engine.get_stats()
    assert stats["cache_misses_total"] > 0 and stats["cache_hits_total"] > 0
    llm.engine.check_invariants()


def test_the_layout_is_interleaved_only_where_the_kernels_read_it_whole():
    cuda = torch.device("cuda")  # a device object: no GPU needed to decide the layout
    a = KeyCodeSparQ(PS, 8, 1, 2)
    assert a.record_interleave(cuda, 16, 2) == 16          # the engine's default on CUDA
    assert a.record_interleave(torch.device("cpu"), 16, 2) == 1
    assert a.record_interleave(cuda, 1, 2) == 1             # all-resident: pages one by one
    assert a.record_interleave(cuda, 16, 4) == 1            # fp32 records (8 words) at page 32
    for attr, val in (("score_kernel", 1), ("fused_select", False), ("records", False)):
        b = KeyCodeSparQ(PS, 8, 1, 2)
        setattr(b, attr, val)
        assert b.record_interleave(cuda, 16, 2) == 1, attr


@pytest.mark.parametrize("rows", [1, 17, 97])
def test_planned_summary_bytes_count_the_padding(rows):
    a = _alg(16)
    s = a.make_summaries(rows, D, torch.bfloat16)
    allocated = sum(t.numel() * t.element_size() for t in s.tensors.values())
    assert a.summary_bytes(rows, D, 2) == allocated
    assert allocated > rows * a.summary_bytes_per_page(D, 2) or rows % 16 == 0


def test_score_phase_one_reads_interleaved_records_through_rows():
    """sparq_codes (score_kernel 1) reads records through their row views: the select falls
    back to a de-interleaved copy and still picks the rows layout's pages."""
    B, Hkv, G, n = 1, 2, 4, 40
    P = B * Hkv * 48
    k, g = _keys(P, 5)
    table = torch.randperm(P, generator=g)[:B * Hkv * n].view(B, Hkv, n).to(torch.int32)
    q = torch.randn(B, Hkv * G, D, generator=g).to(torch.bfloat16)
    num = torch.full((B, Hkv), n, dtype=torch.int32)
    last = torch.full((B,), PS, dtype=torch.int32)
    got = []
    for ri in (1, 16):
        a = _alg(ri)
        a.score_kernel = 1
        s = a.make_summaries(P + 1, D, torch.bfloat16)
        a.index(k, torch.arange(P, dtype=torch.int32), torch.full((P,), PS, dtype=torch.int32),
                s, None)
        got.append(a.select_kernel(q, table, num, last, s, backend="triton"))
    for x, y in zip(*got):
        assert torch.equal(x, y)
