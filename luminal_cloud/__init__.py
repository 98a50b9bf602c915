"""The Luminal Cloud Python SDK.

    from luminal_cloud import Client
    client = Client("http://127.0.0.1:8000", api_key="lc_...")
    client.deploy("model.onnx", name="mnist")
    outputs = client.predict("mnist", {"input": x})

It depends on httpx and numpy only, and imports nothing from the server.
"""

from luminal_cloud.client import Client
from luminal_cloud.errors import APIError, DeployFailed, LuminalCloudError

__all__ = ["APIError", "Client", "DeployFailed", "LuminalCloudError"]
