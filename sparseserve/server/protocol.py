"""OpenAI-compatible request and response models (pydantic v2).

Requests are validated strictly (a string where a number belongs is an error, not a
conversion), unknown fields are ignored the way vLLM ignores them, and every request can be
turned into the engine's `SamplingParams`. Semantic checks that need the server's settings
(model name, `n` limit, context length) live in the handlers; the ones that don't live here
and raise `APIError` with the offending field as `param`.
"""
from __future__ import annotations

import time
import uuid
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from sparseserve.request import SamplingParams
from sparseserve.server.errors import APIError
from sparseserve.structured.params import StructuredOutputsParams
from sparseserve.validation import ParamError, conversation

MAX_LOGPROBS = SamplingParams.MAX_LOGPROBS


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False
    # vLLM extension: attach running usage to every chunk
    continuous_usage_stats: bool = False


class _SamplingRequest(_Strict):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: Optional[str] = None
    n: int = 1
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    stop: Optional[Union[str, list[str]]] = None
    seed: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    logit_bias: Optional[dict[str, float]] = None
    user: Optional[str] = None
    # vLLM extensions
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: Optional[list[int]] = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prompt_logprobs: Optional[int] = None
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs and the older
    # guided_* fields (at most one of them; see `structured_outputs_params`)
    response_format: Optional[dict[str, Any]] = None
    structured_outputs: Optional[dict[str, Any]] = None
    guided_json: Optional[Union[str, dict[str, Any]]] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None

    # SamplingParams field -> this request's field, where the names differ
    _PARAM_NAMES: dict[str, str] = {}

    def _check_common(self) -> None:
        """Checks that only make sense for the HTTP API (the rest: `sparseserve.validation`)."""
        if self.stream_options is not None and not self.stream:
            raise APIError("stream_options is only allowed when stream is true.",
                           param="stream_options")

    def structured_outputs_params(self) -> Optional[StructuredOutputsParams]:
        """The request's constraint, or None. Raises ParamError naming the field at fault."""
        given = [name for name in ("response_format", "structured_outputs", "guided_json",
                                   "guided_regex", "guided_choice", "guided_grammar")
                 if getattr(self, name) is not None]
        rf = self.response_format
        if rf is not None and rf.get("type", "text") == "text" and not rf.keys() - {"type"}:
            given.remove("response_format")
        if len(given) > 1:
            raise ParamError(f"Give at most one structured-output field; got {given}.", given[1])
        if not given:
            return None
        name = given[0]
        if name == "response_format":
            return _response_format(rf)
        if name == "structured_outputs":
            so = dict(self.structured_outputs)
            for ignored in ("backend", "disable_fallback", "disable_any_whitespace",
                            "disable_additional_properties", "whitespace_pattern"):
                so.pop(ignored, None)  # vLLM backend options: llguidance is the only backend
            unknown = sorted(set(so) - {"json", "regex", "choice", "grammar", "json_object"})
            if unknown:
                raise ParamError(f"structured_outputs has unknown fields {unknown}; use one of json, "
                                 "regex, choice, grammar, json_object.", "structured_outputs")
            return StructuredOutputsParams(**so)
        kind = name[len("guided_"):]
        return StructuredOutputsParams(**{kind: getattr(self, name)}, source=name)

    def _sampling_params(self, max_tokens: Optional[int], logprobs: Optional[int],
                         prompt_logprobs: Optional[int] = None) -> SamplingParams:
        def pick(value: Any, default: Any) -> Any:
            return default if value is None else value

        try:
            return SamplingParams(
                n=self.n,
                temperature=pick(self.temperature, 1.0),
                top_p=pick(self.top_p, 1.0),
                top_k=pick(self.top_k, -1),
                min_p=pick(self.min_p, 0.0),
                presence_penalty=pick(self.presence_penalty, 0.0),
                frequency_penalty=pick(self.frequency_penalty, 0.0),
                repetition_penalty=pick(self.repetition_penalty, 1.0),
                logit_bias=self.logit_bias or None,
                seed=self.seed,
                max_tokens=max_tokens,
                min_tokens=self.min_tokens,
                stop=self.stop,
                stop_token_ids=self.stop_token_ids,
                ignore_eos=self.ignore_eos,
                logprobs=logprobs,
                prompt_logprobs=pick(self.prompt_logprobs, prompt_logprobs),
                skip_special_tokens=self.skip_special_tokens,
                include_stop_str_in_output=self.include_stop_str_in_output,
                structured_outputs=self.structured_outputs_params(),
            )
        except ParamError as e:
            param = self._PARAM_NAMES.get(e.param or "", e.param)
            message = str(e)
            if param != e.param and e.param:
                message = message.replace(e.param, param, 1)
            raise APIError(message, param=param, code=e.code) from e
        except ValueError as e:  # pragma: no cover - every check raises ParamError
            raise APIError(str(e)) from e

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


