"""Step outputs across the engine process boundary as deltas.

A `RequestOutput` is cumulative: every step's output of a request repeats its prompt ids, all
tokens, all text and all logprobs so far. Pickled whole each step that is quadratic in the
output length (and a 128k-token prompt per request per step), so the engine process sends only
what is new (`DeltaEncoder.encode`) and the front end rebuilds the cumulative output
(`DeltaAssembler.apply`). The rebuilt output equals the engine's, field for field.

Text is sent as (characters kept, characters added): the engine may cut back text it already
returned (a stop string found across tokens), so a delta can shorten it.

Both sides keep per-request state until the request's finished output went through; the
front end also drops it when it aborts a request (`drop`).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Optional

from sparseserve.outputs import CompletionOutput, RequestOutput


@dataclass
class _Sent:
    tokens: dict[int, int] = field(default_factory=dict)  # choice index -> tokens sent
    chars: dict[int, int] = field(default_factory=dict)   # choice index -> text length sent
    texts: dict[int, str] = field(default_factory=dict)   # choice index -> text sent
    prompt_logprobs: bool = False


class DeltaEncoder:
    """Engine side: `encode(out)` -> a picklable tuple holding only what `out` adds."""

    def __init__(self) -> None:
        self._sent: dict[str, _Sent] = {}

    def encode(self, out: RequestOutput) -> tuple:
        first = out.request_id not in self._sent
        sent = self._sent.setdefault(out.request_id, _Sent())
        choices = []
        for o in out.outputs:
            start = sent.tokens.get(o.index, 0)
            prev = sent.texts.get(o.index, "")
            keep = len(prev) if o.text.startswith(prev) else len(os.path.commonprefix([prev, o.text]))
            choices.append((o.index, o.token_ids[start:], keep, o.text[keep:],
                            None if o.logprobs is None else o.logprobs[start:],
                            o.cumulative_logprob, o.finish_reason, o.stop_reason))
            sent.tokens[o.index] = len(o.token_ids)
            sent.texts[o.index] = o.text
        plp = None
        if out.prompt_logprobs is not None and not sent.prompt_logprobs:
            plp, sent.prompt_logprobs = out.prompt_logprobs, True
        if out.finished:
            del self._sent[out.request_id]
        prompt = (out.prompt, out.prompt_token_ids) if first else None  # sent once
        return (out.request_id, prompt, choices, out.finished, out.metrics, out.new_token_times, plp)

    def drop(self, request_id: str) -> None:
        self._sent.pop(request_id, None)


class DeltaAssembler:
    """Front-end side: `apply(delta)` -> the cumulative RequestOutput the engine produced.

    Call it only for requests still wanted (the front end checks its routes first), so a late
    delta of an aborted request creates no state."""

    def __init__(self) -> None:
        self._state: dict[str, dict[str, Any]] = {}

    def apply(self, delta: tuple) -> Optional[RequestOutput]:
        """None for a request whose first delta was never applied."""
        rid, prompt, choices, finished, metrics, times, plp = delta
        if prompt is not None:  # the request's first output
            self._state[rid] = {"prompt": prompt, "choices": {}, "prompt_logprobs": None}
        st = self._state.get(rid)
        if st is None:
            return None
        if plp is not None:
            st["prompt_logprobs"] = plp
        outs = []
        for index, new_ids, keep, add, new_lps, cum, reason, stop_reason in choices:
            ids, text, lps = st["choices"].get(index, ([], "", None))
            ids = ids + new_ids  # new lists: outputs handed out earlier never change
            text = text[:keep] + add
            if new_lps is not None:
                lps = (lps or []) + new_lps
            st["choices"][index] = (ids, text, lps)
            outs.append(CompletionOutput(index=index, text=text, token_ids=ids,
                                         cumulative_logprob=cum, logprobs=lps,
                                         finish_reason=reason, stop_reason=stop_reason))
        if finished:
            del self._state[rid]
        text, ids = st["prompt"]
        return RequestOutput(rid, text, ids, outs, finished=finished,
                             metrics=metrics, new_token_times=times,
                             prompt_logprobs=st["prompt_logprobs"])

    def drop(self, request_id: str) -> None:
        self._state.pop(request_id, None)

