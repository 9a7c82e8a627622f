"""What both OpenAI endpoints share: model-name, `n` and size checks, valid-Unicode checks,
tokenization (off the event loop and off the engine thread, in a small pool whose threads each
own a copy of the tokenizer, after a character-length bound so a huge prompt is rejected
without being tokenized), context-length checks with vLLM's messages, and submitting to the
async engine with its errors mapped to HTTP errors."""
from __future__ import annotations

import asyncio
import copy
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Optional

from sparseserve.server.async_engine import AsyncLLMEngine
from sparseserve.server.engine_errors import EngineDeadError, EngineOverloadedError
from sparseserve.server.generation_stream import Aborted, GenerationStream
from sparseserve.server.errors import (APIError, engine_failure, from_param_error, model_not_found,
                                       overloaded)
from sparseserve.server.limits import ServerLimits
from sparseserve.server.protocol import random_id
from sparseserve.server.streaming import until_disconnected
from sparseserve.validation import (ParamError, check_logit_bias_vocab, check_num_sequences,
                                    check_prompt_chars, check_unicode)

# chars one token can stand for when a tokenizer has no vocabulary to measure (upper bound)
_FALLBACK_TOKEN_CHARS = 64

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

    def cumulative_logprobs(self, rid: str) -> dict[int, float]:
        """{sample index: cumulative logprob} of one engine request (for best_of)."""
        out = self.last.get(rid)
        return {o.index: o.cumulative_logprob for o in out.outputs
                if o.cumulative_logprob is not None} if out is not None else {}

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
                 limits: Optional[ServerLimits] = None, chat_template: Optional[str] = None) -> None:
        self.engine = engine
        core = engine.engine
        self.served_model_names = list(served_model_names or [getattr(core, "model_name", None) or "default"])
        self.model_name = self.served_model_names[0]
        self.max_model_len = int(core.max_model_len)
        self.limits = limits or ServerLimits()
        self.max_n = self.limits.max_n
        self.chat_template = chat_template
        self.tokenizer = getattr(core, "tokenizer", None)
        vocab = getattr(core, "vocab_size", None)
        self.vocab_size = int(vocab) if vocab else (len(self.tokenizer) if self.tokenizer is not None else None)
        self.max_token_chars = 2 * _max_token_chars(self.tokenizer)  # x2: normalisation can merge chars
        self._local = threading.local()
        try:  # the event loop's own copy, for decoding logprob tokens
            self._decode_tok = copy.deepcopy(self.tokenizer)
        except Exception:  # pragma: no cover
            self._decode_tok = self.tokenizer
        self._tok_pool = ThreadPoolExecutor(max_workers=self.limits.tokenizer_workers,
                                            thread_name_prefix="sparseserve-tokenizer")

    def close(self) -> None:
        self._tok_pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ checks

    def check_model(self, model: Optional[str]) -> str:
        if model is None or model in self.served_model_names:
            return self.model_name if model is None else model
        raise model_not_found(model, self.served_model_names)

    @staticmethod
    def check_unicode(req: Any) -> None:
        """400 naming the first field whose text is not valid Unicode (a lone surrogate)."""
        try:
            check_unicode(req.model_dump(exclude_defaults=True))
        except ParamError as e:
            raise from_param_error(e) from e

    def check_request(self, params: Any, num_prompts: int, num_samples: int) -> None:
        """n / best_of against --max-n, prompts x samples against --max-seqs-per-request,
        logit_bias and stop_token_ids inside the vocabulary."""
        if params.n > self.max_n:
            raise APIError(f"n must be <= {self.max_n} on this server (--max-n), got {params.n}.", param="n")
        if num_samples > self.max_n:
            raise APIError(f"best_of must be <= {self.max_n} on this server (--max-n), got {num_samples}.",
                           param="best_of")
        try:
            check_num_sequences(num_prompts, num_samples, self.limits.max_sequences)
            if self.vocab_size is not None:
                check_logit_bias_vocab(params.logit_bias, self.vocab_size)
                bad = [t for t in params.stop_token_ids if t >= self.vocab_size]
                if bad:
                    raise ParamError(f"stop_token_ids {bad[:8]} are outside the vocabulary "
                                     f"[0, {self.vocab_size}).", "stop_token_ids")
        except ParamError as e:
            raise from_param_error(e) from e

    async def check_structured(self, params: Any) -> None:
        """400 when the request's structured-output constraint cannot be served: no tokenizer,
        or a grammar (schema, regex, choice, Lark) that does not compile, naming the field.
        Compiles in the tokenizer pool (the first use also builds llguidance's tokenizer there),
        so neither the event loop nor the engine thread waits for it."""
        spec = getattr(params, "structured_outputs", None)
        if spec is None:
            return
        core = self.engine.engine
        try:
            backend = core.grammar_backend(spec.field())
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(self._tok_pool, backend.check, spec)
        except ParamError as e:
            raise from_param_error(e) from e

    def check_chars(self, num_chars: int, param: str) -> None:
        try:
            check_prompt_chars(num_chars, self.max_model_len, self.max_token_chars, param)
        except ParamError as e:
            raise from_param_error(e) from e

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
        if self.vocab_size is not None and prompt.text is None:
            bad = [t for t in prompt.token_ids if t >= self.vocab_size]
            if bad:
                raise APIError(f"prompt token ids must be in [0, {self.vocab_size}); got {bad[:8]}.",
                               param=param, code="invalid_token_id")

    # ------------------------------------------------------------------ tokenization

    def _thread_tokenizer(self) -> Any:
        """This pool thread's own copy of the tokenizer (HF fast tokenizers are not safe to
        share between threads, and the engine thread decodes with the original)."""
        tok = getattr(self._local, "tok", None)
        if tok is None:
            try:
                tok = copy.deepcopy(self.tokenizer)
            except Exception:  # pragma: no cover - an uncopyable tokenizer: share it
                tok = self.tokenizer
            self._local.tok = tok
        return tok

    async def in_tokenizer_thread(self, fn: Any) -> Any:
        """Run fn(tokenizer) in the pool with that thread's tokenizer."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tok_pool, lambda: fn(self._thread_tokenizer()))

    async def encode(self, item: Any) -> Prompt:
        """A completion prompt (str or {"prompt_token_ids"}) -> Prompt, tokenized as the engine
        tokenizes text (`encode(text, add_special_tokens=True)`)."""
        if isinstance(item, dict):
            return Prompt(None, list(item["prompt_token_ids"]))  # check_length checks the vocab range
        if self.tokenizer is None:
            raise APIError("This model has no tokenizer; send the prompt as token ids.", param="prompt")
        self.check_chars(len(item), "prompt")
        ids = await self.in_tokenizer_thread(lambda tok: tok.encode(item, add_special_tokens=True))
        return Prompt(item, list(ids))

    async def apply_chat_template(self, conversation: list[dict[str, str]], add_generation_prompt: bool,
                                  continue_final_message: bool, kwargs: Optional[dict[str, Any]]) -> Prompt:
        if self.tokenizer is None:
            raise APIError("This model has no tokenizer, so it cannot serve chat; use /v1/completions "
                           "with token ids.", param="messages")
        if self.chat_template is None and not getattr(self.tokenizer, "chat_template", None):
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

        self.check_chars(sum(len(m["content"]) for m in conversation), "messages")

        def render(tok: Any) -> tuple[str, list[int]]:
            text = tok.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt,
                                           tokenize=False, **extra)
            ids = tok.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt,
                                          tokenize=True, return_dict=False, **extra)
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
            return text, list(ids)

        try:
            text, ids = await self.in_tokenizer_thread(render)
        except APIError:
            raise
        except Exception as e:  # jinja errors (e.g. roles must alternate)
            raise APIError(f"Could not apply the chat template: {e}", param="messages") from e
        return Prompt(text, ids)

    def decode_token(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"<{token_id}>"
        return self._decode_tok.decode([token_id])

    def decode_tokens(self, token_ids: list[int]) -> str:
        """Text of a token-id prompt (for echo)."""
        if self.tokenizer is None:
            return "".join(f"<{t}>" for t in token_ids)
        return self._decode_tok.decode(token_ids)

    # ------------------------------------------------------------------ engine

    async def collect(self, raw: Any, stream: GenerationStream) -> Any:
        """Final outputs of a non-streaming request (None if the client went away first)."""
        try:
            return await until_disconnected(raw, FinalOutputs(stream.request_ids).collect(stream),
                                            stream.abort)
        except EngineDeadError as e:
            raise engine_failure(e) from e

    async def submit(self, prompts: list[tuple[str, Prompt]], params: Any, arrival: float,
                     n: int, max_tokens: Optional[int]) -> GenerationStream:
        try:
            return await self.engine.submit([(rid, p.engine_input()) for rid, p in prompts], params,
                                            arrival, n=n, max_tokens=max_tokens)
        except EngineOverloadedError as e:
            raise overloaded(e.num_waiting, e.limit) from e
        except EngineDeadError as e:
            raise engine_failure(e) from e
        except ParamError as e:
            raise from_param_error(e) from e
        except ValueError as e:
            raise APIError(str(e)) from e


def _max_token_chars(tokenizer: Any) -> int:
    """The most characters one token of `tokenizer` decodes to (an upper bound: vocabulary
    strings are at least as long as their text)."""
    get_vocab = getattr(tokenizer, "get_vocab", None)
    if get_vocab is None:
        return _FALLBACK_TOKEN_CHARS
    try:
        return max((len(t) for t in get_vocab()), default=_FALLBACK_TOKEN_CHARS)
    except Exception:  # pragma: no cover
        return _FALLBACK_TOKEN_CHARS
