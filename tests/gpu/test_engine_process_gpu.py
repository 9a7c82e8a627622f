"""The server's engine process on a GPU: spawned with CUDA (the front end never touches the
device), it serves the sparseserve preset (two-tier cache, CUDA graphs) with the greedy tokens
of the same engine stepped in this process, and leaves no page behind."""
import asyncio

import pytest
import torch

from sparseserve import SamplingParams
from sparseserve.engine.args import EngineArgs
from sparseserve.engine.llm_engine import LLMEngine
from sparseserve.server.async_engine import AsyncLLMEngine

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

PAGE_BYTES = 2 * 3 * 16 * 16 * 2  # K + V, 3 layers, 16 tokens, 16 head dims, bf16 (per KV head)
LENGTHS = (1, 17, 54, 97)


def free_and_total(engine) -> tuple[int, int]:
    return engine.num_free_pages(), engine.num_total_pages()


def test_engine_process_on_the_gpu_equals_the_engine_in_this_process(tiny_model_dirs):
    path, _ = tiny_model_dirs["llama-gqa"]
    args = EngineArgs(model=path, device="cuda", dtype="bfloat16", page_size=16,
                      preset="sparseserve", token_budget=64, sink_pages=1, local_pages=1,
                      max_num_seqs=8, max_model_len=320, kv_cache_memory_bytes=48 * PAGE_BYTES,
                      kv_offloading_size=400 * PAGE_BYTES / 2**30, max_num_batched_tokens=48)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = [[3 + (j * (i + 1)) % 300 for j in range(n)] for i, n in enumerate(LENGTHS)]
    ref = LLMEngine.from_engine_args(args)
    for i, ids in enumerate(prompts):
        ref.add_request(f"g{i}", {"prompt_token_ids": ids}, params)
    want = {}
    while ref.has_unfinished_requests():
        for out in ref.step():
            if out.finished:
                want[out.request_id] = out.outputs[0].token_ids
    ref.shutdown()
    del ref
    torch.cuda.empty_cache()

    aeng = AsyncLLMEngine.in_engine_process(args).start()
    try:
        async def run():
            async def one(i, ids):
                stream = await aeng.submit([(f"g{i}", {"prompt_token_ids": ids})], params)
                last = None
                async with stream:
                    async for _, out in stream:
                        last = out
                return last
            outs = await asyncio.gather(*(one(i, ids) for i, ids in enumerate(prompts)))
            return outs, await aeng.call(free_and_total)

        outs, (free, total) = asyncio.run(run())
    finally:
        aeng.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == [want[f"g{i}"] for i in range(len(prompts))]
    assert free == total
    assert aeng._loop.proc.exitcode == 0
