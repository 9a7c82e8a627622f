"""The device memory plan (engine/memory_plan.py) against the tensors the worker really
allocates, and against its budget on mocked GPUs: summaries (of every host page with
offload), scratch pages, page directory, the two-tier cache's tables and the graph pool are
counted, so the KV slots get only what is left and the engine never allocates more than it
planned."""
import dataclasses

import pytest
import torch

from sparseserve import LLM, SamplingParams
from sparseserve.engine.args import EngineArgs
from sparseserve.engine.memory_plan import (GiB, activation_bytes, fit_num_pages, param_count,
                                            plan_memory)
from sparseserve.sparse import get_algorithm_class
from sparseserve.worker.model_runner import ModelRunner

PAGE_BYTES = 2 * 3 * 16 * 16 * 4  # K+V, 3 layers, page_size 16, head_dim 16, fp32
BASE = dict(page_size=16, token_budget=64, sink_pages=1, local_pages=1, max_num_seqs=3,
            max_model_len=128, max_num_batched_tokens=40)
# (algorithm, two-tier cache): the summaries' row shapes and dtypes differ (keycode2: int32
# codes), and with offload they cover the host pages
CASES = [("dense", False), ("quest", False), ("arkvale", False), ("arkvale", True),
         ("quest", True), ("keycode2", True), ("keycode2", False),
         ("keycode2-sparq", True)]  # records sized by the KV dtype (sparse/keycode_sparq.py)


def with_pages(cfg, num_pages):
    return cfg.replace(cache=dataclasses.replace(cfg.cache, num_pages=num_pages))


def nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def engine_args(model_dir, algo, offload, **kw):
    args = dict(BASE, model=model_dir, sparse_algorithm=algo)
    if offload:
        # odd counts: 37 slots per layer, 7 chunks of 16 host pages
        args.update(kv_offload=True, kv_cache_memory_bytes=37 * PAGE_BYTES,
                    kv_offloading_size=7 * 16 * PAGE_BYTES / GiB)
    else:
        args.update(kv_cache_memory_bytes=53 * PAGE_BYTES)
    args.update(kw)
    return EngineArgs(**args)


def real_bytes(runner: ModelRunner) -> dict[str, int]:
    """Bytes of the tensors the runner holds, by the plan's components (read off the
    objects that own them, not from the plan's formulas)."""
    params = {p.data_ptr(): p for p in runner.model.parameters()}  # each parameter once
    out = {"weights": nbytes(*params.values()),
           "kv": nbytes(*runner.kv.k, *runner.kv.v),
           "summaries": 0 if runner.sparse is None else nbytes(
               *(t for s in runner.sparse.summaries if s is not None
                 for t in s.tensors.values())),
           "page_directory": nbytes(runner.pages.chunks, runner.pages._offset)}
    rope = runner.model.rope
    if rope._full is not None:  # built by the first forward
        out["rope_tables"] = nbytes(rope._table, rope._full, rope.inv_freq)
    pen = runner.sampler.penalties
    if pen.seen is not None:
        out["penalty_state"] = nbytes(pen.seen, pen.counts)
    c = runner.offload
    if c is not None:
        c.stats()  # creates the loader's counter, as the engine's first stats read does
        out["offload_tables"] = nbytes(
            c.page_of, c.last_access, c.owner, c.res_fill, c.row_quota, c.step, c.hit_miss,
            c.prefill_hit_miss, c.direct_bytes_saved, *c.loader._counters.values())
        out["residency_index"] = nbytes(c.res_table)
        out["selection_stamps"] = nbytes(c.stamps.last_selected, c.stamps.chunk_row, c.stamps.step)
    return out


@pytest.fixture(scope="module")
def model_dir(tiny_model_dirs):
    return tiny_model_dirs["llama-gqa"][0]


