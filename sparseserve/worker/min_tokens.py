"""min_tokens: stop tokens are forbidden until a request has generated min_tokens tokens.

vLLM's semantics (its MinTokensLogitsProcessor): while `len(output) < min_tokens`, the logits
of the request's `stop_token_ids` and of the model's EOS ids (even with `ignore_eos`) are set
to -inf, so the first min_tokens tokens are never a stop token; stop strings are not checked
in them either (see engine/detokenizer.py).

With a grammar (structured outputs) vLLM leaves the combination undefined (its grammar mask
and its min_tokens mask can together forbid every token, and sampling then picks garbage).
Here the grammar wins, so an output is always valid for its grammar, and min_tokens is a lower
bound only where the grammar admits that many tokens:
* while the grammar can go on, EOS stays masked until min_tokens and the output keeps growing
  inside the grammar (a regex `[0-9]+` gets at least min_tokens digits);
* once the grammar can only end (a finished choice, a closed JSON object), the engine ends the
  request with finish_reason "stop" before min_tokens (`LLMEngine._append_token`: the matcher
  is stopped), as without min_tokens;
* this mask comes after the grammar's, and where forbidding the stop tokens would leave a row
  with no allowed token at all (the grammar allows only stop tokens: its EOS, or a token the
  user listed in stop_token_ids), they stay as the grammar left them. Such a token does not end
  the request before min_tokens (the engine's stop checks wait for min_tokens; only a stopped
  grammar ends it).

Batched on the device, no host sync: rows [M] and their stop ids are the only host inputs
(copied from pinned memory, `host_copy.to_device`).
"""
from __future__ import annotations

from typing import Sequence

import torch

from sparseserve.worker.host_copy import fill_at, to_device


def stop_token_index(rows: Sequence[int], stop_ids: Sequence[Sequence[int]], vocab: int,
                     device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                     torch.Tensor]:
    """(row of each entry [E], token of each entry [E], entry -> position in rows [E],
    rows [M]) as device tensors; ids outside the vocabulary are dropped."""
    r, t, local = [], [], []
    for i, (row, ids) in enumerate(zip(rows, stop_ids)):
        for tok in ids:
            if 0 <= tok < vocab:
                r.append(row)
                t.append(tok)
                local.append(i)
    as_long = lambda v: to_device(v, torch.long, device)  # noqa: E731
    return as_long(r), as_long(t), as_long(local), as_long(list(rows))


def mask_stop_tokens(logits: torch.Tensor, index: tuple[torch.Tensor, ...]) -> None:
    """In place on logits [N, V], after every other mask: forbid each row's stop tokens
    (`index` from `stop_token_index`), except in rows where nothing else is allowed."""
    r, t, local, rows = index
    if r.numel() == 0:
        return
    before = logits[r, t]
    fill_at(logits, (r, t), float("-inf"))
    nothing_left = torch.isneginf(logits[rows]).all(dim=-1)  # [M]: the grammar can only end
    logits[r, t] = torch.where(nothing_left[local], before, torch.full_like(before, float("-inf")))
