"""`StructuredOutputsParams`: the constraint of one request, named as in vLLM
(`vllm.sampling_params.StructuredOutputsParams`; the server's body field `structured_outputs`,
and the older `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar` and OpenAI's
`response_format` map onto it).

Exactly one of:
  json         a JSON schema (dict, or its JSON text)
  regex        a regular expression the whole output must match (Rust `regex` syntax)
  choice       a list of strings; the output is exactly one of them
  grammar      a Lark grammar (llguidance's dialect; `start` is the start rule)
  json_object  True: any JSON object (OpenAI's response_format {"type": "json_object"})

`source` is the request field the constraint came from (e.g. "response_format",
"guided_regex"); errors name it. Plain Python: no grammar library is imported here.
"""
from __future__ import annotations

import json as _json
from dataclasses import dataclass
from typing import Any, Optional

from sparseserve.validation import ParamError

KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    json: Optional[Any] = None
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None
    source: str = "structured_outputs"

    def __post_init__(self) -> None:
        self.validate()

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def field(self) -> str:
        """The request field to name in errors about this constraint."""
        if self.source == "structured_outputs":
            return f"structured_outputs.{self.kind}"
        return self.source

    def validate(self) -> None:
        """Shape checks (the grammar itself is checked when it is compiled)."""
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ParamError("structured outputs take exactly one of json, regex, choice, grammar or "
                             f"json_object; got {given or 'none'}.", self.source)
        where = self.field()
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    self.json = _json.loads(self.json)
                except ValueError as e:
                    raise ParamError(f"{where} is not valid JSON: {e}.", where) from e
            if not isinstance(self.json, (dict, bool)):
                raise ParamError(f"{where} must be a JSON schema (an object).", where)
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise ParamError(f"{where} must be a non-empty string.", where)
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            raise ParamError(f"{where} must be a non-empty Lark grammar.", where)
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or any(not isinstance(c, str) or not c for c in self.choice)):
                raise ParamError(f"{where} must be a non-empty list of non-empty strings.", where)
            self.choice = list(self.choice)
        if self.json_object is not None and self.json_object is not True:
            raise ParamError(f"{where} must be true when given.", where)

    def cache_key(self) -> str:
        value = getattr(self, self.kind)
        return self.kind + ":" + _json.dumps(value, sort_keys=True)
