"""Request and response bodies."""

from __future__ import annotations

from datetime import date, datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr


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
    # "exported" (the dtypes the graph declares); "tf32", "float16" or "bfloat16" (GPU types only)
    precision: str
    # "inference", or "text-generation" (served through /v1/completions and /v1/chat/completions)
    task: str = "inference"


class CompileProgress(BaseModel):
    # the compiler's phase: parse, reference, search, lower, build, verify or measure
    phase: str
    # candidate programs asked for, and how many of them have been timed so far
    candidates_total: int
    candidates_measured: int
    # rounds of the schedule search timed so far (programs the race does not see)
    search_rounds: int = 0
    # the candidate being lowered, built, verified or timed, when there is one
    candidate: str | None = None
    # since the compile began
    elapsed_seconds: float | None = None


class VersionPublic(BaseModel):
    version: int
    status: str
    target: str
    precision: str
    created_at: datetime
    signature: SignaturePublic | None = None
    report: dict[str, Any] | None = None
    error: str | None = None
    # while the status is compiling (when the compiler has said something yet)
    progress: CompileProgress | None = None
    task: str = "inference"
    # text-generation: the tokens of prompt and completion together the model takes
    context_length: int | None = None


class ModelSummary(BaseModel):
    name: str
    latest_version: int
    latest_status: str
    versions: int
    created_at: datetime
    task: str = "inference"


