"""Text generation without I/O: the request bodies of /v1/completions and /v1/chat/completions,
their answers as a `Generation`, the server-sent events of a streamed answer, and the bundle of
files a generative model is uploaded with. Imports no httpx: the clients do the sending
(luminal_cloud.client).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from luminal_cloud import errors
from luminal_cloud.errors import APIError, LuminalCloudError, error_from

COMPLETIONS, CHAT_COMPLETIONS = "/v1/completions", "/v1/chat/completions"
TASKS = ("inference", "text-generation")
# the upload's form parts beside `file`, each the tokenizer file of that name, sent where the
# directory has it (config and chat_template: optional; the template as optimum exports it)
TOKENIZER_PARTS = {
    "tokenizer": "tokenizer.json",
    "tokenizer_config": "tokenizer_config.json",
    "generation_config": "generation_config.json",
    "config": "config.json",
    "chat_template": "chat_template.jinja",
}
# fields the SDK sets itself, which **extra may not override
_OWN_FIELDS = frozenset({"model", "prompt", "messages", "stream", "stream_options"})
# an error event's status where its code is not one: OpenAI's error types
_STATUS_OF_TYPE = {
    "invalid_request_error": 400,
    "authentication_error": 401,
    "permission_error": 403,
    "not_found_error": 404,
    "rate_limit_error": 429,
}


@dataclass(frozen=True)
class Generation:
    """One generated completion: its text, why it stopped ("stop": an end token or a stop
    string; "length": max_tokens), the tokens counted for the bill, and the server's id."""

    text: str
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    id: str | None

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


def request_body(
    name: str,
    prompt: str | None,
    messages: Sequence[Mapping[str, Any]] | None,
    *,
    max_tokens: int,
    temperature: float,
    top_p: float,
    top_k: int,
    seed: int | None,
    stop: str | Sequence[str] | None,
    version: int | str | None,
    extra: Mapping[str, Any],
    stream: bool,
) -> tuple[str, dict[str, Any]]:
    """The route and the JSON body: a prompt goes to /v1/completions, messages to
    /v1/chat/completions."""
    if (prompt is None) == (messages is None):
        raise ValueError("give either a prompt or messages (a list of {'role', 'content'}), not both")
    clash = _OWN_FIELDS.intersection(extra)
    if clash:
        raise TypeError(
            f"generate sets {', '.join(sorted(clash))} itself; pass the prompt, messages or version"
        )
    body: dict[str, Any] = {"model": name if version is None else f"{name}:{version}"}
    if messages is not None:
        if isinstance(messages, str | bytes):
            raise TypeError("messages is a list of {'role': ..., 'content': ...}; pass a string as prompt")
        body["messages"] = [dict(message) for message in messages]
        path = CHAT_COMPLETIONS
    else:
        body["prompt"] = prompt
        path = COMPLETIONS
    body.update(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k)
    if seed is not None:
        body["seed"] = seed
    if stop is not None:
        body["stop"] = stop if isinstance(stop, str) else list(stop)
    body.update(extra)
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return path, body


def is_chat(path: str) -> bool:
    return path == CHAT_COMPLETIONS


def generation_of(reply: Mapping[str, Any], chat: bool) -> Generation:
    """A non-streamed answer as a Generation."""
    choices = reply.get("choices") or [{}]
    choice = choices[0]
    text = (choice.get("message") or {}).get("content") if chat else choice.get("text")
    usage = reply.get("usage") or {}
    return Generation(
        text=text or "",
        finish_reason=choice.get("finish_reason"),
        prompt_tokens=int(usage.get("prompt_tokens") or 0),
        completion_tokens=int(usage.get("completion_tokens") or 0),
        id=reply.get("id"),
    )


def stream_error(error: Any) -> APIError:
    """The typed error for an error event inside a stream (which came with status 200): the
    status is its code's where that is one (a number, as vLLM's; or the project's code, as
    "unavailable"), else its OpenAI type's, else 500."""
    status = 500
    if isinstance(error, Mapping):
        code = error.get("code")
        if isinstance(code, int) and 400 <= code < 600:
            status = code
        elif isinstance(code, str) and code in errors.CODES:
            status = errors.CODES[code].status
        else:
            status = _STATUS_OF_TYPE.get(str(error.get("type")), 500)
    return error_from(status, error, "the server failed while generating")


# -- server-sent events


@dataclass(frozen=True)
class Event:
    event: str  # "message" unless the server named it
    data: str


class EventParser:
    """Server-sent events from bytes as they arrive, in chunks cut anywhere (within a line, or
    a UTF-8 character): lines end at \\n, \\r\\n or \\r; `:` starts a comment; data lines join with
    \\n; a blank line ends an event; fields other than event and data are ignored."""

    def __init__(self) -> None:
        self._buffer = b""
        self._data: list[str] = []
        self._event = ""

    def feed(self, chunk: bytes) -> Iterator[Event]:
        self._buffer += chunk
        while True:
            cut = _line_end(self._buffer)
            if cut is None:
                return
            end, after = cut
            line, self._buffer = self._buffer[:end], self._buffer[after:]
            event = self._line(line.decode("utf-8", errors="replace"))
            if event is not None:
                yield event

    def end(self) -> Iterator[Event]:
        """The event left when the connection closed without its blank line."""
        line, self._buffer = self._buffer.rstrip(b"\r"), b""
        for text in (line.decode("utf-8", errors="replace"), ""):
            event = self._line(text)
            if event is not None:
                yield event

    def _line(self, line: str) -> Event | None:
        if not line:
            if not self._data:
                self._event = ""
                return None
            event = Event(self._event or "message", "\n".join(self._data))
            self._data, self._event = [], ""
            return event
        if line.startswith(":"):
            return None
        field, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if field == "data":
            self._data.append(value)
        elif field == "event":
            self._event = value
        return None


