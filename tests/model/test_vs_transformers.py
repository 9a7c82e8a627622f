"""The engine against Hugging Face transformers on the same weights: log-probabilities at
every step and greedy tokens over 32+ steps, for tiny random models (GQA, MHA, Qwen2 bias)
and for SmolLM2 loaded from the GGUF by both."""
import os

import pytest
import torch

from sparseserve import LLM, SamplingParams

STEPS = 32


def hf_greedy_with_logprobs(model, prompt_ids, steps):
    """Greedy continuation by transformers; -> (tokens, per-step log-softmax rows)."""
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=steps, do_sample=False, min_new_tokens=steps,
                             output_scores=True, return_dict_in_generate=True,
                             pad_token_id=0, eos_token_id=None)
    toks = out.sequences[0, len(prompt_ids):].tolist()
    logps = [torch.log_softmax(s[0].float(), -1) for s in out.scores]
    return toks, logps


def check_against_hf(llm, hf_model, prompt_ids_list, steps=STEPS, atol=2e-3):
    params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True, logprobs=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids_list], params,
                        use_tqdm=False)
    for p, out in zip(prompt_ids_list, outs):
        ref_toks, ref_logps = hf_greedy_with_logprobs(hf_model, p, steps)
        got = out.outputs[0]
        assert got.token_ids == ref_toks
        for lp_dict, ref in zip(got.logprobs, ref_logps):
            for tok, lp in lp_dict.items():
                assert lp.logprob == pytest.approx(ref[tok].item(), abs=atol)
            # the 5 returned tokens are transformers' top 5
            assert set(ref.topk(5).indices.tolist()) <= set(lp_dict)


@pytest.mark.parametrize("kind", ["llama-gqa", "llama-mha", "qwen2"])
def test_tiny_models_match_transformers(tiny_model_dirs, kind):
    path, hf_model = tiny_model_dirs[kind]
    llm = LLM(path, page_size=16, max_num_seqs=4)
    prompts = [[5], [7 + i % 300 for i in range(17)], [11 + (i * 7) % 300 for i in range(54)],
               [3 + (i * 13) % 310 for i in range(97)]]
    check_against_hf(llm, hf_model, prompts)
    llm.engine.check_invariants()


@pytest.fixture(scope="module")
def smollm2(smollm2_llm):
    from sparseserve.model.loader import resolve_model_source
    src = resolve_model_source(None)
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(src.path),
                                              gguf_file=os.path.basename(src.path),
                                              dtype=torch.float32).eval()
    return smollm2_llm, hf


def test_smollm2_gguf_matches_transformers(smollm2):
    llm, hf = smollm2
    tok = llm.get_tokenizer()
    texts = ["The capital of France is", "def fibonacci(n):",
             "Once upon a time, in a small village by the sea,"]
    prompts = [tok.encode(t) for t in texts]
    chat = tok.apply_chat_template([{"role": "user", "content": "Name three colours."}],
                                   add_generation_prompt=True, tokenize=True, return_dict=False)
    check_against_hf(llm, hf, prompts + [chat], atol=5e-3)
