"""Log-probabilities of prompt tokens, computed from the prefill's hidden states (vLLM's
`prompt_logprobs`).

In a prefill chunk covering prompt positions [s, s + n), the hidden state at position p
predicts the token at p + 1: the chunk yields the logprobs of its tokens at [s + 1, s + n),
and — when the chunk is not the prompt's last — the log-softmax row of its last position is
kept on the device (`pending`, [V] fp32 per request) until the next chunk brings the token at
s + n. Position 0 has none. Only full-depth chunks (layer_end == num_layers) of a request's
first prefill (no output tokens yet) count; a prefill redone after preemption recomputes the
same positions, which the engine overwrites by position.

Device work is launched in `compute` (before sampling, no host sync); `collect` turns it into
host lists after the step's token copy.
Shapes: h [T, hidden]; per chunk logits in slices of `SLICE` positions x V (fp32).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from sparseserve.worker.host_copy import to_device

SLICE = 256  # positions per logits slice: bounds the [slice, V] fp32 temporaries


@dataclass
class _Pending:
    request_id: str
    first_position: int  # prompt position of targets[0]
    targets: list[int]
    logprob: torch.Tensor  # [m] fp32
    rank: torch.Tensor  # [m] int64 (1 = most likely)
    top_logprob: torch.Tensor | None  # [m, k]
    top_id: torch.Tensor | None  # [m, k]


class PromptLogprobs:
    def __init__(self) -> None:
        self.pending: dict[str, torch.Tensor] = {}  # request id -> log-softmax row [V]

    def release(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            self.pending.pop(rid, None)

    def compute(self, model: Any, h: torch.Tensor, chunks: Sequence[Any], offsets: Sequence[int],
                params: Sequence[Any], num_layers: int) -> list[_Pending]:
        """Launch the prompt-logprob work of `chunks` (params[i]: chunk i's SamplingParams)."""
        work = []
        for c, off, p in zip(chunks, offsets, params):
            k = p.prompt_logprobs
            if k is None or c.layer_end < num_layers or c.num_output_tokens > 0:
                continue
            rows, targets = [], []
            prev = self.pending.pop(c.request_id, None)
            if prev is not None and c.start > 0:
                rows.append(prev[None, :])
                targets.append(c.token_ids[0])
            for a in range(0, c.num_tokens, SLICE):
                b = min(a + SLICE, c.num_tokens)
                logp = torch.log_softmax(model.compute_logits(h[off + a:off + b]), dim=-1)
                if not c.sample and b == c.num_tokens:
                    self.pending[c.request_id] = logp[-1].clone()
                use = min(b, c.num_tokens - 1) - a  # rows of this slice with a prompt target
                if use > 0:
                    rows.append(logp[:use])
                    targets.extend(c.token_ids[a + 1:a + 1 + use])
            if not targets:
                continue
            logp = torch.cat(rows)
            tgt = to_device(targets, torch.long, logp.device)
            lp = logp.gather(1, tgt[:, None])[:, 0]
            rank = (logp > lp[:, None]).sum(dim=-1) + 1
            top_lp = top_id = None
            if k > 0:
                top_lp, top_id = logp.topk(k, dim=-1)
            first = c.start if prev is not None and c.start > 0 else c.start + 1
            work.append(_Pending(c.request_id, first, targets, lp, rank, top_lp, top_id))
        return work

    @staticmethod
    def collect(work: Sequence[_Pending]) -> dict[str, tuple[int, list[dict[int, tuple[float, int]]]]]:
        """request id -> (first prompt position, one {token_id: (logprob, rank)} per position)."""
        out = {}
        for w in work:
            lp, rank = w.logprob.tolist(), w.rank.tolist()
            tl = w.top_logprob.tolist() if w.top_logprob is not None else None
            ti = w.top_id.tolist() if w.top_id is not None else None
            entries = []
            for i, t in enumerate(w.targets):
                e = {ti[i][j]: (tl[i][j], j + 1) for j in range(len(ti[i]))} if ti is not None else {}
                e[t] = (lp[i], rank[i])
                entries.append(e)
            out[w.request_id] = (w.first_position, entries)
        return out
