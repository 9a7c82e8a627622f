"""The GGUF cache (model/loader/gguf_cache.py): a second load of a GGUF file reads config,
weights and tokenizer from the cache folder without parsing the file, gets exactly what the
GGUF path gives, and the cache misses when the file changes, is off, or a load was partial."""
import os

import pytest
import torch
from gguf import GGMLQuantizationType as T

from sparseserve.model.loader import gguf_cache, gguf_file
from sparseserve.model.loader.source import iter_weights, load_model_config, resolve_model_source
from tests.conftest import SMOLLM2_MISSING
from tests.model.loader_files import _hf_state, _write_gguf


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    d = tmp_path / "cache"
    monkeypatch.setenv("SPARSESERVE_CACHE_DIR", str(d))
    monkeypatch.delenv("SPARSESERVE_GGUF_CACHE", raising=False)
    gguf_file._cached_reader.cache_clear()
    return d


def _uncached(path, monkeypatch):
    with monkeypatch.context() as mp:
        mp.setenv("SPARSESERVE_GGUF_CACHE", "0")
        source = resolve_model_source(path)
        config = load_model_config(source)
        return config, dict(iter_weights(source, config))


def _no_gguf_parse(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("the GGUF file was parsed although its cache is complete")
    gguf_file._cached_reader.cache_clear()
    monkeypatch.setattr(gguf_file, "_cached_reader", refuse)


@pytest.mark.parametrize("qtype", [T.Q4_1, T.F16], ids=lambda t: t.name)
def test_second_load_reads_the_cache_exactly(cache_dir, tmp_path, monkeypatch, qtype):
    path = _write_gguf(tmp_path / f"tiny.{qtype.name}.gguf", _hf_state(bias=False, tied=False), qtype)
    want_config, want = _uncached(path, monkeypatch)
    assert not cache_dir.exists()  # off means nothing written
    source = resolve_model_source(path)
    first = dict(iter_weights(source, load_model_config(source)))
    entry = gguf_cache.entry_dir(path)
    assert sorted(os.listdir(entry)) == [gguf_cache.CONFIG, gguf_cache.WEIGHTS]  # no temporaries
    _no_gguf_parse(monkeypatch)
    again = resolve_model_source(path)
    assert again == source and again.kind == "gguf"  # the source is unchanged
    config = load_model_config(again)
    assert config == want_config
    got = dict(iter_weights(again, config))
    assert set(got) == set(want) == set(first)
    for name, w in want.items():
        assert got[name].dtype == w.dtype and torch.equal(got[name], w), name


def test_changed_file_misses_and_partial_or_sharded_loads_write_no_weights(cache_dir, tmp_path):
    path = _write_gguf(tmp_path / "tiny.gguf", _hf_state(bias=False, tied=False), T.Q8_0)
    source = resolve_model_source(path)
    config = load_model_config(source)
    it = iter_weights(source, config)
    next(it)
    it.close()  # a load that stopped (an error in the model) caches nothing
    assert gguf_cache.cached(path, gguf_cache.WEIGHTS) is None
    list(iter_weights(source, config, shard=lambda name, shape: None))  # a rank's shard
    assert gguf_cache.cached(path, gguf_cache.WEIGHTS) is None
    list(iter_weights(source, config))
    assert gguf_cache.cached(path, gguf_cache.WEIGHTS) is not None
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # the file "changed"
    assert gguf_cache.cached(path, gguf_cache.WEIGHTS) is None
    assert gguf_cache.cached(path, gguf_cache.CONFIG) is None


def test_weights_over_the_size_limit_are_not_cached(cache_dir, tmp_path, monkeypatch):
    path = _write_gguf(tmp_path / "tiny.gguf", _hf_state(bias=False, tied=False), T.F32)
    monkeypatch.setattr(gguf_cache, "MAX_WEIGHT_BYTES", 1000)
    source = resolve_model_source(path)
    list(iter_weights(source, load_model_config(source)))
    assert gguf_cache.cached(path, gguf_cache.WEIGHTS) is None
    assert gguf_cache.cached(path, gguf_cache.CONFIG) is not None


@pytest.mark.skipif(SMOLLM2_MISSING is not None, reason=SMOLLM2_MISSING or "")
def test_smollm2_tokenizer_from_the_cache_behaves_the_same(cache_dir, monkeypatch):
    from sparseserve.model.loader import load_tokenizer

    source = resolve_model_source(None)
    fresh = load_tokenizer(source)
    assert gguf_cache.cached(source.path, gguf_cache.TOKENIZER) is not None
    _no_gguf_parse(monkeypatch)
    cached = load_tokenizer(source)
    texts = ["Hello, world! Sparse attention — café.", "  two  spaces\nand a tab\t.", "1+1=2"]
    for t in texts:
        assert cached(t)["input_ids"] == fresh(t)["input_ids"]
        ids = fresh(t)["input_ids"]
        assert cached.decode(ids) == fresh.decode(ids)
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id", "chat_template"):
        assert getattr(cached, attr) == getattr(fresh, attr), attr
    assert len(cached) == len(fresh)
    messages = [{"role": "user", "content": "What is 2+2?"}]
    assert (cached.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            == fresh.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
