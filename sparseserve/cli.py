"""`sparseserve` command line: `generate` (offline) and `serve` (OpenAI-compatible server)."""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def _add_generate(sub) -> None:
    from sparseserve.engine.args import EngineArgs

    p = sub.add_parser("generate", help="generate completions for prompts (offline)")
    p.add_argument("prompts", nargs="+", help="prompt text(s)")
    p.add_argument("--chat", action="store_true",
                   help="wrap each prompt as a user message with the model's chat template")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--min-tokens", type=int, default=0)
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--json", action="store_true", help="print results as JSON lines")
    EngineArgs.add_cli_args(p)


def generate_inputs(args: argparse.Namespace) -> tuple[Any, Any]:
    """(prompts or conversations, SamplingParams) from the flags, validated with the server's
    rules (`sparseserve.validation`) so bad values fail before the model loads."""
    from sparseserve.request import SamplingParams
    from sparseserve.validation import check_unicode, conversation

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                            min_tokens=args.min_tokens, presence_penalty=args.presence_penalty,
                            frequency_penalty=args.frequency_penalty,
                            repetition_penalty=args.repetition_penalty)
    check_unicode(list(args.prompts), "prompts")
    if args.chat:
        convs = [[{"role": "user", "content": p}] for p in args.prompts]
        for conv in convs:
            conversation(conv)
        return convs, params
    return list(args.prompts), params


def _run_generate(args: argparse.Namespace) -> int:
    from sparseserve.engine.args import EngineArgs
    from sparseserve.engine.llm import LLM

    inputs, params = generate_inputs(args)  # before the (slow) model load
    eargs = EngineArgs.from_cli_args(args)
    llm = LLM(**vars(eargs))
    outs = llm.chat(inputs, params) if args.chat else llm.generate(inputs, params)
    for prompt, out in zip(args.prompts, outs):
        o = out.outputs[0]
        if args.json:
            print(json.dumps({"prompt": prompt, "text": o.text, "token_ids": o.token_ids,
                              "finish_reason": o.finish_reason}))
        else:
            print(f"### {prompt}\n{o.text}\n[finish_reason={o.finish_reason}, "
                  f"{len(o.token_ids)} tokens]")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sparseserve")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    from sparseserve.bench.fidelity_cli import add_eval_args
    add_eval_args(sub)
    from sparseserve.bench.serve_cli import add_bench_args
    add_bench_args(sub)
    try:
        from sparseserve.server.serve_cli import add_serve_args
        add_serve_args(sub)
    except ImportError as e:  # server extras not installed
        p = sub.add_parser("serve", help="OpenAI-compatible server (needs fastapi, uvicorn)")
        p.set_defaults(_missing=str(e))
    args = parser.parse_args(argv)
    try:
        if args.command == "generate":
            return _run_generate(args)
        if args.command == "bench":
            from sparseserve.bench.serve_cli import run_bench
            return run_bench(args)
        if args.command == "eval":
            from sparseserve.bench.fidelity_cli import run_eval
            return run_eval(args)
        if getattr(args, "_missing", None):
            print(f"sparseserve serve needs the server extras: pip install 'sparseserve[server]' "
                  f"({args._missing})", file=sys.stderr)
            return 2
        from sparseserve.server.serve_cli import run_serve
        return run_serve(args) or 0
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
