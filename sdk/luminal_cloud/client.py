"""The HTTP client."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

import httpx
import numpy as np

from luminal_cloud.errors import APIError, DeployFailed, LuminalCloudError

if TYPE_CHECKING:
    from luminal_cloud.graph import Graph

_NON_FINITE = {"NaN": np.nan, "Infinity": np.inf, "-Infinity": -np.inf}


def _decode(value: Any, dtype: str | None) -> np.ndarray:
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


def _model_file(model: str | Path | bytes | Graph, name: str) -> tuple[str, bytes]:
    if isinstance(model, bytes):
        return f"{name}.onnx", model
    # a Graph, recognized by its export so that uploading files never imports onnx
    if hasattr(model, "to_onnx"):
        return f"{name}.onnx", model.to_onnx()
    return Path(model).name, Path(model).read_bytes()


class Client:
    def __init__(self, url: str, api_key: str, timeout: float = 60.0, transport=None) -> None:
        self._http = httpx.Client(
            base_url=url.rstrip("/"),
            headers={"Authorization": f"Bearer {api_key}"},
            timeout=timeout,
            transport=transport,
        )
        # (name, version) -> output dtypes, so predictions come back in the declared dtype
        self._output_dtypes: dict[tuple[str, int], dict[str, str]] = {}

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _request(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise LuminalCloudError(f"cannot reach the server: {exc}") from None
        if response.status_code >= 400:
            try:
                error = response.json()["error"]
                raise APIError(response.status_code, error["code"], error["message"])
            except (ValueError, KeyError, TypeError):
                raise APIError(response.status_code, "http_error", response.text) from None
        return response.json()

    def deploy(
        self,
        model: str | Path | bytes | Graph,
        name: str,
        target: str = "cpu",
        wait: bool = True,
        timeout: float = 600.0,
    ) -> dict[str, Any]:
        """Upload a model (an ONNX file's path or bytes, or a luminal_cloud.graph.Graph); with
        wait=True, return once it is ready (DeployFailed if not)."""
        filename, data = _model_file(model, name)
        files = {"file": (filename, data, "application/octet-stream")}
        created = self._request("POST", "/v1/models", files=files, data={"name": name, "target": target})
        if not wait:
            return created
        return self.wait(name, created["version"], timeout)

    def wait(self, name: str, version: int, timeout: float = 600.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        delay = 0.05
        while True:
            model = self.model(name)
            found = next(v for v in model["versions"] if v["version"] == version)
            if found["status"] == "ready":
                return found
            if found["status"] == "failed":
                raise DeployFailed(name, version, found["error"] or "unknown error")
            if time.monotonic() > deadline:
                raise LuminalCloudError(f"model {name!r} v{version} still {found['status']} after {timeout}s")
            time.sleep(delay)
            delay = min(delay * 1.5, 1.0)

    def model(self, name: str) -> dict[str, Any]:
        return self._request("GET", f"/v1/models/{name}")

    def models(self) -> list[dict[str, Any]]:
        return self._request("GET", "/v1/models")["models"]

    def delete(self, name: str) -> dict[str, Any]:
        return self._request("DELETE", f"/v1/models/{name}")

    def usage(self) -> dict[str, Any]:
        return self._request("GET", "/v1/usage")

    def infer(self, name: str, inputs: dict[str, np.ndarray], version: int | None = None) -> dict[str, Any]:
        """The raw response: outputs as nested lists, plus model, version and usage."""
        body = {"inputs": {k: np.asarray(v).tolist() for k, v in inputs.items()}}
        params = {"version": version} if version is not None else None
        return self._request("POST", f"/v1/models/{name}/infer", json=body, params=params)

    def predict(
        self, name: str, inputs: dict[str, np.ndarray], version: int | None = None
    ) -> dict[str, np.ndarray]:
        reply = self.infer(name, inputs, version)
        dtypes = self._dtypes(name, reply["version"])
        return {k: _decode(v, dtypes.get(k)) for k, v in reply["outputs"].items()}

    def _dtypes(self, name: str, version: int) -> dict[str, str]:
        key = (name, version)
        if key not in self._output_dtypes:
            model = self.model(name)
            found = next((v for v in model["versions"] if v["version"] == version), None)
            outputs = (found or {}).get("signature") or {"outputs": []}
            self._output_dtypes[key] = {o["name"]: o["dtype"] for o in outputs["outputs"]}
        return self._output_dtypes[key]