def _line_end(buffer: bytes) -> tuple[int, int] | None:
    """Where the first line ends and the next begins; None while no line is complete (a \\r
    last may be the first half of \\r\\n)."""
    newline, carriage = buffer.find(b"\n"), buffer.find(b"\r")
    if carriage == -1 or -1 < newline < carriage:
        return None if newline == -1 else (newline, newline + 1)
    if carriage + 1 == len(buffer):
        return None
    return carriage, carriage + (2 if buffer[carriage + 1] == 0x0A else 1)


class StreamState:
    """What a streamed answer said so far: each chunk's text piece, then its finish_reason, usage
    and id. Raises the typed APIError for an error event."""

    def __init__(self, chat: bool) -> None:
        self.chat = chat
        self.parser = EventParser()
        self.pieces: list[str] = []
        self.finish_reason: str | None = None
        self.usage: dict[str, int] | None = None
        self.id: str | None = None
        self.done = False  # [DONE] came

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def feed(self, chunk: bytes) -> Iterator[str]:
        """The text pieces in these bytes, each as soon as its event is read (none after [DONE])."""
        yield from self._take(self.parser.feed(chunk))

    def end(self) -> Iterator[str]:
        """The connection closed: the pieces of an event it left unfinished. Raises where the
        answer ended before its last chunk."""
        yield from self._take(self.parser.end())
        if not self.done and self.finish_reason is None:
            raise LuminalCloudError("the server closed the stream before the generation finished")

    def whole(self, reply: Mapping[str, Any]) -> Iterator[str]:
        """A server that answered a stream request with one JSON answer: its text, as one piece."""
        generation = generation_of(reply, self.chat)
        self.id, self.finish_reason, self.done = generation.id, generation.finish_reason, True
        self.usage = dict(reply["usage"]) if reply.get("usage") else None
        if generation.text:
            self.pieces.append(generation.text)
            yield generation.text

    def _take(self, events: Iterator[Event]) -> Iterator[str]:
        for event in events:
            if self.done:
                return
            piece = self._event(event)
            if piece:
                self.pieces.append(piece)
                yield piece

    def _event(self, event: Event) -> str | None:
        if event.data.strip() == "[DONE]":
            self.done = True
            return None
        try:
            chunk = json.loads(event.data)
        except ValueError:
            if event.event == "error":
                raise stream_error({"message": event.data}) from None
            raise LuminalCloudError(f"the server sent an unreadable chunk: {event.data[:200]!r}") from None
        if not isinstance(chunk, dict):
            raise LuminalCloudError(f"the server sent an unreadable chunk: {event.data[:200]!r}")
        if event.event == "error" or "error" in chunk:
            raise stream_error(chunk.get("error", chunk))
        self.id = chunk.get("id", self.id)
        if chunk.get("usage"):
            self.usage = dict(chunk["usage"])
        choices = chunk.get("choices") or []
        if not choices:
            return None
        choice = choices[0]
        if choice.get("finish_reason") is not None:
            self.finish_reason = choice["finish_reason"]
        if self.chat:
            return (choice.get("delta") or {}).get("content")
        return choice.get("text")


# -- uploads


def model_bundle(path: Path, task: str) -> tuple[str, bytes, dict[str, tuple[str, bytes, str]]]:
    """A model on disk as the upload's `file` (its name and bytes) and, for text generation, the
    tokenizer's parts. `path`: an ONNX or .zip file, or a directory holding one .onnx file and
    the tokenizer files. For text generation, the tokenizer files of an ONNX file's directory
    travel with it (so a directory with several exports uploads the one named)."""
    if task not in TASKS:
        raise ValueError(f"task is one of {', '.join(TASKS)}, not {task!r}")
    if path.is_dir():
        if task != "text-generation":
            raise ValueError(
                f"{path} is a directory: only task='text-generation' uploads one (with its tokenizer)"
            )
        found = sorted(path.glob("*.onnx"))
        if len(found) != 1:
            named = ", ".join(p.name for p in found) or "none"
            raise ValueError(
                f"{path} must hold exactly one .onnx file (found {named}); pass the file's path instead"
            )
        onnx_file, folder = found[0], path
    elif not path.is_file():
        raise FileNotFoundError(f"no such file or directory: {path}")
    elif path.suffix.lower() == ".zip" or task != "text-generation":
        return path.name, path.read_bytes(), {}
    else:
        onnx_file, folder = path, path.parent
    parts = {
        part: (filename, (folder / filename).read_bytes(), "application/json")
        for part, filename in TOKENIZER_PARTS.items()
        if (folder / filename).is_file()
    }
    if "tokenizer" not in parts:
        raise FileNotFoundError(
            f"no tokenizer.json in {folder}: a text-generation model needs its tokenizer files"
        )
    return onnx_file.name, onnx_file.read_bytes(), parts
