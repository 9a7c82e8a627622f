"""Overlap of consecutive sparse selections (SparseServe's Figure 8): how many of the pages a
decode step selects were selected the step before, and within the last `w` steps (the
working-set window of batch control, default 12) — the locality that the device cache and
working-set-aware batch control rely on.

Real text on a real model (the embedded SmolLM2 on CPU) or dummy weights on the GPU; greedy
free-running decode of `--decode-steps` tokens after a `--context`-token prompt per text, all
texts in one batch, eager (CUDA-graph replays do not call the selection hook). Per (request,
layer, KV head) and step t: overlap = |S_t ∩ S_{t-1}| / |S_t| and window reuse = |S_t ∩
(S_{t-1} ∪ ... ∪ S_{t-w})| / |S_t|, over all selected pages and over the pages the algorithm
chose (sink and local pages, always kept, excluded).

    python benchmarks/selection_overlap.py --out docs/results/data/selection_overlap_smollm2.json
    python benchmarks/selection_overlap.py --out $OUT/overlap.json --model llama-3-8b \\
        --load-format dummy --device cuda --dtype bfloat16 --context 32768
    python benchmarks/selection_overlap.py --out /tmp/o.json --smoke      # tiny, CPU
"""
from __future__ import annotations

import argparse
import os
import sys
from collections import defaultdict

sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                os.path.dirname(os.path.abspath(__file__))]

import common as C  # noqa: E402


class SelectionRecorder:
    """on_select hook: per (batch row, layer, KV head) the list of selected logical-page sets,
    one per decode step; with `margin` > 0 also the next `margin` pages by the algorithm's own
    score below the selection's cutoff (the pages a lookahead prefetch would fetch)."""

    def __init__(self, margin: int = 0) -> None:
        self.sets: dict[tuple[int, int, int], list[frozenset]] = defaultdict(list)
        self.margin = margin
        self.next_pages: dict[tuple[int, int, int], list[tuple]] = defaultdict(list)

    def __call__(self, layer, q, sel, ctx) -> None:
        import torch

        rows = ctx.dec_rows.tolist()
        blocks = sel.blocks.cpu()  # [B, Hkv, K] logical page indices
        num = sel.num_pages.cpu()  # [B, Hkv] entries in use
        ranked = None
        if self.margin:
            algo = ctx.sparse.algorithm
            scores = algo.score(q, ctx.dec_page_table, ctx.dec_num_pages, ctx.dec_last_len,
                                ctx.sparse.summaries[layer], ctx.kv.k[layer])  # [B, Hkv, W]
            taken = torch.zeros_like(scores, dtype=torch.bool).scatter_(2, sel.blocks, True)
            W = scores.shape[-1]
            n = ctx.dec_num_pages.long().unsqueeze(-1)
            real = torch.arange(W, device=scores.device).view(1, 1, W) < n
            # the best-scored pages the selection left out, best first
            scores = scores.float().masked_fill(taken | ~real, float("-inf"))
            k = min(self.margin, W)
            vals, idx = scores.topk(k, dim=-1)
            ranked = torch.where(vals > float("-inf"), idx, -1).cpu()
        for b, row in enumerate(rows):
            for h in range(blocks.shape[1]):
                n = int(num[b, h])
                self.sets[(row, layer, h)].append(frozenset(blocks[b, h, :n].tolist()))
                if ranked is not None:
                    self.next_pages[(row, layer, h)].append(
                        tuple(x for x in ranked[b, h].tolist() if x >= 0))


def overlap_stats(sets: dict, window: int, kept: int, min_pages: int) -> dict:
    """Mean consecutive overlap and window reuse over every (row, layer, head, step >= 1),
    all pages and chosen pages only (selections of rows with fewer than min_pages pages, where
    everything is selected, are skipped); per layer too."""
    acc = defaultdict(list)
    per_layer = defaultdict(list)
    for (row, layer, h), seq in sets.items():
        for t in range(1, len(seq)):
            cur = seq[t]
            if len(cur) < min_pages:
                continue
            hi = max(cur)
            # chosen: not a sink page (the first `kept[0]`) nor a local one (the last kept[1])
            chosen = {p for p in cur if p >= kept[0] and p <= hi - kept[1]}
            prev = seq[t - 1]
            past = frozenset().union(*seq[max(0, t - window):t])
            acc["overlap_all"].append(len(cur & prev) / len(cur))
            acc["window_all"].append(len(cur & past) / len(cur))
            if chosen:
                acc["overlap_chosen"].append(len(chosen & prev) / len(chosen))
                acc["window_chosen"].append(len(chosen & past) / len(chosen))
                per_layer[layer].append(len(chosen & prev) / len(chosen))
    mean = {k: sum(v) / len(v) for k, v in acc.items() if v}
    mean["samples"] = len(acc["overlap_all"])
    mean["per_layer_overlap_chosen"] = {int(k): sum(v) / len(v)
                                        for k, v in sorted(per_layer.items())}
    return mean


