"""Request validation shared by the server, the offline `LLM` API and the CLI.

One set of rules, one set of messages: every check raises `ParamError` (a `ValueError`), which
names the offending field in `param` with the server's (OpenAI / vLLM) field names, so the
server turns it into a 400 with `param` set and `LLM.generate` / `sparseserve generate` show
the same message. Plain Python (no torch, no web framework), so the CLI can validate before
it loads a model.

Contracts:
* `check_sampling_params(p)`  everything `SamplingParams` can check on its own (vLLM's rules:
  ranges, finiteness, int64 seeds, min_tokens <= max_tokens, penalties, logit_bias values,
  the shape of structured_outputs; its grammar compiles later, against the tokenizer).
* `check_logit_bias_vocab(bias, vocab_size)`  token ids of logit_bias inside the vocabulary.
* `conversation(messages)`  OpenAI messages (dicts; content a string or a list of text parts)
  -> `[{"role", "content": str}]` for a chat template; unknown roles and null content rejected.
* `find_invalid_unicode(obj)`  the path of the first string that is not valid Unicode (a lone
  surrogate such as "\\udfff" decoded from JSON), or None.
* `check_prompt_chars(num_chars, max_model_len, max_token_chars, param)`  a prompt longer in
  characters than `max_model_len` tokens could ever cover is rejected before tokenizing.
* `check_num_sequences(num_prompts, n, limit)`  prompts x n sequences per request.
"""
from __future__ import annotations

import math
from typing import Any, Optional

from sparseserve.request import RequestOutputKind

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
PENALTY_LIMIT = 2.0  # presence / frequency penalties lie in [-2, 2] (OpenAI, vLLM)
LOGIT_BIAS_LIMIT = 100.0  # logit_bias values are clamped to [-100, 100] (vLLM)
MAX_LOGIT_BIAS_ENTRIES = 1024
CHAT_ROLES = ("system", "user", "assistant", "developer", "tool")


