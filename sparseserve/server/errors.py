"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` with an HTTP status.

Handlers raise `APIError`; FastAPI's request-validation errors (malformed JSON, missing or
mistyped fields), which FastAPI would answer with 422, are turned into 400 here as well.
"""
from __future__ import annotations

from http import HTTPStatus
from typing import Any, Optional


class APIError(Exception):
    """An error answered to the client (never logged as a server fault)."""

    def __init__(self, message: str, *, status: int = HTTPStatus.BAD_REQUEST,
                 type: str = "invalid_request_error", param: Optional[str] = None,
                 code: Optional[str] = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = int(status)
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: Optional[str] = None,
               code: Optional[str] = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def unauthorized() -> APIError:
    return APIError("Incorrect or missing API key. Send it as 'Authorization: Bearer <key>'.",
                    status=HTTPStatus.UNAUTHORIZED, code="invalid_api_key")


def overloaded(num_waiting: int, limit: int) -> APIError:
    return APIError(f"The server is overloaded: {num_waiting} requests are waiting "
                    f"(--max-waiting-requests={limit}). Retry later.",
                    status=HTTPStatus.SERVICE_UNAVAILABLE, type="server_overloaded",
                    code="too_many_waiting_requests")


def engine_dead(reason: str = "") -> APIError:
    msg = "The engine loop has stopped; the server cannot serve requests."
    if reason:
        msg += f" Cause: {reason}"
    return APIError(msg, status=HTTPStatus.SERVICE_UNAVAILABLE, type="server_error", code="engine_dead")


def shutting_down(reason: str = "") -> APIError:
    msg = ("The server is shutting down and cut this request short (its shutdown timeout passed); "
           "retry it on another server or after the restart.")
    if reason:
        msg += f" ({reason})"
    return APIError(msg, status=HTTPStatus.SERVICE_UNAVAILABLE, type="server_error",
                    code="server_shutting_down")


def engine_failure(exc: BaseException) -> APIError:
    """The 503 for an exception raised by the engine side (shutdown cut or dead loop)."""
    from sparseserve.server.engine_errors import ServerShutdownError
    if isinstance(exc, ServerShutdownError):
        return shutting_down()
    return engine_dead(str(exc))


def model_not_found(model: str, served: list[str]) -> APIError:
    return APIError(f"The model '{model}' does not exist. This server serves "
                    f"{', '.join(repr(m) for m in served)}; send one of those as 'model' (or omit it).",
                    status=HTTPStatus.NOT_FOUND, param="model", code="model_not_found")


def payload_too_large(size: int, limit: int) -> APIError:
    return APIError(f"The request body has {size} bytes; this server accepts at most {limit} "
                    "(--max-request-body-bytes). Send a shorter prompt.",
                    status=HTTPStatus.REQUEST_ENTITY_TOO_LARGE, code="request_too_large")


def from_param_error(e: Any) -> APIError:
    """`sparseserve.validation.ParamError` -> 400 with its param and code."""
    return APIError(str(e), param=getattr(e, "param", None), code=getattr(e, "code", None))


def _path(loc: tuple) -> str:
    parts = [str(p) for p in loc if p != "body"]
    return ".".join(parts)


_TYPE_TAGS = {"str", "int", "float", "bool", "list[str]", "list[int]", "list[list[int]]",
              "dict[str,float]", "dict[str,any]", "list[ChatContentPart]", "ChatContentPart",
              "StreamOptions", "list[any]"}


def _clean_loc(loc: tuple) -> tuple:
    """Drop pydantic's union-member tags ('str', 'list[int]', ...) from an error location."""
    return tuple(p for p in loc if not (isinstance(p, str) and (p in _TYPE_TAGS or "[" in p
                                                                   or p.startswith("function-"))))


def validation_error(errors: list[dict[str, Any]]) -> APIError:
    """One readable 400 from pydantic/FastAPI validation errors."""
    if not errors:
        return APIError("Invalid request body.")
    first = errors[0]
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return APIError(f"The request body is not valid JSON{': ' + detail if detail else ''}.",
                        code="invalid_json")
    loc = _clean_loc(tuple(first.get("loc", ())))
    if loc == ("body",) or not _path(loc):
        if first.get("type") in ("missing", "model_attributes_type", "dict_type", "model_type"):
            return APIError("The request body must be a JSON object.", code="invalid_body")
    param = _path(loc) or None
    same = [e for e in errors if _clean_loc(tuple(e.get("loc", ()))) == loc]
    kind = first.get("type", "")
    if kind == "missing":
        return APIError(f"Missing required field '{param}'.", param=param, code="missing_field")
    got = first.get("input")
    got_s = repr(got)
    if len(got_s) > 60:
        got_s = got_s[:57] + "..."
    if len(same) > 1:
        msgs = "; or ".join(dict.fromkeys(e.get("msg", "") for e in same))
        return APIError(f"Invalid value for '{param}' (got {got_s}): {msgs}.", param=param,
                        code="invalid_type")
    return APIError(f"Invalid value for '{param}' (got {got_s}): {first.get('msg', 'invalid')}.",
                    param=param, code="invalid_type" if kind.endswith("_type") or "parsing" in kind
                    else "invalid_value")
