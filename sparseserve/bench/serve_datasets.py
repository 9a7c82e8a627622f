"""Workloads of `sparseserve bench serve`: request lengths -> prompts.

* `random`: vLLM's random dataset. Input and output lengths are drawn uniformly from
  [L * (1 - r), L * (1 + r)] (L = --random-input-len / --random-output-len, r =
  --random-range-ratio), prompts are random token ids.
* `longbench`: lengths from `longbench.sample_lengths`; prompt content is real text the
  project did not write (bench/texts.py: standard-library code for the code datasets, the
  Python docs, licenses and IDLE's change log for the others; there is no local Chinese text,
  so the two Chinese datasets get English prose of their token length), or random token ids
  when there is no tokenizer.

With a tokenizer, prompts are sent as text (decoded from the chosen token ids and trimmed so
that the server's own tokenization, `encode(text, add_special_tokens=True)`, is not longer
than the drawn length); without one, as token ids. The server's `usage` reports the exact
prompt length either way.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np

from sparseserve.bench import longbench, texts
from sparseserve.bench.serve_types import BenchRequest

CODE_DATASETS = ("lcc", "repobench-p")
PROSE_KINDS = ("docs", "licenses", "news")


def random_lengths(num: int, mean: int, range_ratio: float, rng: np.random.Generator,
                   what: str) -> np.ndarray:
    if mean < 1:
        raise ValueError(f"--random-{what}-len must be >= 1, got {mean}.")
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}.")
    lo = max(1, int(np.floor(mean * (1 - range_ratio))))
    hi = max(lo, int(np.ceil(mean * (1 + range_ratio))))
    return rng.integers(lo, hi + 1, size=num)


def _random_ids(rng: np.random.Generator, length: int, vocab_size: int) -> list[int]:
    return rng.integers(0, vocab_size, size=length).tolist()


class TextPool:
    """Token ids of real text per kind, tokenized once; windows at distinct offsets."""

    MAX_SOURCES = 16  # texts of a kind concatenated at most (each is long)

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._pools: dict[str, tuple[list[int], int]] = {}  # kind -> (ids, next source index)

    def pool(self, kind: str, need: int) -> list[int]:
        ids, k = self._pools.get(kind, ([], 0))
        while len(ids) < 2 * need and k < self.MAX_SOURCES:  # room for windows at many offsets
            _, raw = texts.source_text(kind, k)
            ids = ids + self.tokenizer.encode(raw, add_special_tokens=False)
            k += 1
        self._pools[kind] = (ids, k)
        return ids

    def window(self, kind: str, length: int, index: int) -> list[int]:
        ids = self.pool(kind, length)
        while len(ids) < length:  # a short source: repeat it
            ids = ids + ids
        span = len(ids) - length
        start = (index * 7919) % (span + 1)  # a prime stride: prompts differ from each other
        return ids[start:start + length]


def _fit_text(tokenizer: Any, ids: list[int], length: int) -> str:
    """Text whose server-side tokenization (with special tokens) has at most `length` tokens."""
    keep = list(ids[:max(1, length)])
    for _ in range(8):
        text = tokenizer.decode(keep)
        n = len(tokenizer.encode(text, add_special_tokens=True))
        if n <= length or len(keep) <= 1:
            return text
        keep = keep[:max(1, len(keep) - (n - length))]
    return tokenizer.decode(keep[:max(1, len(keep) // 2)])


def _request(ids: list[int], length: int, output_len: int, dataset: str,
             tokenizer: Any, as_text: bool) -> BenchRequest:
    if as_text:
        return BenchRequest(prompt_len=length, output_len=output_len, dataset=dataset,
                            prompt=_fit_text(tokenizer, ids, length))
    return BenchRequest(prompt_len=len(ids), output_len=output_len, dataset=dataset,
                        prompt_token_ids=list(ids))


def build_requests(dataset_name: str, num_prompts: int, seed: int, tokenizer: Any = None,
                   vocab_size: Optional[int] = None, token_ids: bool = False,
                   max_input_len: Optional[int] = None, max_model_len: Optional[int] = None,
                   random_input_len: int = 1024, random_output_len: int = 128,
                   random_range_ratio: float = 0.0, longbench_datasets: Optional[Sequence[str]] = None,
                   longbench_output_len: Optional[int] = None) -> list[BenchRequest]:
    """The workload's requests, deterministic for a seed (and a Python installation).

    tokenizer: the served model's tokenizer, or None (then prompts are token ids and
    `vocab_size` is required). token_ids: send token ids even with a tokenizer.
    """
    if num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {num_prompts}.")
    if tokenizer is None and not vocab_size:
        raise ValueError("without a tokenizer the benchmark needs the model's vocabulary size "
                         "to draw random token ids; pass --tokenizer or --vocab-size.")
    vocab = vocab_size or tokenizer.vocab_size  # base vocabulary: ids every engine accepts
    as_text = tokenizer is not None and not token_ids
    rng = np.random.default_rng(seed)
    if dataset_name == "random":
        ins = random_lengths(num_prompts, random_input_len, random_range_ratio, rng, "input")
        outs = random_lengths(num_prompts, random_output_len, random_range_ratio, rng, "output")
        reqs = []
        for n_in, n_out in zip(ins.tolist(), outs.tolist()):
            if max_input_len is not None:
                n_in = min(n_in, max_input_len)
            if max_model_len is not None:
                n_in = min(n_in, max_model_len - n_out)
            if n_in < 1:
                raise ValueError(f"an output of {n_out} tokens leaves no room for a prompt in "
                                 f"max_model_len {max_model_len}; lower --random-output-len.")
            reqs.append(_request(_random_ids(rng, n_in, vocab), n_in, n_out, "random",
                                 tokenizer, as_text))
        return reqs
    if dataset_name != "longbench":
        raise ValueError(f"unknown dataset {dataset_name!r}; choose longbench or random.")
    samples = longbench.sample_lengths(num_prompts, seed, max_input_len, max_model_len,
                                       longbench_datasets, output_len=longbench_output_len)
    pool = TextPool(tokenizer) if tokenizer is not None else None
    reqs = []
    for i, s in enumerate(samples):
        if pool is None:
            ids = _random_ids(rng, s.input_len, vocab)
        else:
            kind = "code" if s.dataset in CODE_DATASETS else PROSE_KINDS[i % len(PROSE_KINDS)]
            ids = pool.window(kind, s.input_len, i)
        reqs.append(_request(ids, s.input_len, s.output_len, s.dataset, tokenizer, as_text))
    return reqs
