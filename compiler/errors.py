"""Compiler errors. The server translates these into its own hierarchy at the boundary.

    CompilerError
    ├── InvalidModel       the bytes or the graph are malformed (not ONNX, dangling names, ...)
    ├── UnsupportedModel   well-formed, but uses ops or attributes we do not implement
    └── CorruptArtifact    stored artifact files are missing or do not match their manifest
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


class CorruptArtifact(CompilerError):
    """An artifact's files are incomplete or altered (a crash while saving): compile it again."""
