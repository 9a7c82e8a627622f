"""`sparseserve bench serve`: flags (vLLM's `vllm bench serve` names) and the run.

HTTP (default): the server at --base-url (or http://--host:--port) serves the requests.
In-process (`--engine-args "..."` or `--in-process`): an engine built here from those
`sparseserve serve` engine flags runs them through the server's AsyncLLMEngine, no HTTP.

Prompts need the served model's tokenizer: the engine's in-process; over HTTP --tokenizer
(a HF directory or .gguf file), else --model if it is such a path, else the embedded
SmolLM2's when the server serves it, else none (`--tokenizer none` forces that): then the
prompts are random token ids drawn below the vocabulary size (--vocab-size, or the built-in
dummy config the server is named after).
"""
from __future__ import annotations

import argparse
import functools
import math
import shlex
from typing import Any, Optional

from sparseserve.bench import longbench, serve_metrics


def _rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number (requests/s) or inf") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 (or inf), got {text}")
    return value


def add_bench_args(subparsers: Any) -> argparse.ArgumentParser:
    """Register `bench` with its `serve` subcommand on the top-level subparsers."""
    p = subparsers.add_parser("bench", help="benchmarks (serving: TTFT, ITL, throughput, goodput)")
    sub = p.add_subparsers(dest="bench_command", required=True)
    s = sub.add_parser("serve", help="load an OpenAI-compatible server (or an in-process engine) "
                                     "with a workload and measure it, like `vllm bench serve`")
    g = s.add_argument_group("target")
    g.add_argument("--base-url", default=None, help="server URL (default: http://HOST:PORT)")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--endpoint", default="/v1/completions",
                   choices=["/v1/completions", "/v1/chat/completions"])
    g.add_argument("--model", default=None, help="served model name (default: the server's first)")
    g.add_argument("--tokenizer", default=None,
                   help="tokenizer for the prompts (HF directory or .gguf file; 'none' = token ids)")
    g.add_argument("--vocab-size", type=int, default=None,
                   help="vocabulary size for random token ids when there is no tokenizer")
    g.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    g.add_argument("--engine-args", default=None,
                   help="run in-process: `sparseserve serve` engine flags for the engine, "
                        "e.g. \"--max-model-len 4096 --sparse-algorithm quest\"")
    g.add_argument("--in-process", action="store_true",
                   help="run in-process with --engine-args (default: the default engine, --model)")
    w = s.add_argument_group("workload")
    w.add_argument("--dataset-name", default="random", choices=["random", "longbench"])
    w.add_argument("--num-prompts", type=int, default=1000)
    w.add_argument("--max-input-len", type=int, default=None,
                   help="cap on prompt tokens (the server's max_model_len minus the output "
                        "length caps them anyway)")
    w.add_argument("--random-input-len", type=int, default=1024)
    w.add_argument("--random-output-len", type=int, default=128)
    w.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths uniform in [L*(1-r), L*(1+r)]")
    w.add_argument("--longbench-datasets", nargs="+", default=None, metavar="NAME",
                   help=f"subset of {', '.join(longbench.DATASETS)} (default: all)")
    w.add_argument("--longbench-output-len", type=int, default=None,
                   help="replace LongBench's per-dataset max_new_tokens (short CPU runs)")
    w.add_argument("--token-id-prompts", action="store_true",
                   help="send token ids even when the model has a tokenizer (/v1/completions)")
    w.add_argument("--seed", type=int, default=0, help="workload and arrival-time seed")
    r = s.add_argument_group("load and sampling")
    r.add_argument("--request-rate", type=_rate, default=math.inf,
                   help="requests/s, Poisson (with --burstiness 1); inf = all at once")
    r.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the inter-arrival gaps (1 = Poisson)")
    r.add_argument("--max-concurrency", type=int, default=None)
    r.add_argument("--ignore-eos", action="store_true", help="generate exactly max_tokens")
    r.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    r.add_argument("--top-p", type=float, default=None)
    r.add_argument("--top-k", type=int, default=None)
    o = s.add_argument_group("metrics and output")
    o.add_argument("--percentile-metrics", default="ttft,tpot,itl",
                   help="comma-separated subset of ttft,tpot,itl,e2el")
    o.add_argument("--metric-percentiles", default="99", help="e.g. 50,90,99")
    o.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                   help="SLOs, e.g. ttft:2000 tpot:50 e2el:30000; a request is good if it meets all")
    o.add_argument("--save-result", action="store_true")
    o.add_argument("--result-dir", default=None)
    o.add_argument("--result-filename", default=None)
    o.add_argument("--disable-tqdm", action="store_true")
    return p


def sampling_fields(args: argparse.Namespace) -> dict[str, Any]:
    """Sampling fields shared by both backends (request JSON names = SamplingParams names)."""
    out: dict[str, Any] = {"temperature": args.temperature, "ignore_eos": args.ignore_eos}
    if args.top_p is not None:
        out["top_p"] = args.top_p
    if args.top_k is not None:
        out["top_k"] = args.top_k
    return out


