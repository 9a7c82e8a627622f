"""The LongBench-shaped workload: cited numbers, determinism, caps, per-dataset means."""
from __future__ import annotations

import numpy as np
import pytest

from sparseserve.bench import longbench
from sparseserve.bench.longbench import DATASETS, TOKENS_PER_UNIT, sample_lengths
from sparseserve.bench.serve_datasets import build_requests

# LongBench Table 1 "Avg len" and LongBench/config/dataset2maxlen.json (THUDM/LongBench)
CITED = {"qasper": (3619, 128), "narrativeqa": (18409, 128), "multifieldqa_en": (4559, 64),
         "dureader": (15768, 128), "gov_report": (8734, 512), "qmsum": (10614, 512),
         "multi_news": (2113, 512), "vcsum": (15380, 512), "lcc": (1235, 64),
         "repobench-p": (4206, 64)}


def test_the_ten_datasets_with_their_cited_numbers():
    assert {k: (d.avg_len, d.max_new_tokens) for k, d in DATASETS.items()} == CITED
    assert {d.unit for d in DATASETS.values() if d.language == "zh"} == {"chars"}
    assert DATASETS["narrativeqa"].mean_input_tokens == pytest.approx(18409 * 4 / 3)


def test_deterministic_for_a_seed():
    a = sample_lengths(300, seed=7, max_input_len=32768)
    assert a == sample_lengths(300, seed=7, max_input_len=32768)
    assert a != sample_lengths(300, seed=8, max_input_len=32768)
    assert {s.dataset for s in a} == set(DATASETS)  # the trace mixes all ten


def test_lengths_within_caps():
    for s in sample_lengths(2000, seed=1, max_input_len=8192, max_model_len=8000):
        assert longbench.MIN_INPUT_LEN <= s.input_len <= min(8192, 8000 - s.output_len)
        assert s.output_len == DATASETS[s.dataset].max_new_tokens
    assert all(s.output_len == 8 for s in sample_lengths(50, output_len=8))
    with pytest.raises(ValueError, match="no room"):
        sample_lengths(10, max_model_len=520)  # GovReport's 512 output tokens leave 8
    with pytest.raises(ValueError, match="unknown LongBench dataset.*qasper"):
        sample_lengths(10, datasets=["hotpot"])


def test_per_dataset_means_match_the_cited_ones_without_caps():
    samples = sample_lengths(40000, seed=0)
    for name, d in DATASETS.items():
        lens = np.array([s.input_len for s in samples if s.dataset == name])
        assert len(lens) > 3000
        assert lens.mean() == pytest.approx(d.mean_input_tokens, rel=0.04), name
        assert lens.std() / lens.mean() == pytest.approx(0.53, rel=0.15), name  # sigma 0.5


def test_token_ids_without_tokenizer():
    reqs = build_requests("longbench", 20, seed=3, vocab_size=1000, max_input_len=512)
    assert all(r.prompt is None and len(r.prompt_token_ids) == r.prompt_len <= 512 for r in reqs)
    assert all(0 <= t < 1000 for r in reqs for t in r.prompt_token_ids)
    again = build_requests("longbench", 20, seed=3, vocab_size=1000, max_input_len=512)
    assert [r.prompt_token_ids for r in reqs] == [r.prompt_token_ids for r in again]


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from sparseserve.model.loader.source import resolve_model_source
    from sparseserve.model.loader.tokenizer import load_tokenizer
    return load_tokenizer(resolve_model_source(None))


def test_real_text_prompts_fit_the_drawn_length(smollm2_tokenizer):
    tok = smollm2_tokenizer
    reqs = build_requests("longbench", 12, seed=5, tokenizer=tok, max_input_len=400)
    assert len({r.prompt for r in reqs}) == 12  # distinct windows of the sources
    for r in reqs:
        n = len(tok.encode(r.prompt, add_special_tokens=True))  # the server's tokenization
        assert r.prompt_len - 8 <= n <= r.prompt_len
    code = [r for r in reqs if r.dataset in ("lcc", "repobench-p")]
    assert code and all(("def " in r.prompt or "import" in r.prompt or "self" in r.prompt) for r in code)


def test_code_tokens_per_word_factor_is_the_measured_one(smollm2_tokenizer):
    """TOKENS_PER_UNIT['code words'] was measured on the standard-library code of texts.py."""
    from sparseserve.bench import texts
    words = tokens = 0
    for k in range(3):
        _, raw = texts.source_text("code", k)
        words += len(raw.split())
        tokens += len(smollm2_tokenizer.encode(raw, add_special_tokens=False))
    assert tokens / words == pytest.approx(TOKENS_PER_UNIT["code words"], rel=0.05)


def test_prompt_source_for_http_runs():
    """Dummy models served under a built-in name get token ids below its vocabulary size."""
    from sparseserve.bench.serve_cli import client_tokenizer
    assert client_tokenizer(None, "llama-3-8b") == (None, 128256)
    assert client_tokenizer("none", "lwm-7b") == (None, 32000)
    assert client_tokenizer(None, "some-server-name") == (None, None)
    with pytest.raises(ValueError, match="vocabulary size"):
        build_requests("random", 2, seed=0)
