"""One error hierarchy (cloud.errors), rendered in the shape of the protocol a path speaks:
{"error": {"code": ..., "message": ..., ...details}} everywhere, the KServe v2 protocol's
own {"error": "<message>"} under /v2, and OpenAI's {"error": {"message", "type", "param",
"code"}} on the OpenAI-compatible generation routes."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from cloud.errors import LuminalError, NotReady, Overloaded

log = logging.getLogger(__name__)


def speaks_v2(path: str) -> bool:
    return path == "/v2" or path.startswith("/v2/")


OPENAI_PATHS = ("/v1/completions", "/v1/chat/completions")
# OpenAI's error types by status (what its clients map to exception classes)
_OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
}


def speaks_openai(path: str) -> bool:
    return path in OPENAI_PATHS


def error_response(path: str, status: int, code: str, message: str, headers=None, /, **details) -> JSONResponse:
    """The error in the shape that the protocol of the requested path gives errors."""
    if speaks_v2(path):
        return JSONResponse({"error": message}, status_code=status, headers=headers)
    if speaks_openai(path):
        kind = _OPENAI_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
        body = {"error": {"message": message, "type": kind, "param": details.get("param"), "code": code}}
        return JSONResponse(body, status_code=status, headers=headers)
    body = {"error": {"code": code, "message": message, **details}}
    return JSONResponse(body, status_code=status, headers=headers)


def _status_for(path: str, exc: LuminalError) -> int:
    # v2 (as Triton speaks it) has no 409: a failed version is a 400 there; queued or compiling
    # stays NotReady's 503 on both
    if isinstance(exc, NotReady) and exc.status == 409 and speaks_v2(path):
        return 400
    return exc.status


async def _luminal_error(request: Request, exc: LuminalError) -> JSONResponse:
    # Overloaded, and a version still compiling (NotReady), say when to come back
    retry_after = exc.retry_after if isinstance(exc, Overloaded | NotReady) else None
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    if exc.status == 401:
        headers = {"WWW-Authenticate": "Bearer"}
    path = request.url.path
    return error_response(path, _status_for(path, exc), exc.code, exc.message, headers, **exc.details)


def describe_validation_errors(errors: Sequence[Any]) -> str:
    """Pydantic's errors as one line: "where: what; where: what"."""
    problems = []
    for err in errors:
        loc = tuple(err.get("loc", ()))
        if err.get("type") == "json_invalid":
            problems.append(_invalid_json(loc, err))
            continue
        if loc == ("body",) and err.get("type") == "missing":
            problems.append("the body is empty; send a JSON object")
            continue
        if loc == ("body",) and err.get("type") in ("model_attributes_type", "dict_type", "model_type"):
            problems.append("the body must be a JSON object")
            continue
        where = ".".join(str(p) for p in loc if p != "body")
        problems.append(f"{where}: {err.get('msg')}" if where else str(err.get("msg")))
    return "; ".join(problems) or "invalid request"


def _invalid_json(loc: tuple, err: Mapping[str, Any]) -> str:
    # FastAPI puts the character offset in loc ("body", 14) and json's reason in ctx; pydantic's
    # own parser says both in msg ("Invalid JSON: EOF while parsing ... at line 1 column 12")
    reason = str((err.get("ctx") or {}).get("error") or err.get("msg") or "")
    reason = reason.removeprefix("Invalid JSON: ")
    at = f" at character {loc[1]}" if len(loc) == 2 and loc[0] == "body" and isinstance(loc[1], int) else ""
    return f"the body is not valid JSON ({reason}{at})" if reason else f"the body is not valid JSON{at}"


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    return error_response(request.url.path, 400, "invalid_request", describe_validation_errors(exc.errors()))


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    code = {404: "not_found", 405: "method_not_allowed", 413: "payload_too_large"}.get(
        exc.status_code, "http_error"
    )
    return error_response(request.url.path, exc.status_code, code, str(exc.detail), getattr(exc, "headers", None))


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error", exc_info=exc)
    return error_response(request.url.path, 500, "internal_error", f"internal error ({type(exc).__name__})")


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(LuminalError, _luminal_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected)
