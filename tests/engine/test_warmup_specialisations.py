"""The start-up warm-up compiles what serving runs: after `warm_up`, a serving workload (odd
prompt lengths 1..130, staggered arrivals, hybrid steps with 1..8 decode rows, chunked and
layer-segmented prefill, eviction under offload) launches no Triton kernel in a
specialisation the warm-up did not launch. On a GPU each such launch is a compile of 0.2-1 s
that a user's request waits for (the H200's HTTP TTFT stall, serving.md twentieth session).

The keys are the CUDA launcher's own (`kernels/specialisations.py`: Triton's
`native_specialize_impl` on the launch's arguments, computed under the interpreter). Every
kernel the GPU engine runs through `kernels.resolve_backend` runs as Triton here (page
summaries and selection, slot stores, fused retrieve, residency index, paged prefill, the
fused decoder-layer ops), so they are checked on the CPU exactly as they would be
specialised on the H200; decode attention keeps the CPU path
(tests/kernels/test_specialisations.py covers eager decode).

The `-split-hybrid` configuration runs a step as the GPU runs it with decode CUDA graphs:
the decode rows first, as their own batch (`EagerDecodeGraphs`: the captured forward, run
eagerly; what it launches counts as compiled, as on the GPU at capture), then the prefill
work in a context without decode rows, which maps each prefill's pages in every layer of its
segment at once (`TwoTierCache.map_prefill_layers`). The other configurations run a hybrid
step in one context (each layer's mapping beside that layer's decode retrieve), as the GPU
does only without decode graphs."""
import random

import pytest

import sparseserve.kernels
import sparseserve.kernels.residency_hash
from sparseserve import LLM, SamplingParams
from sparseserve.engine.warmup import warm_up
from sparseserve.kernels.specialisations import SpecialisationLog, describe_difference
from sparseserve.worker.cuda_graphs import DecodeGraphs
from sparseserve.worker.forward_context import ForwardContext

pytestmark = pytest.mark.cpu_only("records launches in Triton's interpreter; on a GPU the "
                                  "compile watch counts real compiles")

PAGE_BYTES = 2 * 3 * 16 * 16 * 4  # K+V, 3 layers, page_size 16, head_dim 16, fp32 (llama-gqa)
OFFLOAD = dict(sparse_algorithm="arkvale", token_budget=64, sink_pages=1, local_pages=1,
               kv_offload=True, kv_offloading_size=800 * PAGE_BYTES / 2**30)
CONFIGS = {
    # 32 device slots, the least a 256-token prompt's prefill needs: decode evicts and loads
    "offload-evicting-chunked": dict(OFFLOAD, kv_cache_memory_bytes=32 * PAGE_BYTES,
                                     max_num_batched_tokens=13),
    # the sparseserve preset's transfers: FlashH2D loads, GPU-direct saves
    "offload-layer-segmented": dict(OFFLOAD, kv_cache_memory_bytes=64 * PAGE_BYTES,
                                    max_num_batched_tokens=64, max_inject_tokens=100,
                                    h2d_method="flash", d2h_method="gpu-direct"),
    "dense-chunked": dict(max_num_batched_tokens=40),
    # the H200 serving run's shape (the sparseserve preset at max_num_batched_tokens 4096):
    # the injection budget (budget x layers) is far beyond the warm-up's prompts, so each of
    # them prefills in one segment from layer 0, while served prompts that share a step's
    # budget are split into segments that start at other layers; decode rows as a graph
    "offload-layer-segmented-split-hybrid": dict(
        OFFLOAD, kv_cache_memory_bytes=64 * PAGE_BYTES, max_num_batched_tokens=128,
        layer_segmented_prefill=True, h2d_method="flash", d2h_method="gpu-direct"),
}
SPLIT_HYBRID = {"offload-layer-segmented-split-hybrid"}
LENGTHS = [1, 17, 54, 97, 130, 33, 64, 5]
ARRIVALS = {0: [0, 1], 2: [2], 5: [3, 4], 9: [5, 6, 7]}  # step -> requests added before it
# split-hybrid: two prompts arrive while one decodes and share a step's injection budget: the
# second's first segment ends before the last layer, and both continue in the next step
# from layers 1 and 2 beside the decode row; then two more prompts prefill together beside
# decode rows
WORKLOADS = {"offload-layer-segmented-split-hybrid": (
    [40, 130, 97, 77, 33], {0: [0], 2: [1, 2], 4: [3, 4]})}


