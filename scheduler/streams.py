"""The distributed engine (settings.request_queue="redis"): the gateway queues each request on
its model version's Redis stream and waits for the answer on its own reply stream; runtime
processes (runtime/process.py) do the batching and the running. The gateway runs no model.

Also here, since only gateways run them: the placement of versions on runtimes, and the ledger
consumer that turns the runtimes' usage events into usage records.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, replace

import numpy as np
import redis
import redis.asyncio as aioredis

from cloud.errors import (
    DeadlineExceeded,
    LuminalError,
    NoRuntimeStarted,
    Overloaded,
    Unavailable,
    error_for_code,
)
from cloud.usage import Usage
from scheduler import wire
from scheduler.engine import InferenceResult, Route
from scheduler.generator import GenerationRequest, TokenEvent, event_from_json, request_to_json
from scheduler.observer import NO_OBSERVER, SchedulerObserver
from scheduler.pricing import UsageSink

log = logging.getLogger(__name__)

# how often a version with waiting requests has its placement checked
WATCH_S = 0.25
# after writing usage records, how long the ledger consumer lets new events gather
LEDGER_LINGER_S = 0.05
# how often a gateway drops the replies it has read from its reply stream
REPLY_TRIM_S = 0.1
# how long a gateway waits before writing again the voids the database refused
VOID_RETRY_S = 1.0
# XADD unless the stream already holds ARGV[1] entries (nil then)
APPEND_BOUNDED = """
if redis.call('XLEN', KEYS[1]) >= tonumber(ARGV[1]) then return nil end
return redis.call('XADD', KEYS[1], '*', unpack(ARGV, 2))
"""
# every entry of a version's stream (KEYS[1]) to its device type's pool stream (KEYS[2]), taken
# or not, acknowledged in the version's group (ARGV[1]) as it leaves; the count moved
MOVE_TO_POOL = """
local entries = redis.call('XRANGE', KEYS[1], '-', '+')
if #entries == 0 then return 0 end
local ids = {}
for i, entry in ipairs(entries) do
  redis.call('XADD', KEYS[2], '*', unpack(entry[2]))
  ids[i] = entry[1]
