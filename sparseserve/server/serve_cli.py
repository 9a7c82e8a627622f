"""`sparseserve serve [MODEL]`: argument parsing and the uvicorn run.

`sparseserve/cli.py` calls `add_serve_args(subparsers)` and `run_serve(args)`. This module
imports no web framework at import time, so `sparseserve --help` works without the server
extras. `python -m sparseserve.server.serve_cli [MODEL] [flags]` runs the same command.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from typing import Any, Optional

from sparseserve.server.limits import (DEFAULT_MAX_N, DEFAULT_MAX_REQUEST_BODY_BYTES,
                                       DEFAULT_MAX_SEQUENCES, DEFAULT_TOKENIZER_WORKERS,
                                       EXIT_REQUESTS_CUT)

API_KEY_ENV = "SPARSESERVE_API_KEY"
# after the shutdown timeout cut the remaining requests, seconds left to send their final events
CUT_GRACE_S = 5.0


def add_serve_args(subparsers: Any) -> argparse.ArgumentParser:
    from sparseserve.engine.args import EngineArgs

    p = subparsers.add_parser(
        "serve", help="OpenAI-compatible HTTP server",
        description="Serve a model over an OpenAI-compatible HTTP API "
                    "(/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics).")
    add_server_flags(p)
    EngineArgs.add_cli_args(p)
    return p


def add_server_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="HF directory, .gguf file or dummy config name (default: the embedded "
                        "SmolLM2-135M-Instruct); same as --model")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to bind (default 8000)")
    p.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer KEY' on /v1 routes (or set {API_KEY_ENV})")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="model name(s) the API accepts; the first is reported (default: the model's name)")
    p.add_argument("--max-waiting-requests", type=int, default=None,
                   help="answer 503 when more requests than this are waiting (default: unlimited)")
    p.add_argument("--max-n", type=int, default=DEFAULT_MAX_N,
                   help=f"largest n (or best_of) a request may ask for (default {DEFAULT_MAX_N})")
    p.add_argument("--max-seqs-per-request", type=int, default=DEFAULT_MAX_SEQUENCES,
                   help="most sequences (prompts x n) one request may start "
                        f"(default {DEFAULT_MAX_SEQUENCES})")
    p.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_REQUEST_BODY_BYTES,
                   help="larger request bodies answer 413 "
                        f"(default {DEFAULT_MAX_REQUEST_BODY_BYTES // (1024 * 1024)} MiB)")
    p.add_argument("--tokenizer-workers", type=int, default=DEFAULT_TOKENIZER_WORKERS,
                   help="threads that tokenize prompts, off the engine thread "
                        f"(default {DEFAULT_TOKENIZER_WORKERS})")
    p.add_argument("--chat-template", default=None,
                   help="Jinja chat template (a file path or the template text) replacing the model's")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds to let in-flight requests finish; then the rest get "
                        "an error (503 / a final SSE error event) and the exit code is "
                        f"{EXIT_REQUESTS_CUT}")
    p.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                   help="run the engine in its own process, so HTTP work (JSON, SSE) never holds "
                        "the engine's GIL (default); --no-engine-process steps it in a thread "
                        "of the server process")
    p.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])


def _chat_template(value: Optional[str]) -> Optional[str]:
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    return value


def server_limits(args: argparse.Namespace) -> Any:
    """The ServerLimits of the flags (ValueError naming the flag when one is < 1)."""
    from sparseserve.server.limits import ServerLimits

    flags = {"max_n": "--max-n", "max_sequences": "--max-seqs-per-request",
             "max_request_body_bytes": "--max-request-body-bytes",
             "tokenizer_workers": "--tokenizer-workers"}
    values = {"max_n": args.max_n, "max_sequences": args.max_seqs_per_request,
              "max_request_body_bytes": args.max_request_body_bytes,
              "tokenizer_workers": args.tokenizer_workers}
    for field, flag in flags.items():
        if values[field] < 1:
            raise ValueError(f"{flag} must be >= 1, got {values[field]}.")
    return ServerLimits(**values)


def run_serve(args: argparse.Namespace) -> int:
    """Load the engine, build the app and serve until SIGTERM/SIGINT. Returns the exit code."""
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        print(f"error: sparseserve serve needs the server extras ({e}); "
              "pip install 'sparseserve[server]'", file=sys.stderr)
        return 2
    from sparseserve.engine.args import EngineArgs
    from sparseserve.engine.gc_pauses import freeze_startup_heap
    from sparseserve.engine.llm_engine import LLMEngine
    from sparseserve.server.api import create_app

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if getattr(args, "model_tag", None):
        if getattr(args, "model", None) not in (None, args.model_tag):
            raise ValueError(f"two models given: {args.model_tag!r} and --model {args.model!r}.")
        args.model = args.model_tag
    if args.max_waiting_requests is not None and args.max_waiting_requests < 0:
        raise ValueError("--max-waiting-requests must be >= 0.")
    limits = server_limits(args)
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    engine_args = EngineArgs.from_cli_args(args)
    if args.engine_process:
        engine = _engine_process(engine_args, args)
    else:
        engine = LLMEngine.from_engine_args(engine_args)
    app = create_app(engine, served_model_names=args.served_model_name, api_key=api_key,
                     max_waiting_requests=args.max_waiting_requests, limits=limits,
                     chat_template=_chat_template(args.chat_template),
                     shutdown_timeout_s=args.shutdown_timeout)
    ctx = app.state.ctx
    logging.getLogger("sparseserve.server").info(
        "serving %s (max_model_len %d) on http://%s:%d%s", ctx.served_model_names, ctx.max_model_len,
        args.host, args.port, " with an API key" if api_key else "")
    # this process serves this app (and, with --no-engine-process, its engine) until it exits:
    # no full collection walks the start-up heap mid-serving (engine/gc_pauses.py)
    freeze_startup_heap()
    return serve_app(app, args.host, args.port, log_level=args.uvicorn_log_level,
                     graceful_timeout_s=args.shutdown_timeout)


def _engine_process(engine_args: Any, args: argparse.Namespace) -> Any:
    """An AsyncLLMEngine whose engine runs in its own process, with the server's metrics."""
    from sparseserve.server.async_engine import AsyncLLMEngine
    from sparseserve.server.metrics import ServerMetrics

    def metrics(info: Any, stats: dict) -> ServerMetrics:
        names = args.served_model_name or [info.model_name or "default"]
        m = ServerMetrics(names[0], max_model_len=info.max_model_len)
        m.start_from(stats)  # count from here: not the start-up warm-up
        return m

    try:
        return AsyncLLMEngine.in_engine_process(engine_args, metrics_factory=metrics,
                                                max_waiting_requests=args.max_waiting_requests)
    except RuntimeError as e:  # the engine's own error is in the log above
        raise ValueError(str(e)) from e