@pytest.mark.parametrize("algo,offload", CASES)
def test_planned_bytes_equal_allocated(model_dir, algo, offload):
    """Each exact component of the plan is the bytes of the tensors the engine allocated,
    after steps that built the RoPE tables and the penalty state of every row."""
    llm = LLM(**vars(engine_args(model_dir, algo, offload)))
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True,
                            repetition_penalty=1.2)
    llm.generate([{"prompt_token_ids": list(range(3, 3 + n))} for n in (1, 17, 54)], params,
                 use_tqdm=False)
    cfg, plan = llm.engine.config, llm.engine.config.memory_plan
    real = real_bytes(llm.engine.runner)
    assert plan.budget is None  # the CPU: no device budget
    assert real["weights"] == plan.weights == param_count(cfg.model) * 4
    assert real["kv"] == plan.kv_slots + plan.details["scratch_pages"]
    assert plan.kv_slots == cfg.cache.num_pages * PAGE_BYTES
    assert real["summaries"] == plan.summaries
    if algo != "dense":
        ids = cfg.cache.num_host_pages if offload else cfg.cache.num_pages
        row = get_algorithm_class(algo)(16, 4, 1, 1).summary_bytes_per_page(16, 4)
        assert plan.summaries == 3 * (ids + 1) * row > 0
    for part in ("page_directory", "rope_tables", "offload_tables", "residency_index",
                 "selection_stamps"):
        assert real.get(part, 0) == plan.details.get(part, 0), part
    # allocated on first use for the rows that have penalties: at most what was planned
    assert 0 < real["penalty_state"] <= plan.details["penalty_state"]
    assert plan.metadata == sum(plan.details.values())
    assert plan.graph_pool == 0  # no CUDA graphs on the CPU
    assert llm.engine.memory_plan()["total"] == plan.total


def test_dense_layers_have_no_summaries(model_dir):
    cfg, source = engine_args(model_dir, "quest", False, dense_layers=1).create_engine_config()
    runner = ModelRunner(cfg, source)
    assert real_bytes(runner)["summaries"] == cfg.memory_plan.summaries > 0
    row = get_algorithm_class("quest")(16, 4, 1, 1).summary_bytes_per_page(16, 4)
    assert cfg.memory_plan.summaries == 2 * (cfg.cache.num_pages + 1) * row


@pytest.fixture
def gpu(monkeypatch):
    """A mocked GPU: set(free, total) decides what torch.cuda.mem_get_info answers."""
    mem = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: mem["info"])
    return lambda free, total: mem.__setitem__("info", (int(free), int(total)))


SIZES = [(2.35, 2.7), (2.5, 2.6), (2.45, 3.0)]  # GiB free, total: small KV budgets on CPU RAM


@pytest.mark.parametrize("free,total", SIZES)
@pytest.mark.parametrize("algo,offload", [("arkvale", True), ("quest", True),
                                          ("keycode2", True), ("arkvale", False),
                                          ("dense", False)])
def test_plan_fits_budget_on_mocked_gpu(model_dir, gpu, monkeypatch, free, total, algo,
                                        offload):
    """gpu_memory_utilization sizes the KV slots: the planned total fits min(free, 0.9 x
    total), and so do the tensors a worker of that config allocates (built on the CPU, same
    shapes) plus the activation allowance. Before summaries were counted the KV slots took
    all of budget - weights - activations and the summaries came on top: this failed."""
    gpu(free * GiB, total * GiB)
    kw = dict(BASE, model=model_dir, device="cuda", sparse_algorithm=algo, max_num_seqs=5,
              max_model_len=256, gpu_memory_utilization=0.9)
    if offload:  # a large host tier: its summaries are a good part of the budget
        kw.update(kv_offload=True, kv_offloading_size=1.5)
    cfg, source = EngineArgs(**kw).create_engine_config()
    plan = cfg.memory_plan
    budget = min(int(free * GiB), int(int(total * GiB) * 0.9))
    assert plan.budget == budget and plan.total <= budget
    assert plan.graph_pool > 0  # CUDA graphs are captured (flash loads, direct saves)
    # slots are filled up to the last one that fits
    assert plan_memory(with_pages(cfg, cfg.cache.num_pages + 1)).total > budget
    monkeypatch.undo()  # the GPU mock off: the worker is built on the CPU
    runner = ModelRunner(cfg.replace(device="cpu"), source)
    real = real_bytes(runner)
    persistent = sum(v for k, v in real.items() if k != "weights")
    # allocated by the first forward / the first request with penalties, at their planned size
    persistent += plan.details["rope_tables"] + plan.details["penalty_state"]
    act = activation_bytes(cfg.model, cfg.scheduler.max_num_batched_tokens,
                           cfg.scheduler.max_num_seqs)
    assert real["weights"] + act + persistent + plan.graph_pool <= budget
    assert real["summaries"] == plan.summaries
    if offload:  # of the 1.5 GiB host tier's 524,288 pages: a good part of what is left
        assert plan.summaries > (budget - act) // 6


def test_fit_num_pages_is_the_largest_that_fits(model_dir):
    cfg, _ = engine_args(model_dir, "arkvale", True).create_engine_config()
    for available in (plan_memory(cfg).total, 3 * GiB + 12345, 2 * GiB + 777_777):
        n = fit_num_pages(cfg, available)
        assert n > 0
        assert plan_memory(with_pages(cfg, n)).total <= available
        assert plan_memory(with_pages(cfg, n + 1)).total > available


