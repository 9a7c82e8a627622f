"""Piecewise CUDA graphs for the steps that carry prefill work (issue 12, item 2).

A decode-only step replays one whole-forward graph (cuda_graphs.py). A step with a prefill
chunk or a layer segment cannot: its attention depends on host-side facts that change every
step (prefix lengths, which pages a chunk maps, the saver's destinations). Everything else in
a layer does not — norms, projections, RoPE, the MLP are row-wise over the step's tokens — so,
as vLLM's piecewise graphs do, those pieces are captured per token-count bucket and attention
runs eagerly between them:

    entry(a)        stream x -> norm, qkv projection, RoPE            (first layer of a range)
    attention(a)    eager: ctx.attention on the step's T real rows
    mid(a + 1)      layer a's O projection, norm, MLP; layer a+1's norm, qkv, RoPE
    ...
    exit(b - 1)     layer b-1's O projection, norm, MLP; the stream residual + x

Pieces read and write static buffers (`x`, `residual`, `qkv`, `attn`, RoPE factors) of the
largest bucket, so graphs of every layer and bucket share one memory pool for their
intermediates. A hybrid step (decode rows + prefill work) that fits the largest bucket runs
whole through the pieces, decode rows included (`runs_whole_step`); a larger one replays its
decode rows' full graph and runs the rest here. A step of T tokens runs the bucket b >= T:
rows [T, b) are padding (zero inputs, position 0) that no real row reads — every piece is
row-wise — and attention sees only the T real rows. A range [a, b) costs 1 + (b - a) graph launches plus attention's own
launches, against ~10 launches per layer outside attention eagerly.

Contract of `run(h, positions, ctx, a, b)`: exactly `model.run_layers(h, positions, ctx, a,
b)` on the fused-kernel path (the same kernels on the same rows; a GEMM over b rows may pick
another cuBLAS algorithm than over T rows, so results agree to rounding, as vLLM's padded
graphs do). Without `capture` (CPU, tests) the pieces run as plain calls over the same
buffers, which exercises everything but the capture itself.
"""
from __future__ import annotations

import torch

from sparseserve.worker.graph_capture import capture_all, smallest_bucket

# token-count buckets: fine where host time dominates (small steps), coarser above
BUCKET_SIZES = (16, 32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096)


def token_buckets(max_tokens: int) -> list[int]:
    """The buckets up to max_tokens (a step's token budget), max_tokens itself included."""
    sizes = [s for s in BUCKET_SIZES if s < max_tokens] + [max_tokens]
    return sorted(set(sizes))


