"""The memory plan's token bound of one step (engine/memory_plan.py step_tokens) holds for
what the scheduler really puts in a step: decode rows and chunks within the token budget, and
with layer-segmented prefill the segments' prompt tokens — which the plan counted as if a step
held only max_num_batched_tokens (a 33k-token LWM-7B segment is 16x that) — and the hidden
states that prompts between their segments keep (worker/model_runner.py saved_hidden)."""
import random

import pytest

from sparseserve.config import CacheConfig, SchedulerConfig
from sparseserve.engine.memory_plan import segment_hidden_tokens, step_tokens
from sparseserve.engine.scheduler import Scheduler
from sparseserve.request import Request, RequestStatus, SamplingParams

LAYERS = 32


@pytest.mark.parametrize("limit, seed", [(None, 0), (2500, 1), (9000, 2), (60000, 3)])
def test_steps_stay_within_the_plans_token_bound(limit, seed):
    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512, max_model_len=8192,
                          max_inject_tokens=limit)
    sched = Scheduler(cfg, CacheConfig(page_size=16, num_pages=1 << 16), LAYERS, 2)
    rng = random.Random(seed)
    lengths = [rng.choice([1, 17, 54, 97, 1000, 4097, 8100]) for _ in range(24)]
    reqs = [Request(f"r{i}", list(range(3, 3 + n)), SamplingParams(max_tokens=3), max_tokens=3)
            for i, n in enumerate(lengths)]
    for r in reqs[:12]:
        sched.add_request(r)
    most, most_held = 0, 0
    for step in range(2000):
        if step == 5:
            for r in reqs[12:]:  # arrivals while segments are in flight
                sched.add_request(r)
        if not sched.has_unfinished():
            break
        out = sched.schedule()
        tokens = sum(c.num_tokens for c in out.chunks)
        most = max(most, tokens)
        assert tokens <= step_tokens(cfg)
        sched.update_after_step(out)
        for c in out.chunks:
            if c.sample:
                r = sched.requests[c.request_id]
                r.output_token_ids.append(5)
                if len(r.output_token_ids) >= r.max_tokens:
                    sched.finish(r, RequestStatus.FINISHED_LENGTH)
        # prompts between segments keep their segment's hidden states until the next one
        held = sum(sched._segment_tokens[r.request_id] for r in sched.running
                   if r.prefill_layer > 0)
        most_held = max(most_held, held)
        assert held <= segment_hidden_tokens(cfg)
    else:
        raise AssertionError("did not finish")
    if limit is not None and limit > 2 * cfg.max_num_batched_tokens:
        assert most > cfg.max_num_batched_tokens  # the old plan's bound was exceeded
    if limit is None:
        assert segment_hidden_tokens(cfg) == 0 and step_tokens(cfg) == 512 and most_held == 0
    else:
        assert most_held > 0  # prompts did wait between segments
