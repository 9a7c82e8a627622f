"""Engine logprobs (`list[dict[token_id, Logprob]]`, one dict per generated token holding the
top-k and the sampled token) -> the two OpenAI shapes:

* completions (legacy): `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`
* chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}`

and `prompt_logprobs_json`: vLLM's `prompt_logprobs` field (completions choices, chat response):
`[null, {"<token id>": {"logprob", "rank", "decoded_token"}}, ...]`.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Optional

Decode = Callable[[int], str]


def _finite(x: float) -> float:
    # JSON has no -inf; OpenAI clients expect a number
    return x if math.isfinite(x) else -9999.0


def _token_str(token_id: int, lp: Any, decode: Decode) -> str:
    s = getattr(lp, "decoded_token", None)
    return s if s is not None else decode(token_id)


def _top(entries: dict[int, Any], k: int) -> list[tuple[int, Any]]:
    ranked = sorted(entries.items(), key=lambda kv: (kv[1].rank, -kv[1].logprob))
    return [kv for kv in ranked if kv[1].rank <= k][:k]


def completion_logprobs(token_ids: list[int], logprobs: Optional[list[dict[int, Any]]], k: int,
                        decode: Decode, text_offset_start: int = 0) -> dict[str, Any]:
    out: dict[str, Any] = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
    offset = text_offset_start
    for i, tid in enumerate(token_ids):
        entries = logprobs[i] if logprobs and i < len(logprobs) else {}
        lp = entries.get(tid)
        tok = _token_str(tid, lp, decode)
        out["tokens"].append(tok)
        out["token_logprobs"].append(_finite(lp.logprob) if lp is not None else None)
        top = {_token_str(t, e, decode): _finite(e.logprob) for t, e in _top(entries, k)}
        if lp is not None:
            top.setdefault(tok, _finite(lp.logprob))
        out["top_logprobs"].append(top)
        out["text_offset"].append(offset)
        offset += len(tok)
    return out


def chat_logprobs(token_ids: list[int], logprobs: Optional[list[dict[int, Any]]], k: int,
                  decode: Decode) -> dict[str, Any]:
    content = []
    for i, tid in enumerate(token_ids):
        entries = logprobs[i] if logprobs and i < len(logprobs) else {}
        lp = entries.get(tid)
        tok = _token_str(tid, lp, decode)
        content.append({
            "token": tok,
            "logprob": _finite(lp.logprob) if lp is not None else -9999.0,
            "bytes": list(tok.encode("utf-8")),
            "top_logprobs": [
                {"token": (s := _token_str(t, e, decode)), "logprob": _finite(e.logprob),
                 "bytes": list(s.encode("utf-8"))}
                for t, e in _top(entries, k)
            ],
        })
    return {"content": content}


def prompt_completion_logprobs(token_ids: list[int], prompt_logprobs: Optional[list[Any]], k: int,
                               decode: Decode) -> dict[str, Any]:
    """The echoed prompt's part of a completions `logprobs` object. `prompt_logprobs` is
    vLLM's: one entry per prompt token, None for the first (nothing precedes it), else
    {token_id: Logprob} with the prompt token and the top-k. Without it (the engine did not
    compute prompt logprobs) every prompt token gets a null logprob."""
    out: dict[str, Any] = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
    offset = 0
    for i, tid in enumerate(token_ids):
        entries = prompt_logprobs[i] if prompt_logprobs and i < len(prompt_logprobs) else None
        lp = entries.get(tid) if entries else None
        tok = _token_str(tid, lp, decode)
        out["tokens"].append(tok)
        out["token_logprobs"].append(_finite(lp.logprob) if lp is not None else None)
        if entries:
            top = {_token_str(t, e, decode): _finite(e.logprob) for t, e in _top(entries, k)}
            if lp is not None:
                top.setdefault(tok, _finite(lp.logprob))
            out["top_logprobs"].append(top)
        else:
            out["top_logprobs"].append(None)
        out["text_offset"].append(offset)
        offset += len(tok)
    return out


def prompt_logprobs_json(prompt_logprobs: Optional[list[Any]]) -> Optional[list[Any]]:
    """RequestOutput.prompt_logprobs -> vLLM's JSON shape (None stays None)."""
    if prompt_logprobs is None:
        return None
    return [None if d is None else {str(t): {"logprob": _finite(e.logprob), "rank": e.rank,
                                             "decoded_token": e.decoded_token} for t, e in d.items()}
            for d in prompt_logprobs]
