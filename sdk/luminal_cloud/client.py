"""The HTTP clients: `Client` (blocking) and `AsyncClient` (awaited), one implementation.

Each public method is written once, in `Calls`, as a generator of steps (luminal_cloud._steps):
it builds httpx requests and reads responses but does no I/O, so the two clients differ only in
the driver that runs those steps over httpx.Client or httpx.AsyncClient.
"""

from __future__ import annotations

import email.utils
import itertools
import json
import random
import sys
import time
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self, TextIO
from urllib.parse import quote

import httpx
import numpy as np

from luminal_cloud import _generation, _progress, _tensors
from luminal_cloud._generation import Generation
from luminal_cloud._steps import Driven, Send, Sleep, Steps, operation, run_async, run_sync
from luminal_cloud._torch import export_onnx
from luminal_cloud.errors import APIError, DeployFailed, LuminalCloudError, ServerUnreachable, error_from

if TYPE_CHECKING:
    from luminal_cloud.graph import Graph

# answers that mean "not now": the request was not taken, so sending it again is safe
RETRY_STATUSES = frozenset({429, 503})
# waits between attempts when the server gives no Retry-After: 0.5 s, doubling, at most 8 s
BACKOFF_FIRST, BACKOFF_MAX = 0.5, 8.0


type Parts = dict[str, tuple[str, bytes, str]]


def _model_file(model: str | Path | bytes | Graph, name: str, task: str) -> tuple[str, bytes, Parts]:
    """The upload's `file` (its name and bytes) and its other file parts (the tokenizer's)."""
    if task not in _generation.TASKS:
        raise ValueError(f"task is one of {', '.join(_generation.TASKS)}, not {task!r}")
    if isinstance(model, bytes):
        return f"{name}.onnx", model, {}
    # a Graph, recognized by its export so that uploading files never imports onnx
    if hasattr(model, "to_onnx"):
        return f"{name}.onnx", model.to_onnx(), {}
    return _generation.model_bundle(Path(model), task)


def retry_after(response: httpx.Response) -> float | None:
    """The seconds a Retry-After header asks for (a number, or an HTTP date); None without one."""
    value = response.headers.get("Retry-After")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def backoff(attempt: int) -> float:
    """The wait after failed attempt number `attempt` (1, 2, ...), jittered so that clients
    turned away together do not come back together."""
    ceiling = min(BACKOFF_MAX, BACKOFF_FIRST * 2 ** (attempt - 1))
    return random.uniform(ceiling / 2, ceiling)


def error_of(response: httpx.Response) -> APIError:
    """The typed error for an error response: /v1's {"error": {"code", "message"}}, the OpenAI
    routes' {"error": {"message", "type", "param", "code"}}, KServe v2's {"error": "message"}, or
    whatever else a proxy in between answered."""
    try:
        error = response.json()["error"]
    except (ValueError, KeyError, TypeError):
        error = None
    if not isinstance(error, dict | str):
        error = response.text or response.reason_phrase
    return error_from(response.status_code, error, response.reason_phrase, retry_after(response))