def serve_app(app: Any, host: str, port: int, log_level: str = "info",
              graceful_timeout_s: float = 30.0) -> int:
    """Run uvicorn until SIGTERM/SIGINT: stop accepting, let in-flight requests finish for up
    to `graceful_timeout_s`, then cut the rest (each stream gets a final SSE error event and
    [DONE], each non-streaming request a 503 JSON), stop the engine loop.

    Returns 0 after a clean shutdown, `EXIT_REQUESTS_CUT` when requests had to be cut, 1 when
    the server did not start."""
    import uvicorn

    engine = getattr(app.state, "engine", None)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                            timeout_graceful_shutdown=int(max(1, graceful_timeout_s) + CUT_GRACE_S))
    server = _CuttingServer(config, cut_after_s=graceful_timeout_s,
                            cut=engine.cut_all if engine is not None else None)
    # uvicorn re-raises the captured signal once it has shut down, with the handler that was
    # installed before it started: make those handlers no-ops so that SIGTERM (and Ctrl-C)
    # end with our exit code after the graceful shutdown. (While uvicorn runs, its own handlers
    # are in place: a second Ctrl-C still forces the exit.)
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, lambda *_: None)
    try:
        server.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if not server.started:
        return 1
    cut = getattr(engine, "num_cut", 0) if engine is not None else 0
    if cut:
        logging.getLogger("sparseserve.server").warning(
            "shutdown timeout (%.1f s) passed: %d request(s) were cut", graceful_timeout_s, cut)
        return EXIT_REQUESTS_CUT
    return 0


def _cutting_server_class() -> Any:
    import asyncio

    import uvicorn

    class CuttingServer(uvicorn.Server):
        """uvicorn.Server whose shutdown cuts the engine's requests `cut_after_s` seconds in,
        while their connections are still open, so that handlers can send a final answer
        before uvicorn's own timeout (cut_after_s + CUT_GRACE_S) would cancel them."""

        def __init__(self, config: Any, cut_after_s: float, cut: Any) -> None:
            super().__init__(config)
            self.cut_after_s = cut_after_s
            self.cut = cut

        async def shutdown(self, sockets: Any = None) -> None:
            timer = asyncio.ensure_future(self._cut_later()) if self.cut is not None else None
            try:
                await super().shutdown(sockets)
            finally:
                if timer is not None:
                    timer.cancel()

        async def _cut_later(self) -> None:
            await asyncio.sleep(self.cut_after_s)
            self.cut()

    return CuttingServer


def _CuttingServer(config: Any, cut_after_s: float, cut: Any) -> Any:
    return _cutting_server_class()(config, cut_after_s, cut)


def main(argv: Optional[list[str]] = None) -> int:
    from sparseserve.engine.args import EngineArgs

    parser = argparse.ArgumentParser(prog="sparseserve serve")
    add_server_flags(parser)
    EngineArgs.add_cli_args(parser)
    args = parser.parse_args(argv)
    try:
        return run_serve(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
