"""`sparseserve eval fidelity`: CLI glue (wired into sparseserve/cli.py as `eval`)."""
from __future__ import annotations

import argparse
import shlex
import sys

ALGORITHMS = ["quest", "arkvale", "infllm", "streaming", "oracle"]


def add_eval_args(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("eval", help="evaluations (fidelity of sparse attention)")
    sub = p.add_subparsers(dest="eval_command", required=True)
    f = sub.add_parser("fidelity", help="sparse vs dense decoding on real long text: "
                                        "teacher-forced agreement/KL/recall and needles")
    f.add_argument("--model", default=None,
                   help="model (default: the embedded SmolLM2-135M-Instruct)")
    f.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192])
    f.add_argument("--budgets", type=int, nargs="+", default=[256, 512, 1024, 2048])
    f.add_argument("--budgets-shorter", type=int, nargs="+", default=None,
                   help="budgets at the lengths below the longest (default: --budgets)")
    f.add_argument("--algorithms", nargs="+", default=ALGORITHMS,
                   help="sparse algorithms (dense is always the baseline); scoring variants: "
                        "quest-sum, arkvale-sum (raw bound sums over the GQA group), "
                        "quest-massscored, arkvale-massscored (mass normalised over the scored pages "
                        "only, not the kept ones)")
    f.add_argument("--num-texts", type=int, default=3, help="texts per length")
    f.add_argument("--tail", type=int, default=256, help="teacher-forced positions per text")
    f.add_argument("--chunk-rows", type=int, default=256,
                   help="tail positions per forward pass (decode rows)")
    f.add_argument("--out", default="fidelity_out", help="output directory")
    f.add_argument("--quick", action="store_true",
                   help="tiny settings (smoke test): short texts, one sweep setting, "
                        "few needles")
    f.add_argument("--sweep-algorithms", nargs="+", default=None,
                   help="algorithms of the settings sweep (default: quest arkvale infllm)")
    f.add_argument("--sweep-settings", nargs="+", default=None,
                   help="sink/local/dense-layer settings swept, e.g. s2l4d0 s1l2d0 s1l4d2 "
                        "(default: s2l4d0 s1l2d0 s1l8d0 s1l4d1 s1l4d2)")
    f.add_argument("--needle-depths", type=float, nargs="+", default=None,
                   help="depths of the single-needle prompts (default 0.1 0.5 0.9)")
    f.add_argument("--needle-settings", nargs="+", default=None,
                   help="only these needle settings: keys (e.g. quest/b2048/s1/l4/d0) or "
                        "'dense', 'default', 'oracle' (the chosen default / oracle at its knobs, "
                        "at the largest budget); default: dense, every algorithm at 512 and "
                        "2048 and the default at every budget")
    f.add_argument("--no-needle", action="store_true", help="skip needle-in-a-haystack")
    f.add_argument("--verify-needle", action=argparse.BooleanOptionalAction, default=True,
                   help="cross-check needle answers with LLM.generate (dense and default)")
    f.add_argument("--engine-kernels", action="store_true",
                   help="use the engine's CPU reference kernels for the tail instead of the "
                        "shared-text evaluation of the same math (much slower)")
    f.add_argument("--plot", action=argparse.BooleanOptionalAction, default=True)
    f.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    return p


def run_eval(args: argparse.Namespace) -> int:
    import os

    from sparseserve.bench.fidelity import run_fidelity, write_results
    from sparseserve.bench.fidelity_report import plot

    if args.eval_command != "fidelity":
        raise ValueError(f"unknown evaluation {args.eval_command!r}")
    if args.quick and args.lengths == [4096, 8192]:
        args.lengths = [512]
    if args.quick and args.budgets == [256, 512, 1024, 2048]:
        args.budgets = [128, 256]
    if args.quick and args.tail == 256:
        args.tail = 32
    if args.quick and args.num_texts == 3:
        args.num_texts = 1
    if args.tail > min(args.lengths) // 2:
        raise ValueError("--tail must be at most half of the shortest length")
    args.command_line = "sparseserve " + " ".join(shlex.quote(a) for a in sys.argv[1:]) \
        if sys.argv and sys.argv[0].endswith(("sparseserve", "cli.py")) else None

    def log(msg: str) -> None:
        print(msg, flush=True)

    out = run_fidelity(args, log, save=lambda o: write_results(o, args.out))
    jpath, mpath = write_results(out, args.out)
    log(f"wrote {jpath} and {mpath}")
    if args.plot:
        png = plot(out, os.path.join(args.out, "fidelity_top1_vs_budget.png"))
        log(f"wrote {png}")
    with open(mpath) as f:
        print(f.read())
    return 0


def main(argv=None) -> int:  # `python -m sparseserve.bench.fidelity_cli fidelity ...`
    parser = argparse.ArgumentParser(prog="sparseserve")
    sub = parser.add_subparsers(dest="command", required=True)
    add_eval_args(sub)
    args = parser.parse_args(["eval"] + list(sys.argv[1:] if argv is None else argv))
    return run_eval(args)


if __name__ == "__main__":
    sys.exit(main())