class ParamError(ValueError):
    """Bad input. `param` is the request field at fault (dotted path), `code` a short id."""

    def __init__(self, message: str, param: Optional[str] = None, code: Optional[str] = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


def _number(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ParamError(f"{name} must be a number, got {value!r}.", name)
    if not math.isfinite(value):
        raise ParamError(f"{name} must be a finite number, got {value!r}.", name)
    return float(value)


def _integer(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ParamError(f"{name} must be an integer, got {value!r}.", name)
    return value


def check_sampling_params(p: Any) -> None:
    """vLLM's SamplingParams rules; raises ParamError naming the field. May normalise
    `top_k == 0` to -1 (both mean disabled) and clamp logit_bias values to [-100, 100]."""
    if _integer(p.n, "n") < 1:
        raise ParamError(f"n must be an integer >= 1, got {p.n!r}.", "n")
    try:
        p.output_kind = RequestOutputKind(p.output_kind)
    except ValueError:
        raise ParamError(f"output_kind must be one of {[k.name for k in RequestOutputKind]} "
                         f"(DELTA is not offered: stream through the server), got "
                         f"{p.output_kind!r}.", "output_kind") from None
    if _number(p.temperature, "temperature") < 0:
        raise ParamError(f"temperature must be >= 0 (0 = greedy), got {p.temperature}.", "temperature")
    if not 0.0 < _number(p.top_p, "top_p") <= 1.0:
        raise ParamError(f"top_p must be in (0, 1], got {p.top_p}; use 1.0 to disable it.", "top_p")
    if _integer(p.top_k, "top_k") == 0:
        p.top_k = -1  # 0 also means "disabled", as in many clients
    if p.top_k < -1:
        raise ParamError(f"top_k must be -1 or 0 (disabled) or >= 1, got {p.top_k}.", "top_k")
    if not 0.0 <= _number(p.min_p, "min_p") <= 1.0:
        raise ParamError(f"min_p must be in [0, 1], got {p.min_p}.", "min_p")
    for name in ("presence_penalty", "frequency_penalty"):
        v = _number(getattr(p, name), name)
        if not -PENALTY_LIMIT <= v <= PENALTY_LIMIT:
            raise ParamError(f"{name} must be in [-2, 2], got {v}.", name)
    if _number(p.repetition_penalty, "repetition_penalty") <= 0:
        raise ParamError(f"repetition_penalty must be > 0 (1 = off), got {p.repetition_penalty}.",
                         "repetition_penalty")
    if p.seed is not None and not INT64_MIN <= _integer(p.seed, "seed") <= INT64_MAX:
        raise ParamError(f"seed must be a 64-bit signed integer (in [{INT64_MIN}, {INT64_MAX}]), "
                         f"got {p.seed}.", "seed")
    if p.max_tokens is not None and _integer(p.max_tokens, "max_tokens") < 1:
        raise ParamError(f"max_tokens must be >= 1, got {p.max_tokens}.", "max_tokens")
    if _integer(p.min_tokens, "min_tokens") < 0:
        raise ParamError(f"min_tokens must be >= 0, got {p.min_tokens}.", "min_tokens")
    if p.max_tokens is not None and p.min_tokens > p.max_tokens:
        raise ParamError(f"min_tokens must be <= max_tokens={p.max_tokens}, got {p.min_tokens}.",
                         "min_tokens")
    limit = p.MAX_LOGPROBS
    for name in ("logprobs", "prompt_logprobs"):
        v = getattr(p, name)
        if v is not None and not 0 <= _integer(v, name) <= limit:
            raise ParamError(f"{name} must be in [0, {limit}], got {v}.", name)
    if any(not isinstance(s, str) or not s for s in p.stop):
        raise ParamError("stop strings must be non-empty strings.", "stop")
    for t in p.stop_token_ids:
        if _integer(t, "stop_token_ids") < 0:
            raise ParamError(f"stop_token_ids must be >= 0, got {t}.", "stop_token_ids")
    if p.logit_bias:
        p.logit_bias = normalize_logit_bias(p.logit_bias)
    if p.structured_outputs is not None:
        p.structured_outputs = structured_outputs(p.structured_outputs)


def structured_outputs(value: Any) -> Any:
    """A StructuredOutputsParams, or a dict of its fields -> StructuredOutputsParams (checked)."""
    from sparseserve.structured.params import StructuredOutputsParams

    if isinstance(value, StructuredOutputsParams):
        value.validate()
        return value
    if isinstance(value, dict):
        unknown = sorted(set(value) - set(StructuredOutputsParams.__dataclass_fields__))
        if unknown:
            raise ParamError(f"structured_outputs has unknown fields {unknown}; use json, regex, "
                             "choice, grammar or json_object.", "structured_outputs")
        return StructuredOutputsParams(**value)
    raise ParamError("structured_outputs must be a StructuredOutputsParams or a dict with one of "
                     "json, regex, choice, grammar, json_object.", "structured_outputs")


def normalize_logit_bias(bias: Any) -> dict[int, float]:
    """{token id (int or its decimal string): bias} -> {int: float clamped to [-100, 100]}."""
    if not isinstance(bias, dict):
        raise ParamError("logit_bias must map token ids to numbers.", "logit_bias")
    if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise ParamError(f"logit_bias may hold at most {MAX_LOGIT_BIAS_ENTRIES} entries, got "
                         f"{len(bias)}.", "logit_bias")
    out: dict[int, float] = {}
    for key, value in bias.items():
        try:
            tid = int(key) if not isinstance(key, bool) else None
        except (TypeError, ValueError):
            tid = None
        if tid is None or tid < 0:
            raise ParamError(f"logit_bias keys must be token ids (integers >= 0), got {key!r}.",
                             "logit_bias")
        v = _number(value, "logit_bias")
        out[tid] = min(LOGIT_BIAS_LIMIT, max(-LOGIT_BIAS_LIMIT, v))
    return out


def check_logit_bias_vocab(bias: Optional[dict[int, float]], vocab_size: int) -> None:
    bad = sorted(t for t in (bias or {}) if t >= vocab_size)
    if bad:
        raise ParamError(f"logit_bias token ids {bad[:8]} are outside the vocabulary [0, {vocab_size}).",
                         "logit_bias")


# --------------------------------------------------------------------------- text and chat

def find_invalid_unicode(obj: Any, path: str = "") -> Optional[str]:
    """Dotted path of the first str in `obj` (nested dicts / lists) that cannot be encoded as
    UTF-8 (a lone surrogate), or None. Dict keys are checked too."""
    if isinstance(obj, str):
        try:
            obj.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
        return None
    if isinstance(obj, dict):
        for k, v in obj.items():
            sub = f"{path}.{k}" if path else str(k)
            hit = find_invalid_unicode(k, sub) or find_invalid_unicode(v, sub)
            if hit:
                return hit
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            hit = find_invalid_unicode(v, f"{path}.{i}" if path else str(i))
            if hit:
                return hit
    return None


def check_unicode(obj: Any, param: str = "") -> None:
    where = find_invalid_unicode(obj, param)
    if where:
        raise ParamError(f"'{where}' is not valid Unicode text (it holds a lone surrogate such as "
                         "\\udfff); send UTF-8 text.", where, "invalid_unicode")


def check_prompt_chars(num_chars: int, max_model_len: int, max_token_chars: int, param: str) -> None:
    """A text of more than max_model_len * max_token_chars characters needs more than
    max_model_len tokens whatever the tokenizer does: reject it without tokenizing."""
    limit = max_model_len * max(1, max_token_chars)
    if num_chars > limit:
        raise ParamError(f"This model's maximum context length is {max_model_len} tokens; your "
                         f"{param} has {num_chars} characters, more than any {max_model_len}-token "
                         "text can hold. Please reduce the length of the prompt.", param,
                         "context_length_exceeded")


def _content_text(content: Any, i: int) -> str:
    where = f"messages.{i}.content"
    if isinstance(content, str):
        return content
    if content is None:
        raise ParamError(f"messages[{i}].content must be a string or a list of text parts, got null.",
                         where)
    if not isinstance(content, list):
        raise ParamError(f"messages[{i}].content must be a string or a list of text parts.", where)
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ParamError(f"messages[{i}]: content part type {kind!r} is not supported "
                             "(sparseserve serves text-only models; send {'type': 'text', 'text': ...}).",
                             where)
        texts.append(part["text"])
    return "\n".join(texts)


def conversation(messages: Any) -> list[dict[str, str]]:
    """OpenAI chat messages -> [{"role", "content": str}] for a chat template ("developer"
    becomes "system"; text parts are joined with newlines, as vLLM does)."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ParamError("messages must contain at least one message.", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ParamError(f"messages[{i}] must be an object with 'role' and 'content'.", f"messages.{i}")
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise ParamError(f"messages[{i}].role must be one of {sorted(CHAT_ROLES)}, got {role!r}.",
                             f"messages.{i}.role")
        if "content" not in m:
            raise ParamError(f"messages[{i}] has no content.", f"messages.{i}.content")
        out.append({"role": "system" if role == "developer" else role,
                    "content": _content_text(m["content"], i)})
    return out


def check_num_sequences(num_prompts: int, n: int, limit: int) -> None:
    if num_prompts * n > limit:
        raise ParamError(f"This request asks for {num_prompts} prompts x n={n} = {num_prompts * n} "
                         f"sequences; the server allows at most {limit} per request. Split it into "
                         "smaller requests.", "prompt" if num_prompts > 1 else "n")
