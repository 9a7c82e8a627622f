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

API_KEY_ENV = "SPARSESERVE_API_KEY"
DEFAULT_MAX_N = 16  # largest `n` a request may ask for unless --max-n says otherwise


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
                   help=f"largest n a request may ask for (default {DEFAULT_MAX_N})")
    p.add_argument("--chat-template", default=None,
                   help="Jinja chat template (a file path or the template text) replacing the model's")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds to let in-flight requests finish before aborting them")
    p.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])


def _chat_template(value: Optional[str]) -> Optional[str]:
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    return value


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
    from sparseserve.engine.llm_engine import LLMEngine
    from sparseserve.server.api import create_app

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if getattr(args, "model_tag", None):
        if getattr(args, "model", None) not in (None, args.model_tag):
            raise ValueError(f"two models given: {args.model_tag!r} and --model {args.model!r}.")
        args.model = args.model_tag
    if args.max_waiting_requests is not None and args.max_waiting_requests < 0:
        raise ValueError("--max-waiting-requests must be >= 0.")
    if args.max_n < 1:
        raise ValueError("--max-n must be >= 1.")
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    engine = LLMEngine.from_engine_args(EngineArgs.from_cli_args(args))
    app = create_app(engine, served_model_names=args.served_model_name, api_key=api_key,
                     max_waiting_requests=args.max_waiting_requests, max_n=args.max_n,
                     chat_template=_chat_template(args.chat_template),
                     shutdown_timeout_s=args.shutdown_timeout)
    ctx = app.state.ctx
    logging.getLogger("sparseserve.server").info(
        "serving %s (max_model_len %d) on http://%s:%d%s", ctx.served_model_names, ctx.max_model_len,
        args.host, args.port, " with an API key" if api_key else "")
    return serve_app(app, args.host, args.port, log_level=args.uvicorn_log_level,
                     graceful_timeout_s=args.shutdown_timeout)


def serve_app(app: Any, host: str, port: int, log_level: str = "info",
              graceful_timeout_s: float = 30.0) -> int:
    """Run uvicorn until SIGTERM/SIGINT: stop accepting, let in-flight requests finish for up
    to `graceful_timeout_s` (then cancel them, which aborts their engine requests), stop the
    engine loop, return 0."""
    import uvicorn

    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                            timeout_graceful_shutdown=int(max(1, graceful_timeout_s)))
    server = uvicorn.Server(config)
    # uvicorn re-raises the captured signal once it has shut down, with the handler that was
    # installed before it started: make those handlers no-ops so that SIGTERM (and Ctrl-C)
    # end with exit code 0 after the graceful shutdown. (While uvicorn runs, its own handlers
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
    return 0 if server.started else 1


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