def _held_stats(sets: dict, start: int, held, min_pages: int) -> dict:
    """Mean share of step t's selected pages in held(key, seq, t) and mean size of
    (selection ∪ held) / |selection|, over steps t >= start of every (row, layer, head);
    selections with fewer than min_pages pages skipped."""
    reuse, size = [], []
    for key, seq in sets.items():
        for t in range(start, len(seq)):
            cur = seq[t]
            if len(cur) < min_pages:
                continue
            h = held(key, seq, t)
            reuse.append(len(cur & h) / len(cur))
            size.append(len(cur | h) / len(cur))
    return {"samples": len(reuse), "reuse": sum(reuse) / len(reuse) if reuse else None,
            "working_set_x_selection": sum(size) / len(size) if size else None}


def window_sweep(sets: dict, windows: list[int], min_pages: int) -> dict:
    """For each window w: the share of a step's selected pages that the previous w steps
    selected (what a device cache holding each head's last-w-step working set serves), and the
    size of that working set, |S_t ∪ S_{t-1} ∪ ... ∪ S_{t-w}|, as a multiple of |S_t| (the
    slots it costs against the token budget). Over steps t >= w only, so every sample has a
    full window; selections with fewer than min_pages pages are skipped."""
    return {str(w): _held_stats(sets, w, lambda key, seq, t, w=w: frozenset().union(*seq[t - w:t]),
                                min_pages) for w in windows}


