"""On a GPU, a decode step of the full system (sparse attention over the two-tier cache:
FlashH2D loads, GPU-direct saves, working-set control, layer-segmented prefill) makes no host
sync before its one token copy: torch's sync debug mode raises on any synchronizing call made
from the start of `ModelRunner.execute` until the step's device work is launched (its
working-set count is the last launch before the token copy). Requests finish while others
decode, so page frees and row releases run inside guarded steps; the device cache is small, so
decode steps load and evict. The guarded run's tokens equal an unguarded run's."""
import pytest
import torch

from sparseserve import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

PAGE_BYTES = 2 * 3 * 16 * 16 * 2  # K + V, 3 layers, 16 tokens, 16 head dims, bf16 (per KV head)


class DecodeSyncGuard:
    """Sync debug mode "error" over each decode-only step's launches (see the module doc)."""

    def __init__(self, runner) -> None:
        self.runner, self.guarded, self.other = runner, 0, 0
        self._execute, self._count = runner.execute, runner.offload.count_working_sets

    def _guarded_execute(self, out):
        if not out.chunks or not all(c.is_decode for c in out.chunks):
            self.other += 1
            return self._execute(out)
        torch.cuda.synchronize()  # earlier steps' work is not this step's to wait for
        self.guarded += 1
        torch.cuda.set_sync_debug_mode("error")
        try:
            return self._execute(out)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    def _count_then_release(self):
        self._count()
        torch.cuda.set_sync_debug_mode("default")  # the token copy comes next: the one sync

    def __enter__(self):
        self.runner.execute = self._guarded_execute
        self.runner.offload.count_working_sets = self._count_then_release
        return self

    def __exit__(self, *exc):
        self.runner.__dict__.pop("execute", None)
        self.runner.offload.__dict__.pop("count_working_sets", None)
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
def test_decode_steps_make_no_host_sync(tiny_model_dirs, eager):
    path, _ = tiny_model_dirs["llama-gqa"]
    kw = dict(device="cuda", dtype="bfloat16", page_size=16, preset="sparseserve",
              token_budget=64, sink_pages=1, local_pages=1, max_num_seqs=8, max_model_len=320,
              kv_cache_memory_bytes=48 * PAGE_BYTES, kv_offloading_size=400 * PAGE_BYTES / 2**30,
              max_num_batched_tokens=48, enforce_eager=eager)
    prompts = [{"prompt_token_ids": [3 + (i * k) % 300 for i in range(n)]}
               for k, n in ((1, 5), (3, 17), (5, 54), (7, 97), (11, 130), (13, 61))]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
              for m in (40, 9, 71, 23, 55, 14)]
    plain = LLM(path, **kw).generate(prompts, params, use_tqdm=False)

    llm = LLM(path, **kw)
    runner = llm.engine.runner
    assert (runner.graphs is None) == eager, runner.graph_error
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # compile and allocate first
    misses = llm.engine.get_stats()["cache_misses_total"]
    with DecodeSyncGuard(runner) as guard:
        outs = llm.generate(prompts, params, use_tqdm=False)
    assert guard.guarded > 40 and guard.other > 0
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    assert llm.engine.get_stats()["cache_misses_total"] > misses  # decode steps loaded pages
    llm.engine.check_invariants()
