"""A PyTorch module as ONNX bytes, exported on the client with torch.onnx.export. PyTorch is the
SDK's optional extra `torch`, imported only here."""

from __future__ import annotations

import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

EXTRA_HINT = "deploy_torch needs PyTorch: pip install 'luminal-cloud-sdk[torch]'"


def export_onnx(
    module: Any,
    example_inputs: Any,
    input_names: Sequence[str] | None,
    output_names: Sequence[str] | None,
    dynamic_axes: Mapping[str, Any] | None,
    opset_version: int | None,
) -> bytes:
    try:
        import torch
    except ImportError as exc:
        raise ImportError(f"{EXTRA_HINT} ({exc})") from None
    args = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    if input_names is None:
        # named so that predict's inputs and dynamic_axes have names to use, not torch's "input.1"
        input_names = ["input"] if len(args) == 1 else [f"input_{i}" for i in range(len(args))]
    options: dict[str, Any] = {
        "input_names": list(input_names),
        "output_names": None if output_names is None else list(output_names),
        "dynamic_axes": None if dynamic_axes is None else dict(dynamic_axes),
    }
    if opset_version is not None:
        options["opset_version"] = opset_version
    with tempfile.TemporaryDirectory(prefix="luminal-export-") as folder:
        path = Path(folder) / "model.onnx"
        torch.onnx.export(module, args, str(path), **options)
        # weights past 2 GB would be written beside the file, which one upload does not carry
        extra = sorted(p.name for p in Path(folder).iterdir() if p != path)
        if extra:
            raise ValueError(
                f"the export wrote external data ({', '.join(extra)}); models over 2 GB cannot be uploaded"
            )
        return path.read_bytes()
