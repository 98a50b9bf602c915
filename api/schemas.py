"""Request and response bodies."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel, Field


class TensorSpecPublic(BaseModel):
    name: str
    # ints, or symbolic dims chosen per request: a name such as "batch", or an expression of
    # names for outputs ("seq+1", "floordiv(seq+1,2)")
    shape: list[int | str]
    dtype: str


class SignaturePublic(BaseModel):
    inputs: list[TensorSpecPublic]
    outputs: list[TensorSpecPublic]
    batch_symbol: str | None
    # the largest size a request may give each symbolic dimension, by symbol name: the service's
    # limit, or the model's own where it is smaller (a table of 64 positions)
    dim_limits: dict[str, int] = Field(default_factory=dict)


class VersionCreated(BaseModel):
    name: str
    version: int
    status: str
    target: str


class VersionPublic(BaseModel):
    version: int
    status: str
    target: str
    created_at: datetime
    signature: SignaturePublic | None = None
    report: dict[str, Any] | None = None
    error: str | None = None


class ModelSummary(BaseModel):
    name: str
    latest_version: int
    latest_status: str
    versions: int
    created_at: datetime


class ModelList(BaseModel):
    models: list[ModelSummary]


class ModelPublic(BaseModel):
    name: str
    created_at: datetime
    versions: list[VersionPublic]


class ModelDeleted(BaseModel):
    name: str
    deleted: bool
    versions: int


class InferRequest(BaseModel):
    # input name -> nested list matching the input's shape
    inputs: dict[str, Any] = Field(min_length=1)


class InferUsage(BaseModel):
    request_id: str
    # this request's billed share of its batch's device time
    exec_ms: float
    # requests and rows in that batch
    batch_size: int
    batch_rows: int
    # waiting time, reported but not billed
    queue_ms: float


class InferResponse(BaseModel):
    model: str
    version: int
    outputs: dict[str, Any]
    usage: InferUsage


class UsageItem(BaseModel):
    model: str
    version: int
    target: str
    requests: int
    rows: int
    billed_seconds: float
    price_per_second: float
    cost: float


class UsageReport(BaseModel):
    tenant: str
    items: list[UsageItem]
    total_billed_seconds: float
    total_cost: float
    currency: str = "USD"
