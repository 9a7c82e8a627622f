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
(tests/kernels/test_specialisations.py covers eager decode)."""
import random

import pytest

import sparseserve.kernels
import sparseserve.kernels.residency_hash
from sparseserve import LLM, SamplingParams
from sparseserve.engine.warmup import warm_up
from sparseserve.kernels.specialisations import SpecialisationLog, describe_difference
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
}
LENGTHS = [1, 17, 54, 97, 130, 33, 64, 5]
ARRIVALS = {0: [0, 1], 2: [2], 5: [3, 4], 9: [5, 6, 7]}  # step -> requests added before it


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
    with SpecialisationLog() as log:
        warm_up(eng)
        warmed = {k: set(v) for k, v in log.keys.items()}
        log.mark()
        steps = 0
        while steps <= max(ARRIVALS) or eng.has_unfinished_requests():
            for i in ARRIVALS.get(steps, []):
                ids = [rng.randrange(3, 300) for _ in range(LENGTHS[i])]
                eng.add_request(str(i), {"prompt_token_ids": ids},
                                SamplingParams(temperature=0.0, max_tokens=4 + 2 * i,
                                               ignore_eos=True))
            eng.step()
            steps += 1
            assert steps < 600
        new = log.new_since_mark()
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
