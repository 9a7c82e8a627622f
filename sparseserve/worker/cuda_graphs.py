"""CUDA graphs for decode-only steps.

A decode step's whole forward (embedding, every layer with KV store + paged decode, logits)
is captured once per batch-size bucket. Inputs are three static buffers (token ids,
positions, batch rows); everything else (where K/V go, page lists, lengths) is derived on
the device inside the graph from the persistent page directory, so replay needs no host work
beyond copying those three small vectors. Padding lanes point at a scratch row whose pages
are a scratch page, so they read and write nothing that belongs to a request.
"""
from __future__ import annotations

import torch

from sparseserve.worker.forward_context import ForwardContext
from sparseserve.worker.offload_context import OffloadForwardContext


def batch_buckets(max_batch: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, max_batch + 16, 16))
    return sorted({min(s, max_batch) for s in sizes})


class DecodeGraphs:
    def __init__(self, runner, max_batch: int) -> None:
        self.runner = runner
        self.sizes = batch_buckets(max_batch)
        dev = runner.device
        n = self.sizes[-1]
        self.input_ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.rows = torch.full((n,), runner.scratch_row, dtype=torch.long, device=dev)
        self.logits: dict[int, torch.Tensor] = {}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = None

    def bucket(self, n: int) -> int | None:
        for s in self.sizes:
            if s >= n:
                return s
        return None

    def _forward(self, b: int) -> torch.Tensor:
        r = self.runner
        args = (r.kv, r.pages, self.rows[:b], self.positions[:b], b, [], r.scale)
        if r.offload is None:
            ctx = ForwardContext(*args, sparse=r.sparse)
        else:
            ctx = OffloadForwardContext(*args, sparse=r.sparse, cache=r.offload,
                                        save_pages=None, save_offsets=None)
        h = r.model.embed(self.input_ids[:b])
        h = r.model.run_layers(h, self.positions[:b], ctx, 0, r.num_layers)
        return r.model.compute_logits(h)

    @torch.inference_mode()
    def capture(self) -> None:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for b in reversed(self.sizes):  # largest first: later graphs reuse its pool
                self._forward(b)  # warm-up: Triton compilation, RoPE table, allocator
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=self.pool, stream=stream):
                    self.logits[b] = self._forward(b)
                if self.pool is None:
                    self.pool = g.pool()
                self.graphs[b] = g
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()

    def stage(self, input_ids: torch.Tensor, positions: torch.Tensor,
              rows: torch.Tensor) -> int:
        """Copy a decode batch [n] into the static inputs, padding lanes pointed at the
        scratch row; -> the bucket b whose graph (or `_forward(b)`) runs it."""
        n = input_ids.shape[0]
        b = self.bucket(n)
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.rows[:n].copy_(rows)
        if b > n:
            self.positions[n:b].zero_()
            self.rows[n:b].fill_(self.runner.scratch_row)
        return b

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor,
            rows: torch.Tensor) -> torch.Tensor:
        """-> logits [n, vocab] (a view into the graph's static output)."""
        b = self.stage(input_ids, positions, rows)
        self.graphs[b].replay()
        return self.logits[b][:input_ids.shape[0]]
