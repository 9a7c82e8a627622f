"""The sampling part of a ModelRunner step (a mixin of ModelRunner): sample the step's logits,
start copying the tokens (and logprobs, working sets) to the host (`_sample_launch`), read
them (`_sample_finish`); `_sample` does both (the synchronous step). Also what the sampler
needs per step from the host: the penalties' token feed and the logprobs' collection.

Uses the runner's row_params, row_stop_ids, grammars, sampler, offload, keep_logits and the
last sampled tokens (_last_tokens / _last_index: the inputs of async scheduling's pending
decode rows, pending_step.py).
"""
from __future__ import annotations

import dataclasses
import time

import torch

from sparseserve.engine.sched_output import ScheduledChunk
from sparseserve.worker.pending_step import PendingStep, RunnerOutput, start_host_copy
from sparseserve.worker.sampler import SamplingBatch


class SamplingStep:
    def _sample(self, chunks: list[ScheduledChunk], logits: torch.Tensor,
                t0: float) -> RunnerOutput:
        """logits [N, vocab] fp32: one row per chunk with `sample`, in chunk order."""
        return self._sample_finish(self._sample_launch(chunks, logits, t0))

    def _sample_launch(self, chunks: list[ScheduledChunk], logits: torch.Tensor,
                       t0: float) -> PendingStep:
        """Sample and start copying the tokens (and working sets) to the host."""
        sampling = [c for c in chunks if c.sample]
        result = RunnerOutput(logits=logits if self.keep_logits else None)
        params = [self.row_params[c.row] for c in sampling]
        stop_ids = None
        if self.row_stop_ids:  # rows below min_tokens may not pick a stop token yet
            stop_ids = [self.row_stop_ids.get(c.row, ()) if c.num_output_tokens < p.min_tokens
                        else () for c, p in zip(sampling, params)]
        batch = SamplingBatch(params=params,
                              num_output_tokens=[c.num_output_tokens for c in sampling],
                              rows=[c.row for c in sampling],
                              grammars=[self.grammars.get(c.request_id) for c in sampling]
                              if self.grammars else None,
                              stop_ids=stop_ids)
        s = self.sampler(logits, batch)
        ws = None
        if self.offload is not None:  # lands with the token copy: no extra sync
            ws = self.offload.count_working_sets()
        names = ("token_ids", "top_logprobs", "top_ids", "sampled_logprob", "sampled_rank")
        hosts, event = start_host_copy([getattr(s, n) for n in names])
        # the next launch's pending decode inputs (async scheduling) are these tokens
        self._last_tokens = s.token_ids
        self._last_index = {c.request_id: i for i, c in enumerate(sampling)}
        result.host_time_s = time.perf_counter() - t0
        return PendingStep(result=result, sampling=sampling, batch=batch,
                           sampled=dataclasses.replace(s, **dict(zip(names, hosts))),
                           event=event, working_sets=ws)

    def _sample_finish(self, p: PendingStep) -> RunnerOutput:
        """The launched step's tokens (the step's one host sync), working sets, logprobs."""
        result, sampling = p.result, p.sampling
        tokens = p.tokens()
        if p.working_sets is not None:
            result.working_sets = p.working_sets.numpy().copy()
        for c, tok in zip(sampling, tokens):
            result.token_ids[c.request_id] = tok
        if p.sampled.sampled_logprob is not None:
            self._collect_logprobs(result, sampling, p.batch, p.sampled)
        return result

    def _feed_penalties(self, chunks: list[ScheduledChunk]) -> None:
        """Tokens entering the KV of requests with penalties (once per chunk: layer_start 0)."""
        fed = [(c.row, c.request_id, c.token_ids) for c in chunks
               if c.layer_start == 0 and self.row_params[c.row].has_penalties]
        if fed:
            self.sampler.feed(fed, self.cfg.model.vocab_size)

    @staticmethod
    def _collect_logprobs(result: RunnerOutput, sampling, batch: SamplingBatch, s) -> None:
        lp = s.sampled_logprob.tolist()
        rank = s.sampled_rank.tolist()
        top_lp = s.top_logprobs.tolist() if s.top_logprobs is not None else None
        top_id = s.top_ids.tolist() if s.top_ids is not None else None
        for i, (c, params) in enumerate(zip(sampling, batch.params)):
            if params.logprobs is None:
                continue
            entry = {}
            for j in range(params.logprobs):
                entry[top_id[i][j]] = (top_lp[i][j], j + 1)
            entry[result.token_ids[c.request_id]] = (lp[i], rank[i])
            result.logprobs[c.request_id] = entry
