"""The offline API, shaped like vLLM's: `LLM(...).generate(prompts, params)` and `.chat(...)`."""
from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Sequence

from sparseserve.engine.args import EngineArgs
from sparseserve.engine.llm_engine import LLMEngine
from sparseserve.outputs import RequestOutput
from sparseserve.request import RequestOutputKind, SamplingParams
from sparseserve.validation import (ParamError, check_logit_bias_vocab, check_unicode,
                                    conversation)


class LLM:
    """Generate text offline. `LLM()` with no model loads the embedded SmolLM2-135M-Instruct.

    Keyword arguments are EngineArgs fields (vLLM names): load_format, dtype, device,
    max_model_len, max_num_seqs, max_num_batched_tokens, page_size, kv_cache_memory_bytes,
    gpu_memory_utilization, seed, enforce_eager, ...
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        self.engine = LLMEngine.from_engine_args(EngineArgs(model=model, **kwargs))
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Any, sampling_params: SamplingParams | Sequence[SamplingParams]
                 | None = None, use_tqdm: bool = True) -> list[RequestOutput]:
        """prompts: a string, a list of strings, {"prompt_token_ids": [...]} or a list of
        those. Returns one RequestOutput per prompt, in order."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        elif prompts and isinstance(prompts, list) and isinstance(prompts[0], int):
            prompts = [{"prompt_token_ids": prompts}]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = (list(sampling_params) if isinstance(sampling_params, (list, tuple))
                  else [sampling_params] * len(prompts))
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts.")
        self._validate(prompts, params)
        # only finished outputs are returned: the engine builds no per-step output for them
        # (copies of each request's tokens, text and logprobs so far, every step); the
        # caller's objects are left as they are
        final = {id(p): dataclasses.replace(p, output_kind=RequestOutputKind.FINAL_ONLY)
                 for p in params}
        params = [final[id(p)] for p in params]
        ids = []
        try:
            for prompt, p in zip(prompts, params):
                rid = str(next(self._ids))
                self.engine.add_request(rid, prompt, p)
                ids.append(rid)
            return self._run(ids, use_tqdm)
        except BaseException:
            self.engine.abort_request(ids)  # nothing stays queued after an error
            raise

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             chat_template: str | None = None) -> list[RequestOutput]:
        """One conversation (a list of messages) or several. Messages follow the server's
        rules (`sparseserve.validation.conversation`): content is a string or a list of
        {"type": "text", "text": ...} parts; roles system/user/assistant/developer/tool."""
        tok = self.get_tokenizer()
        if tok is None:
            raise ValueError("This model has no tokenizer, so chat templates are unavailable.")
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        convs = []
        for i, conv in enumerate(conversations):
            check_unicode(conv, "messages" if len(conversations) == 1 else f"messages.{i}")
            convs.append(conversation(conv))
        extra = {"chat_template": chat_template} if chat_template is not None else {}
        prompts = []
        for conv in convs:
            try:
                ids = tok.apply_chat_template(conv, add_generation_prompt=add_generation_prompt,
                                              tokenize=True, return_dict=False, **extra)
            except Exception as e:  # jinja errors (e.g. roles must alternate)
                raise ParamError(f"Could not apply the chat template: {e}", "messages") from e
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
            prompts.append({"prompt_token_ids": list(ids)})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _validate(self, prompts: list[Any], params: list[SamplingParams]) -> None:
        """The server's rules before anything is queued: valid SamplingParams, valid Unicode,
        logit_bias inside the vocabulary."""
        vocab = self.engine.config.model.vocab_size
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            if not isinstance(p, SamplingParams):
                raise TypeError(f"sampling_params[{i}] is a {type(p).__name__}, not SamplingParams.")
            p.validate()
            check_logit_bias_vocab(p.logit_bias, vocab)
            check_unicode(prompt, "prompt" if len(prompts) == 1 else f"prompt.{i}")

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        results: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm and len(ids) > 1:
            from tqdm.auto import tqdm
            bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True)
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    results[out.request_id] = out
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return [results[i] for i in ids]
