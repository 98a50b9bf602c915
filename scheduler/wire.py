"""What gateways and runtime processes say to each other through Redis: key names, and tensors
and messages as bytes. Pure: no connections here."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

PREFIX = "luminal:"
# runtime ids of every runtime process that has announced itself (some may be dead: the
# heartbeat key below tells)
RUNTIMES = PREFIX + "runtimes"
# usage events of executed requests, read by the ledger consumers of the gateways
USAGE_STREAM = PREFIX + "usage"
# request ids of generations whose client left: every runtime reads it, the one generating
# the sequence frees it at its next step
CANCEL_STREAM = PREFIX + "cancels"
# the consumer groups: runtimes share a version's requests (and their device type's pool
# stream), gateways share the usage events
RUNTIME_GROUP = "runtimes"
LEDGER_GROUP = "ledger"
# a gateway renews its liveness key (gateway_key) every GATEWAY_BEAT_S, to expire
# GATEWAY_TTL_S after its last renewal: a runtime generating a sequence whose gateway's key has
# expired (the gateway died, and no cancel will ever come) frees it, as if its client had left
GATEWAY_BEAT_S = 1.0
GATEWAY_TTL_S = 10


def request_stream(version_id: int) -> str:
    """A version's requests while it is placed on a live runtime (warm)."""
    return f"{PREFIX}requests:{version_id}"


def pool_stream(device: str) -> str:
    """Requests, of any version, for a device type with no live runtime (a pool at zero): every
    runtime of that type reads it, and its consumer group's lag is the backlog an autoscaler
    (KEDA's redis-streams trigger, the stack's --runtimes auto) starts runtimes on."""
    return f"{PREFIX}pool:{device}"


def reply_stream(gateway_id: str) -> str:
    return f"{PREFIX}replies:{gateway_id}"


def gateway_key(reply_to: str) -> str:
    """A gateway's announcement, named by its reply stream (what a request message carries):
    alive while it exists (it expires unless renewed)."""
    return f"{PREFIX}gateway:{reply_to.removeprefix(PREFIX + 'replies:')}"


def heartbeat_key(runtime_id: str) -> str:
    """A runtime's announcement (a hash that expires unless renewed): alive while it exists. Its
    fields: device, memory_budget_bytes, loaded_bytes, loaded (JSON list of artifact keys),
    streams, pid, held (requests taken and not yet answered), last_active (wall-clock time it last
    took or answered a request; its start before the first), for placement and autoscalers."""
    return f"{PREFIX}runtime:{runtime_id}"


def assigned_key(runtime_id: str) -> str:
    """The version ids whose requests a runtime reads."""
    return f"{PREFIX}assigned:{runtime_id}"


def placement_key(version_id: int) -> str:
    """The runtime ids a version is placed on."""
    return f"{PREFIX}placement:{version_id}"


def pack_tensors(tensors: Mapping[str, np.ndarray]) -> bytes:
    """A JSON header line (name -> dtype, shape, byte count) followed by the raw C-order bytes."""
    header, parts = {}, []
    for name, value in tensors.items():
        array = np.ascontiguousarray(value)
        header[name] = [array.dtype.str, list(array.shape), array.nbytes]
        parts.append(array.tobytes())
    return json.dumps(header).encode() + b"\n" + b"".join(parts)


def unpack_tensors(data: bytes) -> dict[str, np.ndarray]:
    head, _, body = data.partition(b"\n")
    tensors, offset = {}, 0
    for name, (dtype, shape, nbytes) in json.loads(head).items():
        kind = np.dtype(dtype)
        tensors[name] = np.frombuffer(body, kind, nbytes // kind.itemsize, offset).reshape(shape)
        offset += nbytes
    return tensors


@dataclass
class RequestMessage:
    """One inference request on a version's stream."""

    request_id: str
    # the gateway's reply stream
    reply_to: str
    # wall-clock time (time.time()) by which it must have started, or it is dropped unrun
    deadline: float
    rows: int
    # the Route, as a dict (scheduler.engine.Route's fields)
    route: dict[str, Any]
    inputs: dict[str, np.ndarray] = field(repr=False)
    # wall-clock time the gateway queued it: a request taken from a pool stream waited from then
    # for a runtime to start (its cold start)
    enqueued_at: float = 0.0
    # "infer", or "generate": a sequence to generate (`generation`: its prompt_ids and sampling
    # params), answered with one "token" reply per event instead of one "ok"
    kind: str = "infer"
    generation: dict[str, Any] = field(default_factory=dict)

    def to_fields(self) -> dict[str, bytes | str]:
        return {"meta": json.dumps(_meta(self, "inputs")), "inputs": pack_tensors(self.inputs)}

    @staticmethod
    def from_fields(fields: Mapping[bytes, bytes]) -> RequestMessage:
        meta = json.loads(fields[b"meta"])
        return RequestMessage(**meta, inputs=unpack_tensors(fields[b"inputs"]))


@dataclass
class ReplyMessage:
    """A runtime's answer to one request: "ok" or "error", after "started" when its batch starts
    where a slow run could pass the request's deadline (runtime.process); a generation's are
    "started", then a "token" per event, the last with its finish_reason."""

    request_id: str
    kind: str
    # on error: the error code of cloud.errors and its message
    code: str = ""
    message: str = ""
    batch_size: int = 0
    batch_rows: int = 0
    exec_seconds: float = 0.0
    batch_exec_seconds: float = 0.0
    queue_seconds: float = 0.0
    # waiting for a runtime to start (a pool at zero) and loading the model: reported, never billed
    cold_start_seconds: float = 0.0
    # kind "token": one event of a generation (index, text, token_id, finish_reason, usage, error)
    event: dict[str, Any] = field(default_factory=dict)
    outputs: dict[str, np.ndarray] = field(default_factory=dict, repr=False)

    def to_fields(self) -> dict[str, bytes | str]:
        return {"meta": json.dumps(_meta(self, "outputs")), "outputs": pack_tensors(self.outputs)}

    @staticmethod
    def from_fields(fields: Mapping[bytes, bytes]) -> ReplyMessage:
        meta = json.loads(fields[b"meta"])
        return ReplyMessage(**meta, outputs=unpack_tensors(fields[b"outputs"]))


def _meta(message: Any, tensors: str) -> dict[str, Any]:
    return {f.name: getattr(message, f.name) for f in fields(message) if f.name != tensors}

