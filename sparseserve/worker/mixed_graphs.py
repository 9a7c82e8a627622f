"""Whole-step CUDA graphs for steps that mix prefill chunks and decode rows (`cudagraph_mode
FULL`, vLLM's name; issue 12, item 2).

Piecewise graphs (piecewise_graphs.py) leave attention eager between the captured pieces, so a
hybrid step still costs ~10 launches of host work per layer. Here attention is captured too,
with fixed shapes whatever the step holds: the prompt chunks (from any position) attend
through one paged prefill launch per layer (kernels/paged_prefill.py), its grid sized for the
most blocks a token bucket can hold; the decode rows through paged decode (split-K, so a long
context is read by many programs) over `max_num_seqs` lanes, unused lanes on the scratch row
writing a dropped row. The per-step facts (each chunk's rows, first position and batch row,
each block's chunk and first row, the live block count, each lane's row and position) are read
from static device buffers; everything else comes from the persistent page directory on the
device, as in the decode graphs (cuda_graphs.py): where each token's K/V goes, and the pages
of each chunk and lane. A step then costs two small host-to-device copies, three
device-to-device ones and one graph launch.

Scope: dense attention over device pages (no sparse selection, no two-tier cache: those keep
their decode graphs and piecewise hybrid steps), whole-model steps (no layer segments), no
prompt logprobs (they need every row's hidden state), at most `max_num_seqs` chunks and the
largest bucket's tokens. Padding rows [T, b) point at the scratch row (their K/V land in the
scratch page) and belong to no chunk: no real row reads them (every other op is row-wise).
Logits are computed for up to `max_num_seqs` sampled rows into one static buffer shared by
every bucket's graph.

Without `capture` (CPU, tests) `_forward` runs as plain calls over the same buffers (Triton's
interpreter for the kernels), which exercises everything but the capture itself.
"""
from __future__ import annotations

import numpy as np
import torch

from sparseserve.kernels import paged_decode_attention
from sparseserve.kernels.paged_prefill import block_tokens, plan_blocks
from sparseserve.kernels.paged_prefill import paged_prefill_attention
from sparseserve.worker.graph_capture import capture_all, smallest_bucket
from sparseserve.worker.plan_staging import PlanStaging


class _GraphAttention:
    """The attention context of a captured mixed step (module docstring): store every row's
    K/V at its page slot; the decode lanes through paged decode (split-K: a long context is
    read by many programs), the prompt chunks through one paged prefill launch."""

    def __init__(self, graphs: "MixedStepGraphs", b: int, store_rows: torch.Tensor,
                 table: torch.Tensor) -> None:
        g = self.g = graphs
        self.b = b
        self.store_rows = store_rows  # [b * Hkv] rows of a cache viewed [P * ps, D]
        self.table = table  # [S, Hkv, W] int32 each chunk's pages
        ps, hkv = g.kv.page_size, g.pages.num_kv_heads
        # decode lanes [S]: their pages, page counts and last page's length, from the device
        seq_lens = g.dec_pos + 1
        n_pages = torch.div(seq_lens + ps - 1, ps, rounding_mode="floor")
        self.dec_table = g.pages.table(g.dec_rows, g.pages.max_blocks)  # [S, Hkv, W]
        self.dec_num_pages = n_pages[:, None].expand(-1, hkv).to(torch.int32).contiguous()
        self.dec_last_len = (seq_lens - (n_pages - 1) * ps).to(torch.int32)

    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor,
                  v: torch.Tensor) -> torch.Tensor:
        g, b = self.g, self.b
        k_cache, v_cache = g.kv.k[layer], g.kv.v[layer]
        d = k.shape[-1]
        k_cache.view(-1, d).index_copy_(0, self.store_rows, k.reshape(-1, d))
        v_cache.view(-1, d).index_copy_(0, self.store_rows, v.reshape(-1, d))
        # row b is where unused decode lanes write. Zeros, not empty: padding rows get no
        # attention output, and left unset they would carry whatever the allocator held (NaN
        # at times) into the next layer, whose K/V for them land in the scratch slot that the
        # unused decode lanes read -- in the capture state a lane writes row 0, the sampled row
        out = torch.zeros((b + 1,) + q.shape[1:], dtype=q.dtype, device=q.device)
        dec = paged_decode_attention(q[g.dec_gather], k_cache, v_cache, self.dec_table,
                                     self.dec_num_pages, self.dec_last_len, g.scale)
        out.index_copy_(0, g.dec_scatter, dec)
        paged_prefill_attention(q, k_cache, v_cache, self.table, g.q_begin, g.q_end,
                                g.starts, g.block_seq[:g.grid(b)], g.block_q0[:g.grid(b)],
                                g.scale, g.block_m, out=out, num_blocks=g.num_blocks)
        return out[:b]


