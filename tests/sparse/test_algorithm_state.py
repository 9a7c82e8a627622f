"""No sparse algorithm (nor the two-tier cache, the page directory, RoPE) keeps a tensor across
calls that a later call replaces.

A decode step captured in a CUDA graph holds the addresses of every tensor it touched; if an
algorithm caches a buffer (keyed by shape, say) and a later call of another size swaps it for
a new one, the old buffer returns to the allocator while the graph keeps writing into it —
the two-tier decode's illegal-address fault on the H200 came from ArkVale's radius scratch,
replaced whenever the offloaded scratch table changed size. Here every registered algorithm
runs the offloaded engine (index and select at many sizes: prefill chunks, decode batches,
forced evictions); the tensors reachable from the algorithm object must be the same objects
at the same addresses before and after."""
import pytest
import torch

from sparseserve import LLM, SamplingParams
from sparseserve.sparse import available_algorithms

ALGOS = [a for a in available_algorithms() if a != "dense"]


def tensors_of(obj, path="algo", seen=None, out=None):
    """{attribute path: (data_ptr, shape)} of every tensor reachable from obj's attributes
    (through dicts, lists and tuples)."""
    seen = set() if seen is None else seen
    out = {} if out is None else out
    if id(obj) in seen:
        return out
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        out[path] = (obj.data_ptr(), tuple(obj.shape))
    elif isinstance(obj, dict):
        for k, v in obj.items():
            tensors_of(v, f"{path}[{k!r}]", seen, out)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            tensors_of(v, f"{path}[{i}]", seen, out)
    elif hasattr(obj, "__dict__") and not isinstance(obj, type):
        for k, v in vars(obj).items():
            tensors_of(v, f"{path}.{k}", seen, out)
    return out


@pytest.mark.parametrize("algo", ALGOS)
def test_algorithm_state_survives_calls_of_every_size(tiny_model_dirs, algo):
    path, _ = tiny_model_dirs["llama-gqa"]
    page_bytes = 2 * 3 * 16 * 16 * 4  # K + V of one page: 3 layers, 16 tokens, head_dim 16
    # the oracle reads every key, so it cannot offload: it runs all-resident
    tiers = dict(kv_cache_memory_bytes=400 * page_bytes) if algo == "oracle" else dict(
        kv_offload=True, kv_cache_memory_bytes=32 * page_bytes,
        kv_offloading_size=200 * page_bytes / 2**30)
    llm = LLM(path, device="cpu", dtype="float32", page_size=16, sparse_algorithm=algo,
              token_budget=64, sink_pages=1, local_pages=1, max_num_seqs=4,
              max_model_len=256, max_num_batched_tokens=48, **tiers)
    runner = llm.engine.runner
    # what a captured decode step can reach besides the algorithm: the two-tier cache, the
    # page directory, the RoPE table (the model's weights are parameters, never replaced)
    reach = {"algorithm": runner.sparse.algorithm, "cache": runner.offload,
             "pages": runner.pages, "rope": runner.model.rope}
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    llm.generate([{"prompt_token_ids": [5 + i % 300 for i in range(40)]}], params,
                 use_tqdm=False)
    before = {k: tensors_of(v) for k, v in reach.items()}
    prompts = [[7 + (i * k) % 300 for i in range(n)] for k, n in
               ((1, 1), (3, 17), (5, 54), (7, 97), (11, 130))]
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    if algo not in ("oracle", "streaming"):  # streaming reads only sinks and recent pages
        assert llm.engine.get_stats()["cache_misses_total"] > 0  # evictions happened
    after = {k: tensors_of(v) for k, v in reach.items()}
    for k in reach:
        assert after[k] == before[k], k
