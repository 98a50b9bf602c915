"""Concatenating requests along the batch dimension and splitting outputs back."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from compiler import Signature


def concat_requests(signature: Signature, requests: Sequence[Mapping[str, np.ndarray]]):
    if len(requests) == 1:
        return dict(requests[0])
    if signature.batch_symbol is None:
        raise ValueError("requests to a model without a batch dimension cannot be batched")
    return {
        spec.name: np.concatenate([r[spec.name] for r in requests], axis=0)
        for spec in signature.inputs
    }


def split_outputs(
    signature: Signature, outputs: Mapping[str, np.ndarray], rows: Sequence[int]
) -> list[dict[str, np.ndarray]]:
    if len(rows) == 1:
        return [dict(outputs)]
    bounds = np.cumsum(rows)[:-1]
    per_output = {name: np.split(value, bounds, axis=0) for name, value in outputs.items()}
    return [{name: parts[i] for name, parts in per_output.items()} for i in range(len(rows))]
