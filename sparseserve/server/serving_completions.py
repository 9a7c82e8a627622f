"""POST /v1/completions (streaming and not)."""
from __future__ import annotations

import time
from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from sparseserve.server.async_engine import Aborted, EngineDeadError, GenerationStream
from sparseserve.server.errors import APIError, engine_dead
from sparseserve.server.logprobs import completion_logprobs
from sparseserve.server.protocol import CompletionRequest
from sparseserve.server.serving import Prompt, ServingContext, request_ids
from sparseserve.server.streaming import DONE, SSEResponse, TextDeltas, sse


async def create_completion(ctx: ServingContext, req: CompletionRequest, raw: Request) -> Response:
    arrival = time.time()
    model = ctx.check_model(req.model)
    params = req.to_sampling_params()
    ctx.check_n(req.n)
    prompts = [await ctx.encode(item) for item in req.prompts()]
    for p in prompts:
        ctx.check_length(p, req.max_tokens, "prompt")
    base, rids = request_ids("cmpl", len(prompts))
    stream = await ctx.submit(list(zip(rids, prompts)), params, arrival, req.n, req.max_tokens)
    created = int(time.time())
    if req.stream:
        return SSEResponse(_stream(ctx, req, stream, base, rids, prompts, model, created),
                           on_close=stream.abort)

    final = await ctx.collect(raw, stream)
    if final is None:
        return Response(status_code=499)  # the client is gone; nobody reads this
    k = params.logprobs
    choices = []
    for pi, rid in enumerate(rids):
        for i, text, ids, lps, reason, stop_reason in final.choices(rid, req.n):
            choices.append({
                "index": pi * req.n + i, "text": text,
                "logprobs": completion_logprobs(ids, lps, k, ctx.decode_token) if k is not None else None,
                "finish_reason": reason, "stop_reason": stop_reason,
            })
    return JSONResponse({"id": base, "object": "text_completion", "created": created, "model": model,
                         "choices": choices, "usage": final.usage(prompts)})


async def _stream(ctx: ServingContext, req: CompletionRequest, stream: GenerationStream, base: str,
                  rids: list[str], prompts: list[Prompt], model: str, created: int) -> AsyncIterator[str]:
    n, k = req.n, req.logprobs
    stop = [req.stop] if isinstance(req.stop, str) else req.stop
    index = {rid: pi for pi, rid in enumerate(rids)}
    deltas = {(pi, i): TextDeltas(stop) for pi in range(len(rids)) for i in range(n)}
    generated: dict[str, int] = {}
    prompt_tokens = sum(len(p.token_ids) for p in prompts)

    def usage() -> dict[str, int]:
        c = sum(generated.values())
        return {"prompt_tokens": prompt_tokens, "completion_tokens": c, "total_tokens": prompt_tokens + c}

    def chunk(choice: dict[str, Any]) -> str:
        body: dict[str, Any] = {"id": base, "object": "text_completion", "created": created,
                                "model": model, "choices": [choice]}
        if req.include_usage:
            body["usage"] = usage() if req.continuous_usage else None
        return sse(body)

    try:
        async with stream:
            async for rid, out in stream:
                pi = index[rid]
                if isinstance(out, Aborted):
                    for i in range(n):
                        d = deltas[(pi, i)]
                        if not d.finished:
                            d.finished = True
                            yield chunk({"index": pi * n + i, "text": "", "logprobs": None,
                                         "finish_reason": "abort", "stop_reason": None})
                    continue
                generated[rid] = out.num_generated_tokens
                for o in out.outputs:
                    d = deltas[(pi, o.index)]
                    if d.finished:
                        continue
                    fin = o.finish_reason is not None
                    offset = d.sent_chars
                    text = d.text_delta(o.text, fin)
                    s, e = d.new_token_range(len(o.token_ids))
                    lp = None
                    if k is not None and e > s:
                        lp = completion_logprobs(o.token_ids[s:e], (o.logprobs or [])[s:e], k,
                                                 ctx.decode_token, offset)
                    if not text and not fin and lp is None:
                        continue
                    d.finished = fin
                    yield chunk({"index": pi * n + o.index, "text": text, "logprobs": lp,
                                 "finish_reason": o.finish_reason, "stop_reason": o.stop_reason})
        if req.include_usage:
            yield sse({"id": base, "object": "text_completion", "created": created, "model": model,
                       "choices": [], "usage": usage()})
    except EngineDeadError as e:
        yield sse(engine_dead(str(e)).body())
    except APIError as e:
        yield sse(e.body())
    yield DONE
