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
"""
from __future__ import annotations

import logging

import torch

from sparseserve.worker.forward_context import ForwardContext
from sparseserve.worker.graph_capture import capture_all, smallest_bucket
from sparseserve.worker.offload_context import OffloadForwardContext

logger = logging.getLogger("sparseserve")


def capture_runner_graphs(runner, max_batch: int):
    """The runner's CUDA graphs as its config asks (engine/memory_plan.py counted their
    pools): -> (DecodeGraphs or None, the decode capture's error or None, PiecewiseGraphs or
    None, MixedStepGraphs or None). A failed capture falls back to eager steps with a
    warning: correct, only slower."""
    from sparseserve.engine.memory_plan import (captures_decode_graphs, captures_mixed_graphs,
                                                captures_piecewise_graphs, piecewise_max_tokens)
    from sparseserve.worker.piecewise_graphs import token_buckets
    cfg = runner.cfg
    if runner.device.type == "cuda" and runner.tp is None:
        # the eager path's chunk-after-prefix attention: compiled now, not mid-serving
        from sparseserve.kernels.paged_prefill import warm_up
        attn = runner.model.model.layers[0].self_attn
        warm_up(runner.kv.k[0], runner.kv.v[0], attn.num_heads, attn.num_kv_heads, runner.scale)
    buckets = token_buckets(piecewise_max_tokens(cfg))
    graphs, error = None, None
    if captures_decode_graphs(cfg):
        graphs, error = _captured(lambda: DecodeGraphs(runner, max_batch),
                                  "CUDA graph capture failed, decoding eagerly")
    mixed = piecewise = None
    if captures_mixed_graphs(cfg):
        from sparseserve.worker.mixed_graphs import MixedStepGraphs
        mixed, _ = _captured(lambda: MixedStepGraphs(runner, buckets, max_batch),
                             "whole-step CUDA graph capture failed, steps with prefill work "
                             "run eagerly")
    if captures_piecewise_graphs(cfg):
        from sparseserve.worker.piecewise_graphs import PiecewiseGraphs
        piecewise, _ = _captured(lambda: PiecewiseGraphs(runner.model, buckets),
                                 "piecewise CUDA graph capture failed, steps with prefill work "
                                 "run eagerly")
    return graphs, error, piecewise, mixed


def _captured(build, failure: str):
    """-> (build() with its graphs captured, None), or (None, the error) after a warning."""
    try:
        graphs = build()
        graphs.capture()
        return graphs, None
    except Exception as e:  # noqa: BLE001
        error = f"{type(e).__name__}: {e}"
        logger.warning("%s: %s", failure, error)
        torch.cuda.synchronize()
        return None, error


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
        # (bucket, fills) -> the graph and its output logits
        self.logits: dict[tuple[int, bool], torch.Tensor] = {}
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        self.variants = graph_variants(runner.offload is not None)
        self.pool = None

    def bucket(self, n: int) -> int | None:
        return smallest_bucket(self.sizes, n)

    def _forward(self, b: int, fills: bool = True) -> torch.Tensor:
        r = self.runner
        args = (r.kv, r.pages, self.rows[:b], self.positions[:b], b, [], r.scale)
        if r.offload is None:
            ctx = ForwardContext(*args, sparse=r.sparse)
        else:
            ctx = OffloadForwardContext(*args, sparse=r.sparse, cache=r.offload,
                                        save_dest=None, decode_fills=fills)
        h = r.model.embed(self.input_ids[:b])
        h = r.model.run_layers(h, self.positions[:b], ctx, 0, r.num_layers)
        ctx.finish_layers(0, r.num_layers)
        return r.model.compute_logits(h)

    @torch.inference_mode()
    def capture(self) -> None:
        keys = [(b, fills) for b in reversed(self.sizes) for fills in self.variants]
        self.graphs, self.logits, self.pool = capture_all(keys, lambda key: self._forward(*key))

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
        self.graphs[key].replay()
        return self.logits[key][:input_ids.shape[0]]


def graph_variants(offload: bool) -> tuple[bool, ...]:
    """The `fills` values captured per bucket: both with the two-tier cache (see the module
    docstring), only True otherwise (the resident context indexes through its own plan)."""
    return (True, False) if offload else (True,)