class OpenAIModel(BaseModel):
    """A generative model as OpenAI's GET /v1/models lists it."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str


class ModelList(BaseModel):
    models: list[ModelSummary]
    # the same list in OpenAI's shape, generative models with a ready version only, so that
    # OpenAI clients (client.models.list()) read this route unchanged
    object: Literal["list"] = "list"
    data: list[OpenAIModel] = []


class ModelPublic(BaseModel):
    name: str
    created_at: datetime
    versions: list[VersionPublic]


class ModelDeleted(BaseModel):
    name: str
    deleted: bool
    versions: int


# -- versions and aliases (api.routes.versions) --


class VersionSummary(BaseModel):
    version: int
    status: str
    target: str
    precision: str
    created_at: datetime
    # the aliases pointing at this version
    aliases: list[str]
    error: str | None = None


class AliasEventPublic(BaseModel):
    # "set" (a promote) or "rollback"
    action: str
    version: int
    at: datetime


class AliasPublic(BaseModel):
    model: str
    alias: str
    # the version the alias points at
    version: int
    # the version a rollback would move it to, if any
    previous: int | None
    # every move, oldest first
    history: list[AliasEventPublic]


class VersionList(BaseModel):
    name: str
    versions: list[VersionSummary]
    aliases: list[AliasPublic]


class AliasUpdate(BaseModel):
    # the ready version the alias points at from now on
    version: int = Field(ge=1)


class AliasDeleted(BaseModel):
    model: str
    alias: str
    deleted: bool


class VersionDeleted(BaseModel):
    model: str
    version: int
    deleted: bool


class InferParameters(BaseModel, extra="forbid"):
    # let NaN, Infinity and -Infinity into float inputs (refused by default)
    allow_non_finite: StrictBool = False


class InferRequest(BaseModel):
    # input name -> nested list matching the input's shape
    inputs: dict[str, Any] = Field(min_length=1)
    parameters: InferParameters = Field(default_factory=InferParameters)


class InferUsage(BaseModel):
    request_id: str
    # this request's billed share of its batch's device time
    exec_ms: float
    # requests and rows in that batch
    batch_size: int
    batch_rows: int
    # waiting time, reported but not billed
    queue_ms: float
    # cold start, reported but not billed: waiting for a runtime to start (its pool was at zero)
    # and loading the model; 0 when warm
    cold_start_ms: float = 0.0


class InferResponse(BaseModel):
    model: str
    version: int
    outputs: dict[str, Any]
    usage: InferUsage


class UsageItem(BaseModel):
    # the group: only the fields of the report's group_by are set
    tenant: str | None = None
    model: str | None = None
    version: int | None = None
    target: str | None = None
    price_per_second: float | None = None
    # a UTC calendar day
    day: date | None = None
    requests: int
    rows: int
    billed_seconds: float
    cost: float
    # generation: tokens read and generated (0 for inference)
    prompt_tokens: int = 0
    completion_tokens: int = 0


class UsageReport(BaseModel):
    # the caller's tenant; in the operators' view, the tenant asked for (absent: every tenant)
    tenant: str | None = None
    group_by: str
    # the period, `to` exclusive, in UTC; absent: unbounded on that side
    start: datetime | None = Field(default=None, serialization_alias="from")
    end: datetime | None = Field(default=None, serialization_alias="to")
    items: list[UsageItem]
    total_billed_seconds: float
    total_cost: float
    currency: str = "USD"


# -- API keys, for operators (api.routes.admin) --


class ApiKeyPublic(BaseModel):
    # the key is shown once, when made; this is what identifies it afterwards
    id: int
    prefix: str
    tenant: str
    created_at: datetime


class ApiKeyList(BaseModel):
    keys: list[ApiKeyPublic]


class ApiKeyRevoked(ApiKeyPublic):
    revoked: bool = True


# -- the KServe v2 / Open Inference Protocol (api.routes.kserve_v2) --


class V2ServerMetadata(BaseModel):
    name: str
    version: str
    # the protocol extensions served, such as "binary_tensor_data"
    extensions: list[str]


class V2TensorMetadata(BaseModel):
    name: str
    # FP32, INT64, BOOL, ...
    datatype: str
    # -1 for a dimension each request chooses
    shape: list[int]


class V2ModelMetadata(BaseModel):
    name: str
    # the ready versions, each of which may be asked for by number
    versions: list[str]
    platform: str
    inputs: list[V2TensorMetadata]
    outputs: list[V2TensorMetadata]


# v2 requests are checked strictly: "yes" is no bool, "3" and 3.0 no dimension, 1 no name


class V2InputParameters(BaseModel, extra="allow"):
    # binary tensor data extension: this many bytes of the body after the JSON header hold the input
    binary_data_size: StrictInt | None = Field(None, ge=0)


class V2RequestInput(BaseModel):
    name: StrictStr
    shape: list[Annotated[StrictInt, Field(ge=0)]]
    datatype: StrictStr
    parameters: V2InputParameters = Field(default_factory=V2InputParameters)
    # the elements in row-major order, flat or nested; absent when they follow the header in binary
    data: Any = None


class V2OutputParameters(BaseModel, extra="allow"):
    # answer with this output's raw bytes after the JSON header; unset: the request's default
    binary_data: StrictBool | None = None


class V2RequestOutput(BaseModel):
    name: StrictStr
    parameters: V2OutputParameters = Field(default_factory=V2OutputParameters)


class V2RequestParameters(BaseModel, extra="allow"):
    # the default for outputs that do not say whether they come in binary
    binary_data_output: StrictBool = False
    # let NaN, Infinity and -Infinity into float inputs (refused by default), as on /v1
    allow_non_finite: StrictBool = False


class V2InferRequest(BaseModel):
    # echoed in the response
    id: StrictStr | None = None
    parameters: V2RequestParameters = Field(default_factory=V2RequestParameters)
    inputs: list[V2RequestInput] = Field(min_length=1)
    # the outputs to return, in this order; absent: all of them
    outputs: list[V2RequestOutput] | None = None


class V2ResponseOutput(BaseModel):
    name: str
    datatype: str
    shape: list[int]
    # {"binary_data_size": bytes} when the output follows the JSON header in binary
    parameters: dict[str, int] | None = None
    # the elements in row-major order, when not in binary
    data: list[Any] | None = None


class V2InferResponse(BaseModel):
    model_config = ConfigDict(protected_namespaces=())

    model_name: str
    model_version: str
    id: str | None = None
    # the usage of /v1's response: request_id, exec_ms, batch_size, batch_rows, queue_ms
    parameters: dict[str, Any]
    outputs: list[V2ResponseOutput]
