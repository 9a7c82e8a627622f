"""LLMEngine: the step loop (schedule -> execute -> update). Not thread-safe: one caller
drives it (the offline LLM, or the server's engine thread)."""
from __future__ import annotations

import logging
import time
from typing import Any

from sparseserve.engine.args import EngineArgs
from sparseserve.engine.detokenizer import IncrementalDetokenizer
from sparseserve.engine.output_processing import OutputProcessing, ParentRequest
from sparseserve.engine.scheduler import Scheduler
from sparseserve.kernels.compile_watch import WATCH as COMPILES
from sparseserve.outputs import RequestOutput
from sparseserve.request import Request, RequestStatus, SamplingParams
from sparseserve.validation import INT64_MAX, INT64_MIN

logger = logging.getLogger("sparseserve")


class LLMEngine(OutputProcessing):
    def __init__(self, args: EngineArgs) -> None:
        from sparseserve.engine.executor import make_executor
        from sparseserve.model.loader import load_tokenizer

        self.config, self.source = args.create_engine_config()
        # how each rank's HBM is split, before anything is allocated (engine/memory_plan.py)
        cc = self.config.cache
        logger.info("%s; %d device pages per layer%s", self.config.memory_plan.describe(),
                    cc.num_pages, f", {cc.num_host_pages} host pages" if cc.kv_offload else "")
        self.model_name = self.source.name
        self.tokenizer = load_tokenizer(self.source, tokenizer=args.tokenizer)
        if self.config.device == "cuda":
            COMPILES.install()  # counts the captures' and warm-up's compiles too
            COMPILES.disarm()  # another engine of this process may have armed it
        self.executor = make_executor(self.config, self.source)
        self.runner = self.executor.runner  # the in-process ModelRunner; None with TP > 1
        # request id -> grammar matcher; the in-process sampler masks with the same dict
        self.grammars: dict = self.runner.grammars if self.runner is not None else {}
        mc = self.config.model
        tp = self.config.parallel.tensor_parallel_size  # page ids: the same on every rank
        self.scheduler = Scheduler(self.config.scheduler, self.config.cache,
                                   mc.num_hidden_layers, mc.num_key_value_heads // tp,
                                   self.config.sparse)
        self.eos_token_ids = tuple(mc.eos_token_ids) or (
            (self.tokenizer.eos_token_id,) if self.tokenizer is not None
            and self.tokenizer.eos_token_id is not None else ())
        self._parents: dict[str, ParentRequest] = {}
        self._child_parent: dict[str, str] = {}
        self._grammar_backend = None  # sparseserve.structured.backend.GrammarBackend, lazily
        self.step_count = 0
        self.last_step_host_time_s = 0.0
        self._inflight = None  # async scheduling: (SchedulerOutput, PendingStep) launched
        if self.config.device == "cuda":  # compile the prefill path's kernels before users do
            from sparseserve.engine.warmup import warm_up
            warm_up(self)
            self._drain()
            self.step_count = 0
            COMPILES.arm()  # a compile from here on lands in a request: warned about

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLMEngine":
        return cls(args)

    def memory_plan(self) -> dict:
        """The device memory plan of one rank (bytes by component, total, budget; see
        engine/memory_plan.py), for benchmarks to record."""
        return self.config.memory_plan.as_dict()

    @property
    def max_model_len(self) -> int:
        return self.config.scheduler.max_model_len

    # ---- requests -------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.config.model.vocab_size

    def grammar_backend(self, field: str = "structured_outputs"):
        """The llguidance compiler for this model's tokenizer (built on first use; thread-safe,
        so the server can compile in its pool). ParamError naming `field` without a tokenizer."""
        from sparseserve.structured.backend import lazy_backend
        return lazy_backend(self, field)

    def add_request(self, request_id: str, prompt: Any, params: SamplingParams | None = None,
                    arrival_time: float | None = None) -> None:
        params = params or SamplingParams()
        params.validate()
        if request_id in self._parents:
            raise ValueError(f"request id {request_id!r} is already in use.")
        text, ids = self._tokenize(prompt)
        if not ids:
            raise ValueError("The prompt is empty; give at least one token.")
        vocab = self.config.model.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab}).")
        limit = self.max_model_len
        if len(ids) >= limit:
            raise ValueError(f"The prompt has {len(ids)} tokens but max_model_len is {limit} "
                             "(prompt plus at least one generated token must fit); shorten the "
                             "prompt or raise max_model_len.")
        room = limit - len(ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        arrival = arrival_time or time.time()
        spec = params.structured_outputs
        matchers = {}
        if spec is not None:
            backend = self.grammar_backend(spec.field())
            for i in range(params.n):
                matchers[request_id if params.n == 1 else f"{request_id}#{i}"] = backend.matcher(spec)
        children = []
        for i in range(params.n):
            child_id = request_id if params.n == 1 else f"{request_id}#{i}"
            child_params = params
            if params.n > 1 and params.seed is not None:
                child_params = _with_seed(params, child_seed(params.seed, i))
            req = Request(child_id, list(ids), child_params, prompt=text, arrival_time=arrival,
                          eos_token_ids=self.eos_token_ids, max_tokens=max_tokens)
            if params.prompt_logprobs is not None:
                req.prompt_logprobs = [None] * len(ids)
            children.append(req)
        if matchers and self.runner is None:
            raise ValueError("structured outputs are not supported with tensor_parallel_size "
                             "> 1 yet; serve with tensor_parallel_size=1 or drop the "
                             "response format / structured_outputs.")
        self.grammars.update(matchers)  # the sampler masks with them from now on
        parent = ParentRequest(request_id, text, list(ids), children)
        for req in children:
            parent.detok[req.request_id] = IncrementalDetokenizer(
                self.tokenizer, ids, params.stop, params.include_stop_str_in_output,
                params.skip_special_tokens, min_tokens=params.min_tokens)
            self._child_parent[req.request_id] = request_id
            self.scheduler.add_request(req)
        self._parents[request_id] = parent

    def _tokenize(self, prompt: Any) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]]
            prompt = prompt.get("prompt")
        if isinstance(prompt, (list, tuple)):
            return None, [int(t) for t in prompt]
        if not isinstance(prompt, str):
            raise ValueError("A prompt is a string, a list of token ids or "
                             "{'prompt_token_ids': [...]}.")
        if self.tokenizer is None:
            raise ValueError("This model has no tokenizer (dummy weights); pass "
                             "{'prompt_token_ids': [...]} instead of text.")
        return prompt, self.tokenizer.encode(prompt, add_special_tokens=True)

    def abort_request(self, request_ids: list[str] | str) -> None:
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for rid in request_ids:
            parent = self._parents.pop(rid, None)
            if parent is None:
                continue
            for req in parent.children:
                self._child_parent.pop(req.request_id, None)
                self.grammars.pop(req.request_id, None)
                if not req.is_finished:
                    self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
        self.executor.release(*self.scheduler.take_freed())

    def has_unfinished_requests(self) -> bool:
        return bool(self._parents)

    # ---- the step -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One step: its outputs. With async scheduling, the next step is launched before the
        last one's tokens are read: the outputs returned are those of the step launched by
        the previous call (see _step_async)."""
        if self.config.async_scheduling:
            return self._step_async()
        return self._step_sync()

    def _step_sync(self) -> list[RequestOutput]:
        out = self.scheduler.schedule()
        if out.is_empty:
            return self._empty_step(out, progress_expected=True)
        res = self.executor.execute(out)
        self.scheduler.update_after_step(out, res.working_sets)
        return self._take_outputs(out, res)

    def _empty_step(self, out, progress_expected: bool) -> list[RequestOutput]:
        if self.scheduler.waiting_for_pinned_slots:
            # slots of the last step's prefill are held until its saves land; an empty step
            # moves the worker's save fence on, and the next step has them
            self.executor.execute(out)
            return []
        self.executor.release(out.freed_rows, out.freed_request_ids, out.freed_pages)
        if progress_expected and self.scheduler.has_unfinished():
            raise RuntimeError("scheduler made no progress with requests waiting; the KV "
                               "cache is too small for a single request.")
        return []

    def _step_async(self) -> list[RequestOutput]:
        """Schedule and launch step N + 1 while step N (launched by the previous call) runs on
        the device, then read step N's tokens and return its outputs. A request's token of
        step N is pending meanwhile (Request.num_pending; the runner feeds it to step N + 1
        on the device). Requests whose sampling reads host state per token (penalties,
        grammars) make the engine drain and run the step synchronously."""
        sched = self.scheduler
        prev, self._inflight = self._inflight, None
        if any(r.sampling_params.has_penalties or rid in self.grammars
               for rid, r in sched.requests.items()):
            outputs = self._collect(prev) if prev is not None else []
            return outputs + self._step_sync()
        out = sched.schedule()
        if out.is_empty:
            outputs = self._empty_step(out, progress_expected=prev is None)
        else:
            handle = self.executor.launch(out)
            sched.update_after_step(out, None)  # positions advance now, working sets later
            for c in out.chunks:
                if c.sample:
                    sched.requests[c.request_id].num_pending += 1
            self._inflight, outputs = (out, handle), []
        if prev is not None:
            outputs = self._collect(prev) + outputs
        return outputs

    def _drain(self) -> list[RequestOutput]:
        """Read the step still in flight, if any (async scheduling): its outputs."""
        prev, self._inflight = self._inflight, None
        return self._collect(prev) if prev is not None else []

    def _collect(self, inflight) -> list[RequestOutput]:
        """Read a launched step's tokens and take its outputs."""
        out, handle = inflight
        res = self.executor.collect(handle)
        for c in out.chunks:
            req = self.scheduler.requests.get(c.request_id)
            if c.sample and req is not None:
                req.num_pending -= 1
        self.scheduler.record_working_sets(out, res.working_sets)
        return self._take_outputs(out, res)

    # ---- introspection --------------------------------------------------------------------
    def get_stats(self, fresh: bool = True) -> dict[str, Any]:
        """Scheduler and two-tier cache counters. fresh=False (the server, after every step)
        does not wait for the device: the cache's counters may be a step late (exact once
        the engine is idle)."""
        sched = self.scheduler
        stats = {
            "num_running": len(sched.running),
            "num_waiting": len(sched.waiting),
            "num_preemptions_total": sched.num_preemptions_total,
            "device_kv_usage": sched.kv.usage,
            "host_kv_usage": 0.0,
            "cache_hits_total": 0,
            "cache_misses_total": 0,
            "bytes_loaded_total": 0,
            "bytes_saved_total": 0,
            "pages_loaded_total": 0,
            "prefill_cache_hits_total": 0,
            "prefill_cache_misses_total": 0,
            "save_wait_seconds_total": 0.0,  # host blocked on DRAM saves (two-tier cache)
            # two-tier cache: requests the last step left waiting for device slots, and the
            # device working set (slots per layer) its admitted requests were estimated at
            "num_waiting_for_slots": sched.num_waiting_for_slots,
            "estimated_working_set": sched.estimated_working_set,
            **COMPILES.stats(),  # Triton compilations of this process (kernels/compile_watch.py)
        }
        tier = self.executor.offload_stats(fresh)  # summed over the TP ranks
        if tier is not None:
            stats.update({k: v for k, v in tier.items() if k in stats})
            stats["host_kv_usage"] = sched.kv.usage
            stats["device_kv_usage"] = tier["resident_slots"] / tier["total_slots"]
        return stats

    def num_free_pages(self) -> int:
        return self.scheduler.kv.num_free_pages

    def num_total_pages(self) -> int:
        return self.scheduler.kv.num_pages

    def check_invariants(self) -> None:
        self.scheduler.check_invariants()
        self.executor.check_invariants()

    def check_health(self) -> None:
        self.executor.check_health()

    def shutdown(self) -> None:
        """Release the model's workers: stop the tensor-parallel worker processes, or with one
        process close the two-tier cache's transfer threads (idempotent; the engine cannot
        step afterwards)."""
        self.executor.shutdown()


def child_seed(seed: int, index: int) -> int:
    """Seed of sample `index` of an n > 1 request: seed + index, wrapped like int64 overflow so
    it stays a valid seed (INT64_MAX + 1 -> INT64_MIN) and distinct for every index."""
    span = INT64_MAX - INT64_MIN + 1
    return (seed + index - INT64_MIN) % span + INT64_MIN


def _with_seed(params: SamplingParams, seed: int) -> SamplingParams:
    import dataclasses
    return dataclasses.replace(params, seed=seed)

