"""SDK exceptions. httpx's errors never leave the client: they become ServerUnreachable or
LuminalCloudError at the boundary (luminal_cloud._calls).

    LuminalCloudError
    ├── ServerUnreachable      no connection to the server (down, wrong URL); names the URL
    ├── APIError               the server answered with an error: status, code and message
    │                          (and, from the OpenAI-style routes, type and param)
    │   ├── InvalidRequest     400
    │   │   ├── InvalidModel   400 the upload is not a usable ONNX file
    │   │   └── InvalidInput   400 inference inputs do not match the signature
    │   ├── Unauthorized       401
    │   ├── Forbidden          403
    │   ├── NotFound           404
    │   ├── NotReady           409 the version failed to compile; 503 still queued or compiling,
    │   │                      after the client's retries
    │   ├── Conflict           409 an alias on a version not ready, deleting a version an alias points at
    │   ├── PayloadTooLarge    413
    │   ├── Overloaded         429 still, after the client's retries; carries retry_after
    │   ├── Unavailable        503 still, after the client's retries
    │   └── DeadlineExceeded   504
    ├── DeployFailed           the model version failed to compile; carries the server's reason
    └── GraphError             (also a ValueError) a graph built with luminal_cloud.graph cannot work:
                               a shape mismatch at the call that makes it, a duplicate name, no outputs
"""

from __future__ import annotations


class LuminalCloudError(Exception):
    pass


class ServerUnreachable(LuminalCloudError):
    def __init__(self, url: str, reason: str) -> None:
        super().__init__(f"cannot reach the Luminal Cloud server at {url}: {reason}")
        self.url = url
        self.reason = reason


class APIError(LuminalCloudError):
    # the status and code this class stands for (APIError itself: any other)
    status = 0
    code = "http_error"
    # OpenAI's error fields, from /v1/completions and /v1/chat/completions: the error's type
    # (invalid_request_error, ...) and the request field it names; None elsewhere
    type: str | None = None
    param: str | None = None

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(f"{status} {code}: {message}")
        self.status = status
        self.code = code
        self.message = message


class InvalidRequest(APIError):
    status, code = 400, "invalid_request"


class InvalidModel(InvalidRequest):
    code = "invalid_model"


class InvalidInput(InvalidRequest):
    code = "invalid_input"


class Unauthorized(APIError):
    status, code = 401, "unauthorized"


class Forbidden(APIError):
    status, code = 403, "forbidden"


class NotFound(APIError):
    status, code = 404, "not_found"


class NotReady(APIError):
    status, code = 409, "not_ready"


class Conflict(APIError):
    status, code = 409, "conflict"


class PayloadTooLarge(APIError):
    status, code = 413, "payload_too_large"


class Overloaded(APIError):
    status, code = 429, "overloaded"

    def __init__(self, status: int, code: str, message: str, retry_after: float | None = None) -> None:
        super().__init__(status, code, message)
        # seconds the server asked us to wait (its Retry-After), None when it did not say
        self.retry_after = retry_after


class Unavailable(APIError):
    status, code = 503, "unavailable"


class DeadlineExceeded(APIError):
    status, code = 504, "deadline_exceeded"


_BY_STATUS: dict[int, type[APIError]] = {
    cls.status: cls
    for cls in (
        InvalidRequest,
        Unauthorized,
        Forbidden,
        NotFound,
        NotReady,
        PayloadTooLarge,
        Overloaded,
        Unavailable,
        DeadlineExceeded,
    )
}
_BY_CODE: dict[str, type[APIError]] = {
    cls.code: cls for cls in (*_BY_STATUS.values(), InvalidModel, InvalidInput, Conflict)
}
# the server's database or object store being down: unavailability, as far as a client can act on it
_BY_CODE["backend_unreachable"] = Unavailable
# the error classes by the codes the server gives
CODES: dict[str, type[APIError]] = _BY_CODE


def api_error(status: int, code: str | None, message: str, retry_after: float | None = None) -> APIError:
    """The typed error for a response: by its code when it has one we know, else by its status."""
    cls = _BY_CODE.get(code or "") or _BY_STATUS.get(status, APIError)
    code = code or cls.code
    if cls is Overloaded:
        return Overloaded(status, code, message, retry_after)
    return cls(status, code, message)


def error_from(status: int, error: object, fallback: str, retry_after: float | None = None) -> APIError:
    """The typed error for a response's "error" member: the project's {"code", "message"},
    OpenAI's {"message", "type", "param", "code"} (its code a string, a number or null), or a
    string; `fallback` is the message where there is none."""
    if isinstance(error, dict):
        code = error.get("code")
        # a number (vLLM's copy of the status) or null is no code: the status types it
        code = code if isinstance(code, str) and code else None
        made = api_error(status, code, str(error.get("message") or fallback), retry_after)
        kind, param = error.get("type"), error.get("param")
        made.type = kind if isinstance(kind, str) else None
        made.param = param if isinstance(param, str) else None
        return made
    if isinstance(error, str):
        return api_error(status, None, error, retry_after)
    return api_error(status, None, fallback, retry_after)


class DeployFailed(LuminalCloudError):
    def __init__(self, name: str, version: int, reason: str) -> None:
        super().__init__(f"model {name!r} version {version} failed to compile: {reason}")
        self.name = name
        self.version = version
        self.reason = reason


class GraphError(LuminalCloudError, ValueError):
    pass
