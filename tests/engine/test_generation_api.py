"""The offline API on the embedded SmolLM2: stop conditions, n, logprobs, chat, text."""
import pytest

from sparseserve import SamplingParams


def test_stop_string_truncates_and_can_be_included(smollm2_llm):
    llm = smollm2_llm
    base = llm.generate("Count: 1, 2, 3,", SamplingParams(temperature=0, max_tokens=24))[0]
    text = base.outputs[0].text
    assert " 5" in text, text  # the model counts on
    cut = llm.generate("Count: 1, 2, 3,", SamplingParams(temperature=0, max_tokens=24,
                                                          stop=[" 5"]))[0].outputs[0]
    assert cut.text == text[:text.index(" 5")]
    assert cut.finish_reason == "stop" and cut.stop_reason == " 5"
    inc = llm.generate("Count: 1, 2, 3,", SamplingParams(temperature=0, max_tokens=24, stop=" 5",
                                                          include_stop_str_in_output=True))
    assert inc[0].outputs[0].text == text[:text.index(" 5") + 2]


def test_stop_token_ids_and_eos(smollm2_llm):
    llm = smollm2_llm
    tok = llm.get_tokenizer()
    base = llm.generate("Count: 1, 2, 3,", SamplingParams(temperature=0, max_tokens=12))[0]
    ids = base.outputs[0].token_ids
    stop_id = ids[3]
    out = llm.generate("Count: 1, 2, 3,", SamplingParams(temperature=0, max_tokens=12,
                                                          stop_token_ids=[stop_id]))[0].outputs[0]
    assert out.token_ids == ids[:ids.index(stop_id) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    # the chat model ends its answer with <|im_end|> (eos); ignore_eos runs to max_tokens
    chat = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                    SamplingParams(temperature=0, max_tokens=40))[0].outputs[0]
    assert chat.finish_reason == "stop" and chat.token_ids[-1] == tok.eos_token_id
    assert "Paris" in chat.text
    full = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                    SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0].outputs[0]
    assert len(full.token_ids) == 40 and full.finish_reason == "length"



def test_min_tokens_masks_eos_stop_ids_and_stop_strings(smollm2_llm):
    """vLLM's min_tokens: EOS and stop_token_ids cannot be sampled, and stop strings are not
    looked for, in the first min_tokens tokens."""
    llm = smollm2_llm
    eos = llm.get_tokenizer().eos_token_id
    ask = [{"role": "user", "content": "What is the capital of France?"}]
    base = llm.chat(ask, SamplingParams(temperature=0, max_tokens=40))[0].outputs[0]
    assert base.token_ids[-1] == eos
    k = len(base.token_ids) + 3
    longer = llm.chat(ask, SamplingParams(temperature=0, max_tokens=40, min_tokens=k))[0].outputs[0]
    assert len(longer.token_ids) >= k and eos not in longer.token_ids[:k]
    assert longer.token_ids[:len(base.token_ids) - 1] == base.token_ids[:-1]
    count = llm.generate("Count: 1, 2, 3,", SamplingParams(temperature=0, max_tokens=12))[0].outputs[0]
    stop_id = count.token_ids[1]
    out = llm.generate("Count: 1, 2, 3,", SamplingParams(temperature=0, max_tokens=12, min_tokens=4,
                                                          stop_token_ids=[stop_id]))[0].outputs[0]
    assert stop_id not in out.token_ids[:4]
    first = llm.generate("Count: 1, 2, 3,", SamplingParams(temperature=0, max_tokens=24,
                                                            stop=[","]))[0].outputs[0]
    later = llm.generate("Count: 1, 2, 3,", SamplingParams(temperature=0, max_tokens=24, stop=[","],
                                                            min_tokens=len(first.token_ids)))[0].outputs[0]
    assert later.finish_reason == "stop" and len(later.text) > len(first.text) and "," in later.text

