"""`python -m tests.server.run_fake_server PORT [SHUTDOWN_TIMEOUT]`: the real serve path
(`serve_app`: uvicorn in the main thread, signal handling) around the fake engine."""
import sys

from sparseserve.server.api import create_app
from sparseserve.server.serve_cli import serve_app
from tests.server.fake_engine import FakeEngine

if __name__ == "__main__":
    port = int(sys.argv[1])
    timeout = float(sys.argv[2]) if len(sys.argv) > 2 else 30.0
    engine = FakeEngine(step_delay=0.05)
    app = create_app(engine, shutdown_timeout_s=timeout)
    code = serve_app(app, "127.0.0.1", port, log_level="warning", graceful_timeout_s=timeout)
    free, total = engine.num_free_pages(), engine.num_total_pages()
    print(f"EXIT pages {free}/{total} unfinished={len(engine._reqs)}", flush=True)
    sys.exit(code)
