"""`python -m sparseserve.cli serve` as a user starts it: the embedded SmolLM2, the API key from
the environment, the real `openai` client, SIGTERM."""
from __future__ import annotations

import httpx
import pytest

openai = pytest.importorskip("openai")

from tests.server.helpers import assert_openai_error, wait_healthy  # noqa: E402

PROMPT = "The capital of France is"


def test_cli_serve_api_key_and_sigterm(tmp_path):
    """`python -m sparseserve.cli serve` end to end: the embedded model, the API key from the
    environment, one request, then SIGTERM -> exit code 0."""
    import os
    import signal
    import subprocess
    import sys

    from tests.server.conftest import free_port
    from tests.server.test_sigterm import ROOT

    port = free_port()
    env = dict(os.environ, SPARSESERVE_API_KEY="test-key")
    log = open(tmp_path / "serve.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "sparseserve.cli", "serve", "--port", str(port),
                             "--max-model-len", "512", "--served-model-name", "smol"],
                            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, base, 150, lambda: open(tmp_path / "serve.log").read())
        assert_openai_error(httpx.post(base + "/v1/completions", json={"prompt": "x"}), 401)
        client = openai.OpenAI(base_url=base + "/v1", api_key="test-key", max_retries=0, timeout=120)
        r = client.completions.create(model="smol", prompt=PROMPT, max_tokens=4, temperature=0)
        assert r.model == "smol" and r.usage.completion_tokens >= 1
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, open(tmp_path / "serve.log").read()
    finally:
        if proc.poll() is None:
            proc.kill()