def build_engine(engine_args: Optional[str], model: Optional[str]) -> Any:
    """An LLMEngine from `sparseserve serve` engine flags (`--model` fills in a missing model)."""
    from sparseserve.engine.args import EngineArgs
    from sparseserve.engine.llm_engine import LLMEngine

    parser = argparse.ArgumentParser(prog="--engine-args", add_help=False)
    EngineArgs.add_cli_args(parser)
    try:
        ns = parser.parse_args(shlex.split(engine_args or ""))
    except SystemExit:
        raise ValueError(f"--engine-args {engine_args!r}: not valid `sparseserve serve` engine "
                         "flags (see `sparseserve serve --help`).") from None
    if ns.model is None:
        ns.model = model
    return LLMEngine.from_engine_args(EngineArgs.from_cli_args(ns))


@functools.lru_cache(maxsize=4)  # a GGUF tokenizer takes seconds to rebuild; runs in one
def client_tokenizer(tokenizer: Optional[str], model: Optional[str]) -> tuple[Any, Optional[int]]:
    """(tokenizer or None, vocab size or None) for HTTP runs; see the module docstring.

    Cached per (tokenizer, model) for drivers that run many benchmarks in one process; the
    tokenizer is only read (encode / decode), never changed."""
    import os

    from sparseserve.model.loader.dummy import builtin_model_config, find_builtin
    from sparseserve.model.loader.source import DEFAULT_MODEL_NAME, ModelSource, resolve_model_source
    from sparseserve.model.loader.tokenizer import load_tokenizer

    if tokenizer is not None and tokenizer.lower() == "none":
        tok = None
    elif tokenizer is not None:
        tok = load_tokenizer(ModelSource("hf", None, "client"), tokenizer=tokenizer)
    elif model is not None and os.path.exists(os.path.expanduser(model)):
        tok = load_tokenizer(ModelSource("hf", None, "client"), tokenizer=model)
    elif model == DEFAULT_MODEL_NAME:
        tok = load_tokenizer(resolve_model_source(None))
    else:
        tok = None
    vocab = None
    if tok is None and model is not None and find_builtin(model) is not None:
        vocab = builtin_model_config(model).vocab_size
    return tok, vocab


def run_bench(args: argparse.Namespace) -> int:
    """`sparseserve bench serve`; returns the exit code (1 if any request failed)."""
    import asyncio

    from sparseserve.bench import serve_report
    from sparseserve.bench.serve_datasets import build_requests
    from sparseserve.bench.serve_runner import run_benchmark

    if args.bench_command != "serve":
        raise ValueError(f"unknown benchmark {args.bench_command!r}")
    pmetrics = serve_metrics.parse_percentile_metrics(args.percentile_metrics)
    percentiles = serve_metrics.parse_percentiles(args.metric_percentiles)
    goodput = serve_metrics.parse_goodput(args.goodput)
    longbench.check_datasets(args.longbench_datasets)
    sampling = sampling_fields(args)
    if args.in_process or args.engine_args is not None:
        from sparseserve.bench.serve_inprocess import InProcessBackend
        if args.endpoint != "/v1/completions":
            raise ValueError("--endpoint is an HTTP setting; in-process runs send prompts as "
                             "/v1/completions does (drop --endpoint or --engine-args).")
        backend: Any = InProcessBackend(build_engine(args.engine_args, args.model), sampling)
        tok, vocab, max_len = backend.tokenizer, backend.vocab_size, backend.max_model_len
    else:
        from sparseserve.bench.serve_client import HTTPBackend
        base = args.base_url or f"http://{args.host}:{args.port}"
        backend = HTTPBackend(base, args.endpoint, args.model, sampling, api_key=args.api_key)
        async def probe() -> None:  # fail fast; learn the model name and max_model_len
            await backend.start()
            await backend.close()
        asyncio.run(probe())
        tok, vocab = client_tokenizer(args.tokenizer, backend.model)
        max_len = backend.max_model_len
        if tok is None and backend.chat:
            raise ValueError("no tokenizer for the prompts, so they would be token ids, which the "
                             "chat endpoint does not take: pass --tokenizer or use /v1/completions.")
    requests = build_requests(
        args.dataset_name, args.num_prompts, args.seed, tokenizer=tok,
        vocab_size=args.vocab_size or vocab, token_ids=args.token_id_prompts,
        max_input_len=args.max_input_len, max_model_len=max_len,
        random_input_len=args.random_input_len, random_output_len=args.random_output_len,
        random_range_ratio=args.random_range_ratio, longbench_datasets=args.longbench_datasets,
        longbench_output_len=args.longbench_output_len)
    result = run_benchmark(requests, backend, request_rate=args.request_rate,
                           burstiness=args.burstiness, max_concurrency=args.max_concurrency,
                           seed=args.seed, percentile_metrics=pmetrics, percentiles=percentiles,
                           goodput=goodput, disable_tqdm=args.disable_tqdm)
    result["dataset_name"] = args.dataset_name
    result["tokenizer_id"] = getattr(tok, "name_or_path", None) if tok is not None else None
    result["prompt_format"] = "text" if requests[0].prompt is not None else "token-ids"
    print(serve_report.summary(result))
    if args.save_result:
        print(f"wrote {serve_report.save_result(result, args.result_dir, args.result_filename)}")
    return 1 if result["failed"] else 0
