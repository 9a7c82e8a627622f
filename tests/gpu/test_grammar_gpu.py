"""Structured output's device path on a GPU: the token bitmask goes to the device from pinned
memory and is unpacked there through the byte table (the CPU takes numpy's unpackbits), and a
sampling step with grammar rows makes no host sync. Greedy grammar-constrained decoding on
CUDA picks the same tokens as on the CPU, step after step, and every token is one the grammar
accepts. The tokenizer is a small byte-level BPE trained here (the SmolLM2 wheel does not
travel to the GPU machine)."""
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
pytest.importorskip("llguidance")

from sparseserve.request import SamplingParams  # noqa: E402
from sparseserve.structured import StructuredOutputsParams  # noqa: E402
from sparseserve.worker.grammar import GrammarMasks  # noqa: E402
from sparseserve.worker.sampler import Sampler, SamplingBatch  # noqa: E402

CORPUS = ["yes no maybe 0123456789 1999 2024 42 7 {\"a\": 1, \"b\": [true, false, null]}",
          "the quick brown fox jumps over the lazy dog 31337 yes, no; maybe!"] * 20


def make_backend():
    """-> (GrammarBackend over a small byte-level BPE trained on CORPUS, padded vocab size)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from sparseserve.structured.backend import GrammarBackend

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")
    vocab = hf.vocab_size + 7  # a padded vocabulary, as models have: the tail is never allowed
    return GrammarBackend(hf, vocab, hf.eos_token_id), vocab


@pytest.fixture(scope="module")
def backend():
    return make_backend()


SPECS = [StructuredOutputsParams(regex=r"[0-9]{2,4}"), None,
         StructuredOutputsParams(choice=["yes", "no", "maybe"]), None,
         StructuredOutputsParams(json_object=True)]


def greedy(device: torch.device, backend, vocab: int, steps: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    logits = [torch.randn(len(SPECS), vocab, generator=gen) * 3 for _ in range(steps)]
    matchers = [backend.matcher(s) if s is not None else None for s in SPECS]
    sampler = Sampler(device, seed=0, max_rows=8)
    params = [SamplingParams(temperature=0)] * len(SPECS)
    out = []
    for step in range(steps):
        x = logits[step].to(device)
        live = [m if m is not None and not m.is_stopped() else None for m in matchers]
        batch = SamplingBatch(params, [step] * len(SPECS), grammars=live)
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        try:
            ids = sampler(x, batch).token_ids
        finally:
            if device.type == "cuda":
                torch.cuda.set_sync_debug_mode("default")
        ids = ids.tolist()
        for m, t in zip(live, ids):
            if m is not None:
                assert m.consume_token(t), f"sampled token {t}, which the grammar forbids"
        out.append(ids)
    return out


def test_grammar_rows_on_cuda_match_the_cpu_without_a_sync(backend):
    be, vocab = backend
    gpu = greedy(torch.device("cuda"), be, vocab, steps=6)
    cpu = greedy(torch.device("cpu"), be, vocab, steps=6)
    assert gpu == cpu


def test_device_unpack_equals_the_cpu_path(backend):
    _, vocab = backend
    words = (vocab + 31) // 32
    host = torch.randint(-2**31, 2**31 - 1, (5, words), dtype=torch.int32).pin_memory()
    on_gpu = GrammarMasks(torch.device("cuda")).forbidden(host, vocab)
    on_cpu = GrammarMasks(torch.device("cpu")).forbidden(host.clone(), vocab)
    assert on_gpu.device.type == "cuda" and torch.equal(on_gpu.cpu(), on_cpu)
