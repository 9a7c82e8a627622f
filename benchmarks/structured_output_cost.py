"""Per-step cost of grammar-constrained decoding on the CPU with the embedded SmolLM2.

Two measurements, at batch 1 and 32 (each row constrained by the same JSON schema):
* `sampler`: one sampling step on [B, V] logits — the grammar part split into the host mask
  fill (llguidance), the device apply (unpack + masked_fill), and the engine's
  `consume_token` per row — against the same step without a grammar. Matchers are advanced
  with the tokens sampled and reset when their grammar completes, so they walk real states.
* `engine`: median LLMEngine decode-step time with the full batch running, with and without
  the schema (greedy, same prompts).

    python benchmarks/structured_output_cost.py --out docs/results/data/structured_output_cost.json
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from common import meta, write_json  # noqa: E402

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"},
    "tags": {"type": "array", "items": {"type": "string"}}}, "required": ["name", "age", "tags"]}


def _ms(values: list[float]) -> float:
    return round(statistics.median(values) * 1e3, 4)


def sampler_cost(tokenizer, vocab: int, eos: int, batch: int, steps: int) -> dict:
    from sparseserve.request import SamplingParams
    from sparseserve.structured import StructuredOutputsParams
    from sparseserve.structured.backend import GrammarBackend
    from sparseserve.worker.sampler import Sampler, SamplingBatch

    backend = GrammarBackend(tokenizer, vocab, eos)
    spec = StructuredOutputsParams(json=SCHEMA)
    matchers = [backend.matcher(spec) for _ in range(batch)]
    sampler = Sampler(torch.device("cpu"), 0)
    params = [SamplingParams(temperature=1.0, max_tokens=None)] * batch
    gen = torch.Generator().manual_seed(0)
    fill, apply, consume, total, plain = [], [], [], [], []
    for step in range(steps):
        logits = torch.randn(batch, vocab, generator=gen) * 3
        b = SamplingBatch(params, [step] * batch)
        t0 = time.perf_counter()
        sampler(logits, b)
        plain.append(time.perf_counter() - t0)
        b.grammars = matchers
        t0 = time.perf_counter()
        out = sampler(logits, b)
        toks = out.token_ids.tolist()
        t1 = time.perf_counter()
        for m, t in zip(matchers, toks):
            m.consume_token(t)
            if m.is_stopped() or m.is_error():
                m.reset()
        t2 = time.perf_counter()
        total.append(t1 - t0)
        consume.append(t2 - t1)
        x = logits.clone()
        t0 = time.perf_counter()
        host = sampler.grammar.fill(matchers, vocab)
        t1 = time.perf_counter()
        x.masked_fill_(sampler.grammar.forbidden(host, vocab), float("-inf"))
        t2 = time.perf_counter()
        fill.append(t1 - t0)
        apply.append(t2 - t1)
    return {"batch": batch, "steps": steps,
            "sampler_without_grammar_ms": _ms(plain), "sampler_with_grammar_ms": _ms(total),
            "grammar_fill_ms": _ms(fill), "grammar_apply_ms": _ms(apply),
            "consume_token_ms": _ms(consume),
            "grammar_overhead_ms": round(_ms(total) - _ms(plain) + _ms(consume), 4)}


def engine_cost(llm, batch: int, max_tokens: int) -> dict:
    from sparseserve.request import SamplingParams
    from sparseserve.structured import StructuredOutputsParams

    eng = llm.engine
    prompt = [{"role": "user", "content": "Describe a person as a JSON object."}]
    ids = llm.get_tokenizer().apply_chat_template(prompt, add_generation_prompt=True, tokenize=True,
                                                  return_dict=False)
    res = {}
    for name, so in (("without", None), ("with", StructuredOutputsParams(json=SCHEMA))):
        p = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=so is None,
                           structured_outputs=so)
        for i in range(batch):
            eng.add_request(f"{name}-{i}", {"prompt_token_ids": list(ids)}, p)
        times = []
        while eng.has_unfinished_requests():
            full = len(eng.scheduler.running) == batch and not eng.scheduler.waiting
            t0 = time.perf_counter()
            eng.step()
            dt = time.perf_counter() - t0
            if full and all(r.output_token_ids for r in eng.scheduler.running):
                times.append(dt)
        res[f"decode_step_{name}_grammar_ms"] = _ms(times) if times else None
        res[f"steps_{name}"] = len(times)
    assert not eng.grammars, "matchers leaked"
    return {"batch": batch, **res}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="docs/results/data/structured_output_cost.json")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--engine-tokens", type=int, default=12)
    args = ap.parse_args()
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    from sparseserve import LLM

    llm = LLM(max_num_seqs=32, max_num_batched_tokens=4096)
    tok = llm.get_tokenizer()
    vocab = llm.engine.config.model.vocab_size
    eos = llm.engine.eos_token_ids[0]
    result = {"meta": meta(), "model": llm.engine.model_name, "vocab_size": vocab,
              "library": "llguidance " + __import__("importlib.metadata").metadata.version("llguidance"),
              "schema": SCHEMA, "sampler": [], "engine": []}
    for b in (1, 32):
        result["sampler"].append(sampler_cost(tok, vocab, eos, b, args.steps))
        print(result["sampler"][-1], flush=True)
    for b in (1, 32):
        result["engine"].append(engine_cost(llm, b, args.engine_tokens))
        print(result["engine"][-1], flush=True)
    print(write_json(args.out, result))


if __name__ == "__main__":
    main()