class EagerDecodeGraphs(DecodeGraphs):
    """The runner's decode CUDA graphs on the CPU: a decode batch is staged and padded to its
    bucket as for a replay, and the captured forward (`_forward`) runs eagerly. `captured`
    records its launches: on the GPU every one of them was compiled at capture (a graph's
    launches depend on its bucket, variant and layer only, and every bucket is captured at
    start-up), so serving may launch them whatever the warm-up ran."""

    def __init__(self, runner, max_batch: int) -> None:
        super().__init__(runner, max_batch)
        self.captured = SpecialisationLog()

    def run(self, input_ids, positions, rows, fills=True):
        b = self.stage(input_ids, positions, rows)
        with self.captured:  # inside the test's log: recorded by both
            logits = self._forward(b, fills or len(self.variants) == 1)
        return logits[:input_ids.shape[0]]


@pytest.fixture(scope="module")
def model_dir(tiny_model_dirs):
    return tiny_model_dirs["llama-gqa"][0]


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_serving_launches_only_what_the_warm_up_launched(model_dir, config, monkeypatch):
    # the GPU's kernel choices on CPU tensors (Triton's interpreter)
    monkeypatch.setattr(ForwardContext, "paged_prefill_kernel", True)
    resolve = sparseserve.kernels.resolve_backend
    monkeypatch.setattr(sparseserve.kernels, "resolve_backend",
                        lambda b, t: "triton" if b in (None, "auto") else resolve(b, t))
    monkeypatch.setattr(sparseserve.kernels.residency_hash, "_backend",
                        lambda t, b: "triton" if b in (None, "auto") else b)
    llm = LLM(model_dir, page_size=16, max_num_seqs=12, max_model_len=256, device="cpu",
              **CONFIGS[config])
    eng = llm.engine
    offload = eng.runner.offload
    if offload is not None:
        offload.fused = True  # the GPU's retrieve kernels
    eng.runner.model.fused_ops = True  # and its fused norm / RoPE / SiLU kernels
    rng = random.Random(0)
    lengths, arrivals = WORKLOADS.get(config, (LENGTHS, ARRIVALS))
    steps_seen = []  # (decode rows, prefill chunks, their first layers) of each serving step
    schedule = eng.scheduler.schedule

    def recording_schedule():
        out = schedule()
        prefills = [c for c in out.chunks if not c.is_decode]
        steps_seen.append((len(out.chunks) - len(prefills), len(prefills),
                           {c.layer_start for c in prefills}))
        return out

    with SpecialisationLog() as log:
        if config in SPLIT_HYBRID:
            eng.runner.graphs = EagerDecodeGraphs(eng.runner, eng.config.scheduler.max_num_seqs)
        warm_up(eng)
        warmed = {k: set(v) for k, v in log.keys.items()}
        log.mark()
        eng.scheduler.schedule = recording_schedule
        steps = 0
        while steps <= max(arrivals) or eng.has_unfinished_requests():
            for i in arrivals.get(steps, []):
                ids = [rng.randrange(3, 300) for _ in range(lengths[i])]
                eng.add_request(str(i), {"prompt_token_ids": ids},
                                SamplingParams(temperature=0.0, max_tokens=4 + 2 * i,
                                               ignore_eos=True))
            eng.step()
            steps += 1
            assert steps < 600
        new = log.new_since_mark()
    if config in SPLIT_HYBRID:
        # what the decode graphs launch, the GPU compiled at capture
        captured = eng.runner.graphs.captured.keys
        new = {k: [key for key in keys if key not in captured.get(k, set())]
               for k, keys in new.items()}
        new = {k: keys for k, keys in new.items() if keys}
        # the steps this configuration is for: prompts prefilled together beside decode rows,
        # and segments that start at an odd layer. (No prompt is chunked, the budget being
        # beyond them: no chunk continues a prefix, in the warm-up or serving.)
        assert any(nd and n >= 2 for nd, n, _ in steps_seen)
        assert any(l0 % 2 for _, _, starts in steps_seen for l0 in starts)
    else:
        assert "_paged_prefill_kernel" in warmed  # a chunk continuing a prefix ran in the warm-up
    if offload is not None:
        assert {"_probe_kernel", "_assign_kernel", "_rebuild_kernel", "_page_select_kernel",
                "_page_summary_kernel", "_store_kernel", "_store_rows_kernel",
                "_flash_h2d_kernel"} <= warmed.keys()
        if config == "offload-layer-segmented":
            assert "_gpu_direct_kernel" in warmed
        offload.check_invariants()
    if config == "offload-evicting-chunked":
        assert eng.get_stats()["pages_loaded_total"] > 0  # serving really evicted and loaded
    assert not new, "; ".join(f"{k}: {describe_difference(key, warmed.get(k, set()))}"
                              for k, keys in new.items() for key in keys)
