"""The Luminal Cloud Python SDK.

    from luminal_cloud import Client
    client = Client("http://127.0.0.1:8000", api_key="lc_...")
    client.deploy("model.onnx", name="mnist")       # a progress bar on a terminal
    outputs = client.predict("mnist", {"input": x})

    client.deploy("gpt2/", name="gpt2", task="text-generation")   # the ONNX decoder + tokenizer
    client.generate("gpt2", "Once upon a time", max_tokens=32).text
    for piece in client.stream("gpt2", messages=[{"role": "user", "content": "Hi"}]):
        print(piece, end="", flush=True)

`AsyncClient` has the same methods, awaited. The SDK depends on httpx and numpy, and imports
nothing from the server; Graph (the native graph API in luminal_cloud.graph) also needs onnx,
and Client.deploy_torch needs torch (the extra `luminal-cloud-sdk[torch]`), each imported on
first use.
"""

from typing import TYPE_CHECKING, Any

from luminal_cloud.errors import (
    APIError,
    Conflict,
    DeadlineExceeded,
    DeployFailed,
    Forbidden,
    GraphError,
    InvalidInput,
    InvalidModel,
    InvalidRequest,
    LuminalCloudError,
    NotFound,
    NotReady,
    Overloaded,
    PayloadTooLarge,
    ServerUnreachable,
    Unauthorized,
    Unavailable,
)

if TYPE_CHECKING:
    from luminal_cloud._generation import Generation
    from luminal_cloud.client import AsyncClient, AsyncTextStream, Client, TextStream
    from luminal_cloud.graph import Graph

__all__ = [
    "APIError",
    "AsyncClient",
    "AsyncTextStream",
    "Client",
    "Conflict",
    "DeadlineExceeded",
    "DeployFailed",
    "Forbidden",
    "Generation",
    "Graph",
    "GraphError",
    "InvalidInput",
    "InvalidModel",
    "InvalidRequest",
    "LuminalCloudError",
    "NotFound",
    "NotReady",
    "Overloaded",
    "PayloadTooLarge",
    "ServerUnreachable",
    "TextStream",
    "Unauthorized",
    "Unavailable",
]


def __getattr__(name: str) -> Any:
    # Graph loads onnx, which a client that only uploads files and predicts never needs; the
    # clients load httpx, which the server's commands behind the same entry point (a runtime
    # starting cold) never need
    if name == "Graph":
        from luminal_cloud.graph import Graph

        return Graph
    if name == "Generation":
        from luminal_cloud._generation import Generation

        return Generation
    if name in ("Client", "AsyncClient", "TextStream", "AsyncTextStream"):
        from luminal_cloud import client

        value = getattr(client, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'luminal_cloud' has no attribute {name!r}")
