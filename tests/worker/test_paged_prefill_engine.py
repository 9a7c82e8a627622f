"""The engine's chunked prefill through the paged prefill kernel (kernels/paged_prefill.py,
the GPU path; forced here onto Triton's interpreter): prompts of odd lengths in 20-token chunks
(not page-aligned, page 16), decode rows beside the chunks, against transformers on the same
weights — tokens and top-5 logprobs."""
import pytest

from sparseserve import LLM
from sparseserve.worker.forward_context import ForwardContext
from tests.model.test_vs_transformers import check_against_hf

PROMPTS = [[5], [7 + i % 300 for i in range(17)], [11 + (i * 7) % 300 for i in range(54)],
           [3 + (i * 13) % 310 for i in range(97)]]


@pytest.mark.parametrize("kind", ["llama-gqa", "llama-mha"])
def test_chunked_prefill_through_the_paged_kernel_matches_transformers(tiny_model_dirs, kind,
                                                                        monkeypatch):
    import sparseserve.kernels.paged_prefill as pp
    calls = []
    real = pp.paged_prefill_attention

    def counted(*args, **kw):
        calls.append(args[5].shape[0])  # chunks in the launch
        return real(*args, **kw)

    monkeypatch.setattr(pp, "paged_prefill_attention", counted)
    monkeypatch.setattr(ForwardContext, "paged_prefill_kernel", True)
    path, hf_model = tiny_model_dirs[kind]
    llm = LLM(path, page_size=16, max_num_seqs=4, max_num_batched_tokens=20, max_model_len=512)
    check_against_hf(llm, hf_model, PROMPTS)
    assert calls, "no chunk went through the paged prefill kernel"
    llm.engine.check_invariants()
