"""What a compile reports as it ends, for operators' metrics.

compile_version is given a CompileObserver; by default cloud/metrics.py's Prometheus one, which
every compile process (the embedded server's, a Celery worker's) exports at its /metrics.
NO_OBSERVER reports nothing (tests, tools).
"""

from __future__ import annotations

from typing import Protocol


class CompileObserver(Protocol):
    def compile_finished(self, status: str, seconds: float) -> None:
        """A compile job ended "ready", "cached" (its artifact was stored already) or "failed",
        after this long (never billed)."""


class _NoObserver:
    def compile_finished(self, status: str, seconds: float) -> None:
        pass


NO_OBSERVER: CompileObserver = _NoObserver()
