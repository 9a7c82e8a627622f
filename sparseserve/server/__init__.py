"""OpenAI-compatible HTTP server (`sparseserve serve`).

Modules, one job each:
  serve_cli.py            CLI flags (`add_serve_args`) and the uvicorn run (`run_serve`, `serve_app`,
                          forced-shutdown cut and exit code)
  limits.py               ServerLimits and every server default (max n, sequences, body bytes, ...)
  api.py                  FastAPI app factory `create_app(engine, ...)`: routes, API key, error handlers
  body_limit.py           request-body size limit (413) as ASGI middleware
  serving.py              shared request handling: model / n / size / Unicode / context-length
                          checks, tokenization in a small thread pool (rules: sparseserve.validation)
  serving_completions.py  POST /v1/completions
  serving_chat.py         POST /v1/chat/completions
  streaming.py            SSE response with disconnect detection, text deltas
  logprobs.py             engine logprobs -> OpenAI completion / chat shapes
  protocol.py             pydantic request / response models
  errors.py               OpenAI-style error objects (400 instead of FastAPI's 422)
  async_engine.py         AsyncLLMEngine: the engine loop in one background thread
  metrics.py              Prometheus metrics (`sparseserve:` + vLLM names)

Importing this package imports no web framework; fastapi / uvicorn / prometheus-client are
needed only by the modules that serve.
"""