class MixedStepGraphs:
    """One whole-forward graph per token bucket for dense mixed steps (module docstring).

    runner: the ModelRunner (model, kv, pages, scale, scratch_row, device); buckets: ascending
    token counts (piecewise_graphs.token_buckets); max_seqs: chunks a step can hold."""

    def __init__(self, runner, buckets: list[int], max_seqs: int, capture: bool = True) -> None:
        if not buckets:
            raise ValueError("mixed-step graphs need at least one token bucket")
        self.model, self.kv, self.pages = runner.model, runner.kv, runner.pages
        self.scale, self.scratch_row = runner.scale, runner.scratch_row
        self.num_layers = runner.num_layers
        self.buckets, self.max_seqs = list(buckets), max_seqs
        self.capture_graphs = capture
        attn = self.model.model.layers[0].self_attn
        self.block_m = block_tokens(attn.num_heads, attn.num_kv_heads)
        n, s, dev = self.buckets[-1], max_seqs, runner.device
        mb = self.grid(n)
        # int64 inputs in one buffer (one host-to-device copy a step): token ids [n],
        # positions [n], batch rows [n]; [S] each: the prompt chunks' batch rows, the sampled
        # rows; per decode lane its row in the batch (unused: 0), where its output goes
        # (unused: row b, dropped), its batch row (unused: the scratch row) and position
        self._i64 = torch.zeros(3 * n + 6 * s, dtype=torch.long, device=dev)
        (self.input_ids, self.positions, self.rows, self.seq_rows, self.sample_idx,
         self.dec_gather, self.dec_scatter, self.dec_rows, self.dec_pos) = \
            torch.split(self._i64, [n, n, n, s, s, s, s, s, s])
        # int32 attention metadata in one buffer: q_begin, q_end, starts [S], block_seq,
        # block_q0 [grid(n)], the live block count [1]
        self._i32 = torch.zeros(3 * s + 2 * mb + 1, dtype=torch.int32, device=dev)
        (self.q_begin, self.q_end, self.starts, self.block_seq, self.block_q0,
         self.num_blocks) = torch.split(self._i32, [s, s, s, mb, mb, 1])
        # host staging: a set is rewritten only once the copy that read it has completed
        # (event queried, never waited on; a new set joins when all are in flight)
        pin = dev.type == "cuda"
        self._staging = PlanStaging(lambda: (
            torch.zeros(self._i64.shape, dtype=torch.long, pin_memory=pin),
            torch.zeros(self._i32.shape, dtype=torch.int32, pin_memory=pin)), size=2)
        self.logits: torch.Tensor | None = None  # [S, vocab] fp32, shared by every bucket
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = None

    @property
    def max_tokens(self) -> int:
        return self.buckets[-1]

    def grid(self, b: int) -> int:
        """Programs per KV head for a b-token bucket: the most blocks b tokens in at most
        max_seqs chunks can need (each chunk adds at most one partial block)."""
        return b // self.block_m + self.max_seqs

    def bucket(self, n: int) -> int | None:
        return smallest_bucket(self.buckets, n)

    def runs(self, chunks, num_tokens: int, row_params: dict) -> bool:
        """Whether a step with prefill work runs whole through these graphs: it fits the
        largest bucket and max_seqs chunks, every chunk runs every layer (no layer segment),
        and none asks for prompt logprobs."""
        return (len(chunks) <= self.max_seqs and num_tokens <= self.max_tokens
                and all(c.layer_start == 0 and c.layer_end == self.num_layers
                        and (c.is_decode or row_params[c.row].prompt_logprobs is None)
                        for c in chunks))

    def _idle(self, h64: torch.Tensor, h32: torch.Tensor, b: int) -> None:
        """Staging at its idle state for bucket b: no chunk, no live block, every row and lane
        on the scratch row, sampled rows 0 (the unused ones are gathered and dropped), decode
        lanes writing row b."""
        n, s = self.max_tokens, self.max_seqs
        h64.zero_()
        h64[2 * n:3 * n + s] = self.scratch_row  # rows, seq_rows
        h64[3 * n + 3 * s:3 * n + 4 * s] = b  # dec_scatter
        h64[3 * n + 4 * s:3 * n + 5 * s] = self.scratch_row  # dec_rows
        h32.zero_()

    # ---- the captured forward -------------------------------------------------------------
    def _forward(self, b: int) -> None:
        model, pages, ps = self.model, self.pages, self.kv.page_size
        pos, rows = self.positions[:b], self.rows[:b]
        store = pages.pages_at(rows, torch.div(pos, ps, rounding_mode="floor"))  # [b, Hkv]
        store_rows = (store * ps + (pos % ps)[:, None]).reshape(-1)
        table = pages.table(self.seq_rows, pages.max_blocks)  # [S, Hkv, W]
        ctx = _GraphAttention(self, b, store_rows, table)
        h = model.embed(self.input_ids[:b])
        h = model.run_layers(h, pos, ctx, 0, self.num_layers)
        logits = model.compute_logits(h[self.sample_idx])  # [S, vocab]
        if self.logits is None:
            self.logits = torch.empty_like(logits)
        self.logits.copy_(logits)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket's graph, largest first (later graphs reuse the pool's blocks),
        with every chunk on the scratch row and no live block. A no-op without `capture`."""
        i, (h64, h32) = self._staging.take()
        # unused decode lanes write row 0 while capturing: a row every bucket has (a step's
        # staging points them at its own bucket's dropped row b)
        self._idle(h64, h32, 0)
        self._i64.copy_(h64)
        self._i32.copy_(h32)
        self._staging.issued(i, None)  # blocking copies: complete
        if self.capture_graphs:
            self.graphs, _, self.pool = capture_all(reversed(self.buckets), self._forward)

    # ---- a step -----------------------------------------------------------------------------
    def run(self, chunks, offsets: list[int], input_ids: torch.Tensor,
            positions: torch.Tensor, token_rows: torch.Tensor) -> torch.Tensor:
        """A whole-model step of `chunks` (decode rows first, `offsets` their first rows in the
        step's token batch; input_ids / positions / token_rows [T] on the device, as the runner
        built them) -> fp32 logits [N, vocab] of the chunks that sample, in chunk order (a view
        of the static output)."""
        t = input_ids.shape[0]
        b = self.bucket(t)
        if b is None or len(chunks) > self.max_seqs:
            raise ValueError(f"a step of {t} tokens in {len(chunks)} chunks does not fit the "
                             f"mixed-step graphs ({self.max_tokens} tokens, {self.max_seqs})")
        n, s = self.max_tokens, self.max_seqs
        nd = sum(1 for c in chunks if c.is_decode)  # decode rows come first
        prompt, p_off = chunks[nd:], offsets[nd:]
        sampled = [off + c.num_tokens - 1 for c, off in zip(chunks, offsets) if c.sample]
        turn, (h64, h32) = self._staging.take()  # no copy reads it any more: no wait
        self._idle(h64, h32, b)
        base = 3 * n
        h64[base + s:base + s + len(sampled)] = torch.tensor(sampled, dtype=torch.long)
        if nd:
            lanes = torch.tensor([offsets[:nd], [c.row for c in chunks[:nd]],
                                  [c.start for c in chunks[:nd]]], dtype=torch.long)
            h64[base + 2 * s:base + 2 * s + nd] = lanes[0]  # dec_gather
            h64[base + 3 * s:base + 3 * s + nd] = lanes[0]  # dec_scatter
            h64[base + 4 * s:base + 4 * s + nd] = lanes[1]  # dec_rows
            h64[base + 5 * s:base + 5 * s + nd] = lanes[2]  # dec_pos
        if prompt:
            m = len(prompt)
            lens = np.asarray([c.num_tokens for c in prompt], dtype=np.int32)
            begin = np.asarray(p_off, dtype=np.int32)
            seq, q0 = plan_blocks(lens, self.block_m, begin)
            mb = self.grid(n)
            h64[base:base + m] = torch.tensor([c.row for c in prompt])  # seq_rows
            h32[0:m] = torch.from_numpy(begin)
            h32[s:s + m] = torch.from_numpy(begin + lens)
            h32[2 * s:2 * s + m] = torch.tensor([c.start for c in prompt], dtype=torch.int32)
            h32[3 * s:3 * s + len(seq)] = torch.from_numpy(seq)
            h32[3 * s + mb:3 * s + mb + len(q0)] = torch.from_numpy(q0)
            h32[3 * s + 2 * mb] = len(seq)
        # the scalars staged first (non-blocking from pinned memory), then the step's device
        # tensors (ids may hold the last step's tokens, filled on the device: async scheduling)
        self._i64.copy_(h64, non_blocking=True)
        self._i32.copy_(h32, non_blocking=True)
        self.input_ids[:t].copy_(input_ids)
        self.positions[:t].copy_(positions)
        self.rows[:t].copy_(token_rows)  # padding rows [t, b): scratch row, position 0
        copied = None
        if self._i64.is_cuda:
            copied = torch.cuda.Event()
            copied.record()
        self._staging.issued(turn, copied)
        g = self.graphs.get(b)
        if g is not None:
            g.replay()
        else:
            self._forward(b)
        return self.logits[:len(sampled)]
