"""Incremental detokenization and stop-string checks.

Text is produced by decoding a short window of recent tokens and emitting only what is new,
and held back while it ends in U+FFFD (a UTF-8 character split across tokens), so streamed
text never contains a broken character. As in vLLM, stop strings are looked for only once more
than `min_tokens` output tokens were added (the first min_tokens tokens never stop).
"""
from __future__ import annotations

from typing import Any

REPLACEMENT = "\ufffd"
# tokens decoded before the new ones, so tokenizers that merge spaces see their context
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], stop: list[str],
                 include_stop: bool, skip_special_tokens: bool, min_tokens: int = 0) -> None:
        self.tokenizer = tokenizer
        self.min_tokens = min_tokens
        self.num_added = 0
        self.stop = stop
        self.include_stop = include_stop
        self.skip_special = skip_special_tokens
        self.tokens: list[int] = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)
        self.text = ""
        self.stopped_by: str | None = None

    def add(self, token_id: int) -> str:
        """Append one token; returns the newly decodable text (may be "")."""
        self.tokens.append(token_id)
        self.num_added += 1
        if self.tokenizer is None:
            return ""
        prefix = self._decode(self.tokens[self.prefix_offset:self.read_offset])
        full = self._decode(self.tokens[self.prefix_offset:])
        if len(full) <= len(prefix) or full.endswith(REPLACEMENT):
            return ""  # nothing printable yet (or an incomplete UTF-8 sequence)
        new = full[len(prefix):]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.tokens)
        return self._append(new)

    def flush(self) -> str:
        """At the end of a request: emit held-back text, even an incomplete character, so the
        final text equals decoding all output tokens at once."""
        if self.tokenizer is None or self.read_offset == len(self.tokens) or self.stopped_by:
            return ""
        prefix = self._decode(self.tokens[self.prefix_offset:self.read_offset])
        full = self._decode(self.tokens[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self.tokens)
        return self._append(full[len(prefix):]) if len(full) > len(prefix) else ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special,
                                     clean_up_tokenization_spaces=False)

    def _append(self, new: str) -> str:
        before = len(self.text)
        self.text += new
        if self.stop and self.num_added > self.min_tokens:
            # only the tail can complete a stop string
            window_start = max(0, before - max(len(s) for s in self.stop) + 1)
            hits = [(self.text.find(s, window_start), s) for s in self.stop]
            hits = [(i, s) for i, s in hits if i >= 0]
            if hits:
                i, s = min(hits)
                self.stopped_by = s
                self.text = self.text[:i + len(s)] if self.include_stop else self.text[:i]
                return self.text[before:] if len(self.text) > before else ""
        return new
