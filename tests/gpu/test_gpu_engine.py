"""GPU path (runs only where CUDA is available): Triton paged decode, CUDA-graph decode and
SDPA prefill agree with transformers and with eager mode."""
import pytest
import torch

from sparseserve import LLM, SamplingParams
from tests.model.test_vs_transformers import check_against_hf

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

PROMPTS = [[5], [7 + i % 300 for i in range(17)], [11 + (i * 7) % 300 for i in range(54)],
           [3 + (i * 13) % 310 for i in range(97)]]


@pytest.mark.parametrize("kind", ["llama-gqa", "llama-mha", "qwen2"])
def test_gpu_fp32_matches_transformers(tiny_model_dirs, kind):
    path, hf_model = tiny_model_dirs[kind]
    llm = LLM(path, device="cuda", dtype="float32", page_size=16, max_num_seqs=4,
              kv_cache_memory_bytes=64 << 20, max_model_len=512)
    assert llm.engine.runner.graphs is not None
    check_against_hf(llm, hf_model, PROMPTS, atol=5e-3)


@pytest.mark.parametrize("kind", ["llama-gqa", "llama-mha"])
def test_gpu_chunked_prefill_matches_transformers(tiny_model_dirs, kind, paged_prefill_calls):
    """Prompts prefilled in 20-token chunks (not page-aligned: page 16): every chunk after the
    first continues a prefix and attends through the paged prefill kernel, fp32, against
    transformers on the whole prompt."""
    path, hf_model = tiny_model_dirs[kind]
    llm = LLM(path, device="cuda", dtype="float32", page_size=16, max_num_seqs=4,
              kv_cache_memory_bytes=64 << 20, max_model_len=512, max_num_batched_tokens=20)
    check_against_hf(llm, hf_model, PROMPTS, atol=5e-3)
    assert paged_prefill_calls, "no chunk went through the paged prefill kernel"


def test_cuda_graphs_equal_eager(tiny_model_dirs):
    path, _ = tiny_model_dirs["llama-gqa"]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS * 3]
    kw = dict(device="cuda", dtype="bfloat16", page_size=16, max_num_seqs=16,
              kv_cache_memory_bytes=64 << 20, max_model_len=512)
    graph = LLM(path, **kw).generate(prompts, params, use_tqdm=False)
    eager = LLM(path, enforce_eager=True, **kw).generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in graph] == [o.outputs[0].token_ids for o in eager]


@pytest.mark.parametrize("offload", [False, True])
def test_async_scheduling_equals_sync_with_graphs(tiny_model_dirs, offload):
    """On the GPU (CUDA graphs, pinned token copies, device-fed pending inputs) async
    scheduling generates the synchronous engine's tokens, dense and over the two-tier cache,
    with stop tokens ending requests while their next step is in flight."""
    path, _ = tiny_model_dirs["llama-gqa"]
    prompts = [{"prompt_token_ids": p} for p in PROMPTS * 2]
    kw = dict(device="cuda", dtype="bfloat16", page_size=16, max_num_seqs=8)
    if offload:  # test_stats_lag.py's two-tier setup (it fits its prompts on the H200)
        page_bytes = 2 * 3 * 16 * 16 * 2
        kw.update(preset="sparseserve", token_budget=64, sink_pages=1, local_pages=1,
                  kv_cache_memory_bytes=48 * page_bytes, max_model_len=320,
                  kv_offloading_size=400 * page_bytes / 2**30, max_num_batched_tokens=48)
    else:
        kw.update(kv_cache_memory_bytes=64 << 20, max_model_len=512)
    base = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    first = LLM(path, **kw).generate(prompts, base, use_tqdm=False)
    stops = sorted({o.outputs[0].token_ids[7] for o in first[:3]})
    params = [SamplingParams(temperature=0.0, max_tokens=20 + i, stop_token_ids=stops)
              for i in range(len(prompts))]
    outs = {}
    for mode in (False, True):
        llm = LLM(path, async_scheduling=mode, **kw)
        assert llm.engine.runner.graphs is not None, llm.engine.runner.graph_error
        outs[mode] = [(o.outputs[0].token_ids, o.outputs[0].finish_reason)
                      for o in llm.generate(prompts, params, use_tqdm=False)]
        if mode:
            assert llm.engine.runner.num_pending_inputs > 0
        llm.engine.check_invariants()
    assert outs[True] == outs[False]


