"""Device memory of one rank, planned from the engine config before anything is allocated.

A rank's HBM holds (MemoryPlan, bytes per rank):
  weights      its parameters (param_count x dtype size): exact
  activations  the largest step's transient buffers (step_tokens of them) + 2 GiB slack (CUDA
               context, allocator, collectives), and with layer-segmented prefill the hidden
               states prompts keep between their segments: an allowance (activation_bytes,
               segment_hidden_bytes)
  kv_slots     its device KV pages (all-resident) or slots (two-tier cache): num_pages per
               layer, K and V: exact
  summaries    the sparse algorithm's rows (SparseAlgorithm.summary_shapes / _dtypes) for
               every page an id can name, + one scratch row, per sparse layer. With offload
               that is every HOST page: summaries grow with the host tier, not the slots: exact
  metadata     the page directory, the two-tier cache's per-slot arrays and residency index,
               the scratch page of every layer, the RoPE tables and the sampler's penalty
               state (allocated on first use, counted at its largest): exact (metadata_bytes)
  graph_pool   the CUDA graphs' private memory pools and static buffers: the decode graphs',
               the piecewise / whole-step graphs' (piecewise_pool_bytes) and the two-tier
               prefill graphs' (two_tier_graph_plan.two_tier_graph_bytes): an allowance
               (graph_pool_bytes)

EngineArgs sizes the KV slots from this plan: with the budget derived from
gpu_memory_utilization, kv_slots are what is left once everything else is counted
(fit_num_pages); an explicit kv_cache_memory_bytes is the KV slots' size, as in vLLM, the rest
comes on top and the total is checked against the GPU's free memory. The worker allocates
exactly what the exact components say (tests/engine/test_memory_plan.py sums its tensors);
persistent tensors of a few kilobytes at most (a grammar's 2 KiB bit table) fall in the
activations' slack. The graph pool's allowance is a formula from the shapes, not yet checked
against a measured pool.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Callable

from sparseserve.config import INJECT_CREDIT_FRACTION, EngineConfig, ModelConfig, SchedulerConfig

logger = logging.getLogger("sparseserve")

GiB = 1 << 30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

# graph pool allowance (graph_pool_bytes): a captured decode step's transients per row, on
# top of the layer activations that activation_bytes counts per token: fp32 RoPE of q and k
# (three [Hq + Hkv, D] fp32 buffers), selection / attention temporaries over every page a row
# can hold (scores, masks, top-k inputs: four 4-byte values per query head and page), and
# the allocator's rounding of a pool's blocks (2 MiB segments, one per size class)
SELECT_BYTES_PER_HEAD_PAGE = 16
GRAPH_POOL_SLACK = 64 << 20
# penalty state per row and vocabulary entry: `seen` bool + `counts` int32 (penalties.py)
PENALTY_BYTES_PER_TOKEN = 5


def gpu_memory(tp: int = 1) -> tuple[int, int]:
    """(free, total) bytes of the GPU with the least free memory among the tp ranks' GPUs
    (CUDA devices 0..tp-1). With tp > 1 the engine process runs no model: NVML answers
    without creating a CUDA context here; without NVML (pynvml) torch.cuda.mem_get_info
    does, at the cost of a context on each GPU in this process."""
    import torch

    if tp == 1:
        return torch.cuda.mem_get_info()
    try:
        import pynvml
        pynvml.nvmlInit()
        try:
            infos = [pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(
                torch.cuda._get_nvml_device_index(i))) for i in range(tp)]
        finally:
            pynvml.nvmlShutdown()
        mems = [(int(m.free), int(m.total)) for m in infos]
    except Exception:  # noqa: BLE001 - no NVML: ask the CUDA runtime
        mems = [torch.cuda.mem_get_info(i) for i in range(tp)]
    return min(f for f, _ in mems), min(t for _, t in mems)


def param_count(mc: ModelConfig, tp: int = 1) -> int:
    """Parameters one of tp ranks holds (model/parallel.py): the projections (and Qwen2's
    q/k/v biases) split tp ways, the embedding and an untied LM head ceil(vocab / tp) rows
    each, the norms whole."""
    h, i, d = mc.hidden_size, mc.intermediate_size, mc.head_dim
    attn = h * d * (2 * mc.num_attention_heads + 2 * mc.num_key_value_heads) // tp
    if mc.attention_bias:
        attn += d * (mc.num_attention_heads + 2 * mc.num_key_value_heads) // tp
    layer = attn + 3 * h * i // tp + 2 * h
    rows = -(-mc.vocab_size // tp)
    head = 0 if mc.tie_word_embeddings else rows * h
    return mc.num_hidden_layers * layer + rows * h + head + h


def activation_bytes(mc: ModelConfig, batched_tokens: int, num_seqs: int, tp: int = 1) -> int:
    """Activations of the largest step on one rank: the hidden-size buffers (whole on every
    rank), its 1/tp of the MLP buffers, fp32 logits of the batch (rank 0 gathers the whole
    vocabulary, and every rank gets rank 0's page counts), plus 2 GiB of slack (CUDA context,
    allocator, collectives' buffers)."""
    return batched_tokens * (mc.hidden_size * 8 + mc.intermediate_size * 6 // tp) \
        + num_seqs * mc.vocab_size * 12 + 2 * GiB


def step_tokens(sc: SchedulerConfig) -> int:
    """The most tokens one step's forward holds at a layer (what its activations scale with):
    the token budget (decode rows and prefill chunks are charged to it), plus with
    layer-segmented prefill the segments' prompt tokens, which are charged to the injection
    budget instead (prompt tokens x layers): every segment runs at least one layer, so at most
    (1 + INJECT_CREDIT_FRACTION) x max_inject_tokens of them, and no more than max_num_seqs
    whole prompts. (A 33k-token LWM-7B prompt runs as one segment: 16x a 2048-token budget.)"""
    n = sc.max_num_batched_tokens
    if sc.max_inject_tokens:
        n += min(int(sc.max_inject_tokens * (1 + INJECT_CREDIT_FRACTION)),
                 sc.max_num_seqs * sc.max_model_len)
    return n


def segment_hidden_tokens(sc: SchedulerConfig) -> int:
    """Tokens whose hidden states prompts keep between their layer segments (the runner's
    saved_hidden: [segment tokens, hidden] per prompt partway through its layers). The
    scheduler serves running requests first, so prompts partway through are the ones the
    injection budget carries, at most the segment part of step_tokens (tested against the
    scheduler: tests/engine/test_step_tokens.py); 0 without layer-segmented prefill."""
    return step_tokens(sc) - sc.max_num_batched_tokens


def segment_hidden_bytes(mc: ModelConfig, sc: SchedulerConfig, dtype_bytes: int) -> int:
    return segment_hidden_tokens(sc) * mc.hidden_size * dtype_bytes


@dataclass(frozen=True)
class MemoryPlan:
    """Device bytes one rank plans for, by component (the module docstring says what each
    holds). budget: what the total must fit in — min(free, total x gpu_memory_utilization)
    when the KV slots were sized from it, the GPU's free memory with an explicit
    kv_cache_memory_bytes, None on the CPU (no device budget). details: metadata's parts."""

    weights: int
    activations: int
    kv_slots: int
    summaries: int
    metadata: int
    graph_pool: int
    budget: int | None = None
    details: dict[str, int] = field(default_factory=dict)

    COMPONENTS = ("weights", "activations", "kv_slots", "summaries", "metadata", "graph_pool")

    @property
    def total(self) -> int:
        return sum(getattr(self, c) for c in self.COMPONENTS)

    def as_dict(self) -> dict:
        """JSON-ready: every component, total, budget and metadata's parts (bytes)."""
        out = {c: getattr(self, c) for c in self.COMPONENTS}
        out.update(total=self.total, budget=self.budget, details=dict(self.details))
        return out

    def describe(self) -> str:
        """One line for the startup log: the split in GiB, total vs budget."""
        names = {"kv_slots": "KV slots", "graph_pool": "graph pool"}
        parts = ", ".join(f"{names.get(c, c)} {getattr(self, c) / GiB:.2f}"
                          for c in self.COMPONENTS)
        budget = ("no device budget (CPU)" if self.budget is None
                  else f"budget {self.budget / GiB:.2f}")
        return f"memory plan per rank (GiB): {parts}; total {self.total / GiB:.2f}, {budget}"


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _rank_shape(cfg: EngineConfig) -> tuple[int, int, int, int]:
    """(layers, KV heads of one rank, head_dim, KV element size)."""
    mc = cfg.model
    tp = cfg.parallel.tensor_parallel_size
    return (mc.num_hidden_layers, mc.num_key_value_heads // tp, mc.head_dim,
            DTYPE_BYTES[cfg.dtype])


def kv_page_bytes(cfg: EngineConfig) -> int:
    """K + V bytes of one page id over every layer (one KV head)."""
    layers, _, d, e = _rank_shape(cfg)
    return 2 * layers * cfg.cache.page_size * d * e


def _sparse_algorithm(cfg: EngineConfig):
    from sparseserve.sparse import get_algorithm_class
    sp, ps = cfg.sparse, cfg.cache.page_size
    return get_algorithm_class(sp.algorithm)(ps, sp.token_budget // ps, sp.sink_pages,
                                             sp.local_pages)


def summary_row_bytes(cfg: EngineConfig) -> int:
    """Summary bytes of one page of one layer (0 without sparse attention)."""
    if not cfg.sparse.enabled:
        return 0
    _, _, d, e = _rank_shape(cfg)
    return _sparse_algorithm(cfg).summary_bytes_per_page(d, e)


def summary_bytes(cfg: EngineConfig) -> int:
    """worker/sparse_runtime.py: per sparse layer one row per page id + a scratch row (page
    ids are host pages with the two-tier cache, device pages without), as the algorithm lays
    them out (keycode2-sparq pads its interleaved records to whole page chunks)."""
    if not cfg.sparse.enabled:
        return 0
    c = cfg.cache
    ids = c.num_host_pages if c.kv_offload else c.num_pages
    sparse_layers = cfg.model.num_hidden_layers - cfg.sparse.dense_layers
    _, _, d, e = _rank_shape(cfg)
    return sparse_layers * _sparse_algorithm(cfg).summary_bytes(
        ids + 1, d, e, cfg.device, c.chunk_pages)


def metadata_bytes(cfg: EngineConfig) -> dict[str, int]:
    """The worker's other persistent device tensors, by part (shapes from the allocating
    code): forward_context.KVCacheTensors' scratch page; page_directory.PageDirectory
    (chunk ids [rows + 1, Hkv, n] int32 + offsets [n * C] int32); offload_cache.TwoTierCache
    (page_of / last_access / owner [L, slots + 1] int64, fill counts [L, 2], quotas
    [rows + 1], six int64 counters + the loader's two; residency index [L, table_size]
    int32; selection stamps of every host page [L, n * C] int32 and chunk owners [n]; the
    decode write-through stage [2, L, rows + 1, Hkv, D] in the KV dtype); the
    RoPE tables (layers.RotaryEmbedding: [len, D] + [len, 2, D] fp32, inv_freq) and
    penalties.PenaltyState at its largest ([max_num_seqs, vocab] bool + int32)."""
    from sparseserve.kernels.residency_hash import table_size

    layers, hkv, d, e = _rank_shape(cfg)
    c, sc = cfg.cache, cfg.scheduler
    rows, ps, chunk = sc.max_num_seqs, c.page_size, c.chunk_pages
    n_chunks = _cdiv(_cdiv(sc.max_model_len, ps), chunk)  # directory entries per row and head
    out = {
        "scratch_pages": 2 * layers * ps * d * e,
        "page_directory": (rows + 1) * hkv * n_chunks * 4 + n_chunks * chunk * 4,
        "rope_tables": 3 * sc.max_model_len * d * 4 + d // 2 * 4,
        "penalty_state": rows * cfg.model.vocab_size * PENALTY_BYTES_PER_TOKEN,
    }
    if c.kv_offload:
        s1 = c.num_pages + 1
        out["offload_tables"] = 3 * layers * s1 * 8 + layers * 2 * 8 + (rows + 1) * 8 + 8 * 8
        out["residency_index"] = layers * table_size(s1) * 4
        # selection stamps [L, n * C] int32 + chunk owners [n] int64 + the int32 step, with
        # n = cdiv(host pages + 1, C) (TwoTierCache: working sets counted by selection)
        n_host_chunks = _cdiv(c.num_host_pages + 1, chunk)
        out["selection_stamps"] = layers * n_host_chunks * chunk * 4 + n_host_chunks * 8 + 4
        if c.d2h_method != "memcpy":  # decode rows' K / V staged for their write-through
            out["decode_stage"] = 2 * layers * (rows + 1) * hkv * d * e
    return out


def captures_decode_graphs(cfg: EngineConfig) -> bool:
    """Whether the runner captures decode CUDA graphs (worker/model_runner.py asks this):
    on CUDA unless enforce_eager; the per-page baselines sync on the host, so with the
    two-tier cache only FlashH2D loads with direct (non-memcpy) decode saves."""
    if cfg.device != "cuda" or cfg.enforce_eager:
        return False
    c = cfg.cache
    return not c.kv_offload or (c.h2d_method == "flash" and c.d2h_method != "memcpy")


PIECEWISE_MAX_TOKENS = 4096  # larger steps are compute-bound: their layers run eagerly


def captures_piecewise_graphs(cfg: EngineConfig) -> bool:
    """Whether the runner captures piecewise graphs for steps with prefill work
    (worker/piecewise_graphs.py): cudagraph_mode FULL_AND_PIECEWISE on one CUDA device
    without enforce_eager (tensor parallelism runs the unfused layers)."""
    return (cfg.device == "cuda" and not cfg.enforce_eager
            and cfg.cudagraph_mode == "FULL_AND_PIECEWISE"
            and cfg.parallel.tensor_parallel_size == 1)


def captures_mixed_graphs(cfg: EngineConfig) -> bool:
    """Whether the runner captures whole-step graphs for steps with prefill work
    (worker/mixed_graphs.py): cudagraph_mode FULL on one CUDA device without enforce_eager,
    for dense attention over device pages (no sparse selection, no two-tier cache)."""
    return (cfg.device == "cuda" and not cfg.enforce_eager and cfg.cudagraph_mode == "FULL"
            and cfg.parallel.tensor_parallel_size == 1 and not cfg.sparse.enabled
            and not cfg.cache.kv_offload)


def piecewise_max_tokens(cfg: EngineConfig) -> int:
    """The largest token bucket of the piecewise graphs: the step's token budget, capped."""
    return min(cfg.scheduler.max_num_batched_tokens, PIECEWISE_MAX_TOKENS)


def piecewise_pool_bytes(cfg: EngineConfig) -> int:
    """The piecewise graphs' static buffers (stream and residual [n, hidden], qkv [n, (Hq +
    2 Hkv) D], attention out [n, Hq D], positions, fp32 RoPE factors [n, 2, D]) and their
    shared pool, which holds one piece's intermediates at the largest bucket n (a layer's
    activations per token, as graph_pool_bytes counts them); 0 when none are captured. The
    whole-step graphs of cudagraph_mode FULL (mixed_graphs.py) hold the same per-token
    buffers inside their pool, plus the static inputs, the kernel's metadata, the page tables
    [S, Hkv, W] int32 of the prompt chunks and of the decode lanes, the decode lanes' split-K
    workspace and the sampled rows' logits [S, vocab] (model dtype and fp32, and the static
    fp32 copy)."""
    mixed = captures_mixed_graphs(cfg)
    if not (captures_piecewise_graphs(cfg) or mixed):
        return 0
    extra = 0
    if mixed:
        s = cfg.scheduler.max_num_seqs
        _, hkv, d, e = _rank_shape(cfg)
        width = _cdiv(cfg.scheduler.max_model_len, cfg.cache.page_size)
        # the decode lanes' split-K workspace: at most num_sms x PROGRAMS_PER_SM rows of
        # [BLOCK_G, D + 2] fp32 (kernels/paged_decode.py; 132 SMs on the H100 / H200)
        workspace = 132 * 8 * max(16, cfg.model.num_attention_heads // hkv) * (d + 2) * 4
        extra = (s * (2 * hkv * width * 4 + cfg.model.vocab_size * (e + 8)
                      + cfg.model.hidden_size * e + 6 * 8) + workspace
                 + piecewise_max_tokens(cfg) * (3 * 8 + 2 * 4))
    mc = cfg.model
    _, hkv, d, e = _rank_shape(cfg)
    hq = mc.num_attention_heads
    n = piecewise_max_tokens(cfg)
    static = n * ((2 * mc.hidden_size + (2 * hq + 2 * hkv) * d) * e + 8 + 2 * d * 4)
    return (static + n * (mc.hidden_size * 8 + mc.intermediate_size * 6) * e // 2
            + GRAPH_POOL_SLACK + extra)


def graph_pool_bytes(cfg: EngineConfig) -> int:
    """Allowance for the decode graphs' shared pool (worker/cuda_graphs.py), without
    measuring: graphs are captured largest bucket first and share one pool, so it holds the
    largest bucket's peak — per row the layer activations (as activation_bytes counts a
    token), fp32 RoPE of q and k, the selection / attention temporaries over every page a
    row can hold (SELECT_BYTES_PER_HEAD_PAGE per query head), with the two-tier cache each
    KV head's gathered K and V page and scratch summary row, and the logits in the model
    dtype and fp32 — plus every other graph's logits (kept as the graphs' outputs: with the
    two-tier cache two graphs per bucket, cuda_graphs.graph_variants), the static inputs and
    GRAPH_POOL_SLACK; plus piecewise_pool_bytes and two_tier_graph_bytes. 0 when no graph is
    captured."""
    from sparseserve.engine.two_tier_graph_plan import two_tier_graph_bytes
    if not captures_decode_graphs(cfg):
        return piecewise_pool_bytes(cfg) + two_tier_graph_bytes(cfg)
    from sparseserve.worker.cuda_graphs import batch_buckets, graph_variants

    mc, tp = cfg.model, cfg.parallel.tensor_parallel_size
    _, hkv, d, e = _rank_shape(cfg)
    hq = mc.num_attention_heads // tp
    width = _cdiv(cfg.scheduler.max_model_len, cfg.cache.page_size)  # pages a row can hold
    per_row = (mc.hidden_size * 8 + mc.intermediate_size * 6 // tp) * e // 2
    per_row += 3 * (hq + hkv) * d * 4 + hq * width * SELECT_BYTES_PER_HEAD_PAGE
    if cfg.cache.kv_offload:
        per_row += hkv * (2 * cfg.cache.page_size * d * e + summary_row_bytes(cfg))
    per_row += mc.vocab_size * (e + 4)
    sizes = batch_buckets(cfg.scheduler.max_num_seqs)
    graphs_rows = len(graph_variants(cfg.cache.kv_offload)) * sum(sizes)
    kept = (graphs_rows - sizes[-1]) * mc.vocab_size * 4
    return (sizes[-1] * (per_row + 3 * 8) + kept + GRAPH_POOL_SLACK + piecewise_pool_bytes(cfg)
            + two_tier_graph_bytes(cfg))


def plan_memory(cfg: EngineConfig, budget: int | None = None) -> MemoryPlan:
    """The device memory plan of one rank of `cfg` (nothing is allocated)."""
    tp = cfg.parallel.tensor_parallel_size
    mc, sc = cfg.model, cfg.scheduler
    meta = metadata_bytes(cfg)
    return MemoryPlan(
        weights=param_count(mc, tp) * DTYPE_BYTES[cfg.dtype],
        activations=activation_bytes(mc, step_tokens(sc), sc.max_num_seqs, tp)
        + segment_hidden_bytes(mc, sc, DTYPE_BYTES[cfg.dtype]),
        kv_slots=cfg.cache.num_pages * kv_page_bytes(cfg),
        summaries=summary_bytes(cfg), metadata=sum(meta.values()),
        graph_pool=graph_pool_bytes(cfg), budget=budget, details=meta)


def fit_num_pages(cfg: EngineConfig, available: int,
                  plan: Callable[[EngineConfig], MemoryPlan] = plan_memory) -> int:
    """The most device pages (slots) per layer whose plan fits in `available` bytes (0 if
    not even the other components fit). Every component is non-decreasing in the page count
    (the residency index grows in powers of two), so a bisection finds it."""
    def fits(n: int) -> bool:
        cache = dataclasses.replace(cfg.cache, num_pages=n)
        return plan(dataclasses.replace(cfg, cache=cache)).total <= available

    lo, hi = 0, max(0, available) // kv_page_bytes(cfg) + 1  # fits(lo); not fits(hi)
    if not fits(0):
        return 0
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def check_plan(plan: MemoryPlan, explicit: bool) -> None:
    """Raise when the plan exceeds its budget (on a GPU), naming what to lower. explicit:
    kv_cache_memory_bytes was given (the budget is then the GPU's free memory)."""
    if plan.budget is None or plan.total <= plan.budget:
        return
    room = plan.budget - (plan.total - plan.kv_slots)
    where = "the GPU's free memory" if explicit else "its budget"
    if explicit and room > 0:
        fix = (f"lower kv_cache_memory_bytes to at most {room} bytes (or leave it unset: the "
               "KV slots are then sized from gpu_memory_utilization), or lower")
    else:
        where += " even without KV slots"
        fix = "lower"
    raise ValueError(f"The device memory plan ({plan.describe()}) exceeds {where}: {fix} "
                     "what else it counts: kv_offloading_size (the summaries of every host "
                     "page stay in HBM), max_num_seqs or max_model_len (metadata, graph "
                     "pool), or set cudagraph_mode FULL_DECODE_ONLY (no prefill graphs: the "
                     "default FULL adds their pool) or enforce_eager (no CUDA graph pool).")


def report_reserved(plan: MemoryPlan | None, device) -> None:
    """On a GPU, once the worker has built everything (weights, KV, summaries, metadata, graph
    pools, cached warm-up transients): what torch's allocator holds against the plan the KV
    slots were sized with — logged, as a warning when it is over."""
    import torch

    if plan is None or torch.device(device).type != "cuda":
        return
    held = torch.cuda.memory_reserved(device)
    log = logger.warning if held > plan.total else logger.info
    log("device memory after start-up: %.2f GiB reserved by torch of the %.2f GiB planned "
        "(memory plan per rank)", held / 2**30, plan.total / 2**30)
