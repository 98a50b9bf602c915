"""One JSON error shape everywhere: {"error": {"code": ..., "message": ..., ...details}}."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from cloud.errors import LuminalError, Overloaded

log = logging.getLogger(__name__)


def error_response(status: int, code: str, message: str, headers=None, /, **details) -> JSONResponse:
    body = {"error": {"code": code, "message": message, **details}}
    return JSONResponse(body, status_code=status, headers=headers)


async def _luminal_error(_request: Request, exc: LuminalError) -> JSONResponse:
    headers = {"Retry-After": str(exc.retry_after)} if isinstance(exc, Overloaded) else None
    if exc.status == 401:
        headers = {"WWW-Authenticate": "Bearer"}
    return error_response(exc.status, exc.code, exc.message, headers, **exc.details)


async def _validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
    problems = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
        problems.append(f"{where}: {err.get('msg')}" if where else str(err.get("msg")))
    return error_response(400, "invalid_request", "; ".join(problems) or "invalid request")


async def _http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
    code = {404: "not_found", 405: "method_not_allowed", 413: "payload_too_large"}.get(
        exc.status_code, "http_error"
    )
    return error_response(exc.status_code, code, str(exc.detail), getattr(exc, "headers", None))


async def _unexpected(_request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error", exc_info=exc)
    return error_response(500, "internal_error", f"internal error ({type(exc).__name__})")


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(LuminalError, _luminal_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected)
