"""The output side of an LLMEngine step (a mixin of LLMEngine): append each finished step's
tokens to their requests — stop strings, stop tokens, EOS, grammars, lengths — and build the
RequestOutput of every user request the step touched (n > 1 children gathered under their
parent, logprobs decoded, per-request metrics).

Uses the engine's scheduler, executor, tokenizer, grammars, _parents / _child_parent (the
user requests and each child's parent id), step_count and last_step_host_time_s.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from sparseserve.engine.detokenizer import IncrementalDetokenizer
from sparseserve.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from sparseserve.request import Request, RequestOutputKind, RequestStatus


@dataclass
class ParentRequest:
    """A user request; with n > 1 it fans out into n child requests."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[Request]
    detok: dict[str, IncrementalDetokenizer] = field(default_factory=dict)
    # per child, built incrementally (each step adds only its new tokens: rebuilding every
    # token's entries each step made a step's output side quadratic in the output length)
    logprob_rows: dict[str, list[dict[int, Logprob]]] = field(default_factory=dict)
    cumulative_logprob: dict[str, tuple[int, float]] = field(default_factory=dict)  # (tokens summed, sum)
    prompt_logprobs: list[Any] | None = None  # RequestOutput.prompt_logprobs, once complete

    @property
    def final_only(self) -> bool:
        return self.children[0].sampling_params.output_kind == RequestOutputKind.FINAL_ONLY


class OutputProcessing:
    def _take_outputs(self, out, res) -> list[RequestOutput]:
        """Append a finished step's tokens to its requests (stops, lengths) and build the
        outputs of the requests it touched."""
        sched = self.scheduler
        self.last_step_host_time_s = res.host_time_s
        self.step_count += 1
        now = time.time()
        touched: dict[str, list[float]] = {}
        for rid, (first, entries) in res.prompt_logprobs.items():
            req = sched.requests.get(rid)
            if req is not None and req.prompt_logprobs:
                req.prompt_logprobs[first:first + len(entries)] = entries
        for chunk in out.chunks:
            req = sched.requests.get(chunk.request_id)
            tok = res.token_ids.get(chunk.request_id)
            if req is None or tok is None or req.is_finished:
                continue
            self._append_token(req, tok, res.logprobs.get(req.request_id), now)
            touched.setdefault(self._child_parent[req.request_id], []).append(now)
        self.executor.release(*sched.take_freed())  # finished requests leave the worker now
        outputs = []
        for pid, times in touched.items():
            parent = self._parents[pid]
            if parent.final_only and not all(r.is_finished for r in parent.children):
                continue  # RequestOutputKind.FINAL_ONLY: nothing is built until it finishes
            ro = self._make_output(parent, times)
            outputs.append(ro)
            if ro.finished:
                del self._parents[pid]
                for req in parent.children:
                    self._child_parent.pop(req.request_id, None)
                    self.grammars.pop(req.request_id, None)
        return outputs

    def _append_token(self, req: Request, tok: int, logprobs, now: float) -> None:
        req.output_token_ids.append(tok)
        if logprobs is not None:
            req.logprobs.append(logprobs)
        if req.first_token_time is None:
            req.first_token_time = now
        req.last_token_time = now
        parent = self._parents[self._child_parent[req.request_id]]
        detok = parent.detok[req.request_id]
        detok.add(tok)
        params = req.sampling_params
        n_out = len(req.output_token_ids)
        status = None
        grammar = self.grammars.get(req.request_id)
        if grammar is not None:
            grammar.consume_token(tok)  # the mask allowed only tokens it accepts
        if detok.stopped_by is not None:
            status, req.stop_reason = RequestStatus.FINISHED_STOPPED, detok.stopped_by
        elif n_out >= params.min_tokens and tok in params.stop_token_ids:
            status, req.stop_reason = RequestStatus.FINISHED_STOPPED, tok
        elif n_out >= params.min_tokens and not params.ignore_eos and tok in req.eos_token_ids:
            status = RequestStatus.FINISHED_STOPPED  # stop_reason None on EOS, as in vLLM
        # the grammar cannot go on: it ends the request, even before min_tokens (the output
        # stays valid for its grammar; worker/min_tokens.py)
        elif grammar is not None and grammar.is_stopped():
            status = RequestStatus.FINISHED_STOPPED
        elif n_out >= req.max_tokens:
            status = RequestStatus.FINISHED_LENGTH
        if status is not None:
            self.grammars.pop(req.request_id, None)
            detok.flush()
            req.finished_time = now
            self.scheduler.finish(req, status)

    def _make_output(self, parent: ParentRequest, times: list[float]) -> RequestOutput:
        outs = []
        for i, req in enumerate(parent.children):
            detok = parent.detok[req.request_id]
            text = detok.text
            ids = list(req.output_token_ids)
            lps = None
            if req.sampling_params.logprobs is not None:
                rows = parent.logprob_rows.setdefault(req.request_id, [])
                rows.extend({t: Logprob(lp, rank, self._decode_one(t)) for t, (lp, rank) in d.items()}
                            for d in req.logprobs[len(rows):])
                lps = list(rows)  # a copy: the consumer's list must not grow under it
            cum = self._cumulative_logprob(parent, req) if req.logprobs else None
            outs.append(CompletionOutput(index=i, text=text, token_ids=ids,
                                         cumulative_logprob=cum, logprobs=lps,
                                         finish_reason=req.finish_reason,
                                         stop_reason=req.stop_reason))
        first = parent.children[0]
        if parent.prompt_logprobs is None and first.prompt_logprobs and first.output_token_ids:
            parent.prompt_logprobs = [None] + [
                {t: Logprob(lp, rank, self._decode_one(t)) for t, (lp, rank) in d.items()}
                if d is not None else None for d in first.prompt_logprobs[1:]]
        metrics = RequestMetrics(
            arrival_time=first.arrival_time,
            first_scheduled_time=min((r.first_scheduled_time for r in parent.children
                                      if r.first_scheduled_time), default=None),
            first_token_time=min((r.first_token_time for r in parent.children
                                  if r.first_token_time), default=None),
            last_token_time=max((r.last_token_time or 0 for r in parent.children), default=None),
            finished_time=max((r.finished_time or 0 for r in parent.children), default=None),
            num_preemptions=sum(r.num_preemptions for r in parent.children))
        finished = all(r.is_finished for r in parent.children)
        return RequestOutput(parent.request_id, parent.prompt, parent.prompt_token_ids, outs,
                             finished=finished, metrics=metrics, new_token_times=times,
                             prompt_logprobs=parent.prompt_logprobs)

    @staticmethod
    def _cumulative_logprob(parent: ParentRequest, req: Request) -> float:
        """Sum of the sampled tokens' logprobs, adding only the tokens new since the last call
        (left to right, so the same float as summing the whole list)."""
        done, total = parent.cumulative_logprob.get(req.request_id, (0, 0))
        ids = req.output_token_ids
        end = min(len(ids), len(req.logprobs))
        for d, t in zip(req.logprobs[done:end], ids[done:end]):
            total += d[t][0]
        parent.cumulative_logprob[req.request_id] = (end, total)
        return total

    def _decode_one(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode([token_id])

