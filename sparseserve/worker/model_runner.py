"""ModelRunner: owns every device tensor (weights, KV pages, page table, saved hidden states)
and executes one scheduled step: apply page-table diffs, run the layers over the tokens
active at each layer, sample. The only host sync per step is the final token copy.
"""
from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

import numpy as np
import torch

from sparseserve import kernels
from sparseserve.config import INJECT_CREDIT_FRACTION, EngineConfig, SparseConfig
from sparseserve.engine.memory_plan import report_reserved
from sparseserve.engine.sched_output import (ScheduledChunk, SchedulerOutput, decode_fills,
                                             layer_intervals)
from sparseserve.kvcache.manager import cdiv
from sparseserve.model.llama import LlamaForCausalLM
from sparseserve.model.loader import iter_weights
from sparseserve.request import SamplingParams
from sparseserve.worker.cpu_threads import CpuThreadPolicy
from sparseserve.worker.cuda_graphs import capture_runner_graphs
from sparseserve.worker.forward_context import ForwardContext, KVCacheTensors, PrefillSeq
from sparseserve.worker.host_copy import to_device
from sparseserve.worker.offload_cache import TwoTierCache
from sparseserve.worker.offload_context import OffloadForwardContext
from sparseserve.worker.page_directory import PageDirectory
from sparseserve.worker.pending_step import PendingStep, RunnerOutput, fill_pending_tokens
from sparseserve.worker.prefill_attention import PaddedCausalAttention
from sparseserve.worker.prompt_logprobs import PromptLogprobs
from sparseserve.worker.sampler import Sampler
from sparseserve.worker.sampling_step import SamplingStep
from sparseserve.worker.segment_plans import SegmentPlans
from sparseserve.worker.sparse_runtime import SparseRuntime
from sparseserve.worker.step_arrays import step_token_arrays
from sparseserve.worker.two_tier_graphs import capture_two_tier_graphs

