"""prompt_logprobs against Hugging Face transformers on the same weights: the log-softmax of
every prompt position (the first token has none), at odd prompt lengths, with chunked prefill
(chunks of 16 tokens: every chunk boundary crosses the pending last-row path) and with
layer-segmented prefill, for tiny random models."""
import pytest
import torch

from sparseserve import LLM, SamplingParams

LENGTHS = (1, 17, 54, 97)
K = 3


def _prompts():
    return [[(5 + i * 7 + n) % 300 + 3 for i in range(n)] for n in LENGTHS]


def hf_prompt_logprobs(model, ids):
    """[len(ids) - 1, V] log-softmax rows: row p - 1 is the distribution of token p."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[:-1]


def check(llm, hf_model, atol=2e-3):
    prompts = _prompts()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=K), use_tqdm=False)
    for ids, out in zip(prompts, outs):
        plp = out.prompt_logprobs
        assert plp is not None and len(plp) == len(ids)
        assert plp[0] is None
        if len(ids) == 1:
            continue
        ref = hf_prompt_logprobs(hf_model, ids)
        for p in range(1, len(ids)):
            entry, row = plp[p], ref[p - 1]
            assert ids[p] in entry  # the prompt token itself, always
            for tok, lp in entry.items():
                assert lp.logprob == pytest.approx(row[tok].item(), abs=atol)
            assert entry[ids[p]].rank == int((row > row[ids[p]]).sum()) + 1
            top = [t for t, lp in entry.items() if lp.rank <= K]
            assert set(top) == set(row.topk(K).indices.tolist())


@pytest.mark.parametrize("kind", ["llama-gqa", "qwen2"])
def test_prompt_logprobs_chunked_prefill_match_transformers(tiny_model_dirs, kind):
    path, hf_model = tiny_model_dirs[kind]
    llm = LLM(path, page_size=16, max_num_seqs=4, max_num_batched_tokens=16)
    check(llm, hf_model)
    assert not llm.engine.runner.prompt_lp.pending  # nothing kept after the prefills
    llm.engine.check_invariants()


def test_prompt_logprobs_layer_segmented_prefill(tiny_model_dirs):
    path, hf_model = tiny_model_dirs["llama-gqa"]
    llm = LLM(path, page_size=16, max_num_seqs=4, max_num_batched_tokens=32,
              layer_segmented_prefill=True)
    check(llm, hf_model)


def test_no_prompt_logprobs_unless_asked(tiny_model_dirs):
    path, _ = tiny_model_dirs["llama-gqa"]
    llm = LLM(path, page_size=16, max_num_seqs=4)
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert out.prompt_logprobs is None
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=2, prompt_logprobs=0),
                       use_tqdm=False)[0]
    assert out.prompt_logprobs[0] is None and [list(d) for d in out.prompt_logprobs[1:]] == [[6], [7]]
