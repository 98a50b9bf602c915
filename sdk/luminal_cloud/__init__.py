"""The Luminal Cloud Python SDK.

    from luminal_cloud import Client
    client = Client("http://127.0.0.1:8000", api_key="lc_...")
    client.deploy("model.onnx", name="mnist")
    outputs = client.predict("mnist", {"input": x})

It depends on httpx and numpy only, and imports nothing from the server. Graph (the native
graph API in luminal_cloud.graph) also needs onnx, imported on first use.
"""

from typing import Any

from luminal_cloud.client import Client
from luminal_cloud.errors import APIError, DeployFailed, GraphError, LuminalCloudError

__all__ = ["APIError", "Client", "DeployFailed", "Graph", "GraphError", "LuminalCloudError"]


def __getattr__(name: str) -> Any:
    # Graph loads onnx, which a client that only uploads files and predicts never needs
    if name == "Graph":
        from luminal_cloud.graph import Graph

        return Graph
    raise AttributeError(f"module 'luminal_cloud' has no attribute {name!r}")