def test_n_samples_logprobs_and_text_consistency(smollm2_llm):
    llm = smollm2_llm
    tok = llm.get_tokenizer()
    out = llm.generate("My favourite food is", SamplingParams(n=3, temperature=1.0, seed=3,
                                                              max_tokens=16, logprobs=2))[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    for o in out.outputs:
        # incremental detokenization equals decoding all tokens at once
        assert o.text == tok.decode(o.token_ids, skip_special_tokens=True)
        assert len(o.logprobs) == len(o.token_ids)
        for t, lp in zip(o.token_ids, o.logprobs):
            assert t in lp and len(lp) in (2, 3) and lp[t].logprob <= 0
            assert sorted(v.rank for k, v in lp.items() if k != t or v.rank <= 2)[0] == 1
    again = llm.generate("My favourite food is", SamplingParams(n=3, temperature=1.0, seed=3,
                                                                max_tokens=16))[0]
    assert [o.token_ids for o in again.outputs] == [o.token_ids for o in out.outputs]


def test_unicode_streams_whole_characters(smollm2_llm):
    llm = smollm2_llm
    tok = llm.get_tokenizer()
    ids = tok.encode("Café 東京 🙂 naïve")
    out = llm.generate({"prompt_token_ids": tok.encode("Say:")},
                       SamplingParams(temperature=0, max_tokens=4))[0]
    assert "\ufffd" not in out.outputs[0].text
    from sparseserve.engine.detokenizer import IncrementalDetokenizer
    d = IncrementalDetokenizer(tok, [], [], False, True)
    pieces = [d.add(t) for t in ids]
    assert "".join(pieces) == "Café 東京 🙂 naïve"
    assert all("\ufffd" not in p for p in pieces)


def test_streamed_logprobs_are_built_once_and_never_change_under_the_consumer(smollm2_llm):
    """Each step's output carries every token's logprobs so far (built incrementally, not
    rebuilt every step) and its cumulative logprob; an output already handed out does not
    change when later steps add tokens."""
    engine = smollm2_llm.engine
    engine.add_request("lp-stream", "The three primary colours are",
                       SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=17, logprobs=1))
    seen = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen.append((out, [(list(o.token_ids), list(o.logprobs), o.cumulative_logprob)
                               for o in out.outputs]))
    final = seen[-1][0]
    assert final.finished and all(len(o.token_ids) == 17 for o in final.outputs)
    for out, snapshot in seen:
        for o, (ids, lps, cum) in zip(out.outputs, snapshot):
            assert o.token_ids == ids and o.logprobs == lps and o.cumulative_logprob == cum
            assert len(o.logprobs) == len(o.token_ids)
            full = final.outputs[o.index]
            assert o.token_ids == full.token_ids[:len(ids)]
            assert o.logprobs == full.logprobs[:len(ids)]  # the same entries, step after step
            total = 0
            for t, lp in zip(o.token_ids, o.logprobs):
                total += lp[t].logprob
            assert o.cumulative_logprob == pytest.approx(total, abs=1e-9)


def test_final_only_outputs_equal_the_cumulative_final(smollm2_llm):
    """RequestOutputKind.FINAL_ONLY (what LLM.generate asks): step() returns nothing for the
    request until it finishes, then an output equal field for field to the last cumulative
    one (n = 2 samples, logprobs, prompt logprobs, a stop string); LLM.generate returns the
    same and leaves the caller's SamplingParams as they were; a kind that is not offered is a
    ParamError that says what to do."""
    from sparseserve import RequestOutputKind
    from sparseserve.validation import ParamError

    engine = smollm2_llm.engine
    kw = dict(n=2, temperature=1.0, seed=11, max_tokens=23, logprobs=2, prompt_logprobs=1,
              stop=[" and"])
    prompt = "List three fruits:"
    finals = {}
    for kind in (RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY):
        rid = f"kind-{kind.name}"
        engine.add_request(rid, prompt, SamplingParams(**kw, output_kind=kind))
        outs = []
        while engine.has_unfinished_requests():
            outs.extend(engine.step())
        assert outs[-1].finished and all(o.request_id == rid for o in outs)
        if kind == RequestOutputKind.FINAL_ONLY:
            assert len(outs) == 1  # no per-step output was built
        else:
            assert len(outs) > 1
        finals[kind] = outs[-1]
    a, b = finals[RequestOutputKind.CUMULATIVE], finals[RequestOutputKind.FINAL_ONLY]
    assert a.prompt_logprobs == b.prompt_logprobs and a.prompt_token_ids == b.prompt_token_ids
    for x, y in zip(a.outputs, b.outputs):
        assert (x.text, x.token_ids, x.logprobs, x.finish_reason, x.stop_reason) == \
            (y.text, y.token_ids, y.logprobs, y.finish_reason, y.stop_reason)
        assert x.cumulative_logprob == pytest.approx(y.cumulative_logprob, abs=1e-9)
    params = SamplingParams(**kw)
    (c,) = smollm2_llm.generate(prompt, params, use_tqdm=False)
    assert params.output_kind == RequestOutputKind.CUMULATIVE  # the caller's object unchanged
    assert [o.token_ids for o in c.outputs] == [o.token_ids for o in a.outputs]
    assert [o.text for o in c.outputs] == [o.text for o in a.outputs]
    with pytest.raises(ParamError, match="DELTA is not offered"):
        SamplingParams(output_kind=1)