class Calls(Driven):
    """Every call the clients make, each a generator of steps (see the module's docstring)."""

    def __init__(
        self,
        url: str,
        api_key: str,
        timeout: float,
        max_attempts: int,
        max_retry_wait: float,
        progress_stream: TextIO | None,
    ) -> None:
        if max_attempts < 1:
            raise ValueError("max_attempts is at least 1 (the first try)")
        self.url = url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {api_key}"}
        self._timeout = httpx.Timeout(timeout).as_dict()
        self._max_attempts = max_attempts
        self._max_retry_wait = max_retry_wait
        # None: sys.stdout as it is when deploy runs (tests and notebooks swap it)
        self._progress_stream = progress_stream
        # (name, version) -> output dtypes, so /v1 predictions come back in the declared dtype
        self._output_dtypes: dict[tuple[str, int], dict[str, str]] = {}
        # whether the server speaks KServe v2 with binary tensors; asked once (GET /v2)
        self._binary_v2: bool | None = None
        # (name, version, alias or None) -> (the version it describes, None for an alias not yet
        # answered; input name -> v2 datatype)
        self._v2_inputs: dict[tuple[str, int | str | None], tuple[int | None, dict[str, str]]] = {}

    # -- requests and responses

    def _request(
        self, method: str, path: str, *, headers: Mapping[str, str] | None = None, **kwargs
    ) -> httpx.Request:
        return httpx.Request(
            method,
            self.url + path,
            headers={**self._headers, **(headers or {})},
            extensions={"timeout": self._timeout},
            **kwargs,
        )

    def _send(
        self, request: httpx.Request, retry: bool = True, stream: bool = False
    ) -> Steps[httpx.Response]:
        """The response, after retrying 429 and 503 (with `retry`) while attempts and the wait
        budget last. With `stream`, a success comes unread (see Send)."""
        waited = 0.0
        attempts = self._max_attempts if retry else 1
        for attempt in range(1, attempts + 1):
            try:
                response = yield Send(request, stream)
            except httpx.TransportError as exc:
                raise self._transport_error(exc) from None
            if response.status_code not in RETRY_STATUSES or attempt == attempts:
                break
            delay = retry_after(response)
            delay = backoff(attempt) if delay is None else delay
            if waited + delay > self._max_retry_wait:
                break
            waited += delay
            yield Sleep(delay)
        return response

    def _transport_error(self, exc: httpx.TransportError) -> LuminalCloudError:
        reason = str(exc) or type(exc).__name__
        if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout):
            return ServerUnreachable(self.url, reason)
        if isinstance(exc, httpx.TimeoutException):
            return LuminalCloudError(f"no answer from {self.url} within the timeout ({type(exc).__name__})")
        return LuminalCloudError(f"the connection to {self.url} failed: {reason}")

    def _checked(self, request: httpx.Request) -> Steps[httpx.Response]:
        response = yield from self._send(request)
        if response.status_code >= 400:
            raise error_of(response)
        return response

    def _json(self, method: str, path: str, **kwargs: Any) -> Steps[Any]:
        response = yield from self._checked(self._request(method, path, **kwargs))
        return response.json()

    # -- models

    @operation
    def deploy(
        self,
        model: str | Path | bytes | Graph,
        name: str,
        target: str = "cpu",
        wait: bool = True,
        timeout: float = 600.0,
        progress: bool = True,
        precision: str = "exported",
        *,
        task: str = "inference",
    ) -> Steps[dict[str, Any]]:
        """Upload a model (an ONNX file's path or bytes, or a luminal_cloud.graph.Graph) to
        compile for `target`, in `precision`: "exported" (the dtypes the model declares), or on
        a GPU target "tf32" (float32 products on tensor cores) or "float16" or "bfloat16"
        (weights and intermediates in 16 bits; inputs and outputs keep their dtypes). With wait=True, return the version once it is ready, or
        raise DeployFailed with the compile error. On a terminal (and unless progress=False) a
        progress bar shows the upload, then the compile's status, phase and candidates
        measured, and elapsed time.

        task="text-generation" uploads a language model (a decoder with its KV cache) for
        generate and stream. `model` is then a directory holding one .onnx file and the
        tokenizer files (tokenizer.json, tokenizer_config.json, generation_config.json, and
        optionally config.json and chat_template.jinja), each sent as its own form part beside
        the ONNX file; or the path of one .onnx file, whose directory's tokenizer files go with
        it; or a .zip bundle of them all, sent as it is."""
        filename, data, parts = _model_file(model, name, task)
        return (
            yield from self._deploy(
                filename, data, name, target, precision, wait, timeout, progress, task, parts
            )
        )

    @operation
    def deploy_torch(
        self,
        module: Any,
        example_inputs: Any,
        name: str,
        *,
        input_names: Sequence[str] | None = None,
        output_names: Sequence[str] | None = None,
        dynamic_axes: Mapping[str, Any] | None = None,
        opset_version: int | None = None,
        target: str = "cpu",
        wait: bool = True,
        timeout: float = 600.0,
        progress: bool = True,
        precision: str = "exported",
    ) -> Steps[dict[str, Any]]:
        """Export a torch.nn.Module with torch.onnx.export here (example_inputs: a tensor or a
        tuple of them; inputs are named "input", or input_0, input_1, ... unless input_names
        says) and deploy it like `deploy` (target and precision included). Needs the extra:
        pip install 'luminal-cloud-sdk[torch]'."""
        data = export_onnx(module, example_inputs, input_names, output_names, dynamic_axes, opset_version)
        return (yield from self._deploy(f"{name}.onnx", data, name, target, precision, wait, timeout, progress))

    def _deploy(
        self,
        filename: str,
        data: bytes,
        name: str,
        target: str,
        precision: str,
        wait: bool,
        timeout: float,
        progress: bool,
        task: str = "inference",
        parts: Parts | None = None,
    ) -> Steps[dict[str, Any]]:
        shown = _progress.Progress(self._progress_stream or sys.stdout, progress)
        request = self._request(
            "POST",
            "/v1/models",
            files={"file": (filename, data, "application/octet-stream"), **(parts or {})},
            data={"name": name, "target": target, "precision": precision, "task": task},
        )
        if shown.shown:
            body = request.read()
            request.stream = _progress.UploadStream(
                body,
                lambda sent: shown.show(
                    _progress.upload_line(filename, sent, len(body)), throttle=sent < len(body)
                ),
            )
        created = (yield from self._checked(request)).json()
        if not wait:
            shown.finish(f"{name} v{created['version']} uploaded, {created['status']}")
            return created
        return (yield from self._wait(name, created["version"], timeout, shown))

    @operation
    def wait(
        self, name: str, version: int, timeout: float = 600.0, progress: bool = False
    ) -> Steps[dict[str, Any]]:
        """The version once it is ready; DeployFailed if it failed to compile."""
        shown = _progress.Progress(self._progress_stream or sys.stdout, progress)
        return (yield from self._wait(name, version, timeout, shown))

    def _wait(
        self, name: str, version: int, timeout: float, shown: _progress.Progress
    ) -> Steps[dict[str, Any]]:
        started = time.monotonic()
        delay = 0.05
        for tick in itertools.count():
            model = yield from self._json("GET", f"/v1/models/{quote(name, safe='')}")
            found = next(v for v in model["versions"] if v["version"] == version)
            elapsed = time.monotonic() - started
            if found["status"] == "ready":
                shown.finish(_progress.done_line(name, version, elapsed, found.get("report")))
                return found
            if found["status"] == "failed":
                shown.finish(_progress.failed_line(name, version, elapsed))
                raise DeployFailed(name, version, found.get("error") or "unknown error")
            line = _progress.compile_line(name, version, found["status"], elapsed, tick, found.get("progress"))
            if elapsed > timeout:
                shown.finish(line)
                raise LuminalCloudError(f"model {name!r} v{version} still {found['status']} after {timeout}s")
            shown.show(line)
            yield Sleep(delay)
            # at most half a second between looks, so the elapsed time on the bar keeps moving
            delay = min(delay * 1.5, 0.5)
        raise AssertionError("unreachable")  # for type checkers: the loop above has no end

    @operation
    def model(self, name: str) -> Steps[dict[str, Any]]:
        """The model and its versions: status (queued, compiling, ready, failed), error, report,
        and progress while compiling."""
        return (yield from self._json("GET", f"/v1/models/{quote(name, safe='')}"))

    @operation
    def models(self) -> Steps[list[dict[str, Any]]]:
        return (yield from self._json("GET", "/v1/models"))["models"]

    @operation
    def delete(self, name: str) -> Steps[dict[str, Any]]:
        return (yield from self._json("DELETE", f"/v1/models/{quote(name, safe='')}"))

    # -- versions and aliases

    @operation
    def versions(self, name: str) -> Steps[dict[str, Any]]:
        """The model's versions (status, created_at, the aliases pointing at each) and its
        aliases with their histories."""
        return (yield from self._json("GET", f"/v1/models/{quote(name, safe='')}/versions"))

    @operation
    def set_alias(self, name: str, alias: str, version: int) -> Steps[dict[str, Any]]:
        """Points `alias` (prod, canary) at a ready version; Conflict for one that is not ready."""
        return (yield from self._set_alias(name, alias, version))

    @operation
    def promote(self, name: str, alias: str, version: int) -> Steps[dict[str, Any]]:
        """Moves `alias` to `version`, as set_alias does: a rollback brings it back."""
        return (yield from self._set_alias(name, alias, version))

    def _set_alias(self, name: str, alias: str, version: int) -> Steps[dict[str, Any]]:
        path = f"/v1/models/{quote(name, safe='')}/aliases/{quote(alias, safe='')}"
        return (yield from self._json("PUT", path, json={"version": version}))

    @operation
    def rollback(self, name: str, alias: str) -> Steps[dict[str, Any]]:
        """Moves `alias` back to the version it pointed at before its last promote."""
        path = f"/v1/models/{quote(name, safe='')}/aliases/{quote(alias, safe='')}/rollback"
        return (yield from self._json("POST", path))

    @operation
    def delete_alias(self, name: str, alias: str) -> Steps[dict[str, Any]]:
        return (yield from self._json("DELETE", f"/v1/models/{quote(name, safe='')}/aliases/{quote(alias, safe='')}"))

    @operation
    def delete_version(self, name: str, version: int) -> Steps[dict[str, Any]]:
        """Deletes one version (the model, with its last one); Conflict while an alias points at it."""
        return (yield from self._json("DELETE", f"/v1/models/{quote(name, safe='')}/versions/{int(version)}"))

    @operation
    def usage(
        self, start: str | None = None, end: str | None = None, group_by: str | None = None
    ) -> Steps[dict[str, Any]]:
        """The bill: requests, billed seconds and cost per version (group_by: model, version or
        day), from `start` (inclusive) to `end` (exclusive), ISO 8601 dates or times in UTC."""
        wanted = {"from": start, "to": end, "group_by": group_by}
        return (yield from self._json("GET", "/v1/usage", params={k: v for k, v in wanted.items() if v is not None}))

    # -- inference

    @operation
    def infer(
        self, name: str, inputs: Mapping[str, Any], version: int | str | None = None
    ) -> Steps[dict[str, Any]]:
        """/v1's raw response: outputs as nested lists, plus model, version and usage. `version`:
        a number, an alias (prod), or None for the newest ready version."""
        return (yield from self._infer_v1(name, inputs, version))

    def _infer_v1(self, name: str, inputs: Mapping[str, Any], version: int | str | None) -> Steps[dict[str, Any]]:
        body = {"inputs": {k: np.asarray(v).tolist() for k, v in inputs.items()}}
        params = {"version": version} if version is not None else None
        return (
            yield from self._json(
                "POST", f"/v1/models/{quote(name, safe='')}/infer", json=body, params=params
            )
        )

    @operation
    def predict(
        self, name: str, inputs: Mapping[str, Any], version: int | str | None = None
    ) -> Steps[dict[str, np.ndarray]]:
        """Outputs as numpy arrays in the model's dtypes (`version` as for infer). Tensors travel
        as raw bytes (KServe v2's binary extension) where the server has it, as /v1 JSON otherwise."""
        if (yield from self._speaks_binary_v2()):
            outputs = yield from self._predict_v2(name, inputs, version)
            if outputs is not None:
                return outputs
        reply = yield from self._infer_v1(name, inputs, version)
        dtypes = yield from self._v1_output_dtypes(name, reply["version"])
        return {k: _tensors.from_json(v, dtypes.get(k)) for k, v in reply["outputs"].items()}

    def _speaks_binary_v2(self) -> Steps[bool]:
        if self._binary_v2 is None:
            response = yield from self._send(self._request("GET", "/v2"))
            if response.status_code >= 500:
                return False  # /v1 for now; asked again next time
            try:
                metadata = response.json() if response.is_success else {}
                self._binary_v2 = "binary_tensor_data" in metadata.get("extensions", [])
            except (ValueError, AttributeError):  # not the protocol's answer: a server without /v2
                self._binary_v2 = False
        return self._binary_v2

    def _predict_v2(
        self, name: str, inputs: Mapping[str, Any], version: int | str | None
    ) -> Steps[dict[str, np.ndarray] | None]:
        """The outputs over v2, or None for a model that /v1 serves instead."""
        key = (name, version)
        path = f"/v2/models/{quote(name, safe='')}" + (
            f"/versions/{quote(str(version), safe='')}" if version is not None else ""
        )
        for fresh in (key not in self._v2_inputs, True):
            described = yield from self._v2_input_datatypes(key, path)
            if described is None:
                return None
            body, header_length = _tensors.v2_request(inputs, described[1])
            headers = {_tensors.HEADER_LENGTH: str(header_length), "Content-Type": "application/octet-stream"}
            response = yield from self._send(
                self._request("POST", f"{path}/infer", content=body, headers=headers)
            )
            if response.status_code == 400 and not fresh:
                # the datatypes may be an older version's: look again, then send once more
                del self._v2_inputs[key]
                continue
            if response.status_code >= 400:
                raise error_of(response)
            header, outputs = _tensors.v2_response(
                response.content, response.headers.get(_tensors.HEADER_LENGTH)
            )
            served = int(header["model_version"])
            if described[0] is None:  # an alias: the version it names now is learnt from the answer
                self._v2_inputs[key] = (served, described[1])
            elif served != described[0]:
                self._v2_inputs.pop(key, None)  # another version serves now: its datatypes next time
            return outputs
        raise AssertionError("unreachable")  # for type checkers: the second round returns or raises

    def _v2_input_datatypes(
        self, key: tuple[str, int | str | None], path: str
    ) -> Steps[tuple[int | None, dict[str, str]] | None]:
        """The version that `path` (a model, or one version of it) describes, and its inputs'
        datatypes; None where v2 cannot serve it."""
        if key not in self._v2_inputs:
            response = yield from self._send(self._request("GET", path), retry=False)
            if response.status_code in (400, 503):
                # a dtype the protocol has no name for (float8, ...): /v1 serves the model; a
                # version not ready (v2 has no 409): /v1 answers NotReady, with its own retries
                return None
            if response.status_code >= 400:
                raise error_of(response)
            metadata = response.json()
            # the version the service picks when none is named is the newest ready one
            if isinstance(key[1], str):
                described = None
            else:
                described = key[1] if key[1] is not None else max(int(v) for v in metadata["versions"])
            self._v2_inputs[key] = (described, {t["name"]: t["datatype"] for t in metadata["inputs"]})
        return self._v2_inputs[key]

    def _v1_output_dtypes(self, name: str, version: int) -> Steps[dict[str, str]]:
        key = (name, version)
        if key not in self._output_dtypes:
            model = yield from self._json("GET", f"/v1/models/{quote(name, safe='')}")
            found = next((v for v in model["versions"] if v["version"] == version), None)
            outputs = (found or {}).get("signature") or {"outputs": []}
            self._output_dtypes[key] = {o["name"]: o["dtype"] for o in outputs["outputs"]}
        return self._output_dtypes[key]

    # -- text generation

    @operation
    def generate(
        self,
        name: str,
        prompt: str | None = None,
        *,
        messages: Sequence[Mapping[str, Any]] | None = None,
        max_tokens: int = 16,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        version: int | str | None = None,
        **extra: Any,
    ) -> Steps[Generation]:
        """Generate text with a model deployed with task="text-generation": a `prompt` is
        completed (/v1/completions), `messages` ([{"role": "user", "content": ...}, ...]) are
        answered with the model's chat template (/v1/chat/completions). Up to `max_tokens` new
        tokens, sampled with `temperature` (0: greedy), `top_p` and `top_k` (0: all), from `seed`
        where given; generation stops at the end token or at any `stop` string. `version`: a
        number, an alias (prod), or None for the newest ready version. `extra` fields go in the
        request body as they are (min_tokens=, ignore_eos=)."""
        path, body = _generation.request_body(
            name,
            prompt,
            messages,
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
            stop=stop,
            version=version,
            extra=extra,
            stream=False,
        )
        reply = yield from self._json("POST", path, json=body)
        return _generation.generation_of(reply, _generation.is_chat(path))

    def stream(
        self,
        name: str,
        prompt: str | None = None,
        *,
        messages: Sequence[Mapping[str, Any]] | None = None,
        max_tokens: int = 16,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        version: int | str | None = None,
        **extra: Any,
    ) -> TextStream | AsyncTextStream:
        """The text of `generate` (same arguments) piece by piece as it is generated: Client
        returns a TextStream (`for piece in client.stream(...)`), AsyncClient an AsyncTextStream
        (`async for piece in aio.stream(...)`). The request goes out at the first piece asked
        for, where an error answer raises as other calls do; once the stream is done, the
        stream's finish_reason, usage and id are set (see TextStream)."""
        path, body = _generation.request_body(
            name,
            prompt,
            messages,
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
            stop=stop,
            version=version,
            extra=extra,
            stream=True,
        )
        request = self._request("POST", path, json=body, headers={"Accept": "text/event-stream"})
        return self._text_stream(request, _generation.StreamState(_generation.is_chat(path)))

    def _text_stream(self, request: httpx.Request, state: _generation.StreamState) -> Any:
        raise NotImplementedError

    def _open_stream(self, request: httpx.Request) -> Steps[httpx.Response]:
        """The streamed answer's response, unread (after the retries of 429 and 503)."""
        response = yield from self._send(request, stream=True)
        if response.is_error:
            raise error_of(response)
        return response


