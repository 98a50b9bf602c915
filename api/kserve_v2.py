"""The KServe v2 / Open Inference Protocol on the wire: datatypes, shapes, request bodies (JSON,
or a JSON header followed by raw tensor bytes: the binary tensor data extension) and responses.

A body with binary parts is `Inference-Header-Content-Length` bytes of JSON, then each binary
input's bytes in the order the header lists them, each `parameters.binary_data_size` long, raw
row-major little-endian. Responses are framed the same way. The functions here are plain
functions of bytes, so large bodies can be decoded and rendered in another process (api.codec).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
from pydantic import ValidationError

from api.codec import encode_output
from api.errors import describe_validation_errors
from api.schemas import V2InferRequest, V2InferResponse, V2RequestInput, V2TensorMetadata
from api.validation import (
    DecodedInputs,
    FlatTensor,
    InputRules,
    check_input_names,
    decode_flat_inputs,
    describe,
    loads,
)
from cloud.errors import InvalidInput, InvalidRequest
from compiler import Signature, TensorSpec
from compiler.shape import Shape

# the IR's dtypes that the protocol names; the narrow float8, float4 and 2/4-bit formats it does not
DATATYPES = {
    "bool": "BOOL",
    "uint8": "UINT8",
    "uint16": "UINT16",
    "uint32": "UINT32",
    "uint64": "UINT64",
    "int8": "INT8",
    "int16": "INT16",
    "int32": "INT32",
    "int64": "INT64",
    "float16": "FP16",
    "bfloat16": "BF16",
    "float32": "FP32",
    "float64": "FP64",
}

HEADER_LENGTH = "Inference-Header-Content-Length"


def datatype(dtype: str) -> str:
    """The protocol's name for an IR dtype."""
    if dtype not in DATATYPES:
        raise InvalidRequest(f"{dtype} has no KServe v2 datatype; call this model through /v1 instead")
    return DATATYPES[dtype]


def dims(shape: Shape) -> list[int]:
    # a dimension each request chooses (batch, seq) is -1
    return [d if isinstance(d, int) else -1 for d in shape]


def tensor_metadata(spec: TensorSpec) -> V2TensorMetadata:
    return V2TensorMetadata(name=spec.name, datatype=datatype(spec.dtype), shape=dims(spec.shape))


@dataclass
class DecodedV2Request(DecodedInputs):
    # the client's id of the request, echoed in the response
    id: str | None
    # (output name, whether to answer it in binary), in the order of the response
    outputs: list[tuple[str, bool]]


def decode_request(
    raw: bytes,
    signature: Signature,
    max_elements: int,
    limits: Mapping[str, int],
    max_memory_bytes: int | None,
    *,
    header_length: str | None,
) -> DecodedV2Request:
    """A v2 inference body to arrays checked like /v1's (api/validation.py); `header_length` is
    the Inference-Header-Content-Length header as sent (None: the body is all JSON)."""
    split = _header_length(header_length, len(raw))
    try:
        # json, not pydantic's parser: it tells a NaN token from 1e999 (api.validation.loads)
        parsed = loads(raw[:split])
    except (ValueError, RecursionError) as exc:
        raise InvalidRequest(f"the inference request's JSON header is not valid JSON ({exc})") from None
    try:
        request = V2InferRequest.model_validate(parsed)
    except ValidationError as exc:
        raise InvalidRequest(f"the inference request's JSON: {describe_validation_errors(exc.errors())}") from None
    given = _tensors(request.inputs, memoryview(raw)[split:])
    check_input_names(signature, given)
    declared_types = {tensor.name: tensor.datatype for tensor in request.inputs}
    for spec in signature.inputs:
        declared, expected = declared_types[spec.name], datatype(spec.dtype)
        if declared != expected:
            raise InvalidInput(f"input {spec.name!r} is {declared}; the model expects {expected} ({describe(spec)})")
    rules = InputRules(allow_non_finite=request.parameters.allow_non_finite)
    decoded = decode_flat_inputs(signature, given, max_elements, limits, max_memory_bytes, rules)
    return DecodedV2Request(decoded.arrays, decoded.rows, request.id, _requested_outputs(signature, request))


