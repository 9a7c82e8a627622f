"""Token bitmasks of grammar-constrained rows, applied to the logits on the device.

Per step (`GrammarMasks.apply`): the host fills one int32 bitmask row per constrained sequence
from its llguidance matcher (bit t of word w allows token 32*w + t: vLLM's / xgrammar's
layout), in one parallel call, into a reused host buffer (pinned on CUDA); the buffer goes to
the device in one non-blocking copy; the rows are unpacked there and the forbidden logits set to
-inf. Rows without a matcher are not touched. The runner calls this after it launched the
forward pass, so on a GPU the host fill overlaps the model's kernels; the step's token copy
(the one host sync) also guarantees the buffer's previous copy finished before it is refilled.

Shapes: logits [N, V] fp32; rows [G] batch rows with a matcher; bitmask [G, ceil(V/32)] int32.
A matcher in an error state (it never is: only allowed tokens are sampled) is left unmasked
rather than masking every token.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch


class GrammarMasks:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._host: torch.Tensor | None = None  # [capacity, words] int32
        self._executor: Any = None
        self._shifts = torch.arange(32, dtype=torch.int32, device=device)

    def _buffer(self, rows: int, words: int) -> torch.Tensor:
        if self._host is None or self._host.shape[0] < rows or self._host.shape[1] != words:
            cap = max(rows, 2 * (0 if self._host is None else self._host.shape[0]), 8)
            self._host = torch.empty((cap, words), dtype=torch.int32,
                                     pin_memory=self.device.type == "cuda")
        return self._host[:rows]

    def fill(self, matchers: Sequence[Any], vocab: int) -> torch.Tensor:
        """Host bitmask [G, ceil(vocab/32)] int32 of the matchers' next allowed tokens."""
        import llguidance
        import llguidance.torch as llt

        words = (vocab + 31) // 32
        buf = self._buffer(len(matchers), words)
        live = [(m, i) for i, m in enumerate(matchers) if not m.is_error()]
        if len(live) < len(matchers):
            buf.fill_(-1)
        if len(live) == 1:
            llt.fill_next_token_bitmask(live[0][0], buf, live[0][1])
        elif live:
            if self._executor is None:
                self._executor = llguidance.LLExecutor()
            llt.fill_next_token_bitmask_par(self._executor, live, buf)
        return buf

    def apply(self, logits: torch.Tensor, rows: Sequence[int], matchers: Sequence[Any]) -> None:
        """In place on logits [N, V]: rows[i] keeps only the tokens matchers[i] allows."""
        vocab = logits.shape[1]
        host = self.fill(matchers, vocab)
        mask = host.to(self.device, non_blocking=True)  # [G, W]
        allowed = ((mask[:, :, None] >> self._shifts) & 1).bool().reshape(len(rows), -1)[:, :vocab]
        if len(rows) == logits.shape[0] and list(rows) == list(range(len(rows))):
            logits.masked_fill_(~allowed, float("-inf"))
            return
        idx = torch.tensor(list(rows), device=logits.device)
        logits[idx] = logits[idx].masked_fill(~allowed, float("-inf"))
