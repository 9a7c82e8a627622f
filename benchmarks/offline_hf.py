"""The Hugging Face transformers baseline of benchmarks/offline_throughput.py: a
random-weight model built from the same config, a timed greedy `generate` (static cache,
exactly the output length), and the part that runs workloads a and b through it (halving the
batch on out-of-memory)."""
from __future__ import annotations

import copy
import time
from typing import Any

import common as C
import numpy as np
from engine_bench import log
from offline_workloads import make_prompts


def hf_load(cfg: dict, device: str, dtype: str, max_len: int):
    """A transformers causal LM with random weights from a config.json-style dict (SDPA
    attention, `dtype` e.g. "bfloat16"), built directly on `device`; max_position_embeddings
    is raised to `max_len` where needed (the default RoPE does not depend on it)."""
    import torch
    import transformers

    d = copy.deepcopy(cfg)
    d["max_position_embeddings"] = max(int(d.get("max_position_embeddings", 0)), max_len)
    model_type = d.pop("model_type", "llama")
    hf_cfg = transformers.AutoConfig.for_model(model_type, **d)
    dtype = getattr(torch, dtype)
    torch.manual_seed(0)
    with torch.device(device):
        try:
            model = transformers.AutoModelForCausalLM.from_config(
                hf_cfg, dtype=dtype, attn_implementation="sdpa")
        except TypeError:  # older transformers: torch_dtype
            model = transformers.AutoModelForCausalLM.from_config(
                hf_cfg, torch_dtype=dtype, attn_implementation="sdpa")
    return model.to(device=device, dtype=dtype).eval()


def hf_generate(model, prompts: Any, output_len: int, batch: int, device: str,
                compile_: bool, max_time: float) -> dict:
    """transformers `generate` over `prompts` [n, p] in batches of `batch`: static cache,
    greedy, exactly `output_len` new tokens (min_new_tokens), torch.compile off unless
    `compile_`; `max_time` caps each call. Timed with the device synchronised."""
    import torch

    n, p = prompts.shape
    eos = model.config.eos_token_id
    pad = eos[0] if isinstance(eos, (list, tuple)) else (eos if eos is not None else 0)
    kw = dict(max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False,
              cache_implementation="static", pad_token_id=pad, max_time=max_time)
    if not compile_:
        kw["disable_compile"] = True
    new = 0
    with C.Timer(device) as t:
        for i in range(0, n, batch):
            ids = torch.as_tensor(prompts[i:i + batch], device=device)
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **kw)
            new += (out.shape[1] - p) * out.shape[0]
            del out, ids
    return {"wall_s": t.wall_s, "prompt_tokens": n * p, "output_tokens": int(new),
            "total_tokens_per_s": (n * p + new) / t.wall_s,
            "output_tokens_per_s": new / t.wall_s, "requests_per_s": n / t.wall_s,
            "all_full_length": new == n * output_len}


def hf_part(cfg: dict, setup: dict, args, ws: dict, deadline: C.Deadline, result: dict,
            save) -> None:
    import transformers

    names = [n for n in ("a", "b") if n in setup["parts"]]
    model = None
    try:
        log(deadline, "transformers: building the model (random init)")
        t0 = time.perf_counter()
        model = hf_load(cfg, setup["device"], setup["dtype"],
                        max(ws[n].max_model_len for n in names))
        C.synchronize()
        load_s = time.perf_counter() - t0
        ids = np.random.default_rng(1).integers(0, cfg["vocab_size"], (2, 32))
        hf_generate(model, ids, 2, 2, setup["device"], False, 60.0)  # warm-up
    except Exception as exc:  # noqa: BLE001
        log(deadline, f"  transformers load FAILED: {type(exc).__name__}: {exc}")
        result["errors"].append({"part": "hf-load", **C.error_record(exc)})
        for n in names:
            result["results"][n]["hf"] = C.error_record(exc)
        names, load_s = [], None
    for name in names:
        w = ws[name]
        rec = {"load_s": load_s, "transformers": transformers.__version__,
               "settings": {"attn_implementation": "sdpa", "cache_implementation": "static",
                            "do_sample": False, "min_new_tokens": w.output_len,
                            "torch_compile": args.hf_compile}, "attempts": []}
        result["results"][name]["hf"] = rec
        if deadline.expired(30):
            rec["error"] = "skipped: time budget used up"
            continue
        prompts = make_prompts(np.random.default_rng(args.seed), w.num_requests,
                               w.prompt_len, cfg["vocab_size"])
        batch = min(args.hf_batch or w.num_requests, w.num_requests)
        while batch >= 1:
            err = None
            try:
                with C.peak_memory(rec):
                    if args.hf_compile:  # first run compiles; the second is timed
                        first = hf_generate(model, prompts, w.output_len, batch, setup["device"],
                                            True, max(deadline.remaining() - 20, 5))
                        rec["first_run_wall_s"] = first["wall_s"]
                    r = hf_generate(model, prompts, w.output_len, batch, setup["device"],
                                    args.hf_compile, max(deadline.remaining() - 20, 5))
                rec.update(r, batch_size=batch, truncated_by_time_budget=not r["all_full_length"])
                rec.pop("error", None)
                log(deadline, f"  transformers {name} (batch {batch}): {r['wall_s']:.2f}s, "
                              f"{r['total_tokens_per_s']:,.0f} tok/s total, "
                              f"{r['output_tokens_per_s']:,.0f} out tok/s")
                break
            except Exception as exc:  # noqa: BLE001
                err = C.error_record(exc)
                oom = C.is_oom(exc)
            rec["attempts"].append({"batch_size": batch, "error": err["error"]})
            C.free_device_memory()
            log(deadline, f"  transformers {name} batch {batch} failed: {err['error'][:200]}")
            if not oom or deadline.expired(30):
                rec.update(err)
                result["errors"].append({"part": f"hf-{name}", **err})
                break
            batch //= 2  # out of memory: same requests in smaller batches
        else:
            rec["error"] = "out of memory at every batch size"
        save()
    del model
    C.free_device_memory()
