"""Every error the service raises on purpose. One handler maps them to HTTP (api/errors.py).

    LuminalError (500)
    ├── InvalidRequest (400)
    │   ├── InvalidModelFile (400)   the upload is not a usable ONNX file
    │   └── InvalidInput (400)       inference inputs do not match the signature
    ├── Unauthorized (401)
    ├── Forbidden (403)              a valid key where its kind may not go: a tenant's on /v1/admin,
    │                                an operator's on a tenant route
    ├── QuotaExceeded (403)          a tenant's model or a model's version quota is full
    ├── NotFound (404)
    ├── BodyReadTimeout (408)        the request body stalled: no bytes for LUMINAL_BODY_READ_TIMEOUT_S
    ├── NotReady (409 or 503)        the version has not compiled: 409 once failed (it never will),
    │                                503 with retry_after while queued or compiling (it may soon)
    ├── Conflict (409)               the change would break a rule: an alias on a version not ready,
    │                                deleting a version an alias points at
    ├── PayloadTooLarge (413)
    ├── Overloaded (429)             a queue is full; carries retry_after seconds
    ├── ClientDisconnected (499)     the client left before sending the whole body (a client event)
    ├── Unavailable (503)
    │   ├── Unreachable (503)        the database or object store cannot be reached or refuses us
    │   └── NoRuntimeStarted (503)   no runtime of the request's pool started within its deadline
    └── DeadlineExceeded (504)
"""

from __future__ import annotations

from typing import Any


class LuminalError(Exception):
    status = 500
    code = "internal_error"

    def __init__(self, message: str, **details: Any) -> None:
        super().__init__(message)
        self.message = message
        self.details = details

    def __reduce__(self) -> tuple:
        # errors cross into the server from child processes (request decoding): keep every field
        return (_restore, (type(self), self.__dict__))


def _restore(cls: type[LuminalError], state: dict[str, Any]) -> LuminalError:
    error = cls.__new__(cls)
    Exception.__init__(error, state["message"])
    error.__dict__.update(state)
    return error


class InvalidRequest(LuminalError):
    status = 400
    code = "invalid_request"


class InvalidModelFile(InvalidRequest):
    code = "invalid_model"


class InvalidInput(InvalidRequest):
    code = "invalid_input"


class Unauthorized(LuminalError):
    status = 401
    code = "unauthorized"


class Forbidden(LuminalError):
    status = 403
    code = "forbidden"


class NotFound(LuminalError):
    status = 404
    code = "not_found"


class NotReady(LuminalError):
    """A version that cannot serve; `version_status` in the details says whether it may yet."""

    status = 409
    code = "not_ready"
    # seconds a client waits before asking again for a version still queued or compiling
    RETRY_AFTER_S = 1

    def __init__(self, message: str, **details: Any) -> None:
        super().__init__(message, **details)
        # queued or compiling passes by itself: the protocols' "unavailable for now", retried
        self.retry_after: int | None = None
        if details.get("version_status") in ("queued", "compiling"):
            self.status, self.retry_after = 503, self.RETRY_AFTER_S


class Conflict(LuminalError):
    status = 409
    code = "conflict"


class PayloadTooLarge(LuminalError):
    status = 413
    code = "payload_too_large"


class BodyReadTimeout(LuminalError):
    status = 408
    code = "request_timeout"


class ClientDisconnected(LuminalError):
    # nginx's "client closed request": never sent, since no one is left to read it
    status = 499
    code = "client_disconnected"


class QuotaExceeded(LuminalError):
    """The tenant holds as many models (or the model as many versions) as its quota allows."""

    status = 403
    code = "quota_exceeded"


class Overloaded(LuminalError):
    status = 429
    code = "overloaded"

    def __init__(self, message: str, retry_after: int, **details: Any) -> None:
        super().__init__(message, **details)
        self.retry_after = retry_after


class Unavailable(LuminalError):
    status = 503
    code = "unavailable"


class Unreachable(Unavailable):
    """A backing service (database, object store) is down, unknown or refuses our credentials;
    the message names it (URL with the password masked), so an operator can fix the setting."""

    code = "backend_unreachable"


class NoRuntimeStarted(Unavailable):
    """A request waited its whole deadline in a pool that had no runtime (scaled to zero, or a device
    type no pool serves) and none started; the message names the pool and the device type."""

    code = "no_runtime_started"


class DeadlineExceeded(LuminalError):
    status = 504
    code = "deadline_exceeded"


def error_for_code(code: str, message: str) -> LuminalError:
    """The error a code names, for errors that crossed a process boundary as (code, message)."""
    pending: list[type[LuminalError]] = [LuminalError]
    while pending:
        cls = pending.pop()
        if cls.code == code and cls is not Overloaded:  # Overloaded needs its retry_after
            return cls(message)
        pending += cls.__subclasses__()
    return LuminalError(message)