def margin_sweep(sets: dict, next_pages: dict, window: int, margins: list[int],
                 min_pages: int) -> dict:
    """For each margin m: a cache holding the last `window` steps' selections plus the m
    best-scored pages each step left out (what a lookahead prefetch would load during step t-1)
    — the share of step t's selected pages it holds, and its size as a multiple of |S_t|.
    m = 0 is the plain window. Over steps t >= window; small selections skipped."""
    def held(key, seq, t, m):
        past = frozenset().union(*seq[t - window:t])
        ahead = next_pages.get(key, [])
        return past | frozenset(ahead[t - 1][:m]) if m and t - 1 < len(ahead) else past
    return {str(m): _held_stats(sets, window, lambda key, seq, t, m=m: held(key, seq, t, m),
                                min_pages) for m in margins}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", required=True, help="JSON result path")
    p.add_argument("--model", default=None, help="model (default: the embedded SmolLM2)")
    p.add_argument("--load-format", default="auto")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--kv-cache-gib", type=float, default=None,
                   help="device KV slots (default: what gpu_memory_utilization leaves)")
    p.add_argument("--algorithms", default="arkvale,keycode2")
    p.add_argument("--token-budget", type=int, default=512)
    p.add_argument("--context", type=int, default=4096, help="prompt tokens per text")
    p.add_argument("--num-texts", type=int, default=2)
    p.add_argument("--decode-steps", type=int, default=48)
    p.add_argument("--window", type=int, default=12, help="working-set window (steps)")
    p.add_argument("--windows", default="1,2,4,8,12,24",
                   help="window sweep: reuse and working-set size per window (steps)")
    p.add_argument("--margins", default="",
                   help="lookahead sweep at --window: also hold the m best-scored pages each "
                        "step left out (comma list of m; empty: skip)")
    p.add_argument("--smoke", action="store_true", help="a tiny random model, short run")
    args = p.parse_args(argv)

    import tempfile

    from sparseserve import LLM, SamplingParams
    from sparseserve.bench.texts import KINDS, load_texts

    tmp = tempfile.TemporaryDirectory()
    model, load_format = args.model, args.load_format
    if args.smoke:
        from tests.tiny_models import make_tiny_model
        model = os.path.join(tmp.name, "tiny")
        make_tiny_model(model)
        args.context, args.decode_steps, args.token_budget = 200, 8, 64
    page = 16 if args.smoke else 32
    result = {"meta": C.meta(argv), "settings": vars(args), "runs": {}}
    for algo in args.algorithms.split(","):
        llm = LLM(model, load_format=load_format, device=args.device, dtype=args.dtype,
                  sparse_algorithm=algo, token_budget=args.token_budget, page_size=page,
                  max_model_len=args.context + args.decode_steps + page,
                  max_num_seqs=max(2, args.num_texts), enforce_eager=True,
                  kv_cache_memory_bytes=(int(args.kv_cache_gib * 2**30)
                                         if args.kv_cache_gib else None))
        vocab = llm.engine.config.model.vocab_size
        if args.smoke or load_format == "dummy":
            import random
            rng = random.Random(0)
            prompts = [[rng.randrange(3, vocab) for _ in range(args.context)]
                       for _ in range(args.num_texts)]
            names = [f"random:{i}" for i in range(args.num_texts)]
        else:
            texts = load_texts(llm.get_tokenizer(), args.context, args.num_texts, KINDS)
            prompts, names = [t.token_ids for t in texts], [t.name for t in texts]
        margins = [int(m) for m in args.margins.split(",") if m.strip()]
        rec = SelectionRecorder(max(margins, default=0))
        params = SamplingParams(temperature=0.0, max_tokens=args.decode_steps, ignore_eos=True)
        with llm.engine.runner.hooked(on_select=rec):
            llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
        sc = llm.engine.config.sparse
        budget_pages = sc.token_budget // page
        stats = overlap_stats(rec.sets, args.window, (sc.sink_pages, sc.local_pages),
                              min_pages=budget_pages)
        windows = [int(w) for w in args.windows.split(",")]
        result["runs"][algo] = {"texts": names, "budget_pages": budget_pages,
                                "sink_pages": sc.sink_pages, "local_pages": sc.local_pages,
                                **stats, "window_sweep": window_sweep(rec.sets, windows,
                                                                      budget_pages)}
        if margins:
            result["runs"][algo]["margin_sweep"] = margin_sweep(
                rec.sets, rec.next_pages, args.window, [0] + margins, budget_pages)
        C.write_json(args.out, result)
        # free this engine's HBM before the next one sizes its KV cache from what is free
        llm.engine.shutdown()
        del llm
        C.free_device_memory()
    fig_path = os.path.splitext(args.out)[0] + ".png"
    plt = C.pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for algo, r in result["runs"].items():
            layers = r["per_layer_overlap_chosen"]
            ax.plot(list(layers), list(layers.values()), marker="o", label=algo)
        ax.set_xlabel("layer")
        ax.set_ylabel("overlap with the previous step")
        ax.set_ylim(0, 1)
        ax.set_title(f"consecutive selections, budget {args.token_budget}, {args.context} tokens")
        ax.legend()
        C.save_figure(fig, fig_path)
    print(f"wrote {args.out}\n")
    rows = [[a, r["samples"], C.fmt(100 * r.get("overlap_all", 0)),
             C.fmt(100 * r.get("overlap_chosen", 0)), C.fmt(100 * r.get("window_all", 0)),
             C.fmt(100 * r.get("window_chosen", 0))] for a, r in result["runs"].items()]
    print(C.table(["algorithm", "samples", "overlap % all", "overlap % chosen",
                   f"in last {args.window} % all", f"in last {args.window} % chosen"], rows))
    sweep = [[a, w, x["samples"], C.fmt(100 * x["reuse"]) if x["reuse"] is not None else "-",
              C.fmt(x["working_set_x_selection"], 2)
              if x["working_set_x_selection"] is not None else "-"]
             for a, r in result["runs"].items() for w, x in r["window_sweep"].items()]
    print("\nwindow sweep (reuse = selected pages found in the previous w steps' union; "
          "working set = that union with the step's, x the selection size)")
    print(C.table(["algorithm", "window", "samples", "reuse %", "working set x"], sweep))
    ms = [[a, m, x["samples"], C.fmt(100 * x["reuse"]) if x["reuse"] is not None else "-",
           C.fmt(x["working_set_x_selection"], 2)
           if x["working_set_x_selection"] is not None else "-"]
          for a, r in result["runs"].items() for m, x in r.get("margin_sweep", {}).items()]
    if ms:
        print(f"\nlookahead sweep at window {args.window} (the m best-scored pages each step "
              "left out, held too)")
        print(C.table(["algorithm", "margin", "samples", "reuse %", "working set x"], ms))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
