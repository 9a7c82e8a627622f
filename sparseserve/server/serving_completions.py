"""POST /v1/completions (streaming and not)."""
from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from sparseserve.server.engine_errors import EngineDeadError
from sparseserve.server.generation_stream import Aborted, GenerationStream
from sparseserve.server.errors import APIError, engine_failure
from sparseserve.server.logprobs import (completion_logprobs, prompt_completion_logprobs,
                                         prompt_logprobs_json)
from sparseserve.server.protocol import CompletionRequest
from sparseserve.server.serving import Prompt, ServingContext, request_ids
from sparseserve.server.streaming import DONE, SSEResponse, TextDeltas, sse


async def create_completion(ctx: ServingContext, req: CompletionRequest, raw: Request) -> Response:
    arrival = time.time()
    model = ctx.check_model(req.model)
    ctx.check_unicode(req)
    params = req.to_sampling_params()
    items = req.prompts()
    ctx.check_request(params, len(items), req.num_samples)
    await ctx.check_structured(params)
    engine_params = params
    if req.num_samples != params.n:  # best_of: sample more, keep the n most likely
        engine_params = dataclasses.replace(params, n=req.num_samples,
                                            logprobs=0 if params.logprobs is None else params.logprobs)
    prompts = list(await asyncio.gather(*(ctx.encode(item) for item in items)))
    for p in prompts:
        ctx.check_length(p, req.max_tokens, "prompt")
    base, rids = request_ids("cmpl", len(prompts))
    stream = await ctx.submit(list(zip(rids, prompts)), engine_params, arrival, req.num_samples,
                              req.max_tokens)
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
        rows = final.choices(rid, req.num_samples)
        if req.num_samples != req.n:
            rows = best_rows(rows, final.cumulative_logprobs(rid), req.n)
        echo_text, echo_lp = _echo(ctx, req, prompts[pi], final.last.get(rid), k)
        for i, text, ids, lps, reason, stop_reason in rows:
            lp = None
            if k is not None:
                lp = completion_logprobs(ids, lps, k, ctx.decode_token, len(echo_text))
                if echo_lp is not None:
                    lp = {key: echo_lp[key] + lp[key] for key in lp}
            choice = {"index": pi * req.n + i, "text": echo_text + text, "logprobs": lp,
                      "finish_reason": reason, "stop_reason": stop_reason}
            if req.prompt_logprobs is not None:  # vLLM's field, asked for explicitly
                out = final.last.get(rid)
                choice["prompt_logprobs"] = prompt_logprobs_json(getattr(out, "prompt_logprobs", None))
            choices.append(choice)
    return JSONResponse({"id": base, "object": "text_completion", "created": created, "model": model,
                         "choices": choices, "usage": final.usage(prompts)})


def best_rows(rows: list[tuple], cumulative: dict[int, float], n: int) -> list[tuple]:
    """The n rows with the highest cumulative logprob, re-indexed 0..n-1 (best_of)."""
    ranked = sorted(rows, key=lambda r: -cumulative.get(r[0], float("-inf")))[:n]
    return [(i,) + tuple(r[1:]) for i, r in enumerate(ranked)]


def _echo(ctx: ServingContext, req: CompletionRequest, prompt: Prompt, out: Any,
          k: Any) -> tuple[str, Any]:
    """(prompt text to prepend, its logprobs in the completion shape or None) for echo."""
    if not req.echo:
        return "", None
    text = prompt.text if prompt.text is not None else ctx.decode_tokens(prompt.token_ids)
    if k is None:
        return text, None
    plps = getattr(out, "prompt_logprobs", None) if out is not None else None
    return text, prompt_completion_logprobs(prompt.token_ids, plps, k, ctx.decode_token)


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

    echoed: dict[int, int] = {}  # prompt index -> characters of echoed prompt text

    try:
        async with stream:
            async for rid, out in stream:
                pi = index[rid]
                if req.echo and pi not in echoed:  # the prompt first, once per choice
                    text, lp = _echo(ctx, req, prompts[pi], None if isinstance(out, Aborted) else out, k)
                    echoed[pi] = len(text)
                    for i in range(n):
                        yield chunk({"index": pi * n + i, "text": text, "logprobs": lp,
                                     "finish_reason": None, "stop_reason": None})
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
                    offset = echoed.get(pi, 0) + d.sent_chars
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
        yield sse(engine_failure(e).body())
    except APIError as e:
        yield sse(e.body())
    yield DONE
