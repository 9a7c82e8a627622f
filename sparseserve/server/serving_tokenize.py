"""POST /tokenize and POST /detokenize, vLLM's tokenizer API.

* `/tokenize`: `{"prompt": str}` (special tokens added by default, as the completions endpoint
  tokenizes) or `{"messages": [...]}` (the chat template applied as the chat endpoint applies it;
  `add_generation_prompt`, `continue_final_message`, `chat_template_kwargs`; no special tokens
  added by default: the template carries them) -> `{"count", "max_model_len", "tokens",
  "token_strs"}` (`token_strs` with `return_token_strs: true`, else null).
* `/detokenize`: `{"tokens": [int]}` -> `{"prompt": str}`; ids outside the vocabulary are a 400.

Both run the tokenizer in the server's tokenizer pool, never on the event loop or the engine.
"""
from __future__ import annotations

from typing import Any, Optional

from sparseserve.server.errors import APIError
from sparseserve.server.protocol import ChatCompletionRequest, ChatMessage, _Strict
from sparseserve.server.serving import ServingContext


class TokenizeRequest(_Strict):
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    add_special_tokens: Optional[bool] = None  # default: True for prompt, False for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: Optional[dict[str, Any]] = None
    return_token_strs: bool = False


class DetokenizeRequest(_Strict):
    model: Optional[str] = None
    tokens: list[int]


async def tokenize(ctx: ServingContext, req: TokenizeRequest) -> dict[str, Any]:
    ctx.check_model(req.model)
    ctx.check_unicode(req)
    if (req.prompt is None) == (req.messages is None):
        raise APIError("Send exactly one of `prompt` (text) and `messages` (a chat).",
                       param="prompt" if req.prompt is None else "messages")
    if ctx.tokenizer is None:
        raise APIError("This model has no tokenizer (dummy weights): there is nothing to "
                       "tokenize with.", param="prompt" if req.messages is None else "messages")
    if req.prompt is not None:
        ctx.check_chars(len(req.prompt), "prompt")
        special = True if req.add_special_tokens is None else req.add_special_tokens
        text = req.prompt
        ids = await ctx.in_tokenizer_thread(lambda tok: tok.encode(text, add_special_tokens=special))
    else:
        chat = ChatCompletionRequest(messages=req.messages)
        prompt = await ctx.apply_chat_template(chat.conversation(), req.add_generation_prompt,
                                               req.continue_final_message, req.chat_template_kwargs)
        ids = prompt.token_ids
        if req.add_special_tokens:  # the rendered text encoded with the tokenizer's specials
            text = prompt.text
            ids = await ctx.in_tokenizer_thread(lambda tok: tok.encode(text, add_special_tokens=True))
    ids = [int(t) for t in ids]
    strs = None
    if req.return_token_strs:
        strs = await ctx.in_tokenizer_thread(lambda tok: tok.convert_ids_to_tokens(ids))
    return {"count": len(ids), "max_model_len": ctx.max_model_len, "tokens": ids,
            "token_strs": strs}


async def detokenize(ctx: ServingContext, req: DetokenizeRequest) -> dict[str, Any]:
    ctx.check_model(req.model)
    if ctx.tokenizer is None:
        raise APIError("This model has no tokenizer (dummy weights): there is nothing to "
                       "detokenize with.", param="tokens")
    vocab = ctx.vocab_size
    bad = [t for t in req.tokens if t < 0 or (vocab is not None and t >= vocab)]
    if bad:
        raise APIError(f"tokens must be in [0, {vocab}); got {bad[:8]}.", param="tokens",
                       code="invalid_token_id")
    ids = list(req.tokens)
    text = await ctx.in_tokenizer_thread(lambda tok: tok.decode(ids))
    return {"prompt": text}
