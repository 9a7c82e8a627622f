"""Capturing a family of CUDA graphs into one shared memory pool (the decode, piecewise and
whole-step graphs all do it the same way), and finding a step's bucket among their sizes."""
from __future__ import annotations

import bisect
from typing import Any, Callable, Hashable, Iterable, Sequence

import torch


def smallest_bucket(sizes: Sequence[int], n: int) -> int | None:
    """The smallest of the ascending `sizes` that holds n, None if none does."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


def capture_all(keys: Iterable[Hashable], forward: Callable[[Any], Any]
                ) -> tuple[dict, dict, Any]:
    """Capture `forward(key)` for every key, in the order given (largest first, so later
    graphs reuse the pool's blocks), each after one eager warm-up call (Triton compilation,
    cuBLAS workspaces, the allocator), on a side stream, all into one pool.
    -> ({key: graph}, {key: what forward returned inside the capture (the graph's static
    output)}, the pool). The caller's stream waits for the captures; the device is synced."""
    graphs, outputs, pool = {}, {}, None
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for key in keys:
            forward(key)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool, stream=stream):
                outputs[key] = forward(key)
            if pool is None:
                pool = g.pool()
            graphs[key] = g
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    return graphs, outputs, pool
