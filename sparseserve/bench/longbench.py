"""The LongBench-shaped workload of SparseServe's serving trace: request lengths only.

SparseServe's trace mixes ten LongBench datasets. For each we take:

* the average input length published by LongBench (Bai et al. 2023, "LongBench: A Bilingual,
  Multitask Benchmark for Long Context Understanding", arXiv:2308.14508, Table 1 "Avg len";
  the same table is THUDM/LongBench LongBench/task.md at commit 2e00731f8d0b). LongBench counts
  words (Python's str.split) for English and code datasets and characters for Chinese ones,
  to stay independent of any tokenizer;
* LongBench's own generation limit, max_new_tokens, from THUDM/LongBench
  LongBench/config/dataset2maxlen.json (same commit).

Words and characters become tokens with one stated factor per unit (TOKENS_PER_UNIT):

* English words: 4/3 tokens per word, OpenAI's published rule of thumb "1 token ~ 3/4 of a
  word" (help.openai.com/en/articles/4936856-what-are-tokens-and-how-to-count-them);
* code words: 2.3 tokens per whitespace-separated word, measured here with the embedded
  SmolLM2 tokenizer on the Python standard-library modules of bench/texts.py (real code:
  2.32; tests/bench/test_longbench.py re-measures it);
* Chinese characters: 0.6 tokens per character, DeepSeek's published conversion
  (api-docs.deepseek.com/quick_start/token_usage: "1 Chinese character ~ 0.6 token").

Each request picks a dataset uniformly (the trace's mixing weights are not published), then
an input length from a lognormal whose mean is the dataset's mean in tokens (sigma
LOGNORMAL_SIGMA, i.e. a coefficient of variation of about 0.53, a spread comparable to
LongBench's), capped by `max_input_len` (the paper: 32k for LWM-7B, 128k for Llama-3-8B) and
by `max_model_len - output_len` so that every request fits the server. The output length is
the dataset's max_new_tokens (all of it is generated when the client sends ignore_eos).
Everything is deterministic for a seed.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

TOKENS_PER_UNIT = {"words": 4.0 / 3.0, "code words": 2.3, "chars": 0.6}
LOGNORMAL_SIGMA = 0.5
MIN_INPUT_LEN = 16  # shorter prompts are not long-context requests


@dataclass(frozen=True)
class LongBenchDataset:
    name: str  # LongBench's config key
    title: str
    language: str
    avg_len: int  # LongBench Table 1 "Avg len", in `unit`
    unit: str  # "words", "code words" or "chars"
    max_new_tokens: int  # dataset2maxlen.json

    @property
    def mean_input_tokens(self) -> float:
        return self.avg_len * TOKENS_PER_UNIT[self.unit]


DATASETS: dict[str, LongBenchDataset] = {d.name: d for d in (
    LongBenchDataset("qasper", "Qasper", "en", 3619, "words", 128),
    LongBenchDataset("narrativeqa", "NarrativeQA", "en", 18409, "words", 128),
    LongBenchDataset("multifieldqa_en", "MultiFieldQA-en", "en", 4559, "words", 64),
    LongBenchDataset("dureader", "DuReader", "zh", 15768, "chars", 128),
    LongBenchDataset("gov_report", "GovReport", "en", 8734, "words", 512),
    LongBenchDataset("qmsum", "QMSum", "en", 10614, "words", 512),
    LongBenchDataset("multi_news", "MultiNews", "en", 2113, "words", 512),
    LongBenchDataset("vcsum", "VCSum", "zh", 15380, "chars", 512),
    LongBenchDataset("lcc", "LCC", "code", 1235, "code words", 64),
    LongBenchDataset("repobench-p", "RepoBench-P", "code", 4206, "code words", 64),
)}


@dataclass(frozen=True)
class LengthSample:
    dataset: str
    input_len: int
    output_len: int


def check_datasets(names: Optional[Sequence[str]]) -> list[str]:
    """The chosen dataset names (default: all ten); ValueError listing the valid ones."""
    if not names:
        return list(DATASETS)
    bad = [n for n in names if n not in DATASETS]
    if bad:
        raise ValueError(f"unknown LongBench dataset(s) {', '.join(bad)}; choose from "
                         f"{', '.join(DATASETS)}.")
    return list(names)


def sample_lengths(num: int, seed: int = 0, max_input_len: Optional[int] = None,
                   max_model_len: Optional[int] = None, datasets: Optional[Sequence[str]] = None,
                   sigma: float = LOGNORMAL_SIGMA,
                   output_len: Optional[int] = None) -> list[LengthSample]:
    """`num` (dataset, input length, output length) draws; see the module docstring.

    `output_len` replaces every dataset's max_new_tokens (short runs on CPU).

    With neither cap, input lengths follow the lognormal (at least MIN_INPUT_LEN tokens).
    Raises ValueError when a cap leaves no room for a prompt of MIN_INPUT_LEN tokens.
    """
    if output_len is not None and output_len < 1:
        raise ValueError(f"--longbench-output-len must be >= 1, got {output_len}.")
    if num < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {num}.")
    names = check_datasets(datasets)
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(names), size=num)
    normals = rng.standard_normal(num)
    out = []
    for pick, z in zip(picks, normals):
        d = DATASETS[names[pick]]
        out_len = d.max_new_tokens if output_len is None else output_len
        # E[exp(mu + sigma z)] = exp(mu + sigma^2 / 2) = the dataset's mean
        mu = math.log(d.mean_input_tokens) - sigma * sigma / 2
        length = max(MIN_INPUT_LEN, int(round(math.exp(mu + sigma * z))))
        cap = max_input_len
        if max_model_len is not None:
            room = max_model_len - out_len
            cap = room if cap is None else min(cap, room)
        if cap is not None:
            if cap < MIN_INPUT_LEN:
                raise ValueError(f"no room for a {d.title} prompt: max input length {cap} "
                                 f"(max_model_len {max_model_len}, output {out_len} "
                                 f"tokens) is below {MIN_INPUT_LEN}; raise --max-input-len or "
                                 "the server's --max-model-len.")
            length = min(length, cap)
        out.append(LengthSample(d.name, length, out_len))
    return out
