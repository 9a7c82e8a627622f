"""What both OpenAI endpoints share: model-name and `n` checks, tokenization (off the event
loop, on a private copy of the tokenizer so it never races the engine thread's decoding),
context-length checks with vLLM's messages, and submitting to the async engine with its
errors mapped to HTTP errors."""
from __future__ import annotations

import asyncio
import copy
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Optional

from sparseserve.server.async_engine import (Aborted, AsyncLLMEngine, EngineDeadError,
                                             EngineOverloadedError, GenerationStream)
from sparseserve.server.errors import APIError, engine_dead, overloaded
from sparseserve.server.protocol import random_id
from sparseserve.server.serve_cli import DEFAULT_MAX_N
from sparseserve.server.streaming import until_disconnected

logger = logging.getLogger("sparseserve.server")


@dataclass
class Prompt:
    text: Optional[str]
    token_ids: list[int]

    def engine_input(self) -> dict[str, Any]:
        d: dict[str, Any] = {"prompt_token_ids": self.token_ids}
        if self.text is not None:
            d["prompt"] = self.text
        return d


class FinalOutputs:
    """Last output per engine request, remembering which ones the engine side aborted."""

    def __init__(self, request_ids: list[str]) -> None:
        self.request_ids = request_ids
        self.last: dict[str, Any] = {}
        self.aborted: set[str] = set()

    async def collect(self, stream: GenerationStream) -> "FinalOutputs":
        async with stream:
            async for rid, out in stream:
                if isinstance(out, Aborted):
                    self.aborted.add(rid)
                else:
                    self.last[rid] = out
        return self

    def choices(self, rid: str, n: int) -> list[tuple[int, str, list[int], Any, Optional[str], Any]]:
        """(index, text, token_ids, logprobs, finish_reason, stop_reason) for each of n samples."""
        out = self.last.get(rid)
        by_index = {o.index: o for o in out.outputs} if out is not None else {}
        rows = []
        for i in range(n):
            o = by_index.get(i)
            if o is None:
                rows.append((i, "", [], None, "abort", None))
                continue
            reason = o.finish_reason or ("abort" if rid in self.aborted else None)
            rows.append((i, o.text, list(o.token_ids), o.logprobs, reason, o.stop_reason))
        return rows

    def usage(self, prompts: list[Prompt]) -> dict[str, int]:
        prompt_tokens = sum(len(p.token_ids) for p in prompts)
        completion = sum(len(o.token_ids) for out in self.last.values() for o in out.outputs)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                "total_tokens": prompt_tokens + completion}


def request_ids(prefix: str, count: int) -> tuple[str, list[str]]:
    """A response id and one engine request id per prompt."""
    base = random_id(prefix)
    return base, ([base] if count == 1 else [f"{base}-{i}" for i in range(count)])


