"""HTTP backend of the serving benchmark: streaming requests to an OpenAI-compatible server.

Every request is sent with `stream: true` and `stream_options: {"include_usage": true}`; the
sparseserve server then ends the stream with a chunk whose `usage` holds the exact prompt
and completion token counts (serving_completions.py / serving_chat.py), and those are what
the benchmark reports. A server that sends no usage is measured by counting token-carrying
chunks instead, and the result says so (`usage_source: "chunks"`): a chunk can carry more
than one token, so that count is a lower bound.

A token-carrying event is a chunk with non-empty text (completions: `text`, chat:
`delta.content`), with logprob entries (token-id prompts ask for `logprobs: 0`: a model
served without a tokenizer streams no text), or with a finish reason (the last token may
decode to no text). The chat endpoint's opening chunk (`role: assistant`, empty content)
carries no token.
"""
from __future__ import annotations

import json
import time
from typing import Any, Optional

import httpx

from sparseserve.bench.serve_types import BenchRequest, RequestResult

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")


def _error_text(status: int, body: bytes) -> str:
    try:
        message = json.loads(body)["error"]["message"]
    except Exception:
        message = body.decode("utf-8", "replace")[:500]
    return f"HTTP {status}: {message}"


class HTTPBackend:
    """Sends `BenchRequest`s to `base_url + endpoint`; see the module docstring.

    sampling: extra request fields (temperature, top_p, top_k, ignore_eos, ...).
    """

    name = "http"

    def __init__(self, base_url: str, endpoint: str = "/v1/completions", model: Optional[str] = None,
                 sampling: Optional[dict[str, Any]] = None, api_key: Optional[str] = None,
                 timeout_s: float = 6 * 3600.0) -> None:
        if endpoint not in ENDPOINTS:
            raise ValueError(f"--endpoint {endpoint!r}: choose {' or '.join(ENDPOINTS)}.")
        self.base_url = base_url.rstrip("/")
        self.endpoint = endpoint
        self.model = model
        self.sampling = dict(sampling or {})
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout_s = timeout_s
        self.max_model_len: Optional[int] = None
        self._client: Optional[httpx.AsyncClient] = None

    @property
    def chat(self) -> bool:
        return self.endpoint == "/v1/chat/completions"

    async def start(self) -> None:
        """Open the connection pool and read the served model (name, max_model_len) from
        /v1/models. ValueError if the server cannot be reached or does not serve `model`."""
        if self._client is not None:
            return
        # no pool limit: --max-concurrency, not the client, bounds the requests in flight
        self._client = httpx.AsyncClient(base_url=self.base_url, headers=self.headers,
                                         timeout=httpx.Timeout(self.timeout_s, connect=30.0),
                                         limits=httpx.Limits(max_connections=None,
                                                             max_keepalive_connections=None))
        try:
            r = await self._client.get("/v1/models")
        except httpx.HTTPError as e:
            await self.close()
            raise ValueError(f"cannot reach the server at {self.base_url} ({type(e).__name__}: {e}); "
                             "start it with `sparseserve serve` or fix --base-url/--host/--port.") from e
        if r.status_code != 200:
            await self.close()
            raise ValueError(f"GET {self.base_url}/v1/models: {_error_text(r.status_code, r.content)}")
        cards = r.json().get("data", [])
        card = next((c for c in cards if self.model in (None, c.get("id"))), None)
        if card is None:
            await self.close()
            raise ValueError(f"the server serves {[c.get('id') for c in cards]}, not {self.model!r}; "
                             "fix --model or leave it out.")
        self.model = card.get("id")
        self.max_model_len = card.get("max_model_len")

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def read_metrics(self) -> Optional[str]:
        try:
            r = await self._client.get("/metrics")
        except httpx.HTTPError:
            return None
        return r.text if r.status_code == 200 else None

    def payload(self, req: BenchRequest) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "stream": True,
                                "stream_options": {"include_usage": True}}
        body.update(self.sampling)
        if self.chat:
            if req.prompt is None:
                raise ValueError("the chat endpoint needs text prompts; a model without a "
                                 "tokenizer can only be benchmarked on /v1/completions.")
            body["messages"] = [{"role": "user", "content": req.prompt}]
            body["max_completion_tokens"] = req.output_len
        else:
            body["prompt"] = req.prompt if req.prompt is not None else req.prompt_token_ids
            body["max_tokens"] = req.output_len
            if req.prompt is None:
                # token-id prompts: the model may have no tokenizer, and then every text delta
                # is empty; the sampled token's logprob entry (`<id>`) makes each new token
                # arrive in a chunk of its own, which TTFT and ITL are measured from
                body.setdefault("logprobs", 0)
        return body

    async def send(self, req: BenchRequest) -> RequestResult:
        res = RequestResult(prompt_len=req.prompt_len, dataset=req.dataset)
        try:
            body = self.payload(req)
        except ValueError as e:  # a request this endpoint cannot take: a failed request
            res.error = str(e)
            return res
        start = res.start_time = time.perf_counter()
        last: Optional[float] = None
        events, texts, finish, usage, done = 0, [], None, None, False
        try:
            async with self._client.stream("POST", self.endpoint, json=body) as resp:
                if resp.status_code != 200:
                    res.error = _error_text(resp.status_code, await resp.aread())
                    res.latency = time.perf_counter() - start
                    return res
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue  # blank separators, SSE comments
                    data = line[len("data:"):].strip()
                    if data == "[DONE]":
                        done = True
                        break
                    now = time.perf_counter()
                    obj = json.loads(data)
                    if "error" in obj:
                        res.error = f"stream error: {obj['error'].get('message', obj['error'])}"
                        break
                    if obj.get("usage"):
                        usage = obj["usage"]
                    for choice in obj.get("choices") or []:
                        text = (choice.get("delta") or {}).get("content") if self.chat else choice.get("text")
                        lp = choice.get("logprobs") or {}
                        if not text and not lp.get("tokens") and choice.get("finish_reason") is None:
                            continue
                        texts.append(text or "")
                        finish = choice.get("finish_reason") or finish
                        events += 1
                        if last is None:
                            res.ttft = now - start
                        else:
                            res.itl.append(now - last)
                        last = now
        except (httpx.HTTPError, json.JSONDecodeError) as e:
            res.error = f"{type(e).__name__}: {e}"
        res.latency = time.perf_counter() - start
        res.generated_text = "".join(texts)
        if not res.error:
            if not done:
                res.error = "the stream ended without [DONE]"
            elif finish is None or finish == "abort":
                res.error = f"the request ended with finish_reason {finish!r}"
        if usage is not None:
            res.prompt_len = int(usage.get("prompt_tokens", req.prompt_len))
            res.output_len = int(usage.get("completion_tokens", events))
        else:
            res.usage_source, res.output_len = "chunks", events
        res.success = not res.error
        return res
