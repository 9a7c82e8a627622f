"""Start-up warm-up: a few tiny requests through the real step path before the engine serves.

Why: Triton compiles a kernel the first time it sees a new specialisation (an integer argument
that is 1, or divisible by 16, a 16-byte-aligned pointer, ...). CUDA-graph capture compiles the
decode kernels, but nothing compiled the prefill path's kernels (the fused decoder-layer ops at
prefill token counts, retrieve / summaries / saves of a prefill, the eager part of a hybrid step)
until the first users' prompts did. Measured on the H200 (LWM-7B, `sparseserve` preset, a fresh
machine, 8 LongBench-shaped prompts at 2 req/s over HTTP): mean TTFT 3.97 s on the first pass,
0.32 s and 0.28 s on the next two (docs/results/serving.md, thirteenth session). vLLM runs a
dummy batch at start-up for the same reason.

The warm-up is greedy (the sampler's generator is not drawn from), its requests finish and free
their pages before `warm_up` returns, and the engine's counters it moved are reported so the
server can count from after it (`ServerMetrics.start_from`). It runs by default on CUDA devices
only: on the CPU nothing is compiled at run time (Triton's interpreter is not the engine's path).
"""
from __future__ import annotations

import logging
import time

from sparseserve.request import SamplingParams

logger = logging.getLogger("sparseserve")

WARMUP_PREFIX = "__sparseserve_warmup__"


def warmup_prompt_lens(page_size: int, max_model_len: int, decode_tokens: int) -> list[int]:
    """Two prompt lengths: one not a multiple of 16 and not page-aligned, one a multiple of
    16 that fills its pages (Triton's two integer specialisations besides 1, which decode
    covers), both within max_model_len with room for `decode_tokens`."""
    room = max_model_len - decode_tokens - 1
    lens = [page_size + 5, 2 * page_size]
    return sorted({max(1, min(n, room)) for n in lens})


def warm_up(engine, decode_tokens: int = 4, max_steps: int = 10_000) -> float:
    """Run the warm-up on `engine` (an LLMEngine with no requests); -> seconds it took.

    The first prompt starts alone and decodes; the second arrives while it decodes, so a step
    mixes decode rows (their CUDA graph) with an eager prefill (a hybrid step). Raises if the
    engine cannot serve them: a cache too small for two short prompts cannot serve users."""
    if engine.has_unfinished_requests():
        raise RuntimeError("warm_up runs before the engine takes requests.")
    t0 = time.perf_counter()
    cfg = engine.config
    lens = warmup_prompt_lens(cfg.cache.page_size, cfg.scheduler.max_model_len, decode_tokens)
    vocab = cfg.model.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=decode_tokens, ignore_eos=True)
    ids = [f"{WARMUP_PREFIX}{i}" for i in range(len(lens))]
    prompts = [[(7 * t + 3) % vocab for t in range(n)] for n in lens]
    engine.add_request(ids[0], {"prompt_token_ids": prompts[0]}, params)
    started_second = len(ids) == 1
    for _ in range(max_steps):
        outs = engine.step()
        if not started_second and any(o.request_id == ids[0] and o.outputs[0].token_ids
                                      for o in outs):
            engine.add_request(ids[1], {"prompt_token_ids": prompts[1]}, params)
            started_second = True
        if started_second and not engine.has_unfinished_requests():
            break
    else:
        engine.abort_request(ids)
        raise RuntimeError(f"the start-up warm-up did not finish in {max_steps} steps.")
    took = time.perf_counter() - t0
    logger.info("warm-up: %d prompts (%s tokens) and %d decode steps each in %.2f s",
                len(lens), "/".join(map(str, lens)), decode_tokens, took)
    return took
