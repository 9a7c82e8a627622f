"""In-process backend of the serving benchmark: the server's AsyncLLMEngine without HTTP.

The same engine loop thread, the same Prometheus metrics object and the same request path
the server uses (`AsyncLLMEngine.submit` and its output stream), minus uvicorn, JSON and
SSE. It measures what the HTTP backend measures, from the caller's side of the stream:

* a token-carrying event is an output whose generated-token count grew (the HTTP backend
  sees the same outputs as chunks; a chunk is skipped there only when its new tokens decode
  to no text yet, e.g. half of a multi-byte character);
* prompt and output token counts are the engine's (what the server puts in `usage`);
* a prompt that does not leave room for `max_tokens` in max_model_len is an error, as the
  server answers 400 for it (the engine alone would silently shorten the output).

`InProcessBackend(engine)` takes an `LLMEngine` (then it owns an AsyncLLMEngine with
ServerMetrics, started in `start` and shut down in `close`; the LLMEngine stays usable) or an
already running `AsyncLLMEngine` (left running).
"""
from __future__ import annotations

import itertools
import time
import uuid
from typing import Any, Optional

from sparseserve.bench.serve_types import BenchRequest, RequestResult


class InProcessBackend:
    name = "in-process"

    def __init__(self, engine: Any, sampling: Optional[dict[str, Any]] = None) -> None:
        from sparseserve.server.async_engine import AsyncLLMEngine

        self.sampling = dict(sampling or {})
        self._owned = not isinstance(engine, AsyncLLMEngine)
        self._engine = engine
        self.async_engine: Optional[AsyncLLMEngine] = None if self._owned else engine
        core = engine if self._owned else engine.engine
        self.model = getattr(core, "model_name", None) or "default"
        self.max_model_len = int(core.max_model_len)
        self.tokenizer = getattr(core, "tokenizer", None)
        self.vocab_size = int(core.vocab_size) if hasattr(core, "vocab_size") else None
        self._ids = itertools.count()
        self._prefix = f"bench-{uuid.uuid4().hex[:8]}"

    async def start(self) -> None:
        if self.async_engine is not None:
            return
        from sparseserve.server.async_engine import AsyncLLMEngine
        from sparseserve.server.metrics import ServerMetrics

        metrics = ServerMetrics(self.model, max_model_len=self.max_model_len, process_metrics=False)
        # the engine may have run before (warm-up, an earlier point): its counters are totals
        # since it started, and this run's /metrics must hold only this run's share
        metrics.start_from(self._engine.get_stats())
        self.async_engine = AsyncLLMEngine(self._engine, metrics=metrics).start()

    async def close(self) -> None:
        if self._owned and self.async_engine is not None:
            self.async_engine.shutdown()
            self.async_engine = None

    async def read_metrics(self) -> Optional[str]:
        registry = getattr(self.async_engine.metrics, "registry", None)
        if registry is None:
            return None
        from prometheus_client import generate_latest
        return generate_latest(registry).decode("utf-8")

    def sampling_params(self, req: BenchRequest) -> Any:
        from sparseserve.request import SamplingParams
        return SamplingParams(max_tokens=req.output_len, **self.sampling)

    async def send(self, req: BenchRequest) -> RequestResult:
        res = RequestResult(prompt_len=req.prompt_len, dataset=req.dataset)
        prompt: Any = req.prompt if req.prompt is not None else {"prompt_token_ids": req.prompt_token_ids}
        rid = f"{self._prefix}-{next(self._ids)}"
        start = res.start_time = time.perf_counter()
        last_t: Optional[float] = None
        seen, out = 0, None
        try:
            params = self.sampling_params(req)
            stream = await self.async_engine.submit([(rid, prompt)], params, n=1,
                                                    max_tokens=req.output_len)
            async with stream:
                async for _rid, item in stream:
                    now = time.perf_counter()
                    if not hasattr(item, "outputs"):  # Aborted
                        res.error = "the engine aborted the request"
                        break
                    out = item
                    if out.num_generated_tokens > seen:
                        seen = out.num_generated_tokens
                        if last_t is None:
                            res.ttft = now - start
                        else:
                            res.itl.append(now - last_t)
                        last_t = now
        except Exception as e:  # ValueError (bad input), EngineDeadError, EngineOverloadedError
            res.error = f"{type(e).__name__}: {e}"
        res.latency = time.perf_counter() - start
        if out is not None:
            res.prompt_len = len(out.prompt_token_ids)
            res.output_len = out.num_generated_tokens
            res.generated_text = out.outputs[0].text if out.outputs else ""
            if not res.error and not out.finished:
                res.error = "the output stream ended before the request finished"
            if not res.error and res.prompt_len + req.output_len > self.max_model_len:
                res.error = (f"prompt ({res.prompt_len}) + max_tokens ({req.output_len}) exceeds "
                             f"max_model_len {self.max_model_len}")
        elif not res.error:
            res.error = "no output"
        res.success = not res.error
        return res
