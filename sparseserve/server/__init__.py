"""OpenAI-compatible HTTP server (`sparseserve serve`).

Modules, one job each:
  serve_cli.py            CLI flags (`add_serve_args`) and the uvicorn run (`run_serve`, `serve_app`,
                          forced-shutdown cut and exit code)
  limits.py               ServerLimits and every server default (max n, sequences, body bytes, ...)
  api.py                  FastAPI app factory `create_app(engine, ...)`: routes, API key, error handlers
  body_limit.py           request-body size limit (413) as ASGI middleware
  serving.py              shared request handling: model / n / size / Unicode / context-length
                          checks, tokenization in a small thread pool (rules: sparseserve.validation),
                          structured-output grammars compiled in the same pool (400 naming the field)
  serving_completions.py  POST /v1/completions
  serving_chat.py         POST /v1/chat/completions
  streaming.py            SSE response with disconnect detection, text deltas
  logprobs.py             engine logprobs -> OpenAI completion / chat shapes; vLLM's prompt_logprobs
  protocol.py             pydantic request / response models; response_format / structured_outputs /
                          guided_json|regex|choice|grammar -> sparseserve.structured.StructuredOutputsParams
  errors.py               OpenAI-style error objects (400 instead of FastAPI's 422)
  async_engine.py         AsyncLLMEngine: the asyncio face of the engine (submit / abort / call,
                          start / shutdown / forced cut, health)
  engine_loop.py          EngineLoop: the one thread that calls the engine (commands, steps,
                          output routing, stats and metrics feed)
  generation_stream.py    GenerationStream: one HTTP request's outputs, aborted when left
  engine_errors.py        EngineDeadError, ServerShutdownError, EngineOverloadedError
  metrics.py              Prometheus metrics (`sparseserve:` + vLLM names)

Importing this package imports no web framework; fastapi / uvicorn / prometheus-client are
needed only by the modules that serve.
"""
