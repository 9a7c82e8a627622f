"""On a GPU, `get_stats(fresh=False)` (what the server reads after every step) makes no host
sync, its counters never go back, and once the engine is idle they reach the fresh values
within two reads; `fresh=True` reads the device at once."""
import pytest
import torch

from sparseserve import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

PAGE_BYTES = 2 * 3 * 16 * 16 * 2  # K + V, 3 layers, 16 tokens, 16 head dims, bf16 (per KV head)
TOTALS = ("cache_hits_total", "cache_misses_total", "bytes_loaded_total", "bytes_saved_total",
          "pages_loaded_total", "prefill_cache_hits_total", "prefill_cache_misses_total")


def test_lagged_counters_do_not_sync_and_converge(tiny_model_dirs):
    path, _ = tiny_model_dirs["llama-gqa"]
    llm = LLM(path, device="cuda", dtype="bfloat16", page_size=16, preset="sparseserve",
              token_budget=64, sink_pages=1, local_pages=1, max_num_seqs=8, max_model_len=320,
              kv_cache_memory_bytes=48 * PAGE_BYTES,
              kv_offloading_size=400 * PAGE_BYTES / 2**30, max_num_batched_tokens=48)
    eng = llm.engine
    for i, n in enumerate((17, 97, 130, 54)):
        eng.add_request(str(i), {"prompt_token_ids": [3 + (j * (i + 1)) % 300 for j in range(n)]},
                        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    prev = eng.get_stats()
    reads = 0
    while eng.has_unfinished_requests():
        eng.step()
        torch.cuda.set_sync_debug_mode("error")
        try:
            cur = eng.get_stats(fresh=False)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        reads += 1
        assert all(cur[k] >= prev[k] for k in TOTALS), (prev, cur)
        prev = cur
    assert reads > 40
    torch.cuda.synchronize()
    fresh = eng.get_stats()
    assert fresh["cache_misses_total"] > 0 and fresh["bytes_saved_total"] > 0
    # the fresh read dropped any copy in flight: lagged reads now return at least it
    for _ in range(2):
        lag = eng.get_stats(fresh=False)
        assert all(lag[k] == fresh[k] for k in TOTALS)
    eng.check_invariants()


def test_lagged_reads_rate_limit_their_copies():
    """With min_interval_s, lagged reads build the counters (parts()) at most that often and
    return the last landed copy in between; a fresh read always builds and waits."""
    import time

    from sparseserve.worker.lagged_counters import LaggedCounters

    dev = torch.device("cuda")
    x = torch.zeros(3, dtype=torch.long, device=dev)
    built = []

    def parts():
        built.append(1)
        return [x]
    lag = LaggedCounters(min_interval_s=0.2)
    assert lag.read(parts, dev, fresh=True) == [0, 0, 0] and len(built) == 1
    x += 5
    for _ in range(20):  # inside the interval: no new copy, the fresh values stay
        assert lag.read(parts, dev, fresh=False) == [0, 0, 0]
    assert len(built) == 1
    time.sleep(0.25)
    lag.read(parts, dev, fresh=False)  # starts a copy
    assert len(built) == 2
    torch.cuda.synchronize()
    assert lag.read(parts, dev, fresh=False) == [5, 5, 5]  # the copy landed
    assert lag.read(parts, dev, fresh=True) == [5, 5, 5] and len(built) == 3
