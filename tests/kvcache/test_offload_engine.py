"""Two-tier cache in the engine (CPU mode: both tiers in CPU memory, a capacity-limited
device pool): forced offload gives token-for-token the output of everything resident."""
import random

import pytest
import torch

from sparseserve import LLM, SamplingParams

LENGTHS = [1, 17, 54, 97, 130]
PAGE_BYTES = 2 * 3 * 16 * 16 * 4  # K+V, 3 layers, page_size 16, head_dim 16, fp32


def prompts(seed=0):
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, 320) for _ in range(n)]} for n in LENGTHS]


PARAMS = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, logprobs=2)
# the CPU engine (both tiers in CPU memory, exact fp32, CPU-sized caches): tests/gpu covers
# the GPU
SPARSE = dict(page_size=16, sparse_algorithm="arkvale", token_budget=64, sink_pages=1,
              local_pages=1, max_num_seqs=4, max_model_len=256, device="cpu")


@pytest.fixture(scope="module")
def model_dir(tiny_model_dirs):
    return tiny_model_dirs["llama-gqa"][0]


def offload_llm(model_dir, slots, **kw):
    args = dict(SPARSE, kv_offload=True, kv_cache_memory_bytes=slots * PAGE_BYTES,
                kv_offloading_size=200 * PAGE_BYTES / 2**30)
    args.update(kw)
    return LLM(model_dir, **args)


