"""CUDA graphs for decode-only steps.

A decode step's whole forward (embedding, every layer with KV store + paged decode, logits)
is captured once per batch-size bucket. Inputs are three static buffers (token ids,
positions, batch rows); everything else (where K/V go, page lists, lengths) is derived on
the device inside the graph from the persistent page directory, so replay needs no host work
beyond copying those three small vectors. Padding lanes point at a scratch row whose pages
are a scratch page, so they read and write nothing that belongs to a request.

With the two-tier cache each bucket has two graphs: one indexes the pages that decode tokens
fill (masked on the device), one leaves that out for the steps where the host knows that no
token completes a page (31 of 32 steps of a lone request; the indexing is ~19 launches per
layer). Both share the pool and the static inputs.

A step may be captured as `pieces` consecutive graphs over ranges of layers (the first also
embeds, the last also finishes the layers and computes the logits), replayed in order: the
host submits piece i + 1 while the GPU runs piece i, so only the first piece's launch is
spent with the GPU idle (`benchmarks/graph_launch.py` measures what a launch costs). The
residual stream and the forward context pass from piece to piece in the shared pool.
"""
from __future__ import annotations

import os

import torch

from sparseserve.worker.forward_context import ForwardContext
from sparseserve.worker.offload_context import OffloadForwardContext


def batch_buckets(max_batch: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, max_batch + 16, 16))
    return sorted({min(s, max_batch) for s in sizes})


# graphs per decode step (layer ranges); SPARSESERVE_GRAPH_PIECES overrides for experiments
GRAPH_PIECES = int(os.environ.get("SPARSESERVE_GRAPH_PIECES", 1))


def layer_ranges(num_layers: int, pieces: int) -> list[tuple[int, int]]:
    """[l0, l1) of each piece: `pieces` (at most num_layers) near-equal ranges."""
    n = max(1, min(pieces, num_layers))
    bounds = [round(i * num_layers / n) for i in range(n + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


class DecodeGraphs:
    def __init__(self, runner, max_batch: int, pieces: int | None = None) -> None:
        self.runner = runner
        self.ranges = layer_ranges(runner.num_layers, pieces or GRAPH_PIECES)
        self.sizes = batch_buckets(max_batch)
        dev = runner.device
        n = self.sizes[-1]
        self.input_ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.rows = torch.full((n,), runner.scratch_row, dtype=torch.long, device=dev)
        # (bucket, fills) -> the graph and its output logits
        self.logits: dict[tuple[int, bool], torch.Tensor] = {}
        # (bucket, fills) -> its graphs, one per layer range, replayed in order
        self.graphs: dict[tuple[int, bool], list[torch.cuda.CUDAGraph]] = {}
        self.variants = graph_variants(runner.offload is not None)
        self.pool = None

    def bucket(self, n: int) -> int | None:
        for s in self.sizes:
            if s >= n:
                return s
        return None

    def _forward(self, b: int, fills: bool = True) -> torch.Tensor:
        state: dict = {}
        for piece in range(len(self.ranges)):
            out = self._piece(b, fills, piece, state)
        return out

    def _piece(self, b: int, fills: bool, piece: int, state: dict):
        """Piece `piece` of the step's forward (layers self.ranges[piece]); `state` carries
        the context and the residual stream to the next piece. -> the logits [b, vocab]
        from the last piece, else None."""
        r = self.runner
        l0, l1 = self.ranges[piece]
        if piece == 0:
            args = (r.kv, r.pages, self.rows[:b], self.positions[:b], b, [], r.scale)
            if r.offload is None:
                state["ctx"] = ForwardContext(*args, sparse=r.sparse)
            else:
                state["ctx"] = OffloadForwardContext(*args, sparse=r.sparse, cache=r.offload,
                                                     save_pages=None, save_offsets=None,
                                                     decode_fills=fills)
            state["h"] = r.model.embed(self.input_ids[:b])
        ctx = state["ctx"]
        state["h"] = r.model.run_layers(state["h"], self.positions[:b], ctx, l0, l1)
        if l1 < r.num_layers:
            return None
        ctx.finish_layers(0, r.num_layers)
        return r.model.compute_logits(state["h"])

    @torch.inference_mode()
    def capture(self) -> None:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for b in reversed(self.sizes):  # largest first: later graphs reuse its pool
                for fills in self.variants:
                    self._forward(b, fills)  # warm-up: Triton compilation, RoPE, allocator
                    state: dict = {}
                    graphs = []
                    for piece in range(len(self.ranges)):
                        g = torch.cuda.CUDAGraph()
                        with torch.cuda.graph(g, pool=self.pool, stream=stream):
                            out = self._piece(b, fills, piece, state)
                        if self.pool is None:
                            self.pool = g.pool()
                        graphs.append(g)
                    self.logits[b, fills] = out
                    self.graphs[b, fills] = graphs
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
            rows: torch.Tensor, fills: bool = True) -> torch.Tensor:
        """-> logits [n, vocab] (a view into the graph's static output). `fills`: a decode
        token of the batch may complete its page (the host's check; True is always safe)."""
        b = self.stage(input_ids, positions, rows)
        key = (b, fills or len(self.variants) == 1)
        self.replay(key)
        return self.logits[key][:input_ids.shape[0]]

    def replay(self, key: tuple[int, bool]) -> None:
        """Replay the step graphs of `key` = (bucket, fills) on the staged inputs."""
        for g in self.graphs[key]:  # in capture order: each reads its predecessor's stream
            g.replay()


def graph_variants(offload: bool) -> tuple[bool, ...]:
    """The `fills` values captured per bucket: both with the two-tier cache (see the module
    docstring), only True otherwise (the resident context indexes through its own plan)."""
    return (True, False) if offload else (True,)