@pytest.mark.parametrize("mode", ["FULL_DECODE_ONLY", "FULL_AND_PIECEWISE", "FULL"])
def test_dummy_llama3_shape_runs(tmp_path, mode):
    """The Llama-3-8B shape serves in every graph mode (hybrid steps: two prompts decode while
    a third is chunked in), and what torch reserves for the engine (weights, KV, the graph
    pools, cuDNN plans) stays inside its memory plan — with piecewise graphs for every layer
    and bucket up to 2,048 tokens, or whole-step graphs per bucket (FULL)."""
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved()
    llm = LLM("llama-3-8b", load_format="dummy", max_model_len=4096, max_num_seqs=8,
              max_num_batched_tokens=2048, kv_cache_memory_bytes=4 << 30, cudagraph_mode=mode)
    assert (llm.engine.runner.piecewise is not None) == (mode == "FULL_AND_PIECEWISE")
    assert (llm.engine.runner.mixed is not None) == (mode == "FULL")
    assert torch.cuda.memory_reserved() - before <= llm.engine.config.memory_plan.total
    prompts = [{"prompt_token_ids": list(range(1, n))} for n in (1000, 600, 3000)]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                        use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 8 for o in outs)
    llm.engine.check_invariants()
    del llm, outs
    torch.cuda.empty_cache()


@pytest.mark.parametrize("h2d, d2h, inject", [("flash", "flash", None), ("memcpy", "memcpy", None),
                                              ("flash", "gpu-direct", None),
                                              ("flash", "gpu-direct", 300),
                                              ("flash", "copy-engine", None),
                                              ("flash", "copy-engine", 300)])
def test_gpu_forced_offload_equals_resident(tiny_model_dirs, h2d, d2h, inject):
    """Pinned host tier + HBM slots with FlashH2D / FlashD2H (and the baselines) on the GPU;
    inject: layer-segmented prefill, whose whole prompts with GPU-direct saves take no slot
    (side-stream saves fenced on the device before the first decode step loads them)."""
    path, _ = tiny_model_dirs["llama-gqa"]
    sparse = dict(device="cuda", dtype="float32", page_size=16, sparse_algorithm="arkvale",
                  token_budget=64, sink_pages=1, local_pages=1, max_num_seqs=4,
                  max_model_len=256)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS + [[9 + i % 300 for i in range(130)]]]
    resident = LLM(path, kv_cache_memory_bytes=16 << 20, **sparse).generate(
        prompts, params, use_tqdm=False)
    page_bytes = 2 * 3 * 16 * 16 * 4
    llm = LLM(path, kv_offload=True, kv_cache_memory_bytes=32 * page_bytes,
              kv_offloading_size=200 * page_bytes / 2**30, h2d_method=h2d, d2h_method=d2h,
              max_num_batched_tokens=48, max_inject_tokens=inject, **sparse)
    assert llm.engine.scheduler.slot_free_prefill is (inject is not None)
    misses = llm.engine.get_stats()["cache_misses_total"]  # after the start-up warm-up
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in resident]
    assert llm.engine.get_stats()["cache_misses_total"] > misses
    if h2d == "flash" and d2h != "memcpy":
        assert llm.engine.runner.graphs is not None, llm.engine.runner.graph_error
    llm.engine.check_invariants()


def test_offload_cuda_graphs_equal_eager_under_eviction(tiny_model_dirs):
    """Two-tier decode in CUDA graphs == eager while the device cache evicts, with decode
    batches of every size (requests of different lengths finish at different steps, so the
    graphs of several buckets replay between eager prefill steps of other sizes): the class
    of the H200 fault, where a buffer a graph had captured was replaced by a call of another
    size."""
    path, _ = tiny_model_dirs["llama-gqa"]
    page_bytes = 2 * 3 * 16 * 16 * 2
    kw = dict(device="cuda", dtype="bfloat16", page_size=16, sparse_algorithm="arkvale",
              token_budget=64, sink_pages=1, local_pages=1, max_num_seqs=8,
              max_model_len=320, kv_offload=True, kv_cache_memory_bytes=48 * page_bytes,
              kv_offloading_size=400 * page_bytes / 2**30, max_num_batched_tokens=48)
    prompts = [{"prompt_token_ids": [3 + (i * k) % 300 for i in range(n)]}
               for k, n in ((1, 5), (3, 17), (5, 54), (7, 97), (11, 130), (13, 61), (17, 33),
                            (19, 160))]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
              for m in (40, 9, 71, 23, 55, 14, 90, 31)]
    graph = LLM(path, **kw)
    assert graph.engine.runner.graphs is not None, graph.engine.runner.graph_error
    misses = graph.engine.get_stats()["cache_misses_total"]  # after the start-up warm-up
    g = graph.generate(prompts, params, use_tqdm=False)
    assert graph.engine.get_stats()["cache_misses_total"] > misses
    graph.engine.check_invariants()
    e = LLM(path, enforce_eager=True, **kw).generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in g] == [o.outputs[0].token_ids for o in e]
