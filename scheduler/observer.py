"""What the scheduler reports as it queues and runs requests, for operators' metrics.

The engines and the runtime process are given a SchedulerObserver; cloud/metrics.py holds the
Prometheus one, and NO_OBSERVER reports nothing (tests, tools).
"""

from __future__ import annotations

from typing import Protocol


class SchedulerObserver(Protocol):
    def batch_executed(
        self, tenant: str, model: str, target: str, requests: int, exec_seconds: float, billed_seconds: float
    ) -> None:
        """A batch ran: its requests, its measured device time, and the seconds billed for it."""

    def queue_waited(self, tenant: str, model: str, seconds: float) -> None:
        """A request left the queue for a batch after waiting this long (never billed)."""

    def request_rejected(self, tenant: str, model: str) -> None:
        """A request was refused because its queue was full."""

    def cold_started(self, tenant: str, model: str, target: str, seconds: float) -> None:
        """A request was answered after a cold start this long: waiting for a runtime of its
        device type to start (its pool was at zero) and loading its model (never billed)."""

    def generation_finished(
        self, tenant: str, model: str, target: str, prompt_tokens: int, completion_tokens: int, billed_seconds: float
    ) -> None:
        """A generation ended (finished, stopped or cancelled): its tokens and billed seconds."""


class _NoObserver:
    def batch_executed(
        self, tenant: str, model: str, target: str, requests: int, exec_seconds: float, billed_seconds: float
    ) -> None:
        pass

    def queue_waited(self, tenant: str, model: str, seconds: float) -> None:
        pass

    def request_rejected(self, tenant: str, model: str) -> None:
        pass

    def cold_started(self, tenant: str, model: str, target: str, seconds: float) -> None:
        pass

    def generation_finished(
        self, tenant: str, model: str, target: str, prompt_tokens: int, completion_tokens: int, billed_seconds: float
    ) -> None:
        pass


NO_OBSERVER: SchedulerObserver = _NoObserver()