end
redis.pcall('XACK', KEYS[1], ARGV[1], unpack(ids))
redis.call('XDEL', KEYS[1], unpack(ids))
return #entries
"""


@dataclass
class RuntimeInfo:
    runtime_id: str
    device: str
    memory_budget_bytes: int
    loaded_bytes: int
    loaded: list[str]
    streams: int


def choose_runtime(route: Route, live: list[RuntimeInfo], exclude: set[str]) -> RuntimeInfo | None:
    """Where a version goes next: a runtime of its device type with room for it, one that has it
    loaded first, then the least busy. None when no runtime of its device type lives (a pool at
    zero: the request waits in the pool stream while one starts); Unavailable when none of those
    that live can hold it."""
    of_device = [r for r in live if r.device == route.target]
    if not of_device:
        return None
    fits = [r for r in of_device if r.memory_budget_bytes >= route.model_bytes]
    if not fits:
        largest = max(r.memory_budget_bytes for r in of_device)
        raise Unavailable(
            f"{route.model_name} v{route.version} needs about {route.model_bytes / 2**20:.1f} MiB, more than the "
            f"memory budget of every {route.target} runtime (the largest is {largest / 2**20:.1f} MiB)"
        )
    candidates = [r for r in fits if r.runtime_id not in exclude] or fits
    return min(candidates, key=lambda r: (route.artifact_key not in r.loaded, r.streams, r.loaded_bytes))


class Placement:
    """Keeps every version with waiting requests on at least one live runtime, and on one more
    while its backlog is longer than `spread_backlog` requests; says when its device type has
    no live runtime at all (a pool at zero)."""

    def __init__(self, client: aioredis.Redis, spread_backlog: int, cache_s: float = 0.5) -> None:
        self.redis = client
        self.spread_backlog = spread_backlog
        self.cache_s = cache_s
        self._live: list[RuntimeInfo] = []
        self._live_at = -1.0

    async def live_runtimes(self) -> list[RuntimeInfo]:
        now = time.monotonic()
        if now - self._live_at < self.cache_s:
            return self._live
        ids = sorted(m.decode() for m in await self.redis.smembers(wire.RUNTIMES))
        async with self.redis.pipeline(transaction=False) as pipe:
            for runtime_id in ids:
                pipe.hgetall(wire.heartbeat_key(runtime_id))
            infos = await pipe.execute()
        live, dead = [], []
        for runtime_id, info in zip(ids, infos):
            if not info:
                dead.append(runtime_id)
                continue
            live.append(
                RuntimeInfo(
                    runtime_id,
                    info[b"device"].decode(),
                    int(info[b"memory_budget_bytes"]),
                    int(info[b"loaded_bytes"]),
                    json.loads(info[b"loaded"]),
                    int(info[b"streams"]),
                )
            )
        if dead:
            await self.redis.srem(wire.RUNTIMES, *dead)
        self._live, self._live_at = live, now
        return live

    async def ensure(self, route: Route, backlog: int) -> bool:
        """True once the version is placed on a live runtime; False when no runtime of its device
        type lives (its requests go to the pool stream)."""
        live = await self.live_runtimes()
        live_ids = {r.runtime_id for r in live}
        placed = {m.decode() for m in await self.redis.smembers(wire.placement_key(route.version_id))}
        gone = placed - live_ids
        if gone:
            await self.redis.srem(wire.placement_key(route.version_id), *gone)
        serving = placed & live_ids
        of_device = {r.runtime_id for r in live if r.device == route.target}
        if serving and (backlog <= self.spread_backlog or not (of_device - serving)):
            return True
        chosen = choose_runtime(route, live, exclude=serving)
        if chosen is None:
            return False
        if chosen.runtime_id in serving:
            return True
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.sadd(wire.placement_key(route.version_id), chosen.runtime_id)
            pipe.sadd(wire.assigned_key(chosen.runtime_id), route.version_id)
            await pipe.execute()
        log.info("placed %s v%s on %s", route.model_name, route.version, chosen.runtime_id)
        return True

    async def remove(self, version_id: int) -> None:
        placed = await self.redis.smembers(wire.placement_key(version_id))
        async with self.redis.pipeline(transaction=True) as pipe:
            for runtime_id in placed:
                pipe.srem(wire.assigned_key(runtime_id.decode()), version_id)
            pipe.delete(wire.placement_key(version_id), wire.request_stream(version_id))
            await pipe.execute()


@dataclass
class _Waiter:
    future: asyncio.Future
    # when a runtime said its batch started (loop time), or None while queued
    started: float | None = None
    # where it was queued: its stream and entry id
    stream: str = ""
    message_id: bytes = b""


class StreamEngine:
    """Engine over Redis Streams. Needs a running event loop (it starts its reader tasks).

    A request for a version placed on a live runtime goes to the version's stream; one for a
    device type with no live runtime (a pool at zero) goes to the type's pool stream, where it
    waits, bounded by its deadline, while an autoscaler starts a runtime (the activator pattern):
    that wait is its cold start, reported and never billed."""

    def __init__(
        self,
        redis_url: str,
        ledger: UsageSink,
        max_queue_requests: int,
        max_batch_rows: int,
        request_timeout_s: float,
        retry_after_s: int,
        claim_idle_s: float,
        *,
        masked_redis_url: str,
        observer: SchedulerObserver = NO_OBSERVER,
    ) -> None:
        # messages name Redis by this URL, its password masked by the caller (one masker, in cloud.db)
        self.masked_redis_url = masked_redis_url
        self.redis = aioredis.Redis.from_url(redis_url, socket_connect_timeout=2, socket_timeout=10)
        self.ledger = ledger
        self.observer = observer
        self.max_queue_requests = max_queue_requests
        self.request_timeout_s = request_timeout_s
        self.retry_after_s = retry_after_s
        self.claim_idle_s = claim_idle_s
        self.placement = Placement(self.redis, spread_backlog=2 * max_batch_rows)
        self.gateway_id = uuid.uuid4().hex[:12]
        self.reply_to = wire.reply_stream(self.gateway_id)
        self._waiting: dict[str, _Waiter] = {}
        # generations under way: request id -> the queue its replies go to
        self._generating: dict[str, asyncio.Queue[wire.ReplyMessage]] = {}
        # version id -> (its route, requests waiting), and the task keeping each placed
        self._watched: dict[int, tuple[Route, int]] = {}
        self._watchers: dict[int, asyncio.Task] = {}
        # version id -> the stream its requests go to and when that was decided (loop time)
        self._decided: dict[int, tuple[str, float]] = {}
        # device types whose pool stream's consumer group this gateway has made sure of
        self._pools: set[str] = set()
        # requests answered with an error after their append was tried, their voids not yet written
        self._unbilled: set[str] = set()
        self._loop = asyncio.get_running_loop()
        self._voids_due = asyncio.Event()
        self._append_bounded = self.redis.register_script(APPEND_BOUNDED)
        self._move_to_pool = self.redis.register_script(MOVE_TO_POOL)
        self._tasks = [
            self._loop.create_task(self._read_replies(), name="replies"),
            self._loop.create_task(self._consume_usage(), name="ledger"),
            self._loop.create_task(self._beat(), name="gateway-beat"),
            self._loop.create_task(self._write_voids(), name="voids"),
        ]

    def _unreachable(self, exc: Exception) -> Unavailable:
        return Unavailable(f"the request queue (Redis at {self.masked_redis_url}) is unreachable: {exc}")

    async def infer(
        self, route: Route, inputs: Mapping[str, np.ndarray], rows: int, request_id: str
    ) -> InferenceResult:
        waiter = _Waiter(self._loop.create_future())
        now = time.time()
        deadline = now + self.request_timeout_s
        appending = False
        try:
            stream = await self._stream_for(route)
            message = wire.RequestMessage(
                request_id, self.reply_to, deadline, rows, route_fields(route), dict(inputs), enqueued_at=now
            )
            self._waiting[request_id] = waiter
            fields = [part for pair in message.to_fields().items() for part in pair]
            appending = True
            # the bound holds across gateways: the length check and the append are one step
            message_id = await self._append_bounded(keys=[stream], args=[self.max_queue_requests, *fields])
            if message_id is None:
                self._waiting.pop(request_id, None)
                self.observer.request_rejected(route.tenant_name, route.model_name)
                queue = (
                    f"for {route.model_name} v{route.version}" if stream == wire.request_stream(route.version_id)
                    else f"of requests waiting for a {route.target} runtime to start"
                )
                raise Overloaded(
                    f"the queue {queue} is full ({self.max_queue_requests} requests)", retry_after=self.retry_after_s
                )
        except redis.RedisError as exc:
            self._waiting.pop(request_id, None)
            if appending:  # the append may have reached Redis, only its answer lost: a runtime may run it
                self._void(request_id)
            raise self._unreachable(exc) from None
        waiter.stream, waiter.message_id = stream, message_id
        self._watch(route, +1)
        try:
            result = await self._wait(waiter, deadline, route)
        except BaseException:
            # given up (its deadline, a lost reply) or failed: a runtime may run it still, or have run it
            self._void(request_id)
            raise
        finally:
            self._waiting.pop(request_id, None)
            self._watch(route, -1)
        if result.cold_start_seconds > 0:
            self.observer.cold_started(route.tenant_name, route.model_name, route.target, result.cold_start_seconds)
        return result

    async def generate(self, route: Route, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        """The sequence, generated by one runtime, its events coming back on this gateway's reply
        stream. Queued, it must start by its deadline (a pool at zero: while a runtime starts);
        started, its runtime must not fall silent for longer than a claim takes. A runtime that
        dies mid-sequence leaves its message to another, which generates it again: a seed is set
        here when the request has none, so the second runtime repeats the same tokens, and the
        events already passed on are dropped by index. Closing the iterator early (a client that
        left) tells the runtime to free the sequence."""
        if request.params.seed is None:
            request = replace(request, params=replace(request.params, seed=random.getrandbits(63)))
        replies: asyncio.Queue[wire.ReplyMessage] = asyncio.Queue()
        now = time.time()
        deadline = now + self.request_timeout_s
        appending = False
        try:
            stream = await self._stream_for(route)
            message = wire.RequestMessage(
                request.request_id, self.reply_to, deadline, 1, route_fields(route), {}, enqueued_at=now,
                kind="generate", generation=request_to_json(request),
            )
            self._generating[request.request_id] = replies
            fields = [part for pair in message.to_fields().items() for part in pair]
            appending = True
            message_id = await self._append_bounded(keys=[stream], args=[self.max_queue_requests, *fields])
        except redis.RedisError as exc:
            self._generating.pop(request.request_id, None)
            if appending:  # as infer's: a runtime may generate it, its client told 503
                self._void(request.request_id)
            raise self._unreachable(exc) from None
        if message_id is None:
            self._generating.pop(request.request_id, None)
            self.observer.request_rejected(route.tenant_name, route.model_name)
            raise Overloaded(
                f"the queue for {route.model_name} v{route.version} is full ({self.max_queue_requests} requests)",
                retry_after=self.retry_after_s,
            )
        self._watch(route, +1)
        finished = False
        delivered, started = 0, False
        try:
            while True:
                wait = (
                    self.request_timeout_s + self.claim_idle_s
                    if started else max(0.0, deadline - time.time())
                )
                try:
                    reply = await asyncio.wait_for(replies.get(), wait)
                except TimeoutError:
                    if started:
                        raise DeadlineExceeded("the runtime generating this sequence stopped answering") from None
                    if stream == wire.pool_stream(route.target):
                        raise await self._gave_up_waiting_for_a_runtime(_Waiter(self._loop.create_future(), None, stream, message_id), route) from None
                    raise DeadlineExceeded("the generation waited in the queue past its deadline") from None
                if reply.kind == "error":
                    finished = True
                    raise error_for_code(reply.code, reply.message)
                started = True
                if reply.kind != "token":
                    continue
                index, event = event_from_json(reply.event)
                if index < delivered:
                    continue  # a runtime that took over generates the sequence again
                delivered = index + 1
                if event.finish_reason is not None:
                    finished = True
                yield event
                if finished:
                    return
        except LuminalError:
            # an error before any event is the client's whole answer: what a runtime generated is
            # not billed (after one, the sequence is billed for what it generated, however it ends)
            if delivered == 0:
                self._void(request.request_id)
            raise
        finally:
            self._generating.pop(request.request_id, None)
            self._watch(route, -1)
            if not finished:
                try:
                    await self.redis.xadd(wire.CANCEL_STREAM, {"request_id": request.request_id}, maxlen=10_000, approximate=True)
                except redis.RedisError as exc:
                    log.warning("could not cancel generation %s: %s", request.request_id, exc)

    async def _stream_for(self, route: Route) -> str:
        """Where the version's requests go now, decided again at most every WATCH_S (and by its
        watcher while requests wait): two Redis round trips saved on most requests."""
        decided = self._decided.get(route.version_id)
        if decided is not None and (
            route.version_id in self._watchers or self._loop.time() - decided[1] < WATCH_S
        ):
            return decided[0]
        return await self._place(route)

    async def _place(self, route: Route) -> str:
        """The version's stream once it is placed on a live runtime; its device type's pool
        stream while no runtime of that type lives."""
        own = wire.request_stream(route.version_id)
        if await self.placement.ensure(route, await self.redis.xlen(own)):
            stream = own
        else:
            stream = wire.pool_stream(route.target)
            if route.target not in self._pools:
                # the group from the first request on: its lag then counts every waiting request
                await _create_group(self.redis, stream)
                self._pools.add(route.target)
        self._decided[route.version_id] = (stream, self._loop.time())
        return stream

    def _watch(self, route: Route, change: int) -> None:
        """Counts a version's waiting requests; while there are any, a task keeps it placed."""
        _, waiting = self._watched.get(route.version_id, (route, 0))
        self._watched[route.version_id] = (route, waiting + change)
        if waiting == 0 and change > 0 and route.version_id not in self._watchers:
            task = self._loop.create_task(self._keep_placed(route.version_id), name=f"place-{route.version_id}")
            self._watchers[route.version_id] = task

    async def _keep_placed(self, version_id: int) -> None:
        """Every WATCH_S while requests wait: a dead runtime's versions go to a live one, a growing
        backlog spreads to one more runtime, and when no runtime of the version's device type lives
        any more (its pool went to zero), what waits in the version's stream moves to the pool
        stream, where a runtime that starts finds it."""
        try:
            while True:
                await asyncio.sleep(WATCH_S)
                route, waiting = self._watched[version_id]
                if waiting <= 0:
                    return
                try:
                    own = wire.request_stream(version_id)
                    stream = await self._place(route)
                    if stream != own and (moved := await self._move_to_pool(keys=[own, stream], args=[wire.RUNTIME_GROUP])):
                        log.warning("%s v%s: no %s runtime lives; %d queued requests moved to %s",
                                    route.model_name, route.version, route.target, moved, stream)
                except (redis.RedisError, LuminalError) as exc:
                    log.warning("placing %s v%s again failed: %s", route.model_name, route.version, exc)
        finally:
            self._watchers.pop(version_id, None)
            if self._watched.get(version_id, (None, 0))[1] <= 0:
                self._watched.pop(version_id, None)

    async def _wait(self, waiter: _Waiter, deadline: float, route: Route) -> InferenceResult:
        """The reply. Queued, the request gets 504 at its deadline; once its batch started, it
        waits for the run, and for a takeover if its runtime dies meanwhile."""
        while True:
            now = self._loop.time()
            if waiter.started is None:
                remaining = deadline - time.time()
            else:
                remaining = waiter.started + self.request_timeout_s + self.claim_idle_s - now
            if remaining <= 0:
                if waiter.started is not None:
                    raise DeadlineExceeded("the runtime running this request stopped answering")
                if waiter.stream == wire.pool_stream(route.target):
                    raise await self._gave_up_waiting_for_a_runtime(waiter, route)
                raise DeadlineExceeded("the request waited in the queue past its deadline")
            try:
                return await asyncio.wait_for(asyncio.shield(waiter.future), remaining)
            except TimeoutError:
                pass

    async def _gave_up_waiting_for_a_runtime(self, waiter: _Waiter, route: Route) -> NoRuntimeStarted:
        """A request that waited in the pool stream past its deadline leaves it, so that no runtime
        runs it later and no autoscaler starts one for it (a runtime that took it already drops
        it unrun: its deadline passed)."""
        try:
            await self.redis.xdel(waiter.stream, waiter.message_id)
        except redis.RedisError as exc:
            log.warning("removing an expired request from %s failed: %s", waiter.stream, exc)
        return NoRuntimeStarted(
            f"no {route.target} runtime started within the request's {self.request_timeout_s:g} s deadline: the pool "
            f"{waiter.stream} had none running when it arrived (scaled to zero, or no pool serves {route.target})",
            waited_for="runtime_start",
            device_type=route.target,
            pool=waiter.stream,
            waited_seconds=self.request_timeout_s,
        )

    async def _read_replies(self) -> None:
        last, trimmed = "$", "$"
        trimmed_at = self._loop.time()
        while True:
            try:
                replies = await self.redis.xread({self.reply_to: last}, count=500, block=1000)
            except redis.RedisError as exc:
                log.warning("reading replies failed (%s); retrying", exc)
                await asyncio.sleep(0.5)
                continue
            except asyncio.CancelledError:
                return
            for _stream, entries in replies or []:
                for message_id, fields in entries:
                    last = message_id
                    self._resolve(wire.ReplyMessage.from_fields(fields))
            # replies read are dropped in one command now and then, not one per read
            if last != trimmed and self._loop.time() - trimmed_at >= REPLY_TRIM_S:
                trimmed, trimmed_at = last, self._loop.time()
                try:
                    await self.redis.xtrim(self.reply_to, minid=last)
                except redis.RedisError:
                    pass  # trimmed by length anyway

    async def _beat(self) -> None:
        """Renews this gateway's liveness key: runtimes free the sequences of a gateway whose key
        expired (one killed with streams open sends no cancel for them)."""
        key = wire.gateway_key(self.reply_to)
        while True:
            try:
                await self.redis.set(key, self.gateway_id, ex=wire.GATEWAY_TTL_S)
            except redis.RedisError as exc:
                log.warning("renewing the gateway's liveness key failed: %s", exc)
            except asyncio.CancelledError:
                return
            try:
                await asyncio.sleep(wire.GATEWAY_BEAT_S)
            except asyncio.CancelledError:
                return

    def _resolve(self, reply: wire.ReplyMessage) -> None:
        generation = self._generating.get(reply.request_id)
        if generation is not None:
            generation.put_nowait(reply)
            return
        waiter = self._waiting.get(reply.request_id)
        if waiter is None or waiter.future.done():
            return  # answered already (a runtime that took over ran it again), or given up
        if reply.kind == "started":
            waiter.started = self._loop.time()
        elif reply.kind == "ok":
            waiter.future.set_result(
                InferenceResult(
                    reply.outputs,
                    reply.batch_size,
                    reply.batch_rows,
                    reply.exec_seconds,
                    reply.batch_exec_seconds,
                    reply.queue_seconds,
                    reply.cold_start_seconds,
                )
            )
        else:
            waiter.future.set_exception(error_for_code(reply.code, reply.message))

    def _void(self, request_id: str) -> None:
        """The request was answered with an error, never a 200, after it may have reached a runtime:
        its usage, recorded already or to come, is voided (written by _write_voids, off the
        request's path: the error is answered without waiting for the database)."""
        self._unbilled.add(request_id)
        self._voids_due.set()

    async def _write_voids(self) -> None:
        """Writes the voids of the requests answered with an error; those the database refuses
        (down, restarting) are kept and written again every VOID_RETRY_S."""
        while True:
            try:
                await self._voids_due.wait()
                self._voids_due.clear()
                await self._flush_voids()
            except asyncio.CancelledError:
                return
            except Exception as exc:  # noqa: BLE001  an outage of the database: the voids are kept
                log.warning("voiding %d requests answered with an error failed (%s); retrying", len(self._unbilled), exc)
                self._voids_due.set()
                try:
                    await asyncio.sleep(VOID_RETRY_S)
                except asyncio.CancelledError:
                    return

    async def _flush_voids(self) -> None:
        request_ids = sorted(self._unbilled)
        if request_ids:
            await asyncio.to_thread(self.ledger.void, request_ids)
            self._unbilled.difference_update(request_ids)

    async def _consume_usage(self) -> None:
        """Usage events to the ledger. Gateways share the work in one consumer group; an event
        is acknowledged once its record is written, and one a dead gateway held is taken over."""
        consumer, created, last_claim = self.gateway_id, False, 0.0
        while True:
            try:
                if not created:
                    try:
                        await self.redis.xgroup_create(wire.USAGE_STREAM, wire.LEDGER_GROUP, id="0", mkstream=True)
                    except redis.ResponseError as exc:
                        if "BUSYGROUP" not in str(exc):
                            raise
                    created = True
                entries = []
                if time.monotonic() - last_claim > self.claim_idle_s:
                    last_claim = time.monotonic()
                    _, claimed, _ = await self.redis.xautoclaim(
                        wire.USAGE_STREAM, wire.LEDGER_GROUP, consumer, int(self.claim_idle_s * 3000), "0-0", count=500
                    )
                    entries += [e for e in claimed if e[1]]
                read = await self.redis.xreadgroup(
                    wire.LEDGER_GROUP, consumer, {wire.USAGE_STREAM: ">"}, count=500, block=1000
                )
                entries += [e for _stream, got in read or [] for e in got]
                if not entries:
                    continue
                usages = [Usage(**json.loads(fields[b"usage"])) for _, fields in entries]
                await asyncio.to_thread(self.ledger.record, usages)
                ids = [message_id for message_id, _ in entries]
                async with self.redis.pipeline(transaction=False) as pipe:
                    pipe.xack(wire.USAGE_STREAM, wire.LEDGER_GROUP, *ids)
                    pipe.xdel(wire.USAGE_STREAM, *ids)
                    await pipe.execute()
                # let events gather: one write of many rather than a write and three round trips
                # per request; a record is never urgent
                await asyncio.sleep(LEDGER_LINGER_S)
            except asyncio.CancelledError:
                return
            except Exception as exc:  # noqa: BLE001  an outage of Redis or the database: the events wait in Redis
                created = created and "NOGROUP" not in str(exc)  # a restarted Redis lost the group
                log.warning("recording usage events failed (%s); retrying", exc)
                await asyncio.sleep(1.0)

    def forget(self, version_id: int) -> None:
        self._decided.pop(version_id, None)
        self._loop.create_task(self._forget(version_id))

    async def _forget(self, version_id: int) -> None:
        try:
            await self.placement.remove(version_id)
        except redis.RedisError as exc:
            log.warning("removing the queue of version %s failed: %s", version_id, exc)

    async def close(self) -> None:
        tasks = [*self._tasks, *self._watchers.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        try:
            await self._flush_voids()
        except Exception as exc:  # noqa: BLE001  the database down at the stop: the ids are logged, for an operator
            log.error("requests answered with an error could not be voided (%s); they may be billed: %s",
                      exc, " ".join(sorted(self._unbilled)))
        try:
            await self.redis.delete(self.reply_to, wire.gateway_key(self.reply_to))
        except redis.RedisError:
            pass
        await self.redis.aclose()


async def _create_group(client: aioredis.Redis, stream: str) -> None:
    try:
        await client.xgroup_create(stream, wire.RUNTIME_GROUP, id="0", mkstream=True)
    except redis.ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


def route_fields(route: Route) -> dict:
    return {name: getattr(route, name) for name in Route.__dataclass_fields__}