def test_explicit_kv_bytes_are_the_slots_and_must_fit_the_gpu(model_dir, gpu):
    """kv_cache_memory_bytes is the KV slots' size (vLLM); the rest comes on top and the
    whole plan is checked against the GPU's free memory, with what to lower."""
    gpu(3 * GiB, 4 * GiB)
    kw = dict(BASE, model=model_dir, device="cuda", sparse_algorithm="arkvale",
              kv_offload=True, kv_offloading_size=0.5)
    cfg, _ = EngineArgs(kv_cache_memory_bytes=101 * PAGE_BYTES // 2, **kw).create_engine_config()
    assert cfg.cache.num_pages == 101  # bf16 pages: half of PAGE_BYTES
    assert cfg.memory_plan.kv_slots == 101 * PAGE_BYTES // 2
    assert cfg.memory_plan.budget == 3 * GiB >= cfg.memory_plan.total
    with pytest.raises(ValueError, match="lower kv_cache_memory_bytes to at most"):
        EngineArgs(kv_cache_memory_bytes=GiB, **kw).create_engine_config()
    with pytest.raises(ValueError, match="kv_offloading_size"):
        EngineArgs(kv_cache_memory_bytes=GiB, **dict(kw, kv_offloading_size=64)
                   ).create_engine_config()


def test_no_room_for_slots_names_the_host_tier(model_dir, gpu):
    gpu(2.3 * GiB, 2.4 * GiB)
    with pytest.raises(ValueError, match="lower kv_offloading_size"):
        EngineArgs(**dict(BASE, model=model_dir, device="cuda", sparse_algorithm="arkvale",
                          kv_offload=True, kv_offloading_size=64)).create_engine_config()


def test_graph_pool_only_with_captured_graphs(model_dir, gpu):
    gpu(3 * GiB, 4 * GiB)
    kw = dict(BASE, model=model_dir, device="cuda", kv_cache_memory_bytes=64 * PAGE_BYTES)
    graphs = EngineArgs(**kw).create_engine_config()[0].memory_plan
    eager = EngineArgs(enforce_eager=True, **kw).create_engine_config()[0].memory_plan
    memcpy = EngineArgs(preset="sparse-offload", kv_offloading_size=0.1,
                        **kw).create_engine_config()[0].memory_plan  # per-page copies: eager
    assert graphs.graph_pool > 0 and eager.graph_pool == memcpy.graph_pool == 0


def test_startup_logs_the_split(model_dir, caplog):
    with caplog.at_level("INFO", logger="sparseserve"):
        LLM(**vars(engine_args(model_dir, "arkvale", True)))
    line = next(r.getMessage() for r in caplog.records if "memory plan" in r.getMessage())
    for word in ("weights", "activations", "KV slots", "summaries", "metadata", "graph pool",
                 "total", "budget"):
        assert word in line


def test_llama3_8b_h200_offload_arkvale_counts_summaries(gpu):
    """Llama-3-8B (bf16) on a mocked 141 GB H200 with offload and ArkVale: the summaries of
    every host page (two [128] bf16 vectors per page and layer: 1/32 of the host tier) are in
    HBM, and the KV slots shrink by them."""
    gpu(140 * GiB, 141 * GiB)
    kw = dict(model="llama-3-8b", load_format="dummy", device="cuda", dtype="bfloat16",
              preset="sparseserve", max_model_len=32768, max_num_seqs=64)
    small = EngineArgs(kv_offloading_size=8, **kw).create_engine_config()[0]
    large = EngineArgs(kv_offloading_size=256, **kw).create_engine_config()[0]
    page_bytes = 2 * 32 * 32 * 128 * 2
    for cfg in (small, large):
        plan = cfg.memory_plan
        print(plan.describe())
        assert plan.summaries == 32 * (cfg.cache.num_host_pages + 1) * 2 * 128 * 2
        assert plan.total <= plan.budget == int(141 * GiB * 0.9)
        assert plan.budget - plan.total < page_bytes + 64  # no slot left unused
    assert large.memory_plan.summaries == pytest.approx(8 * GiB, rel=1e-3)
    shrink = (small.cache.num_pages - large.cache.num_pages) * page_bytes
    more = large.memory_plan.summaries - small.memory_plan.summaries
    # (fewer slots also need less metadata: the slots shrink a little less than that)
    assert shrink == pytest.approx(more, rel=0.01)


def test_piecewise_graphs_are_counted(gpu):
    """cudagraph_mode FULL_AND_PIECEWISE adds the piecewise graphs' static buffers and pool
    (worker/piecewise_graphs.py) to the graph pool, and the KV slots shrink by it; at least
    the static buffers' real bytes (stream, residual, qkv, attention out, positions, RoPE
    factors at the largest bucket)."""
    from sparseserve.engine.memory_plan import piecewise_max_tokens, piecewise_pool_bytes

    gpu(140 * GiB, 141 * GiB)
    kw = dict(model="llama-3-8b", load_format="dummy", device="cuda", dtype="bfloat16",
              max_model_len=32768, max_num_seqs=64)
    full = EngineArgs(cudagraph_mode="FULL_DECODE_ONLY", **kw).create_engine_config()[0]
    pw = EngineArgs(cudagraph_mode="FULL_AND_PIECEWISE", **kw).create_engine_config()[0]
    extra = piecewise_pool_bytes(pw)
    assert piecewise_pool_bytes(full) == 0 and extra > 0
    assert pw.memory_plan.graph_pool - full.memory_plan.graph_pool == extra
    n = piecewise_max_tokens(pw)
    assert n == 2048
    static = n * ((2 * 4096 + (32 + 8 + 8 + 32) * 128) * 2 + 8 + 2 * 128 * 4)
    assert extra > static
    page_bytes = 2 * 32 * 32 * 128 * 2
    assert full.cache.num_pages - pw.cache.num_pages == pytest.approx(extra / page_bytes, abs=2)
    eager = EngineArgs(cudagraph_mode="FULL_AND_PIECEWISE", enforce_eager=True,
                       **kw).create_engine_config()[0]
    assert eager.memory_plan.graph_pool == 0


def test_cudagraph_mode_checked(model_dir, caplog):
    with pytest.raises(ValueError, match="cudagraph_mode 'PIECEWISE' is not one of"):
        EngineArgs(model=model_dir, cudagraph_mode="PIECEWISE").create_engine_config()
    with caplog.at_level("WARNING", logger="sparseserve"):
        EngineArgs(model=model_dir, device="cpu",
                   cudagraph_mode="FULL_AND_PIECEWISE").create_engine_config()
    assert "cudagraph_mode FULL_AND_PIECEWISE has no effect: there are no CUDA graphs on cpu" \
        in caplog.text


@pytest.mark.parametrize("kw,message", [
    (dict(preset="sparseserve"),
     "it captures the layer segments of whole prompts (slot-free, up to 128 tokens: "
     "two_tier_graphs.MAX_TOKENS = 8192)"),
    (dict(preset="sparseserve", max_model_len=10000, max_num_batched_tokens=10000,
          kv_offloading_size=0.05, load_format="dummy"),  # beyond the model's 1024 positions
     "(slot-free, up to 8192 tokens: two_tier_graphs.MAX_TOKENS = 8192)"),
    (dict(preset="sparse"), "Here the two-tier cache (kv_offload) is off: FULL does nothing "
     "beyond FULL_DECODE_ONLY"),
    (dict(preset="sparseserve", d2h_method="flash"), "Here d2h_method is flash, not gpu-direct"),
    (dict(preset="sparseserve", d2h_method="memcpy"), "Here d2h_method is memcpy, not gpu-direct"),
    (dict(preset="sparseserve", d2h_method="copy-engine"),
     "Here d2h_method is copy-engine, not gpu-direct"),
    (dict(preset="sparseserve", layer_segmented_prefill=False),
     "Here layer-segmented prefill is off (max_inject_tokens None): no prompt is prefilled "
     "slot-free: FULL does nothing beyond FULL_DECODE_ONLY"),
    (dict(preset="dense"), None),
])
def test_full_mode_says_what_it_captures(model_dir, gpu, caplog, kw, message):
    """cudagraph_mode FULL with sparse attention or the two-tier cache: the warning names the
    two-tier prefill graphs and their 8192-token limit where two_tier_graph_plan captures
    them, else the condition that rules them out (FULL then adds nothing to
    FULL_DECODE_ONLY); dense: whole-step graphs, no warning."""
    from sparseserve.engine.two_tier_graph_plan import captures_two_tier_graphs

    gpu(3 * GiB, 4 * GiB)
    args = dict(BASE, model=model_dir, device="cuda", cudagraph_mode="FULL",
                kv_cache_memory_bytes=64 * PAGE_BYTES)
    if kw.get("preset") != "dense" and kw.get("preset") != "sparse":
        args["kv_offloading_size"] = 0.01
    args.update(kw)
    with caplog.at_level("WARNING", logger="sparseserve"):
        cfg = EngineArgs(**args).create_engine_config()[0]
    full = [r.getMessage() for r in caplog.records if "cudagraph_mode FULL" in r.getMessage()]
    if message is None:
        assert not full
        return
    assert len(full) == 1 and message in full[0], full
    assert "dense attention over device pages only" in full[0]
    assert captures_two_tier_graphs(cfg) == ("Here" not in full[0])
    assert "8192" in full[0]


@pytest.mark.parametrize("kw,mode", [
    (dict(preset="sparseserve"), "FULL"),  # the two-tier layer graphs
    (dict(preset="dense"), "FULL"),  # whole-step graphs
    (dict(), "FULL"),  # no preset: dense attention over device pages
    (dict(preset="sparse"), "FULL_DECODE_ONLY"),
    (dict(preset="sparse-offload"), "FULL_DECODE_ONLY"),
    (dict(preset="sparseserve", d2h_method="flash"), "FULL_DECODE_ONLY"),
    (dict(preset="sparseserve", layer_segmented_prefill=False), "FULL_DECODE_ONLY"),
    (dict(preset="dense", enforce_eager=True), "FULL_DECODE_ONLY"),
    (dict(preset="dense", device="cpu"), "FULL_DECODE_ONLY"),
    (dict(preset="dense", cudagraph_mode="FULL_DECODE_ONLY"), "FULL_DECODE_ONLY"),
    (dict(preset="dense", cudagraph_mode="FULL_AND_PIECEWISE"), "FULL_AND_PIECEWISE"),
])
def test_default_graph_mode(model_dir, gpu, caplog, kw, mode):
    """cudagraph_mode left unset: FULL where the configuration captures its steps with prefill
    work (whole-step graphs for dense attention over device pages, the sparseserve preset's
    two-tier layer graphs), else FULL_DECODE_ONLY, without the warnings an explicit FULL
    gets; an explicit mode is kept. The graph pool follows the resolved mode."""
    from sparseserve.engine.memory_plan import captures_mixed_graphs
    from sparseserve.engine.two_tier_graph_plan import captures_two_tier_graphs

    gpu(3 * GiB, 4 * GiB)
    args = dict(BASE, model=model_dir, device="cuda", kv_cache_memory_bytes=64 * PAGE_BYTES)
    if kw.get("preset", "dense") not in ("dense", "sparse"):
        args["kv_offloading_size"] = 0.01
    args.update(kw)
    with caplog.at_level("WARNING", logger="sparseserve"):
        cfg = EngineArgs(**args).create_engine_config()[0]
    assert cfg.cudagraph_mode == mode
    assert (captures_mixed_graphs(cfg) or captures_two_tier_graphs(cfg)) == (mode == "FULL")
    assert "cudagraph_mode" not in caplog.text
    if mode == "FULL":
        explicit = EngineArgs(**dict(args, cudagraph_mode="FULL")).create_engine_config()[0]
        assert explicit.memory_plan == cfg.memory_plan


def test_whole_step_graphs_are_counted(gpu, caplog):
    """cudagraph_mode FULL (worker/mixed_graphs.py) adds the piecewise-sized pool plus the
    whole-step graphs' page tables [S, Hkv, W] and sampled logits [S, vocab] to the graph
    pool; with sparse attention it captures nothing extra and warns."""
    from sparseserve.engine.memory_plan import captures_mixed_graphs, piecewise_pool_bytes

    gpu(140 * GiB, 141 * GiB)
    kw = dict(model="llama-3-8b", load_format="dummy", device="cuda", dtype="bfloat16",
              max_model_len=32768, max_num_seqs=64)
    pw = EngineArgs(cudagraph_mode="FULL_AND_PIECEWISE", **kw).create_engine_config()[0]
    full = EngineArgs(cudagraph_mode="FULL", **kw).create_engine_config()[0]
    assert captures_mixed_graphs(full) and not captures_mixed_graphs(pw)
    extra = piecewise_pool_bytes(full) - piecewise_pool_bytes(pw)
    assert full.memory_plan.graph_pool - pw.memory_plan.graph_pool == extra
    width = -(-32768 // full.cache.page_size)  # pages a row can hold
    tables, logits = 2 * 64 * 8 * width * 4, 64 * 128256 * (2 + 8)
    assert extra >= tables + logits
    with caplog.at_level("WARNING", logger="sparseserve"):
        sparse = EngineArgs(cudagraph_mode="FULL", preset="sparse", **kw).create_engine_config()[0]
    assert not captures_mixed_graphs(sparse)
    assert "dense attention over device pages only" in caplog.text
