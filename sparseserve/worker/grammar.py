"""Token bitmasks of grammar-constrained rows, applied to the logits on the device.

Per step (`GrammarMasks.apply`): the host fills one int32 bitmask row per constrained sequence
from its llguidance matcher (bit t of word w allows token 32*w + t: vLLM's / xgrammar's
layout), in one parallel call, into a reused host buffer (pinned on CUDA); the buffer goes to
the device in one non-blocking copy (4 bytes per 32 tokens), its bytes are unpacked there
through a [256, 8] lookup table, and the forbidden logits set to -inf. On a CPU device the
unpacking is numpy's `unpackbits` (3x faster than torch shifts there; what remains is the
masked_fill). Rows without a matcher are not touched. The runner calls this after it launched the
forward pass, so on a GPU the host fill overlaps the model's kernels; the step's token copy
(the one host sync) also guarantees the buffer's previous copy finished before it is refilled.

Shapes: logits [N, V] fp32; rows [G] batch rows with a matcher; bitmask [G, ceil(V/32)] int32.
A matcher in an error state (it never is: only allowed tokens are sampled) is left unmasked
rather than masking every token.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from sparseserve.worker.host_copy import to_device


class GrammarMasks:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._host: torch.Tensor | None = None  # [capacity, words] int32
        self._executor: Any = None
        # forbidden[b, j]: bit j of byte value b is 0 (words are little-endian: byte i of
        # word w holds tokens 32 * w + 8 * i ...)
        bits = torch.arange(8, device=device)
        self._forbidden = ((torch.arange(256, device=device)[:, None] >> bits) & 1) == 0

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
        forbidden = self.forbidden(self.fill(matchers, vocab), vocab)  # [G, V] bool
        if len(rows) == logits.shape[0] and list(rows) == list(range(len(rows))):
            logits.masked_fill_(forbidden, float("-inf"))
            return
        idx = to_device(list(rows), torch.long, logits.device)
        logits[idx] = logits[idx].masked_fill(forbidden, float("-inf"))

    def forbidden(self, host: torch.Tensor, vocab: int) -> torch.Tensor:
        """Host bitmask [G, W] int32 -> [G, vocab] bool on the device, True = forbidden."""
        if self.device.type == "cpu":
            by = np.invert(host.numpy().view(np.uint8))
            return torch.from_numpy(np.unpackbits(by, axis=1, bitorder="little")[:, :vocab]
                                    .view(np.bool_))
        return self.forbidden_on_device(host.to(self.device, non_blocking=True), vocab)

    def forbidden_on_device(self, mask: torch.Tensor, vocab: int) -> torch.Tensor:
        """Device bitmask [G, W] int32 -> [G, vocab] bool (the table path the GPU takes)."""
        by = mask.view(torch.uint8).long()  # [G, 4W]
        return self._forbidden[by].reshape(mask.shape[0], -1)[:, :vocab]
