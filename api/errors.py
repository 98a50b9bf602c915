"""One error hierarchy (cloud.errors), rendered in the shape of the protocol a path speaks:
{"error": {"code": ..., "message": ..., ...details}} everywhere, and the KServe v2 protocol's
own {"error": "<message>"} under /v2."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from cloud.errors import LuminalError, NotReady, Overloaded

log = logging.getLogger(__name__)


def speaks_v2(path: str) -> bool:
    return path == "/v2" or path.startswith("/v2/")


def error_response(path: str, status: int, code: str, message: str, headers=None, /, **details) -> JSONResponse:
    """The error in the shape that the protocol of the requested path gives errors."""
    if speaks_v2(path):
        return JSONResponse({"error": message}, status_code=status, headers=headers)
    body = {"error": {"code": code, "message": message, **details}}
    return JSONResponse(body, status_code=status, headers=headers)


def _status_for(path: str, exc: LuminalError) -> int:
    # v2 has no 409: a version still compiling is unavailable for now, a failed one never serves
    if isinstance(exc, NotReady) and speaks_v2(path):
        return 400 if exc.details.get("version_status") == "failed" else 503
    return exc.status


async def _luminal_error(request: Request, exc: LuminalError) -> JSONResponse:
    headers = {"Retry-After": str(exc.retry_after)} if isinstance(exc, Overloaded) else None
    if exc.status == 401:
        headers = {"WWW-Authenticate": "Bearer"}
    path = request.url.path
    return error_response(path, _status_for(path, exc), exc.code, exc.message, headers, **exc.details)


def describe_validation_errors(errors: Sequence[Any]) -> str:
    """Pydantic's errors as one line: "where: what; where: what"."""
    problems = []
    for err in errors:
        where = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
        problems.append(f"{where}: {err.get('msg')}" if where else str(err.get("msg")))
    return "; ".join(problems) or "invalid request"


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
