"""The usage record: what one request consumed and what it costs, as the ledger (cloud/metering.py)
writes it. Plain data, no I/O: the scheduler prices each request of a batch into one
(scheduler/pricing.py), and runtime processes send it to the ledger as JSON (scheduler/streams.py).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Usage:
    """What one request consumed: the record the ledger writes."""

    request_id: str
    tenant_id: int
    model_name: str
    version: int
    target: str
    # rows this request contributed to its batch
    rows: int
    # requests and rows in the batch it ran in
    batch_size: int
    batch_rows: int
    # measured device time of the whole batch
    batch_exec_seconds: float
    # this request's share of it
    billed_seconds: float
    price_per_second: float
    # generation: the sequence's prompt and generated tokens (its rows are their sum, its batch
    # the steps it ran in); None for inference
    prompt_tokens: int | None = None
    completion_tokens: int | None = None

    @property
    def cost(self) -> float:
        return self.billed_seconds * self.price_per_second