class Client(Calls):
    """A blocking client. Retries 429 and 503 (after the server's Retry-After, or a backoff) up
    to `max_attempts` tries and `max_retry_wait` seconds of waiting in all; deploy's progress
    goes to `progress_stream` (stdout), when it is a terminal. `transport`: httpx's, for tests."""

    def __init__(
        self,
        url: str,
        api_key: str,
        timeout: float = 60.0,
        transport: httpx.BaseTransport | None = None,
        *,
        max_attempts: int = 5,
        max_retry_wait: float = 60.0,
        progress_stream: TextIO | None = None,
    ) -> None:
        super().__init__(url, api_key, timeout, max_attempts, max_retry_wait, progress_stream)
        self._http = httpx.Client(transport=transport)

    def _run(self, steps: Steps[Any]) -> Any:
        return run_sync(self._http, steps)

    def _text_stream(self, request: httpx.Request, state: _generation.StreamState) -> TextStream:
        return TextStream(self, request, state)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClient(Calls):
    """The same calls as Client, each awaited: `async with AsyncClient(url, key) as client:
    outputs = await client.predict(...)`. Options as Client's."""

    def __init__(
        self,
        url: str,
        api_key: str,
        timeout: float = 60.0,
        transport: httpx.AsyncBaseTransport | None = None,
        *,
        max_attempts: int = 5,
        max_retry_wait: float = 60.0,
        progress_stream: TextIO | None = None,
    ) -> None:
        super().__init__(url, api_key, timeout, max_attempts, max_retry_wait, progress_stream)
        self._http = httpx.AsyncClient(transport=transport)

    def _run(self, steps: Steps[Any]) -> Any:
        return run_async(self._http, steps)

    def _text_stream(self, request: httpx.Request, state: _generation.StreamState) -> AsyncTextStream:
        return AsyncTextStream(self, request, state)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


