"""Compiler errors. The server translates these into its own hierarchy at the boundary.

    CompilerError
    ├── InvalidModel       the bytes or the graph are malformed (not ONNX, dangling names, ...)
    └── UnsupportedModel   well-formed, but uses ops or attributes we do not implement
"""

from __future__ import annotations


class CompilerError(Exception):
    """Base of every error the compiler raises on purpose."""


class InvalidModel(CompilerError):
    """The upload is not a well-formed model."""


class UnsupportedModel(CompilerError):
    """The model uses operations we cannot compile; `missing` names each of them."""

    def __init__(self, missing: list[str]) -> None:
        self.missing = sorted(set(missing))
        super().__init__("unsupported: " + ", ".join(self.missing))
