"""One inference request's way through the service, shared by /v1 and the KServe v2 protocol:
resolve the version, decode and validate the body off the event loop, queue it on the engine
(which meters it), and count it in the request metrics. The routes differ only in how a body is
decoded and how the outputs are rendered."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from fastapi import Request
from starlette.concurrency import run_in_threadpool

from api.schemas import InferUsage
from api.services import Services
from api.validation import DecodedInputs, symbol_limits
from cloud import metrics
from cloud.db import ModelVersion, Tenant
from cloud.errors import ClientDisconnected, LuminalError
from cloud.settings import Settings
from compiler import Signature
from registry import ServedVersion
from scheduler.engine import InferenceResult, Route

# decode(body, signature, max_elements, symbol limits, max_memory_bytes): a plain function, so a
# large body can be decoded in another process (api.codec)
type Decoder[Decoded: DecodedInputs] = Callable[[bytes, Signature, int, Mapping[str, int], int | None], Decoded]


@dataclass
class Served[Decoded: DecodedInputs]:
    # the version that answered
    version: ModelVersion
    signature: Signature
    # what the decoder made of the body: the inputs, and whatever else its protocol carries
    decoded: Decoded
    result: InferenceResult
    # the service's id of the request, the key of its usage record
    request_id: str

    def usage(self) -> InferUsage:
        return InferUsage(
            request_id=self.request_id,
            exec_ms=self.result.exec_seconds * 1000,
            batch_size=self.result.batch_size,
            batch_rows=self.result.batch_rows,
            queue_ms=self.result.queue_seconds * 1000,
            cold_start_ms=self.result.cold_start_seconds * 1000,
        )


# version id -> (its signature as stored, the settings, the parsed signature, its symbol limits):
# parsing them and fitting the limits to the memory budget took 30-85 us a request (an MLP, BERT)
_PREPARED: dict[int, tuple[dict, Settings, Signature, dict[str, int]]] = {}
_PREPARED_MAX = 1024


def _prepared(version_id: int, stored: dict, settings: Settings) -> tuple[Signature, dict[str, int]]:
    entry = _PREPARED.get(version_id)
    # by identity: the registry's cached answer keeps its dict, and servers with other settings
    # or databases in one process (tests) never share an entry
    if entry is None or entry[0] is not stored or entry[1] is not settings:
        if len(_PREPARED) >= _PREPARED_MAX:
            _PREPARED.clear()
        signature = Signature.from_json(stored)
        entry = _PREPARED[version_id] = (stored, settings, signature, symbol_limits(signature, settings))
    return entry[2], entry[3]


def route_of(found: ServedVersion, tenant: Tenant, name: str, batchable: bool) -> Route:
    """What the engine needs to know of a resolved version, for a request of `tenant`."""
    return Route(
        version_id=found.id,
        tenant_id=tenant.id,
        tenant_name=tenant.name,
        model_name=name,
        version=found.number,
        target=found.target,
        artifact_key=found.artifact_key,
        batchable=batchable,
        model_bytes=found.graph_bytes,
        bundle=found.bundle,
    )


async def serve[Decoded: DecodedInputs](
    services: Services,
    tenant: Tenant,
    request: Request,
    name: str,
    version: int | str | None,
    decode: Decoder[Decoded],
) -> Served[Decoded]:
    """Runs the request's body through the model `name`: its newest ready version, or `version`
    (a number, or an alias that names one)."""
    started = time.perf_counter()
    outcome = "error"
    model_label = metrics.UNKNOWN_MODEL  # until the name resolves to a model of this tenant
    try:
        raw = await request.body()
        found = services.registry.resolve_cached(tenant.id, name, version) or await run_in_threadpool(
            services.registry.resolve, tenant.id, name, version
        )
        model_label = name
        settings = services.settings
        signature, limits = _prepared(found.id, found.signature, settings)
        decoded = await services.codec.run(
            len(raw),
            decode,
            raw,
            signature,
            settings.max_request_elements,
            limits,
            settings.max_request_memory_bytes,
        )
        route = route_of(found, tenant, name, batchable=signature.batch_symbol is not None)
        request_id = uuid.uuid4().hex
        result = await services.engine.infer(route, decoded.arrays, decoded.rows, request_id)
        outcome = "ok"
    except LuminalError as exc:
        # a client that left got no status: its outcome is a client event, never a server error
        outcome = exc.code if isinstance(exc, ClientDisconnected) else str(exc.status)
        raise
    finally:
        metrics.REQUESTS.labels(tenant.name, model_label, outcome).inc()
        metrics.REQUEST_LATENCY.labels(tenant.name, model_label).observe(time.perf_counter() - started)
    return Served(found, signature, decoded, result, request_id)
