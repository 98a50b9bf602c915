"""How one implementation of the client serves both httpx transports.

Every public method of the client is written once, as a generator of steps: it yields
`Send(request)` and receives the httpx.Response, read in full (or has the httpx.TransportError
thrown in at the yield), and yields `Sleep(seconds)` to wait; `Send(request, stream=True)` leaves
a success's body unread, for a stream's reader (Client.stream) to read and close. It does no I/O itself. A driver runs it: `run_sync`
over an httpx.Client for `Client`, `run_async` over an httpx.AsyncClient for `AsyncClient`.
`operation` turns such a generator into the public method, whose driver the class chooses.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable, Coroutine, Generator
from dataclasses import dataclass
from typing import Any, Concatenate

import httpx


@dataclass(frozen=True)
class Send:
    # sent as is; the step receives the response, read in full unless `stream`: then a success
    # (below 400) comes unread, for the caller to read (iter_bytes or aiter_bytes) and close
    request: httpx.Request
    stream: bool = False


@dataclass(frozen=True)
class Sleep:
    seconds: float


type Step = Send | Sleep
# a call's steps: yields Steps, is sent each Send's response, returns the call's result
type Steps[T] = Generator[Step, Any, T]


def run_sync[T](http: httpx.Client, steps: Steps[T]) -> T:
    reply: Any = None
    failure: httpx.TransportError | None = None
    while True:
        try:
            step = steps.throw(failure) if failure else steps.send(reply)
        except StopIteration as done:
            return done.value
        reply, failure = None, None
        if isinstance(step, Sleep):
            time.sleep(step.seconds)
            continue
        try:
            reply = http.send(step.request, stream=step.stream)
        except httpx.TransportError as exc:
            failure = exc
            continue
        if step.stream and reply.is_error:
            try:
                reply.read()  # an error's body, for its message
            except httpx.TransportError as exc:
                reply.close()
                reply, failure = None, exc


async def run_async[T](http: httpx.AsyncClient, steps: Steps[T]) -> T:
    reply: Any = None
    failure: httpx.TransportError | None = None
    while True:
        try:
            step = steps.throw(failure) if failure else steps.send(reply)
        except StopIteration as done:
            return done.value
        reply, failure = None, None
        if isinstance(step, Sleep):
            await asyncio.sleep(step.seconds)
            continue
        try:
            reply = await http.send(step.request, stream=step.stream)
        except httpx.TransportError as exc:
            failure = exc
            continue
        if step.stream and reply.is_error:
            try:
                await reply.aread()  # an error's body, for its message
            except httpx.TransportError as exc:
                await reply.aclose()
                reply, failure = None, exc


class Driven:
    """A client: something that runs steps (the result, or a coroutine of it)."""

    def _run(self, steps: Steps[Any]) -> Any:
        raise NotImplementedError


def operation[C: Driven, **P, T](
    steps: Callable[Concatenate[C, P], Steps[T]],
) -> Callable[Concatenate[C, P], T | Coroutine[Any, Any, T]]:
    """A generator of steps as a public method: Client returns its result, AsyncClient an
    awaitable of it."""

    @functools.wraps(steps)
    def run(self: C, *args: P.args, **kwargs: P.kwargs) -> Any:
        return self._run(steps(self, *args, **kwargs))

    return run
