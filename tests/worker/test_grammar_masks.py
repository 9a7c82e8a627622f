"""Grammar token bitmasks in the sampler, with llguidance matchers over SmolLM2's tokenizer:
the allowed set equals what the matcher accepts, rows without a grammar are untouched, both
unpacking paths (numpy on CPU, the byte table on a device) agree, and sampling under a mask
only ever picks allowed tokens."""
import numpy as np
import pytest
import torch

pytest.importorskip("llguidance")

from sparseserve.request import SamplingParams  # noqa: E402
from sparseserve.structured import StructuredOutputsParams  # noqa: E402
from sparseserve.worker.grammar import GrammarMasks  # noqa: E402
from sparseserve.worker.sampler import Sampler, SamplingBatch  # noqa: E402

VOCAB = 49152


@pytest.fixture(scope="module")
def smollm2_backend():
    from sparseserve.model.loader import load_tokenizer, resolve_model_source
    from sparseserve.structured.backend import GrammarBackend
    tok = load_tokenizer(resolve_model_source(None))
    return GrammarBackend(tok, VOCAB, tok.eos_token_id), tok


def test_mask_is_what_the_matcher_accepts(smollm2_backend):
    backend, tok = smollm2_backend
    m = backend.matcher(StructuredOutputsParams(choice=["yes", "no"]))
    host = GrammarMasks(torch.device("cpu")).fill([m], VOCAB)
    allowed = np.flatnonzero(~GrammarMasks(torch.device("cpu")).forbidden(host, VOCAB)[0].numpy())
    assert len(allowed) > 0
    for t in allowed:
        text = tok.decode([int(t)])
        assert "yes".startswith(text) or "no".startswith(text), text
    for t in tok.encode("yes", add_special_tokens=False)[:1] + tok.encode("no", add_special_tokens=False)[:1]:
        assert t in allowed


def test_unpack_paths_agree():
    g = GrammarMasks(torch.device("cpu"))
    mask = torch.randint(-2**31, 2**31 - 1, (5, (VOCAB + 31) // 32), dtype=torch.int32)
    a = g.forbidden(mask, VOCAB - 7)
    b = g.forbidden_on_device(mask, VOCAB - 7)
    assert torch.equal(a, b)
    shifts = torch.arange(32, dtype=torch.int32)
    ref = ((mask[:, :, None] >> shifts) & 1).reshape(5, -1)[:, :VOCAB - 7] == 0
    assert torch.equal(a, ref)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_sampler_masks_only_grammar_rows(smollm2_backend, temperature):
    backend, _ = smollm2_backend
    spec = StructuredOutputsParams(regex=r"[0-9]{2,4}")
    matchers = [backend.matcher(spec), None, backend.matcher(spec), None]
    sampler = Sampler(torch.device("cpu"), 0)
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(1)) * 4
    params = [SamplingParams(temperature=temperature, seed=7)] * 4
    plain = sampler(logits.clone(), SamplingBatch(params, [0] * 4)).token_ids
    out = sampler(logits.clone(), SamplingBatch(params, [0] * 4, grammars=matchers)).token_ids
    assert out[1] == plain[1] and out[3] == plain[3]  # unconstrained rows: the same draw
    for i in (0, 2):
        m = matchers[i]
        assert m.consume_token(int(out[i])), "sampled a token the grammar forbids"
        assert not m.is_error()


def test_error_matcher_is_not_masked(smollm2_backend):
    backend, _ = smollm2_backend
    m = backend.matcher(StructuredOutputsParams(regex="a"))
    m.consume_token(backend.ll_tokenizer.tokenize_str("zzz")[0])  # forbidden: error state
    assert m.is_error()
    host = GrammarMasks(torch.device("cpu")).fill([m], VOCAB)
    assert (host == -1).all()


def test_min_tokens_keeps_eos_where_the_grammar_can_only_end(smollm2_backend):
    """A grammar that allows only EOS and a row still below min_tokens: EOS is picked (not a
    token the grammar forbids); an unconstrained row below min_tokens never picks EOS."""
    backend, tok = smollm2_backend
    m = backend.matcher(StructuredOutputsParams(regex="yes"))
    for t in tok.encode("yes", add_special_tokens=False):
        m.consume_token(t)
    eos = tok.eos_token_id
    logits = torch.randn(2, VOCAB)
    logits[:, eos] = 30.0
    params = [SamplingParams(temperature=0.0, min_tokens=5), SamplingParams(temperature=0.0, min_tokens=5)]
    out = Sampler(torch.device("cpu"), 0)(logits, SamplingBatch(params, [1, 1], grammars=[m, None],
                                                                stop_ids=[(eos,), (eos,)]))
    assert out.token_ids.tolist()[0] == eos and out.token_ids.tolist()[1] != eos