class PiecewiseGraphs:
    """The attention-free pieces of every layer, per token bucket (see the module docstring).

    model: a LlamaForCausalLM on the fused-kernel path (no tensor parallelism); buckets:
    ascending token counts (token_buckets)."""

    def __init__(self, model, buckets: list[int], capture: bool = True) -> None:
        if not buckets:
            raise ValueError("piecewise graphs need at least one token bucket")
        self.model = model
        self.layers = model.model.layers
        self.buckets = list(buckets)
        self.capture_graphs = capture
        cfg = model.config
        attn = self.layers[0].self_attn
        hq, hkv, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
        n = self.buckets[-1]
        w = model.model.norm.weight
        dev, dt = w.device, w.dtype
        # [n, hidden]: the stream in (entry), the MLP output between pieces, the stream out
        self.x = torch.zeros(n, cfg.hidden_size, dtype=dt, device=dev)
        self.residual = torch.zeros(n, cfg.hidden_size, dtype=dt, device=dev)  # [n, hidden]
        self.qkv = torch.zeros(n, hq + 2 * hkv, d, dtype=dt, device=dev)  # [n, Hq + 2 Hkv, D]
        self.attn = torch.zeros(n, hq * d, dtype=dt, device=dev)  # [n, Hq * D] attention out
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)  # [n]
        # [n, 2, D] fp32 RoPE factors of the positions: (cos, signed sin)
        self.rope = torch.zeros(n, 2, d, dtype=torch.float32, device=dev)
        self.graphs: dict[tuple[str, int, int], torch.cuda.CUDAGraph] = {}
        self.pool = None

    @property
    def max_tokens(self) -> int:
        return self.buckets[-1]

    def runs_whole_step(self, num_decode: int, num_chunks: int, num_tokens: int,
                        segmented: bool = False, sparse_decode: bool = False) -> bool:
        """Whether a step with decode rows runs all its tokens through the pieces in one pass
        (vLLM's FULL_AND_PIECEWISE: mixed batches piecewise, decode-only batches in their
        full graph): a hybrid step that fits the largest bucket then reads the weights once,
        not in the decode graph and again for its prefill work (decode attention runs
        eagerly with the rest). Only for dense decode rows: sparse selection and the two-tier
        cache's retrieve (`sparse_decode`) cost ~0.8 ms of host time per layer eagerly
        (measured on the H200, Llama-3-8B: a 2,048-token prompt beside 8 decode rows of the
        sparseserve preset took 98.9 ms that way against 74.0 ms with their graph; dense
        rows: 51.2 vs 53.4 ms). Not when the prefill work is a layer segment (`segmented`):
        the decode rows would then run every layer eagerly for a few layers of prefill."""
        return (num_decode < num_chunks and num_tokens <= self.max_tokens and not segmented
                and not sparse_decode)

    def bucket(self, n: int) -> int | None:
        return smallest_bucket(self.buckets, n)

    # ---- the pieces (each reads and writes only the static buffers' first b rows) ----------
    def _cos_sin(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rope[:b, 0:1], self.rope[:b, 1:2]

    def _entry(self, layer: int, b: int) -> None:
        qkv, res = self.layers[layer].attention_inputs(self.x[:b], None, self._cos_sin(b))
        self.qkv[:b].copy_(qkv)
        self.residual[:b].copy_(res)

    def _mid(self, layer: int, b: int) -> None:
        x, res = self.layers[layer - 1].attention_outputs(self.attn[:b], self.residual[:b])
        qkv, res = self.layers[layer].attention_inputs(x, res, self._cos_sin(b))
        self.qkv[:b].copy_(qkv)
        self.residual[:b].copy_(res)

    def _exit(self, layer: int, b: int) -> None:
        x, res = self.layers[layer].attention_outputs(self.attn[:b], self.residual[:b])
        torch.add(res, x, out=self.x[:b])

    _PIECES = {"entry": _entry, "mid": _mid, "exit": _exit}

    def _pieces(self):
        """Every (kind, layer) a range can need: entry at any layer, mid from layer 1, exit
        at any layer."""
        n = len(self.layers)
        return ([("entry", i) for i in range(n)] + [("mid", i) for i in range(1, n)]
                + [("exit", i) for i in range(n)])

    def _piece(self, kind: str, layer: int, b: int) -> None:
        key = (kind, layer, b)
        g = self.graphs.get(key)
        if g is not None:
            g.replay()
        else:
            self._PIECES[kind](self, layer, b)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every piece of every bucket, largest bucket first (later graphs reuse the
        pool's blocks: the pieces' intermediates are freed at the end of each capture, their
        results live in the static buffers). A no-op without `capture`."""
        if not self.capture_graphs:
            return
        keys = [(kind, layer, b) for b in reversed(self.buckets) for kind, layer in self._pieces()]
        self.graphs, _, self.pool = capture_all(
            keys, lambda key: self._PIECES[key[0]](self, key[1], key[2]))
        self.x.zero_()
        self.residual.zero_()
        self.attn.zero_()

    # ---- a step -------------------------------------------------------------------------
    def run(self, h: torch.Tensor, positions: torch.Tensor, ctx, start: int,
            end: int) -> torch.Tensor:
        """Layers [start, end) over the residual stream h [T, hidden] at `positions` [T]
        with ctx's attention -> the stream [T, hidden] (a new tensor). T <= max_tokens."""
        t = h.shape[0]
        b = self.bucket(t)
        if b is None:
            raise ValueError(f"{t} tokens exceed the largest piecewise bucket "
                             f"({self.max_tokens}); run the layers eagerly")
        self.x[:t].copy_(h)
        self.positions[:t].copy_(positions)
        if b > t:  # padding rows: zero stream, position 0, zero attention output
            self.x[t:b].zero_()
            self.positions[t:b].zero_()
            self.attn[t:b].zero_()
        torch.index_select(self.model.rope.full_table(h.device), 0, self.positions[:b],
                           out=self.rope[:b])
        # a saver that reads k / v on a side stream after attention returns (the two-tier
        # cache's) must not see the next piece overwrite them: hand it copies
        copy_kv = getattr(ctx, "reads_kv_after_attention", False)
        self._piece("entry", start, b)
        for layer in range(start, end):
            q, k, v = self.layers[layer].self_attn.split_qkv(self.qkv[:t])
            if copy_kv:
                k, v = k.clone(), v.clone()
            out = ctx.attention(layer, q, k, v)  # [T, Hq, D]
            self.attn[:t].copy_(out.reshape(t, -1))
            self._piece("mid" if layer + 1 < end else "exit",
                        layer + 1 if layer + 1 < end else layer, b)
        return self.x[:t].clone()