def _answered_whole(response: httpx.Response) -> bool:
    # a server that does not stream answers one JSON document
    return response.headers.get("Content-Type", "").startswith("application/json")


class _Stream:
    def __init__(self, state: _generation.StreamState) -> None:
        self._state = state

    @property
    def finish_reason(self) -> str | None:
        """Why the generation stopped ("stop" or "length"); None until its last chunk."""
        return self._state.finish_reason

    @property
    def usage(self) -> dict[str, int] | None:
        """{"prompt_tokens", "completion_tokens", "total_tokens"}, once the stream is done (None
        where the server sent none)."""
        return self._state.usage

    @property
    def id(self) -> str | None:
        return self._state.id

    @property
    def text(self) -> str:
        """The pieces so far, joined."""
        return self._state.text

    def generation(self) -> Generation:
        """What generate would have answered (once the stream is done)."""
        usage = self.usage or {}
        return Generation(
            self.text,
            self.finish_reason,
            int(usage.get("prompt_tokens") or 0),
            int(usage.get("completion_tokens") or 0),
            self.id,
        )


class TextStream(_Stream, Iterator[str]):
    """The text pieces of a streamed generation (Client.stream), each a str as it arrives. The
    request goes out at the first piece asked for; an error answer raises there (the SDK's
    APIError subclasses, as other calls), and so does an error event mid-stream. Once the
    iteration ends, finish_reason, usage, id and text (all pieces) are set. close(), or leaving
    `with client.stream(...) as pieces:`, ends it early and closes the connection."""

    def __init__(self, client: Client, request: httpx.Request, state: _generation.StreamState) -> None:
        super().__init__(state)
        self._pieces = self._read(client, request)

    def __iter__(self) -> Self:
        return self

    def __next__(self) -> str:
        return next(self._pieces)

    def close(self) -> None:
        self._pieces.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _read(self, client: Client, request: httpx.Request) -> Iterator[str]:
        response: httpx.Response = client._run(client._open_stream(request))
        try:
            if _answered_whole(response):
                yield from self._state.whole(json.loads(response.read()))
                return
            for chunk in response.iter_bytes():
                yield from self._state.feed(chunk)
                if self._state.done:
                    return
            yield from self._state.end()
        except httpx.TransportError as exc:
            raise client._transport_error(exc) from None
        finally:
            response.close()


class AsyncTextStream(_Stream, AsyncIterator[str]):
    """TextStream's async twin (AsyncClient.stream): `async for piece in aio.stream(...)`;
    aclose(), or `async with`, ends it early."""

    def __init__(self, client: AsyncClient, request: httpx.Request, state: _generation.StreamState) -> None:
        super().__init__(state)
        self._pieces = self._read(client, request)

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> str:
        return await anext(self._pieces)

    async def aclose(self) -> None:
        await self._pieces.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _read(self, client: AsyncClient, request: httpx.Request) -> AsyncIterator[str]:
        response: httpx.Response = await client._run(client._open_stream(request))
        try:
            if _answered_whole(response):
                for piece in self._state.whole(json.loads(await response.aread())):
                    yield piece
                return
            async for chunk in response.aiter_bytes():
                for piece in self._state.feed(chunk):
                    yield piece
                if self._state.done:
                    return
            for piece in self._state.end():
                yield piece
        except httpx.TransportError as exc:
            raise client._transport_error(exc) from None
        finally:
            await response.aclose()
