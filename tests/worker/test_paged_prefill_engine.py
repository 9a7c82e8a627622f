"""The engine's chunked prefill through the paged prefill kernel (kernels/paged_prefill.py,
the GPU path; forced here onto Triton's interpreter): prompts of odd lengths in 20-token chunks
(not page-aligned, page 16), decode rows beside the chunks, against transformers on the same
weights — tokens and top-5 logprobs."""
import pytest

from sparseserve import LLM
from sparseserve.worker.forward_context import ForwardContext
from tests.conftest import DEVICE
from tests.model.test_vs_transformers import check_against_hf

PROMPTS = [[5], [7 + i % 300 for i in range(17)], [11 + (i * 7) % 300 for i in range(54)],
           [3 + (i * 13) % 310 for i in range(97)]]


@pytest.mark.parametrize("kind", ["llama-gqa", "llama-mha"])
def test_chunked_prefill_through_the_paged_kernel_matches_transformers(tiny_model_dirs, kind,
                                                                        monkeypatch,
                                                                        paged_prefill_calls):
    monkeypatch.setattr(ForwardContext, "paged_prefill_kernel", True)
    path, hf_model = tiny_model_dirs[kind]
    # fp32: a GPU would default to bf16, whose tokens drift from fp32 HF; a small KV cache:
    # on a GPU the default sizes it from 90 % of the free memory, which starves the other
    # test processes sharing the GPU (make test-gpu)
    llm = LLM(path, page_size=16, max_num_seqs=4, max_num_batched_tokens=20, max_model_len=512,
              dtype="float32", kv_cache_memory_bytes=16 << 20)
    check_against_hf(llm, hf_model, PROMPTS, atol=2e-3 if DEVICE.type == "cpu" else 5e-3)
    assert paged_prefill_calls, "no chunk went through the paged prefill kernel"
    llm.engine.check_invariants()
