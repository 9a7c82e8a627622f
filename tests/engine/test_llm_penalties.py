"""Penalties and logit_bias through the whole engine on the embedded SmolLM2."""
from sparseserve import SamplingParams

PROMPT = "Repeat after me: the cat, the cat, the cat, the cat,"


def test_logit_bias_forces_a_token(smollm2_llm):
    tok = smollm2_llm.get_tokenizer()
    target = tok.encode(" banana", add_special_tokens=False)[0]
    out = smollm2_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=5,
                                                      logit_bias={target: 100}))[0].outputs[0]
    assert out.token_ids == [target] * 5
    banned = smollm2_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8))[0].outputs[0]
    first = banned.token_ids[0]
    again = smollm2_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8,
                                                        logit_bias={first: -100}))[0].outputs[0]
    assert first not in again.token_ids[:1]


def test_penalties_change_greedy_output_and_stay_per_request(smollm2_llm):
    llm = smollm2_llm
    base = SamplingParams(temperature=0, max_tokens=24)
    pen = SamplingParams(temperature=0, max_tokens=24, frequency_penalty=2.0, presence_penalty=1.0,
                         repetition_penalty=1.3)
    alone_base = llm.generate(PROMPT, base)[0].outputs[0].token_ids
    alone_pen = llm.generate(PROMPT, pen)[0].outputs[0].token_ids
    assert alone_pen != alone_base
    assert len(set(alone_pen)) > len(set(alone_base)), (alone_base, alone_pen)
    # batched with each other (different rows, one sampler pass): same tokens as alone
    mixed = llm.generate([PROMPT, PROMPT, "Count: 1, 2, 3,"], [pen, base, pen])
    assert mixed[0].outputs[0].token_ids == alone_pen
    assert mixed[1].outputs[0].token_ids == alone_base
    assert mixed[2].outputs[0].token_ids == llm.generate("Count: 1, 2, 3,", pen)[0].outputs[0].token_ids
    assert llm.engine.num_free_pages() == llm.engine.num_total_pages()
