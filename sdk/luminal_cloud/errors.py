"""SDK exceptions.

    LuminalCloudError
    ├── APIError       the server answered with an error; carries status, code and message
    ├── DeployFailed   the model version failed to compile; carries the server's reason
    └── GraphError     (also a ValueError) a graph built with luminal_cloud.graph cannot work:
                       a shape mismatch at the call that makes it, a duplicate name, no outputs
"""

from __future__ import annotations


class LuminalCloudError(Exception):
    pass


class APIError(LuminalCloudError):
    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(f"{status} {code}: {message}")
        self.status = status
        self.code = code
        self.message = message


class DeployFailed(LuminalCloudError):
    def __init__(self, name: str, version: int, reason: str) -> None:
        super().__init__(f"model {name!r} version {version} failed to compile: {reason}")
        self.name = name
        self.version = version
        self.reason = reason


class GraphError(LuminalCloudError, ValueError):
    pass