def _response_format(rf: dict[str, Any]) -> StructuredOutputsParams:
    """OpenAI's response_format -> StructuredOutputsParams: {"type": "json_object"} or
    {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}."""
    kind = rf.get("type")
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True, source="response_format")
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or "schema" not in js:
            raise ParamError("response_format of type json_schema needs "
                             "{'json_schema': {'name': ..., 'schema': {...}}}.", "response_format.json_schema")
        return StructuredOutputsParams(json=js["schema"], source="response_format.json_schema.schema")
    raise ParamError(f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}.",
                     "response_format.type")


# --------------------------------------------------------------------------- completions

PromptType = Union[str, list[str], list[int], list[list[int]]]


class CompletionRequest(_SamplingRequest):
    prompt: PromptType
    max_tokens: Optional[int] = 16
    logprobs: Optional[int] = None
    echo: bool = False
    suffix: Optional[str] = None
    best_of: Optional[int] = None

    def prompts(self) -> list[Union[str, dict[str, list[int]]]]:
        """The prompts as engine inputs: strings, or {"prompt_token_ids": [...]}."""
        p = self.prompt
        if isinstance(p, str):
            items: list[Any] = [p]
        elif len(p) == 0:
            raise APIError("prompt must not be empty.", param="prompt")
        elif isinstance(p[0], int):
            items = [{"prompt_token_ids": list(p)}]
        elif isinstance(p[0], str):
            items = list(p)
        else:
            items = [{"prompt_token_ids": list(ids)} for ids in p]
        for item in items:
            if (isinstance(item, str) and not item) or (isinstance(item, dict) and not item["prompt_token_ids"]):
                raise APIError("prompt must not be empty.", param="prompt")
            if isinstance(item, dict) and any(t < 0 for t in item["prompt_token_ids"]):
                raise APIError("prompt token ids must be >= 0.", param="prompt")
        return items

    def to_sampling_params(self) -> SamplingParams:
        self._check_common()
        if self.suffix:
            raise APIError("suffix is not supported by sparseserve.", param="suffix")
        if self.best_of is not None:
            if self.best_of < self.n:
                raise APIError(f"best_of must be >= n={self.n}, got {self.best_of}.", param="best_of")
            if self.stream and self.best_of > 1:
                raise APIError("best_of cannot be used with stream (the best sequences are only "
                               "known at the end); drop best_of or stream.", param="best_of")
        # echo with logprobs reports the prompt's logprobs too (vLLM: prompt_logprobs = logprobs)
        echo_lp = self.logprobs if self.echo and self.logprobs is not None else None
        return self._sampling_params(self.max_tokens, self.logprobs, echo_lp)

    @property
    def num_samples(self) -> int:
        """Sequences generated per prompt (best_of when given, else n)."""
        return self.best_of if self.best_of is not None else self.n


class CompletionLogProbs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[Optional[float]] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[Optional[dict[str, float]]] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogProbs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Optional[UsageInfo] = None


# --------------------------------------------------------------------------- chat

class ChatContentPart(_Strict):
    model_config = ConfigDict(strict=True, extra="allow")
    type: str
    text: Optional[str] = None


class ChatMessage(_Strict):
    role: str
    content: Optional[Union[str, list[ChatContentPart]]] = None
    name: Optional[str] = None


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage]
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    tools: Optional[list[Any]] = None
    tool_choice: Optional[Any] = None
    parallel_tool_calls: Optional[bool] = None
    # vLLM extensions
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: Optional[dict[str, Any]] = None
    echo: bool = False

    def conversation(self) -> list[dict[str, str]]:
        """The messages for the chat template (rules: `sparseserve.validation.conversation`)."""
        raw = []
        for m in self.messages:
            d: dict[str, Any] = {"role": m.role}
            if "content" in m.model_fields_set:
                c = m.content
                d["content"] = c if c is None or isinstance(c, str) else [p.model_dump() for p in c]
            raw.append(d)
        try:
            return conversation(raw)
        except ParamError as e:
            raise APIError(str(e), param=e.param, code=e.code) from e

    def effective_max_tokens(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def to_sampling_params(self, default_max_tokens: Optional[int] = None) -> SamplingParams:
        self._check_common()
        max_tokens = self.effective_max_tokens()
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError("top_logprobs requires logprobs to be true.", param="top_logprobs")
        if self.tools:
            raise APIError("tools / function calling is not supported by sparseserve yet.", param="tools")
        if self.echo:
            raise APIError("echo is not supported by /v1/chat/completions in sparseserve; use "
                           "/v1/completions with echo.", param="echo")
        names = {"logprobs": "top_logprobs"}
        if self.max_completion_tokens is not None:
            names["max_tokens"] = "max_completion_tokens"
        self._PARAM_NAMES = names
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(max_tokens if max_tokens is not None else default_max_tokens, logprobs)

    @property
    def num_samples(self) -> int:
        return self.n


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: Optional[list[ChatTokenLogprob]] = None


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: Optional[str] = None


class ChatCompletionChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: Optional[ChatChoiceLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: Optional[UsageInfo] = None


class DeltaMessage(BaseModel):
    role: Optional[str] = None
    content: Optional[str] = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: Optional[ChatChoiceLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Optional[UsageInfo] = None


# --------------------------------------------------------------------------- models

class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "sparseserve"
    root: Optional[str] = None
    max_model_len: Optional[int] = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)