def _header_length(header: str | None, body_bytes: int) -> int:
    if header is None:
        return body_bytes
    if not (header.isascii() and header.strip().isdigit()):
        raise InvalidRequest(f"{HEADER_LENGTH} {header!r} is not a number of bytes")
    length = int(header)
    if length > body_bytes:
        raise InvalidRequest(f"{HEADER_LENGTH} is {length} but the body has only {body_bytes} bytes")
    return length


def _tensors(inputs: list[V2RequestInput], binary: memoryview) -> dict[str, FlatTensor]:
    """Each input's shape and elements: its JSON data, or its slice of the binary section."""
    tensors: dict[str, FlatTensor] = {}
    offset = 0
    for tensor in inputs:
        if tensor.name in tensors:
            raise InvalidInput(f"input {tensor.name!r} is given twice")
        if "shared_memory_region" in (tensor.parameters.model_extra or {}):
            raise InvalidRequest("the shared memory extension is not served; send the data in the body")
        size = tensor.parameters.binary_data_size
        if size is None and tensor.data is None:
            raise InvalidInput(f"input {tensor.name!r} has neither data nor parameters.binary_data_size")
        if size is not None and tensor.data is not None:
            raise InvalidInput(f"input {tensor.name!r} has both data and parameters.binary_data_size")
        if size is None:
            tensors[tensor.name] = FlatTensor(tuple(tensor.shape), tensor.data)
            continue
        if offset + size > len(binary):
            raise InvalidInput(
                f"input {tensor.name!r} declares {size} bytes of binary data but the body has only "
                f"{len(binary) - offset} left after the JSON header and the inputs before it"
            )
        tensors[tensor.name] = FlatTensor(tuple(tensor.shape), bytes(binary[offset : offset + size]))
        offset += size
    if offset != len(binary):
        raise InvalidRequest(
            f"the body has {len(binary) - offset} bytes left over after the inputs' binary data "
            f"({offset} bytes declared by binary_data_size)"
        )
    return tensors


def _requested_outputs(signature: Signature, request: V2InferRequest) -> list[tuple[str, bool]]:
    default_binary = request.parameters.binary_data_output
    if request.outputs is None:
        requested = [(spec.name, default_binary) for spec in signature.outputs]
    else:
        known = [spec.name for spec in signature.outputs]
        for output in request.outputs:
            if output.name not in known:
                raise InvalidRequest(f"unknown output {output.name!r}; the model's outputs are {', '.join(known)}")
            if "classification" in (output.parameters.model_extra or {}):
                raise InvalidRequest("the classification extension is not served; ask for the output itself")
        requested = [
            (o.name, default_binary if o.parameters.binary_data is None else o.parameters.binary_data)
            for o in request.outputs
        ]
    specs = {spec.name: spec for spec in signature.outputs}
    for name, _ in requested:
        datatype(specs[name].dtype)  # an output the protocol cannot name fails before the model runs
    return requested


def render_response(
    model: str,
    version: int,
    request_id: str | None,
    outputs: Mapping[str, np.ndarray],
    requested: list[tuple[str, bool]],
    usage: dict,
) -> tuple[bytes, int | None]:
    """The response body, and the length of its JSON header when binary outputs follow it."""
    tensors, binary = [], []
    for name, as_binary in requested:
        array = outputs[name]
        tensor = {"name": name, "datatype": datatype(array.dtype.name), "shape": list(array.shape)}
        if as_binary:
            data = np.ascontiguousarray(array, array.dtype.newbyteorder("<")).tobytes()
            binary.append(data)
            tensor["parameters"] = {"binary_data_size": len(data)}
        else:
            tensor["data"] = encode_output(array.reshape(-1))
        tensors.append(tensor)
    response = V2InferResponse(
        model_name=model, model_version=str(version), id=request_id, parameters=usage, outputs=tensors
    )
    header = response.model_dump_json(exclude_none=True).encode()
    if not binary:
        return header, None
    return b"".join([header, *binary]), len(header)
