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

import dataclasses
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


def continued_prompt_len(page_size: int, max_model_len: int, decode_tokens: int,
                         chunk_tokens: int, cache_tokens: int) -> int:
    """A prompt of whole pages longer than one prefill chunk of `chunk_tokens`
    (max_num_batched_tokens, or max_inject_tokens under layer-segmented prefill, which chunks
    a prompt to it): its second chunk continues a prefix, the paged prefill kernel's only
    path, which short prompts never reach (on the H200 its first compile cost a user's
    request 0.9 s: serving.md, twentieth session). When that exceeds a quarter of the cache's
    `cache_tokens` or max_model_len less room for `decode_tokens` (layer-segmented prefill's
    budget is usually beyond both), two pages instead: no served prompt continues a prefix
    below that either, so a long warm-up prefill would buy nothing."""
    room = max_model_len - decode_tokens - 1
    n = max(2, chunk_tokens // page_size + 1) * page_size
    if n > min(cache_tokens // 4, room):  # no prompt continues a prefix: no long prefill
        n = 2 * page_size
    return max(1, min(n, room))


def warm_up(engine, decode_tokens: int = 4, max_steps: int = 10_000) -> float:
    """Run the warm-up on `engine` (an LLMEngine with no requests); -> seconds it took.

    Three phases, each started when the previous one's requests produced their first token:
    prompt A alone (a prefill-only step, then decode); prompt B, longer than a prefill chunk,
    while A decodes (hybrid steps: one decode row beside a prefill, then beside a chunk that
    continues B's prefix); then, when max_num_seqs allows, two prompts together while
    A and B decode (two decode rows beside two prefill chunks: Triton specialises integer
    arguments on == 1, so a batch of one row does not compile the kernels of a batch of two).
    A and B then stop (aborted), the last two finish. Raises if the engine cannot serve them:
    a cache too small for a few short prompts cannot serve users.

    Under layer-segmented prefill A's prefill takes two steps: its first layer alone (the
    injection budget lowered to A for that step), then its other layers, a segment from
    layer 1. A prefill maps its pages in every layer of its segment at once
    (TwoTierCache.map_prefill_layers) through the rows of the per-layer slot arrays from the
    segment's first layer on; with an even slot count (40,960 at 20 GiB of Llama-3-8B KV) a
    row of slots + 1 int64 entries is an odd count, so the 16-byte alignment of the first
    row alternates with the layer, and the retrieve kernels are specialised on it. Served
    prompts that share a step's injection budget start segments at any layer, while the
    warm-up's short prompts otherwise all start at layer 0
    (on the H200 the sparseserve preset at max_num_batched_tokens 4096 compiled
    _probe_kernel and _assign_kernel mid-serving for it)."""
    if engine.has_unfinished_requests():
        raise RuntimeError("warm_up runs before the engine takes requests.")
    t0 = time.perf_counter()
    cfg = engine.config
    sc = cfg.scheduler
    lens = warmup_prompt_lens(cfg.cache.page_size, sc.max_model_len, decode_tokens)
    continued = continued_prompt_len(cfg.cache.page_size, sc.max_model_len, decode_tokens,
                                     sc.max_inject_tokens or sc.max_num_batched_tokens,
                                     engine.num_total_pages() // engine.scheduler.kv.num_kv_heads
                                     * cfg.cache.page_size)  # pages are per KV head
    vocab = cfg.model.vocab_size
    together = max(0, min(2, sc.max_num_seqs - 2))  # phase 3's prompts
    # A and B keep decoding through phase 3 (aborted after it); room: prompt + tokens fit
    longest = max(lens + [continued])
    long_tokens = max(decode_tokens, min(decode_tokens + 64, sc.max_model_len - longest))
    phases = [[lens[0]], [continued], [lens[0], lens[-1]][:together]]
    phases = [p for p in phases if p]  # A, B and (when room) the two together
    added: list[str] = []
    seen_token: set[str] = set()
    steps = 0

    def step() -> None:
        nonlocal steps
        if steps == max_steps:
            engine.abort_request(added)
            raise RuntimeError(f"the start-up warm-up did not finish in {max_steps} steps.")
        steps += 1
        seen_token.update(o.request_id for o in engine.step()
                          if o.outputs and o.outputs[0].token_ids)

    for k, phase in enumerate(phases):
        for n in phase:
            i = len(added)
            keeps_decoding = k < 2 and len(phases) == 3
            params = SamplingParams(temperature=0.0, ignore_eos=True,
                                    max_tokens=long_tokens if keeps_decoding else decode_tokens)
            added.append(f"{WARMUP_PREFIX}{i}")
            engine.add_request(added[-1], {"prompt_token_ids": [(7 * t + 3 + i) % vocab
                                                                 for t in range(n)]}, params)
        if k == 0 and sc.max_inject_tokens:
            _first_layer_alone(engine, added[0], phase[0], step)
        while engine.has_unfinished_requests() and not seen_token.issuperset(added):
            step()
    engine.abort_request(added[:2])  # A and B, if still decoding (finished ids are skipped)
    while engine.has_unfinished_requests():
        step()
    took = time.perf_counter() - t0
    logger.info("warm-up: %d prompts (%s tokens) in %d phases, %.2f s", len(added),
                " + ".join("/".join(map(str, p)) for p in phases), len(phases), took)
    return took


def _first_layer_alone(engine, request_id: str, num_tokens: int, step) -> None:
    """Step until request `request_id` (a prompt of `num_tokens`, waiting) ran its first
    layer segment, with the scheduler's injection budget lowered to the prompt: one layer.
    The next step, under the configured budget, runs its other layers from layer 1. A
    configured budget below the prompt is kept (it chunks the prompt to itself, one layer a
    step already): raised to the prompt, the segment's tokens (fixed at its first layer) would
    not fit the configured budget afterwards, and the prompt would never be scheduled again."""
    sched = engine.scheduler
    req = sched.requests[request_id]
    configured = sched.cfg
    sched.cfg = dataclasses.replace(
        configured, max_inject_tokens=min(num_tokens, configured.max_inject_tokens))
    try:
        while req.prefill_layer == 0 and req.num_computed_tokens == 0 and \
                engine.has_unfinished_requests():
            step()
    finally:
        sched.cfg = configured
