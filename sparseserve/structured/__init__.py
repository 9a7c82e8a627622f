"""Structured output (grammar-constrained decoding).

* `params.StructuredOutputsParams`  what a request asks for (vLLM's names: json, regex, choice,
  grammar, json_object), plain Python so the CLI and the server validate it without the
  grammar library;
* `backend.GrammarBackend`  compiles it with llguidance against the model's tokenizer and
  hands out one matcher per sequence;
* `sparseserve.worker.grammar`  fills and applies the token bitmasks in the sampler.
"""
from sparseserve.structured.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
