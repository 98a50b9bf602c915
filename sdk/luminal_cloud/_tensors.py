"""Tensors on the wire, both ways: /v1's nested JSON lists, and the KServe v2 binary tensor
data extension (a JSON header of `Inference-Header-Content-Length` bytes, then each tensor's raw
row-major little-endian bytes, `parameters.binary_data_size` each). Plain functions of bytes."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import numpy as np

HEADER_LENGTH = "Inference-Header-Content-Length"

# the protocol's datatypes and numpy's names for them (BF16 is ml_dtypes', which onnx brings)
_NUMPY_NAMES = {
    "BOOL": "bool",
    "UINT8": "uint8",
    "UINT16": "uint16",
    "UINT32": "uint32",
    "UINT64": "uint64",
    "INT8": "int8",
    "INT16": "int16",
    "INT32": "int32",
    "INT64": "int64",
    "FP16": "float16",
    "BF16": "bfloat16",
    "FP32": "float32",
    "FP64": "float64",
}
_DATATYPES = {numpy: v2 for v2, numpy in _NUMPY_NAMES.items()}

# how /v1 and v2's JSON write floats that JSON has no numbers for
_NON_FINITE = {"NaN": np.nan, "Infinity": np.inf, "-Infinity": -np.inf}


def numpy_dtype(datatype: str) -> np.dtype:
    if datatype == "BF16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    if datatype not in _NUMPY_NAMES:
        raise ValueError(f"the server sent a tensor of datatype {datatype!r}, which has no numpy dtype")
    return np.dtype(_NUMPY_NAMES[datatype])


def datatype(dtype: np.dtype) -> str:
    # an unknown dtype goes by its own name: the server's answer says what it expected instead
    return _DATATYPES.get(dtype.name, dtype.name.upper())


def from_json(value: Any, dtype: str | np.dtype | None) -> np.ndarray:
    """Nested (or flat) lists as an array, in `dtype` when known."""
    array = np.asarray(value, dtype=object if _has_strings(value) else None)
    if array.dtype == object:
        array = np.vectorize(lambda v: _NON_FINITE.get(v, v), otypes=[np.float64])(array)
    return array.astype(dtype) if dtype else array


def _has_strings(value: Any) -> bool:
    if isinstance(value, str):
        return True
    if isinstance(value, list):
        return any(_has_strings(v) for v in value)
    return False


def _as_declared(value: Any, declared: str | None) -> np.ndarray:
    """The input in the model's datatype where numpy casts within its kind (float64 to float32,
    int64 to int32); anything else is sent as it is, and the server's answer names the mismatch."""
    array = np.asarray(value)
    if declared is not None and declared in _NUMPY_NAMES:
        wanted = numpy_dtype(declared)
        if np.can_cast(array.dtype, wanted, "same_kind"):
            array = array.astype(wanted, copy=False)
    return np.ascontiguousarray(array, array.dtype.newbyteorder("<"))


def v2_request(inputs: Mapping[str, Any], declared: Mapping[str, str]) -> tuple[bytes, int]:
    """An inference request with binary inputs and binary outputs asked for, and the length of
    its JSON header; `declared` is the model's datatype per input name."""
    tensors, data = [], []
    for name, value in inputs.items():
        array = _as_declared(value, declared.get(name))
        raw = array.tobytes()
        data.append(raw)
        tensors.append(
            {
                "name": name,
                "shape": list(array.shape),
                "datatype": datatype(array.dtype),
                "parameters": {"binary_data_size": len(raw)},
            }
        )
    header = json.dumps({"inputs": tensors, "parameters": {"binary_data_output": True}}).encode()
    return b"".join([header, *data]), len(header)


def v2_response(body: bytes, header_length: str | None) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The response's JSON header, and its outputs as arrays (binary ones share one writable
    copy of the body)."""
    split = len(body) if header_length is None else int(header_length)
    header = json.loads(body[:split])
    binary = memoryview(bytearray(body[split:]))
    outputs, offset = {}, 0
    for tensor in header["outputs"]:
        dtype, shape = numpy_dtype(tensor["datatype"]), tuple(tensor["shape"])
        size = (tensor.get("parameters") or {}).get("binary_data_size")
        if size is None:
            outputs[tensor["name"]] = from_json(tensor["data"], dtype).reshape(shape)
            continue
        raw = binary[offset : offset + size]
        offset += size
        array = np.frombuffer(raw, dtype.newbyteorder("<")).reshape(shape)
        outputs[tensor["name"]] = array.astype(dtype, copy=False)
    return header, outputs
