"""What `deploy` shows on a terminal: the upload's bytes, then the compile's status and elapsed
time (with the compiler's phase and the candidates measured so far, when the server says them),
then the candidates the compiler measured. One line, redrawn; nothing when the stream is not a
terminal."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, TextIO

import httpx

_BAR = 24
_CHUNK = 64 * 1024
_SPINNER = "|/-\\"


def upload_line(filename: str, sent: int, total: int) -> str:
    done = round(_BAR * sent / total) if total else _BAR
    return f"Uploading {filename}  [{'#' * done}{'-' * (_BAR - done)}]  {_size(sent)} / {_size(total)}"


def compile_line(
    name: str, version: int, status: str, elapsed: float, tick: int, progress: dict[str, Any] | None = None
) -> str:
    spinner = _SPINNER[tick % len(_SPINNER)]
    return f"Compiling {name} v{version}  {spinner} {status}{_phase(progress)}  {_clock(elapsed)}"


def _phase(progress: dict[str, Any] | None) -> str:
    """': measure native-loops, 2/3 candidates measured', or what of it the server sent."""
    if not progress or not progress.get("phase"):
        return ""
    text = f": {progress['phase']}"
    if progress.get("candidate"):
        text += f" {progress['candidate']}"
    total = progress.get("candidates_total")
    if total and total > 1:
        text += f", {progress.get('candidates_measured', 0)}/{total} candidates measured"
    return text


def done_line(name: str, version: int, elapsed: float, report: dict[str, Any] | None) -> str:
    return f"{name} v{version} ready in {elapsed:.1f} s{_candidates(report)}"


def failed_line(name: str, version: int, elapsed: float) -> str:
    return f"{name} v{version} failed to compile after {elapsed:.1f} s"


def _candidates(report: dict[str, Any] | None) -> str:
    """', native-blas chosen of 2 candidates measured (0.118 ms)', or what of it the report has."""
    if not report or not report.get("chosen"):
        return ""
    candidates = report.get("candidates") or []
    measured = [c for c in candidates if c.get("median_ms") is not None]
    chosen = next((c for c in candidates if c.get("name") == report["chosen"]), {})
    text = f", {report['chosen']} chosen"
    if measured:
        text += f" of {len(measured)} candidate{'s' * (len(measured) != 1)} measured"
    if chosen.get("median_ms") is not None:
        text += f" ({chosen['median_ms']} ms)"
    return text


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB"):
        if n < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


def _clock(seconds: float) -> str:
    minutes, seconds = divmod(int(seconds), 60)
    return f"{minutes}:{seconds:02d}"


class Progress:
    """The one line on `stream`, or nothing: when `enabled` is false or `stream` is not a TTY."""

    def __init__(self, stream: TextIO, enabled: bool) -> None:
        isatty = getattr(stream, "isatty", None)
        self._stream = stream if enabled and isatty is not None and isatty() else None
        self._width = 0
        self._drawn_at = 0.0

    @property
    def shown(self) -> bool:
        return self._stream is not None

    def show(self, line: str, *, throttle: bool = False) -> None:
        if self._stream is None:
            return
        now = time.monotonic()
        if throttle and now - self._drawn_at < 0.1:
            return
        self._drawn_at = now
        # spaces wipe what a longer line before left behind
        self._stream.write("\r" + line.ljust(self._width))
        self._stream.flush()
        self._width = len(line)

    def finish(self, line: str) -> None:
        if self._stream is not None:
            self.show(line)
            self._stream.write("\n")
            self._stream.flush()
            self._width = 0


class UploadStream(httpx.SyncByteStream, httpx.AsyncByteStream):
    """A request body sent in chunks, telling `sent` how many bytes have gone; it can be sent
    again (a retried upload), for either of httpx's transports."""

    def __init__(self, body: bytes, sent: Callable[[int], None]) -> None:
        self._body = body
        self._sent = sent

    def _chunks(self) -> Iterator[bytes]:
        for start in range(0, len(self._body), _CHUNK):
            yield self._body[start : start + _CHUNK]
            self._sent(min(start + _CHUNK, len(self._body)))

    def __iter__(self) -> Iterator[bytes]:
        return self._chunks()

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for chunk in self._chunks():
            yield chunk