logger = logging.getLogger("sparseserve")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelRunner(SamplingStep):
    def __init__(self, cfg: EngineConfig, source, tp=None) -> None:
        """tp: a model.parallel.TensorParallel (this process is one rank: its shard of the
        weights, its num_key_value_heads / tp.size KV heads' pages), or None."""
        self.cfg = cfg
        self.tp = tp
        self.device = torch.device(cfg.device)
        self.dtype = DTYPES[cfg.dtype]
        mc = cfg.model
        self.num_layers = mc.num_hidden_layers
        self.num_kv_heads = mc.num_key_value_heads // (1 if tp is None else tp.size)
        self.page_size = cfg.cache.page_size
        self.scale = mc.head_dim ** -0.5
        max_len = cfg.scheduler.max_model_len
        self.max_blocks = cdiv(max_len, self.page_size)

        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)  # build in the final dtype: no fp32 copy of 8B
        try:
            with torch.device(self.device):
                model = LlamaForCausalLM(mc, max_positions=max_len, tp=tp)
        finally:
            torch.set_default_dtype(default_dtype)
        if source.kind == "dummy":
            model.init_dummy_weights(cfg.seed)
        else:
            model.load_weights(iter_weights(source, mc, shard=model.weight_shard))
        self.model = model.eval()
        if self.device.type == "cpu":
            model.pack_cpu_linears()  # oneDNN's pre-packed weights (model/cpu_linear.py)

        # one extra page and one extra row: the scratch that CUDA-graph padding lanes use
        self.kv = KVCacheTensors(self.num_layers, cfg.cache.num_pages + 1, self.page_size,
                                 mc.head_dim, self.dtype, self.device)
        rows = cfg.scheduler.max_num_seqs
        self.scratch_row = rows
        self.offload = None
        # page ids in the page table: device pages, or host pages with the two-tier cache
        num_ids = cfg.cache.num_pages
        if cfg.cache.kv_offload:
            sc = cfg.scheduler
            # a layer-segmented step injects up to 1.25x its budget (the scheduler's credit)
            step_token_layers = (int(sc.max_inject_tokens * (1 + INJECT_CREDIT_FRACTION))
                                 if sc.max_inject_tokens
                                 else sc.max_num_batched_tokens * self.num_layers)
            self.offload = TwoTierCache(
                cfg.cache, self.num_layers, mc.head_dim, rows, self.dtype, self.device,
                sc.working_set_window,
                step_save_bytes=step_token_layers * self.num_kv_heads * mc.head_dim
                * self.dtype.itemsize * 2, num_kv_heads=self.num_kv_heads)
            self.offload.attach_device_tier(self.kv.k, self.kv.v)
            num_ids = cfg.cache.num_host_pages
        # the device page table: a chunk directory (+ CPU mirror for the saver's host ids)
        self.pages = PageDirectory(rows, self.num_kv_heads, self.max_blocks,
                                   cfg.cache.chunk_pages, num_ids, self.device)
        # a layer-segmented prompt's host plans, shared by its segment steps (two-tier cache)
        self.segment_plans = SegmentPlans(self.pages, self.page_size, self.num_layers)
        self._step_plans: dict = {}  # this step's entries (SegmentPlans.for_step)
        self.row_params: dict[int, SamplingParams] = {}
        self.row_stop_ids: dict[int, tuple[int, ...]] = {}  # rows with min_tokens (NewRow)
        self.saved_hidden: dict[str, torch.Tensor] = {}  # layer-segmented prefill state
        self.sampler = Sampler(self.device, cfg.seed, max_rows=rows)
        # request id -> grammar matcher: the engine adds one per constrained request and
        # removes it when the request finishes or is aborted; the sampler masks with it
        self.grammars: dict[str, Any] = {}
        self.prompt_lp = PromptLogprobs()
        self._prompt_lp_work: list = []  # this step's prompt-logprob work (_run_eager)
        self.sparse = None
        if cfg.sparse.enabled:
            self.sparse = SparseRuntime(cfg.sparse, self.num_layers, num_ids, self.page_size,
                                        mc.head_dim, self.dtype, self.device,
                                        cfg.cache.chunk_pages)
        self.keep_logits = False  # evaluation: return each step's logits in RunnerOutput
        # the last sampled tokens on the device and each request's index in them: the inputs
        # of the next launch's pending decode rows (async scheduling, pending_step.py)
        self._last_tokens: torch.Tensor | None = None
        self._last_index: dict[str, int] = {}
        self.num_pending_inputs = 0  # decode inputs fed from the device so far (async)
        # evaluation hooks (see `hooked`): set on every eager forward context
        self.on_select = None
        self.decode_attention = None
        # CPU engine: torch threads per step (worker/cpu_threads.py); TP ranks set their own
        self.cpu_threads = CpuThreadPolicy() if self.device.type == "cpu" and tp is None else None
        # whole-prompt prefill attention on cuDNN plans built here, once (prefill_attention.py)
        self.prefill_attn = PaddedCausalAttention.for_cuda(
            mc.num_attention_heads // (1 if tp is None else tp.size), self.num_kv_heads,
            mc.head_dim, self.scale, self.dtype, self.device, max_len)
        # CUDA graphs: whole decode steps, and the attention-free pieces of the other steps
        self.graphs, self.graph_error, self.piecewise, self.mixed = capture_runner_graphs(
            self, rows)
        # and the two-tier cache's layer-segmented prompts, one graph per layer and bucket
        self.two_tier = capture_two_tier_graphs(self)
        report_reserved(cfg.memory_plan, self.device)

    # ---- step -----------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        """Run a step and wait for its tokens."""
        r = self._forward_step(out)
        if isinstance(r, RunnerOutput):
            return r
        return self._with_prompt_logprobs(self._sample(*r))

    @torch.inference_mode()
    def launch(self, out: SchedulerOutput) -> PendingStep:
        """Run a step without waiting for its tokens (async scheduling): `collect` reads them.
        Its decode rows may take their input from the previous launch's tokens on the device
        (request.PENDING_TOKEN; worker/pending_step.py)."""
        r = self._forward_step(out)
        if isinstance(r, RunnerOutput):
            return PendingStep(ready=r)
        return self._sample_launch(*r)

    def collect(self, pending: PendingStep) -> RunnerOutput:
        """A launched step's RunnerOutput (waits for its token copy only)."""
        if pending.ready is not None:
            return pending.ready
        return self._with_prompt_logprobs(self._sample_finish(pending))

    def _forward_step(self, out: SchedulerOutput):
        """A step up to its logits: -> (chunks, logits, t0) for _sample, or the RunnerOutput
        of a step that samples nothing."""
        t0 = time.perf_counter()
        if self.cpu_threads is not None:
            self.cpu_threads.for_step(any(not c.is_decode for c in out.chunks))
        self.release(out.freed_rows, out.freed_request_ids, out.freed_pages)
        if self.offload is not None:
            self.offload.begin_step()
        for nr in out.new_rows:
            self.row_params[nr.row] = nr.params
            if nr.min_tokens_stop_ids:
                self.row_stop_ids[nr.row] = nr.min_tokens_stop_ids
            else:
                self.row_stop_ids.pop(nr.row, None)
        if self.offload is not None and out.row_quotas is not None:
            self.offload.set_quotas(torch.from_numpy(out.row_quotas))
        self._apply_page_diffs(out.chunks)
        self._step_plans = (self.segment_plans.for_step(out.chunks)
                            if self.offload is not None else {})
        if self.offload is not None and any(c.slot_free and c.layer_end == self.num_layers
                                            for c in out.chunks):
            # a slot-free prompt finishes here and decodes next step, loading its pages from
            # DRAM: the next step's loads wait (on the device) for this step's saves
            self.offload.fence_saves_next_step()
        # decode tokens first: the decode kernel reads one contiguous block of rows
        chunks = sorted(out.chunks, key=lambda c: not c.is_decode)
        if not chunks:
            return RunnerOutput()
        self._feed_penalties(chunks)

        ids, pos, rows, offsets = step_token_arrays(chunks)
        n = len(ids)
        dev = self.device
        self._np_pos, self._np_rows = pos, rows
        input_ids = to_device(ids, torch.long, dev)
        self.num_pending_inputs += fill_pending_tokens(input_ids, chunks, offsets,
                                                       self._last_tokens, self._last_index)
        positions = to_device(pos, torch.long, dev)
        token_rows = to_device(rows, torch.long, dev)

        nd = sum(1 for c in chunks if c.is_decode)
        self._decode_fills = decode_fills(chunks[:nd], self.page_size)
        if nd < len(chunks) and self.mixed is not None and self.mixed.runs(chunks, n,
                                                                           self.row_params):
            return chunks, self.mixed.run(chunks, offsets, input_ids, positions, token_rows), t0
        pw = self.piecewise
        whole = pw is not None and pw.runs_whole_step(  # all rows through the pieces
            nd, len(chunks), n,
            segmented=any(c.layer_start or c.layer_end < self.num_layers for c in chunks),
            sparse_decode=self.sparse is not None or self.offload is not None)
        if self.graphs is not None and nd and self.graphs.bucket(nd) is not None and not whole:
            logits = self.graphs.run(input_ids[:nd], positions[:nd], token_rows[:nd],
                                     fills=self._decode_fills)
            if nd < len(chunks):
                # a hybrid step the piecewise graphs do not run whole: the decode rows replay
                # their graph, the prefill work runs after it in the same step
                logits = logits.clone()
                self._np_pos, self._np_rows = self._np_pos[nd:], self._np_rows[nd:]
                rest = self._run_eager(chunks[nd:], [o - nd for o in offsets[nd:]],
                                       input_ids[nd:], positions[nd:], token_rows[nd:])
                if rest is not None:
                    logits = torch.cat([logits, rest])
            return chunks, logits, t0
        logits = self._run_eager(chunks, offsets, input_ids, positions, token_rows)
        if logits is None:
            return self._with_prompt_logprobs(RunnerOutput(host_time_s=time.perf_counter() - t0))
        return chunks, logits, t0

    def _with_prompt_logprobs(self, res: RunnerOutput) -> RunnerOutput:
        """Attach the prompt logprobs `_run_eager` launched this step (after the token copy)."""
        work, self._prompt_lp_work = self._prompt_lp_work, []
        if work:
            res.prompt_logprobs = self.prompt_lp.collect(work)
        return res

    def _run_eager(self, chunks: list[ScheduledChunk], offsets: list[int],
                   input_ids: torch.Tensor, positions: torch.Tensor,
                   token_rows: torch.Tensor) -> torch.Tensor | None:
        """The layers over the tokens active at each layer, op by op; -> logits [N, vocab]
        of the chunks that sample (in chunk order), or None if none does."""
        dev = self.device
        h = self._initial_hidden(chunks, offsets, input_ids)
        for a, b in layer_intervals(chunks):
            active = [i for i, c in enumerate(chunks) if c.layer_start <= a and c.layer_end >= b]
            # slot-free prompts' layer segments replay their layers' graphs, after the rest,
            # one prompt after another (they share the graphs' static buffers)
            graphed = self._two_tier_chunks(chunks, active, h)
            active = [i for i in active if i not in graphed]
            if active:
                h = self._run_group(h, chunks, offsets, active, positions, token_rows, a, b)
            for tt in graphed:
                sl = slice(offsets[tt], offsets[tt] + chunks[tt].num_tokens)
                out = self.two_tier.run(h[sl], chunks[tt], a, b)
                if len(chunks) == 1:
                    h = out
                else:
                    h[sl] = out

        for c, off in zip(chunks, offsets):
            if c.layer_end < self.num_layers:
                self.saved_hidden[c.request_id] = h[off:off + c.num_tokens].clone()
            else:
                self.saved_hidden.pop(c.request_id, None)
        self._prompt_lp_work = self.prompt_lp.compute(
            self.model, h, chunks, offsets, [self.row_params[c.row] for c in chunks], self.num_layers)
        sampling_rows = [off + c.num_tokens - 1 for c, off in zip(chunks, offsets) if c.sample]
        if not sampling_rows:
            return None
        return self.model.compute_logits(h[to_device(sampling_rows, torch.long, dev)])

    def _run_group(self, h: torch.Tensor, chunks: list[ScheduledChunk], offsets: list[int],
                   active: list[int], positions: torch.Tensor, token_rows: torch.Tensor,
                   a: int, b: int) -> torch.Tensor:
        """Layers [a, b) over the chunks `active` (indexes into chunks) in one context ->
        the step's stream h with their rows updated."""
        if len(active) == len(chunks):
            ctx = self._context(chunks, offsets, token_rows, positions)
            ctx.begin_layers(a, b)
            h = self._run_layers(h, positions, ctx, a, b)
            ctx.finish_layers(a, b)
            return h
        sub = [chunks[i] for i in active]
        idx_np = np.concatenate([np.arange(offsets[i], offsets[i] + chunks[i].num_tokens)
                                 for i in active])
        idx = to_device(idx_np, torch.long, self.device)
        sub_offsets = np.cumsum([0] + [c.num_tokens for c in sub])[:-1].tolist()
        ctx = self._context(sub, sub_offsets, token_rows[idx], positions[idx], np_idx=idx_np)
        ctx.begin_layers(a, b)
        h[idx] = self._run_layers(h[idx], positions[idx], ctx, a, b)
        ctx.finish_layers(a, b)
        return h

    def _two_tier_chunks(self, chunks: list[ScheduledChunk], active: list[int],
                         h: torch.Tensor) -> list[int]:
        """The active chunks whose layers replay the two-tier prefill graphs
        (worker/two_tier_graphs.py): every slot-free prompt within their largest bucket, on
        the fused path."""
        tt = self.two_tier
        if tt is None or not self.model.use_fused_ops(h):
            return []
        return [i for i in active if tt.runs(chunks[i])]

    def _run_layers(self, h: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext,
                    a: int, b: int) -> torch.Tensor:
        """Layers [a, b) over the stream h [T, hidden]: through the piecewise graphs when the
        step's T tokens fit their largest bucket (worker/piecewise_graphs.py), else op by op."""
        pw = self.piecewise
        if pw is not None and h.shape[0] <= pw.max_tokens and self.model.use_fused_ops(h):
            return pw.run(h, positions, ctx, a, b)
        return self.model.run_layers(h, positions, ctx, a, b)

    def _initial_hidden(self, chunks: list[ScheduledChunk], offsets: list[int],
                        input_ids: torch.Tensor) -> torch.Tensor:
        if all(c.layer_start == 0 for c in chunks):
            return self.model.embed(input_ids)
        h = torch.empty((input_ids.shape[0], self.cfg.model.hidden_size), dtype=self.dtype,
                        device=self.device)
        for c, off in zip(chunks, offsets):
            sl = slice(off, off + c.num_tokens)
            if c.layer_start == 0:
                h[sl] = self.model.embed(input_ids[sl])
            else:
                h[sl] = self.saved_hidden[c.request_id]
        return h

    def _context(self, chunks: list[ScheduledChunk], offsets: list[int], rows: torch.Tensor,
                 positions: torch.Tensor, np_idx: np.ndarray | None = None) -> ForwardContext:
        num_decode = 0
        while num_decode < len(chunks) and chunks[num_decode].is_decode:
            num_decode += 1
        prefills = [PrefillSeq(off, off + c.num_tokens, c.start, c.row, c.slot_free,
                               c.resident_pages, self._step_plans.get(c.request_id))
                    for c, off in zip(chunks[num_decode:], offsets[num_decode:])]
        # decode tables as wide as the longest decode request (known here: no sync), but at the
        # full width (as graphs) for Triton's sparse select, which is compiled per width class:
        # a width that followed the batch compiled variants mid-serving (serving.md, session 20)
        width = None
        if num_decode and (self.sparse is None or kernels.resolve_backend(None, rows) == "torch"):
            width = max(cdiv(c.start + 1, self.page_size) for c in chunks[:num_decode])
        args = (self.kv, self.pages, rows, positions, num_decode, prefills, self.scale)
        if self.offload is None:
            ctx = ForwardContext(*args, decode_width=width, sparse=self.sparse,
                                 prefill_attention=self.prefill_attn)
        else:
            pos, rws = self._np_pos, self._np_rows
            if np_idx is not None:
                pos, rws = pos[np_idx], rws[np_idx]
            ctx = OffloadForwardContext(  # the save destinations: made if the context needs them
                *args, decode_width=width, sparse=self.sparse, prefill_attention=self.prefill_attn,
                cache=self.offload, decode_fills=getattr(self, "_decode_fills", True),
                save_dest=lambda plans=self._step_plans: self.segment_plans.save_dest(
                    chunks, pos, rws, plans))
        if self.on_select is not None:
            ctx.on_select = self.on_select
        if self.decode_attention is not None:
            ctx.decode_attention = self.decode_attention
        return ctx

    # ---- evaluation seam (sparseserve.bench.fidelity*, tests) -------------------------------
    def new_sparse_runtime(self, cfg: SparseConfig) -> SparseRuntime:
        """A fresh sparse runtime for `cfg` shaped for this runner (summaries of every page,
        empty), to swap in with `hooked(sparse=...)`."""
        return SparseRuntime(cfg, self.num_layers, self.cfg.cache.num_pages, self.page_size,
                             self.cfg.model.head_dim, self.dtype, self.device,
                             self.cfg.cache.chunk_pages)

    _KEEP = object()

    @contextlib.contextmanager
    def hooked(self, *, sparse: Any = _KEEP, on_select: Any = _KEEP, decode_attention: Any = _KEEP):
        """Within the block, steps run with `sparse` (a SparseRuntime, or None: dense) instead
        of the runner's own, call `on_select(layer, q, selection, ctx)` after every sparse decode
        selection and attend decode rows with `decode_attention` (a drop-in for
        `kernels.paged_decode_attention`; the eager single-tier path only). An argument not
        given keeps its current value; everything is restored on exit. For evaluation harnesses
        and tests that drive `execute` directly; decode-graph replays do not see the hooks, and
        the whole-step graphs of steps with prefill work (cudagraph_mode FULL) are off within
        the block, so a hooked runtime indexes every prompt chunk."""
        saved = (self.sparse, self.on_select, self.decode_attention, self.mixed)
        self.mixed = None
        keep = ModelRunner._KEEP
        if sparse is not keep:
            self.sparse = sparse
        if on_select is not keep:
            self.on_select = on_select
        if decode_attention is not keep:
            self.decode_attention = decode_attention
        try:
            yield self
        finally:
            self.sparse, self.on_select, self.decode_attention, self.mixed = saved

    # ---- bookkeeping ----------------------------------------------------------------------
    def release(self, rows: list[int], request_ids: list[str], pages: np.ndarray) -> None:
        """Forget finished / preempted requests: their rows, saved states and page residency."""
        for row in rows:
            self.row_params.pop(row, None)
            self.row_stop_ids.pop(row, None)
        for rid in request_ids:
            self.saved_hidden.pop(rid, None)  # finished or preempted mid-segment
        self.segment_plans.release(request_ids)
        self.prompt_lp.release(request_ids)
        if self.offload is not None:
            self.offload.free_pages(pages)

    def _apply_page_diffs(self, chunks: list[ScheduledChunk]) -> None:
        """Write newly allocated chunks into the page directory in one scatter."""
        parts = [c for c in chunks if c.new_chunks.size]
        if not parts:
            return
        hkv = self.num_kv_heads
        r_idx, h_idx, c_idx, vals = [], [], [], []
        for c in parts:
            n = c.new_chunks.shape[0]
            r_idx.append(np.full(n * hkv, c.row))
            h_idx.append(np.tile(np.arange(hkv), n))
            c_idx.append(np.repeat(np.arange(c.first_new_chunk, c.first_new_chunk + n), hkv))
            vals.append(c.new_chunks.reshape(-1))
        r, h, ci, val = (np.concatenate(x) for x in (r_idx, h_idx, c_idx, vals))
        self.pages.write(r, h, ci, val, lambda x, dt: to_device(x, dt, self.device))
        if self.offload is not None:  # who owns which host chunk: working-set counts
            owners = to_device(np.stack([r, val]), torch.long, self.device)  # one copy
            self.offload.stamps.assign(owners[0], owners[1])