class ServingContext:
    def __init__(self, engine: AsyncLLMEngine, served_model_names: Optional[list[str]] = None,
                 max_n: int = DEFAULT_MAX_N, chat_template: Optional[str] = None) -> None:
        self.engine = engine
        core = engine.engine
        self.served_model_names = list(served_model_names or [getattr(core, "model_name", None) or "default"])
        self.model_name = self.served_model_names[0]
        self.max_model_len = int(core.max_model_len)
        self.max_n = max_n
        self.chat_template = chat_template
        tok = getattr(core, "tokenizer", None)
        try:
            self.tokenizer = copy.deepcopy(tok) if tok is not None else None
        except Exception:  # pragma: no cover - unpicklable tokenizer: share it
            self.tokenizer = tok
        self._tok_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sparseserve-tokenizer")

    def close(self) -> None:
        self._tok_pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ checks

    def check_model(self, model: Optional[str]) -> str:
        if model is None or model in self.served_model_names:
            return self.model_name if model is None else model
        raise APIError(f"The model '{model}' does not exist. This server serves "
                       f"{', '.join(repr(m) for m in self.served_model_names)}.",
                       param="model", code="model_not_found")

    def check_n(self, n: int, num_prompts: int = 1) -> None:
        if n > self.max_n:
            raise APIError(f"n must be <= {self.max_n} on this server, got {n}.", param="n")

    def check_length(self, prompt: Prompt, max_tokens: Optional[int], param: str,
                     max_tokens_param: str = "max_tokens") -> None:
        limit, n_prompt = self.max_model_len, len(prompt.token_ids)
        if n_prompt == 0:
            raise APIError("The prompt is empty.", param=param)
        if n_prompt >= limit:
            raise APIError(f"This model's maximum context length is {limit} tokens. However, your "
                           f"prompt has {n_prompt} tokens (at least one token must be generated). "
                           "Please reduce the length of the prompt.", param=param,
                           code="context_length_exceeded")
        if max_tokens is not None and n_prompt + max_tokens > limit:
            raise APIError(f"This model's maximum context length is {limit} tokens. However, you "
                           f"requested {n_prompt + max_tokens} tokens ({n_prompt} in the prompt, "
                           f"{max_tokens} in the completion). Please reduce the length of the "
                           f"prompt or {max_tokens_param}.", param=max_tokens_param,
                           code="context_length_exceeded")

    # ------------------------------------------------------------------ tokenization

    async def _in_tokenizer_thread(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tok_pool, lambda: fn(*args, **kwargs))

    async def encode(self, item: Any) -> Prompt:
        """A completion prompt (str or {"prompt_token_ids"}) -> Prompt, tokenized as the engine
        tokenizes text (`encode(text, add_special_tokens=True)`)."""
        if isinstance(item, dict):
            return Prompt(None, list(item["prompt_token_ids"]))  # the engine checks the vocab range
        if self.tokenizer is None:
            raise APIError("This model has no tokenizer; send the prompt as token ids.", param="prompt")
        ids = await self._in_tokenizer_thread(self.tokenizer.encode, item, add_special_tokens=True)
        return Prompt(item, list(ids))

    async def apply_chat_template(self, conversation: list[dict[str, str]], add_generation_prompt: bool,
                                  continue_final_message: bool, kwargs: Optional[dict[str, Any]]) -> Prompt:
        tok = self.tokenizer
        if tok is None:
            raise APIError("This model has no tokenizer, so it cannot serve chat; use /v1/completions "
                           "with token ids.", param="messages")
        if self.chat_template is None and not getattr(tok, "chat_template", None):
            raise APIError("This model has no chat template; use /v1/completions or start the "
                           "server with --chat-template.", param="messages")
        if continue_final_message and add_generation_prompt:
            raise APIError("continue_final_message and add_generation_prompt cannot both be true.",
                           param="continue_final_message")
        extra = dict(kwargs or {})
        if continue_final_message:
            extra["continue_final_message"] = True
        if self.chat_template is not None:
            extra["chat_template"] = self.chat_template

        def render() -> tuple[str, list[int]]:
            text = tok.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt,
                                           tokenize=False, **extra)
            ids = tok.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt,
                                          tokenize=True, return_dict=False, **extra)
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
            return text, list(ids)

        try:
            text, ids = await self._in_tokenizer_thread(render)
        except APIError:
            raise
        except Exception as e:  # jinja errors (e.g. roles must alternate)
            raise APIError(f"Could not apply the chat template: {e}", param="messages") from e
        return Prompt(text, ids)

    def decode_token(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"<{token_id}>"
        return self.tokenizer.decode([token_id])

    # ------------------------------------------------------------------ engine

    async def collect(self, raw: Any, stream: GenerationStream) -> Any:
        """Final outputs of a non-streaming request (None if the client went away first)."""
        try:
            return await until_disconnected(raw, FinalOutputs(stream.request_ids).collect(stream),
                                            stream.abort)
        except EngineDeadError as e:
            raise engine_dead(str(e)) from e

    async def submit(self, prompts: list[tuple[str, Prompt]], params: Any, arrival: float,
                     n: int, max_tokens: Optional[int]) -> GenerationStream:
        try:
            return await self.engine.submit([(rid, p.engine_input()) for rid, p in prompts], params,
                                            arrival, n=n, max_tokens=max_tokens)
        except EngineOverloadedError as e:
            raise overloaded(e.num_waiting, e.limit) from e
        except EngineDeadError as e:
            raise engine_dead(str(e)) from e
        except ValueError as e:
            raise APIError(str(e)) from e
