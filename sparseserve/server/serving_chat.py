"""POST /v1/chat/completions (streaming and not). The prompt is the model's chat template
applied to the messages, tokenized exactly as `LLM.chat` does."""
from __future__ import annotations

import time
from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from sparseserve.server.engine_errors import EngineDeadError
from sparseserve.server.generation_stream import Aborted, GenerationStream
from sparseserve.server.errors import APIError, engine_failure
from sparseserve.server.logprobs import chat_logprobs, prompt_logprobs_json
from sparseserve.server.protocol import ChatCompletionRequest
from sparseserve.server.serving import Prompt, ServingContext, request_ids
from sparseserve.server.streaming import DONE, SSEResponse, TextDeltas, sse


async def create_chat_completion(ctx: ServingContext, req: ChatCompletionRequest, raw: Request) -> Response:
    arrival = time.time()
    model = ctx.check_model(req.model)
    ctx.check_unicode(req)
    params = req.to_sampling_params()
    ctx.check_request(params, 1, req.num_samples)
    await ctx.check_structured(params)
    prompt = await ctx.apply_chat_template(req.conversation(), req.add_generation_prompt,
                                           req.continue_final_message, req.chat_template_kwargs)
    max_tokens = req.effective_max_tokens()
    ctx.check_length(prompt, max_tokens, "messages",
                     "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens")
    base, rids = request_ids("chatcmpl", 1)
    stream = await ctx.submit([(rids[0], prompt)], params, arrival, req.n, max_tokens)
    created = int(time.time())
    if req.stream:
        return SSEResponse(_stream(ctx, req, stream, base, prompt, model, created), on_close=stream.abort)

    final = await ctx.collect(raw, stream)
    if final is None:
        return Response(status_code=499)
    k = params.logprobs
    choices = []
    for i, text, ids, lps, reason, stop_reason in final.choices(rids[0], req.n):
        choices.append({
            "index": i, "message": {"role": "assistant", "content": text},
            "logprobs": chat_logprobs(ids, lps, k, ctx.decode_token) if k is not None else None,
            "finish_reason": reason, "stop_reason": stop_reason,
        })
    body = {"id": base, "object": "chat.completion", "created": created, "model": model,
            "choices": choices, "usage": final.usage([prompt])}
    if req.prompt_logprobs is not None:  # vLLM: one list for the (shared) prompt
        body["prompt_logprobs"] = prompt_logprobs_json(
            getattr(final.last.get(rids[0]), "prompt_logprobs", None))
    return JSONResponse(body)


async def _stream(ctx: ServingContext, req: ChatCompletionRequest, stream: GenerationStream, base: str,
                  prompt: Prompt, model: str, created: int) -> AsyncIterator[str]:
    n = req.n
    k = (req.top_logprobs or 0) if req.logprobs else None
    stop = [req.stop] if isinstance(req.stop, str) else req.stop
    deltas = [TextDeltas(stop) for _ in range(n)]
    generated = 0
    prompt_tokens = len(prompt.token_ids)

    def usage() -> dict[str, int]:
        return {"prompt_tokens": prompt_tokens, "completion_tokens": generated,
                "total_tokens": prompt_tokens + generated}

    def chunk(index: int, delta: dict[str, Any], logprobs: Any = None, finish_reason: Any = None,
              stop_reason: Any = None) -> str:
        body: dict[str, Any] = {
            "id": base, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                         "finish_reason": finish_reason, "stop_reason": stop_reason}]}
        if req.include_usage:
            body["usage"] = usage() if req.continuous_usage else None
        return sse(body)

    try:
        async with stream:
            for i in range(n):  # every choice starts with the assistant role
                yield chunk(i, {"role": "assistant", "content": ""})
            async for _rid, out in stream:
                if isinstance(out, Aborted):
                    for i, d in enumerate(deltas):
                        if not d.finished:
                            d.finished = True
                            yield chunk(i, {}, finish_reason="abort")
                    continue
                generated = out.num_generated_tokens
                for o in out.outputs:
                    d = deltas[o.index]
                    if d.finished:
                        continue
                    fin = o.finish_reason is not None
                    text = d.text_delta(o.text, fin)
                    s, e = d.new_token_range(len(o.token_ids))
                    lp = None
                    if k is not None and e > s:
                        lp = chat_logprobs(o.token_ids[s:e], (o.logprobs or [])[s:e], k, ctx.decode_token)
                    if not text and not fin and lp is None:
                        continue
                    d.finished = fin
                    yield chunk(o.index, {"content": text} if text or not fin else {}, lp,
                                o.finish_reason, o.stop_reason)
        if req.include_usage:
            yield sse({"id": base, "object": "chat.completion.chunk", "created": created, "model": model,
                       "choices": [], "usage": usage()})
    except EngineDeadError as e:
        yield sse(engine_failure(e).body())
    except APIError as e:
        yield sse(e.body())
    yield DONE