def assert_same_outputs(outs, want):
    """Token for token, and every logprob `want` returned within 1e-4."""
    for a, b in zip(outs, want, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            for t in y:
                assert x[t].logprob == pytest.approx(y[t].logprob, abs=1e-4)


def check_forced_offload_equals_resident(model_dir, algo, **kw):
    """`algo` on 32 slots (exactly the mandatory selection of 4 requests x 2 heads x 4 pages)
    == all resident, tokens and logprobs, with hits and misses; -> the offload LLM."""
    resident = LLM(model_dir, **dict(SPARSE, sparse_algorithm=algo)).generate(
        prompts(), PARAMS, use_tqdm=False)
    llm = offload_llm(model_dir, 32, sparse_algorithm=algo, max_num_batched_tokens=48, **kw)
    assert_same_outputs(llm.generate(prompts(), PARAMS, use_tqdm=False), resident)
    stats = llm.engine.get_stats()
    assert stats["cache_misses_total"] > 0 and stats["cache_hits_total"] > 0
    llm.engine.check_invariants()
    return llm


@pytest.mark.parametrize("algo", ["arkvale", "quest", "infllm"])
@pytest.mark.parametrize("eviction", ["category-lru", "lru"])
def test_forced_offload_equals_resident(model_dir, algo, eviction):
    llm = check_forced_offload_equals_resident(model_dir, algo, eviction=eviction)
    stats = llm.engine.get_stats()
    assert stats["bytes_loaded_total"] > 0 and stats["bytes_saved_total"] > 0
    assert llm.engine.num_free_pages() == llm.engine.num_total_pages()
    runner = llm.engine.runner
    assert int((runner.offload.page_of[:, :-1] >= 0).sum()) == 0, "slots still mapped"


@pytest.mark.parametrize("d2h", ["gpu-direct", "copy-engine"])
@pytest.mark.parametrize("inject", [None, 300])
def test_forced_offload_equals_resident_per_saver(model_dir, d2h, inject):
    """The savers whose saves complete in stream order, with chunked and layer-segmented
    (slot-free whole prompts: decode loads what the saver wrote) prefill."""
    llm = check_forced_offload_equals_resident(model_dir, "arkvale", d2h_method=d2h,
                                               max_inject_tokens=inject)
    assert llm.engine.scheduler.slot_free_prefill is (inject is not None)
    assert llm.engine.get_stats()["bytes_saved_total"] > 0


def test_offload_many_requests_no_leaks_and_roomy_cache_hits(model_dir):
    llm = offload_llm(model_dir, 256, max_num_batched_tokens=64)
    rng = random.Random(2)
    for _ in range(2):
        ps = [{"prompt_token_ids": [rng.randrange(3, 320) for _ in range(rng.randrange(1, 120))]}
              for _ in range(12)]
        params = [SamplingParams(temperature=rng.choice([0.0, 0.9]), max_tokens=rng.randrange(1, 25))
                  for _ in ps]
        outs = llm.generate(ps, params, use_tqdm=False)
        assert all(o.finished for o in outs)
        llm.engine.check_invariants()
        assert llm.engine.num_free_pages() == llm.engine.num_total_pages()
    off = llm.engine.runner.offload
    assert int((off.page_of[:, :-1] >= 0).sum()) == 0


def test_residency_index_consistent_while_running(model_dir):
    """Step the engine by hand: after every step the residency index (hash table) and the
    reverse map agree, pages stay in their request's chunks, and a tight cache really evicts."""
    llm = offload_llm(model_dir, 40, max_num_batched_tokens=64)
    eng = llm.engine
    rng = random.Random(5)
    for i, n in enumerate([97, 17, 130, 54]):
        eng.add_request(str(i), {"prompt_token_ids": [rng.randrange(3, 320) for _ in range(n)]},
                        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    steps = 0
    while eng.has_unfinished_requests():
        eng.step()
        eng.check_invariants()
        steps += 1
    assert steps > 40
    stats = eng.get_stats()
    assert stats["cache_misses_total"] > 0 and stats["cache_hits_total"] > 0
    assert int((eng.runner.offload.page_of[:, :-1] >= 0).sum()) == 0
    assert eng.num_free_pages() == eng.num_total_pages()


def test_offload_config_errors(model_dir):
    with pytest.raises(ValueError, match="sparse_algorithm"):
        LLM(model_dir, page_size=16, kv_offload=True, kv_offloading_size=0.001)
    with pytest.raises(ValueError, match="kv_offloading_size"):
        LLM(model_dir, **dict(SPARSE, kv_offload=True, kv_offloading_size=0))
    with pytest.raises(ValueError, match="slots"):  # a 256-token prompt needs 32 slots
        offload_llm(model_dir, 8)
    with pytest.raises(ValueError, match="--h2d-method.*--kv-offload"):
        LLM(model_dir, **dict(SPARSE, h2d_method="memcpy"))
    with pytest.raises(ValueError, match="working-set-control"):
        LLM(model_dir, **dict(SPARSE, working_set_control=True))


def test_host_tier_size_defaults_to_what_the_requests_need(model_dir):
    llm = LLM(model_dir, **dict(SPARSE, kv_offload=True, kv_cache_memory_bytes=64 * PAGE_BYTES))
    cache = llm.engine.config.cache
    # 4 requests x 256 tokens / 16 per page x 2 KV heads, in whole chunks of 16
    assert cache.num_host_pages == 4 * 256 // 16 * 2


def test_device_metadata_grows_with_slots_not_host_tier(model_dir):
    """Two-level page table: the device holds a chunk directory and a residency index sized
    by the slots; a 4x larger host tier adds no device metadata (summaries aside)."""
    from sparseserve.config import HOST_CHUNK_PAGES
    from sparseserve.kernels.residency_hash import table_size
    sizes = []
    for host_pages in (200, 800):
        llm = LLM(model_dir, **dict(SPARSE, kv_offload=True, kv_cache_memory_bytes=64 * PAGE_BYTES,
                                    kv_offloading_size=host_pages * PAGE_BYTES / 2**30))
        r = llm.engine.runner
        off = r.offload
        assert r.pages.chunks.shape == (SPARSE["max_num_seqs"] + 1, 2,
                                        -(-r.max_blocks // HOST_CHUNK_PAGES))
        assert off.res_table.shape == (3, table_size(off.num_slots + 1))
        assert off.num_host_pages == host_pages // HOST_CHUNK_PAGES * HOST_CHUNK_PAGES
        sizes.append(sum(t.numel() * t.element_size() for t in
                         (r.pages.chunks, off.res_table, off.page_of, off.last_access, off.owner)))
    assert sizes[0] == sizes[1]


def test_gpu_retrieve_path_defers_index_rebuilds_to_the_step_end(model_dir, monkeypatch):
    """The GPU's code path on CPU tensors (the fused retrieve's Triton kernels in the
    interpreter): a decode step leaves every layer's residency-index rebuild to one batched
    launch set after its layers (TwoTierCache.finish_decode), and its decode rows' DRAM
    write-through to one launch; a tight cache evicts enough that rebuilds are due, and the
    tokens still equal the all-resident run's."""
    from sparseserve.kernels import residency_hash

    calls = []
    real = residency_hash.rebuild_if_full
    monkeypatch.setattr(residency_hash, "rebuild_if_full",
                        lambda table, *a, **kw: (calls.append(table.dim()), real(table, *a, **kw)))
    ps = prompts()
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    resident = LLM(model_dir, **SPARSE).generate(ps, params, use_tqdm=False)
    llm = offload_llm(model_dir, 32, max_num_batched_tokens=48, d2h_method="gpu-direct")
    off = llm.engine.runner.offload
    off.fused = True
    outs = llm.generate(ps, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in resident]
    assert 2 in calls  # the decode steps' batched rebuild over every layer
    assert llm.engine.get_stats()["cache_misses_total"] > 0
    llm.engine.check_invariants()


@pytest.mark.parametrize("algo", ["arkvale", "infllm", "retroinfer"])
def test_forced_offload_paged_prefill_kernel_equals_resident(model_dir, algo, monkeypatch,
                                                            paged_prefill_calls):
    """Chunks continuing a prefix over the two tiers through the paged prefill kernel (the GPU
    path, interpreted here; pages they complete indexed from their slots, queries and values
    included) == all resident on the torch path, tokens and logprobs."""
    from sparseserve.worker.forward_context import ForwardContext

    resident = LLM(model_dir, **dict(SPARSE, sparse_algorithm=algo)).generate(
        prompts(), PARAMS, use_tqdm=False)
    monkeypatch.setattr(ForwardContext, "paged_prefill_kernel", True)
    llm = offload_llm(model_dir, 32, sparse_algorithm=algo, max_num_batched_tokens=48)
    outs = llm.generate(prompts(), PARAMS, use_tqdm=False)
    assert paged_prefill_calls, "no chunk went through the paged prefill kernel"
    assert_same_outputs(outs, resident)
    llm.engine.check_invariants()


@pytest.mark.parametrize("segmented", [False, True])
def test_prefill_maps_every_layer_at_once_equals_resident(model_dir, monkeypatch, segmented):
    """The GPU's code path on CPU tensors (fused retrieve, interpreted): a prefill chunk in a
    context without decode rows maps its pages in all of the interval's layers with one
    map_prefill_layers call (not a retrieve per layer), chunked and layer-segmented, beside
    hybrid steps that keep the per-layer mapping — and the tokens and logprobs equal the
    all-resident run's; nothing leaks."""
    from sparseserve.worker.offload_cache import TwoTierCache

    intervals, per_layer = [], []
    real_map, real_retrieve = TwoTierCache.map_prefill_layers, TwoTierCache.retrieve
    monkeypatch.setattr(TwoTierCache, "map_prefill_layers",
                        lambda self, l0, l1, *a, **kw: (intervals.append((l0, l1)),
                                                        real_map(self, l0, l1, *a, **kw))[1])
    monkeypatch.setattr(TwoTierCache, "retrieve",
                        lambda self, layer, *a, prefill=False, **kw: (
                            per_layer.append(layer) if prefill else None,
                            real_retrieve(self, layer, *a, prefill=prefill, **kw))[1])
    ref = LLM(model_dir, **SPARSE)
    llm = offload_llm(model_dir, 32, max_num_batched_tokens=48, d2h_method="gpu-direct",
                      layer_segmented_prefill=segmented)
    llm.engine.runner.offload.fused = True
    eng = llm.engine
    for seed in (0, 1):
        resident = ref.generate(prompts(seed), PARAMS, use_tqdm=False)
        outs = {}
        for i, p in enumerate(prompts(seed)):
            eng.add_request(str(i), p, PARAMS)
            if i == 2:  # two prompts decode while the rest arrive: the layers' slots differ
                for _ in range(6):
                    outs.update((o.request_id, o) for o in eng.step() if o.finished)
        while eng.has_unfinished_requests():
            outs.update((o.request_id, o) for o in eng.step() if o.finished)
            assert_resident_bytes(eng)
        assert_same_outputs([outs[str(i)] for i in range(len(LENGTHS))], resident)
    assert intervals and all(l1 > l0 for l0, l1 in intervals)
    if not segmented:  # whole-model chunks: every interval is all the layers
        assert set(intervals) == {(0, 3)}
    # prefill chunks beside decode rows (one CPU context: no decode graph) keep the
    # per-layer mapping, after each layer's decode retrieve: both paths ran
    assert per_layer
    llm.engine.check_invariants()


def assert_resident_bytes(eng):
    """Every page of a decoding request that is resident in a layer's device slots holds
    that layer's bytes of the page in DRAM, over the tokens written so far (a slot mapped in
    one layer but filled in another would differ)."""
    import numpy as np

    off, pages, ps = eng.runner.offload, eng.runner.pages, eng.runner.page_size
    for req in eng.scheduler.running:
        row = eng.scheduler._rows.get(req.request_id)
        n = req.num_computed_tokens
        if row is None or not req.output_token_ids or n == 0:
            continue
        nb = -(-n // ps)
        host = pages.host_pages(np.full(nb, row), np.arange(nb))  # [nb, Hkv]
        for layer in range(off.num_layers):
            slots = off.slot_of(layer, torch.as_tensor(host.reshape(-1))).view(host.shape)
            for b, h in zip(*np.nonzero(slots.numpy() >= 0)):
                m = ps if b < nb - 1 else n - (nb - 1) * ps
                s, hp = int(slots[b, h]), int(host[b, h])
                assert torch.equal(off.dev_k[layer][s][:m], off.host_k[layer][hp][:m]), (
                    f"layer {layer}: slot {s} does not hold page {hp}'s keys")
                assert torch.equal(off.dev_v[layer][s][:m], off.host_v[layer][hp][:m])
