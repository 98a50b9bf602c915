"""A runtime process (`luminal-cloud runtime --device cpu`): serves the requests queued on the
Redis streams of the model versions placed on it, and on its device type's pool stream.

It announces itself and its capacity with heartbeats; reads its versions' streams and the pool
stream (requests that arrived while no runtime of its type lived: any version, loaded on demand)
in consumer groups shared with the other runtimes, batching with the one policy
(scheduler.policy); loads artifacts from the object store on first use; answers each request on
its gateway's reply stream; and emits one usage event per executed request. A request's message
is acknowledged in the same transaction as its usage event and reply, so a runtime killed before
that leaves the message to another runtime, which claims it: nothing is lost, and the ledger,
idempotent by request id, never bills twice. On SIGTERM it withdraws its announcement first (no
new request is sent its way), runs what it has taken, and exits.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import redis

from cloud.errors import DeadlineExceeded, LuminalError
from cloud.usage import Usage
from runtime.runtime import Runtime
from scheduler import wire
from scheduler.engine import InferenceResult, Route, run_isolating, run_priced
from scheduler.observer import NO_OBSERVER, SchedulerObserver
from scheduler.policy import BatchPolicy, BatchQueue, Pending
from scheduler.pricing import price_for

if TYPE_CHECKING:
    from scheduler.generating import GenerationService

log = logging.getLogger(__name__)

# how often a runtime looks for versions newly placed on it: the wait of a new version's first
# request, and the longest an idle runtime blocks reading
ASSIGNMENT_CHECK_S = 0.2
# a request is told its batch started only when its deadline is nearer than this (plus a few
# batch times) or the batch may be slow (a cold start, a first run): its gateway then waits for
# the run instead of answering 504 while it runs. Any other request's answer comes long before
# its deadline, and a "started" message for each would cost a round trip on both sides.
STARTED_NOTICE_S = 2.0
# on a stop, how long the sequences under way may run to their end before the runtime exits
# (one that is cut is generated again by another runtime)
DRAIN_GENERATION_S = 60.0
# how often, at most, a runtime looks whether the gateway of the sequences it generates still
# lives (its liveness key, scheduler.wire.gateway_key): one EXISTS per gateway and interval
GATEWAY_CHECK_S = 0.5


# acknowledges the answered entries ARGV[2..] of a pool stream (KEYS[1]) in its group (ARGV[1]),
# then trims what is answered from its head rather than deleting them one by one: XDEL's
# tombstones make Redis report the group's lag as unknown, and that lag is what autoscalers
# (KEDA's redis-streams trigger) start runtimes on
ACK_AND_TRIM = """
redis.call('XACK', KEYS[1], ARGV[1], unpack(ARGV, 2))
local oldest = redis.call('XPENDING', KEYS[1], ARGV[1])[2]
if not oldest then
  for _, group in ipairs(redis.call('XINFO', 'GROUPS', KEYS[1])) do
    local info = {}
    for i = 1, #group, 2 do info[group[i]] = group[i + 1] end
    if info['name'] == ARGV[1] then
      local ms, seq = string.match(info['last-delivered-id'], '(%d+)-(%d+)')
      oldest = ms .. '-' .. (tonumber(seq) + 1)
    end
  end
end
if oldest then redis.call('XTRIM', KEYS[1], 'MINID', oldest) end
return 1
"""


@dataclass
class Taken:
    """A request read from a stream and waiting in this runtime's batch queue."""

    stream: str
    message_id: bytes
    message: wire.RequestMessage
    # seconds it waited in its pool stream for a runtime to start (0 from a version's stream)
    waited_for_runtime: float = 0.0

    @property
    def inputs(self):
        return self.message.inputs


@dataclass(frozen=True)
class RuntimeConfig:
    device: str
    heartbeat_s: float
    claim_idle_s: float
    max_batch_rows: int
    max_delay_s: float
    adaptive_batching: bool
    prices: dict[str, float]


class RuntimeProcess:
    def __init__(
        self,
        client: redis.Redis,
        runtime: Runtime,
        config: RuntimeConfig,
        observer: SchedulerObserver = NO_OBSERVER,
        generation: Callable[[], GenerationService] | None = None,
    ) -> None:
        if runtime.memory_budget_bytes is None:
            raise ValueError("a runtime process needs a memory budget: placement reads it from the heartbeat")
        self.redis = client
        self.runtime = runtime
        self.config = config
        self.observer = observer
        self.runtime_id = f"{config.device}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.pool = wire.pool_stream(config.device)
        # (stream, version id) -> the requests taken from it: a pool stream holds many versions
        self._queues: dict[tuple[str, int], BatchQueue] = {}
        self._streams: list[str] = []
        self._stopping = threading.Event()
        self._last_claim = 0.0
        self._last_assignment_check = 0.0
        # what autoscalers read in the heartbeat: requests taken and not yet answered, and when
        # one was last taken or answered (wall clock)
        self._running = 0
        self._last_active = time.time()
        # when it began serving (wall clock)
        self._serving_since = float("inf")
        self._ack_and_trim = self.redis.register_script(ACK_AND_TRIM)
        # generation: sequences this runtime generates (request id -> its message), and where it
        # has read the cancels up to
        # made on the first sequence (its modules too): a runtime of inference models starts without them
        self._make_generation = generation
        self.generation: GenerationService | None = None
        self._generating: dict[str, Taken] = {}
        self._generating_lock = threading.Lock()
        self._cancels_read = "$"
        # reply stream -> when its gateway's liveness key was last looked at (monotonic), and the
        # gateways seen alive: only these are taken for dead when their key is gone (a gateway
        # that never announced itself, of an older release, is never)
        self._gateway_checked: dict[str, float] = {}
        self._gateways_seen: set[str] = set()

    # -- announcing --
    def announce(self) -> None:
        info = {
            "device": self.config.device,
            # the budget the runtime evicts by is the one gateways place by
            "memory_budget_bytes": self.runtime.memory_budget_bytes,
            "loaded_bytes": self.runtime.loaded_bytes,
            "loaded": json.dumps(self.runtime.loaded_keys),
            "streams": len(self._streams),
            "pid": os.getpid(),
            "held": self.held,
            "last_active": self._last_active,
        }
        key = wire.heartbeat_key(self.runtime_id)
        with self.redis.pipeline() as pipe:
            pipe.hset(key, mapping=info)
            pipe.expire(key, max(1, round(3 * self.config.heartbeat_s)))
            pipe.sadd(wire.RUNTIMES, self.runtime_id)
            pipe.execute()

    @property
    def held(self) -> int:
        """Requests taken and not yet answered."""
        generating = self.generation.active() if self.generation is not None else 0
        return sum(len(queue) for queue in list(self._queues.values())) + self._running + generating

    def beat(self) -> None:
        """Scale to zero, then announce: models idle past the runtime's idle_unload_s leave device
        memory first, so the heartbeat names only what is still loaded."""
        self.runtime.unload_idle()
        if self.generation is not None:
            self.generation.unload_idle()
            self._keep_generations_claimed()
            self._free_orphans()
        self.announce()

    def _heartbeat_loop(self) -> None:
        while not self._stopping.wait(self.config.heartbeat_s):
            try:
                self.beat()
            except redis.RedisError as exc:
                log.warning("heartbeat failed: %s", exc)

    def withdraw(self) -> None:
        """Leaves the placements at once, so gateways place this runtime's models elsewhere."""
        assigned = self.redis.smembers(wire.assigned_key(self.runtime_id))
        with self.redis.pipeline() as pipe:
            for version in assigned:
                pipe.srem(wire.placement_key(int(version)), self.runtime_id)
            pipe.delete(wire.assigned_key(self.runtime_id), wire.heartbeat_key(self.runtime_id))
            pipe.srem(wire.RUNTIMES, self.runtime_id)
            pipe.execute()

    # -- reading --
    def refresh_streams(self) -> None:
        versions = sorted(int(v) for v in self.redis.smembers(wire.assigned_key(self.runtime_id)))
        streams = [self.pool, *(wire.request_stream(v) for v in versions)]
        for stream in set(streams) - set(self._streams):
            try:
                self.redis.xgroup_create(stream, wire.RUNTIME_GROUP, id="0", mkstream=True)
            except redis.ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise
        gone = set(self._streams) - set(streams)
        with self._generating_lock:
            ended = [t for t in self._generating.values() if t.stream in gone]
        for taken in ended:  # the model was deleted: its sequences end at their next step
            if self.generation is not None:
                self.generation.cancel(int(taken.message.route["version_id"]), taken.message.request_id)
        for key in [key for key in self._queues if key[0] in gone]:
            # unplaced (its model was deleted): what it still holds is answered, not dropped
            for pending in self._queues.pop(key).expired(float("inf")):
                self._answer_error(pending.payload, "unavailable", "the model was removed while the request was queued")
        self._streams = streams

    def _policy(self) -> BatchPolicy:
        return BatchPolicy(
            self.config.max_batch_rows,
            self.config.max_delay_s,
            max_queue_requests=1 << 30,
            adaptive=self.config.adaptive_batching,
        )

    def _read(self, block_s: float) -> list[tuple[str, bytes, dict]]:
        if not self._streams:
            self._stopping.wait(min(block_s, self.config.heartbeat_s))
            return []
        try:
            replies = self.redis.xreadgroup(
                wire.RUNTIME_GROUP,
                self.runtime_id,
                {stream: ">" for stream in self._streams},
                count=self.config.max_batch_rows,
                block=max(1, int(block_s * 1000)),
            )
        except redis.ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            self._streams = []  # a stream was deleted under us: read the assignments again
            return []
        return [(stream.decode(), message_id, fields) for stream, entries in replies or [] for message_id, fields in entries]

    def _claim_orphans(self) -> list[tuple[str, bytes, dict]]:
        """Messages a dead runtime took and never answered."""
        taken = []
        for stream in self._streams:
            _, entries, _ = self.redis.xautoclaim(
                stream, wire.RUNTIME_GROUP, self.runtime_id, int(self.config.claim_idle_s * 1000), "0-0", count=100
            )
            taken += [(stream, message_id, fields) for message_id, fields in entries if fields]
        if taken:
            log.warning("took over %d requests of a runtime that stopped answering", len(taken))
        return taken

    def _accept(self, stream: str, message_id: bytes, fields: dict) -> None:
        message = wire.RequestMessage.from_fields(fields)
        if message.kind == "generate":
            self._start_generation(Taken(stream, message_id, message))
            return
        wall = self._last_active = time.time()
        # a request queued before this runtime served waited for a runtime to start: its cold start
        waited = wall - message.enqueued_at if stream == self.pool and 0 < message.enqueued_at < self._serving_since else 0.0
        taken = Taken(stream, message_id, message, waited)
        now = time.monotonic()
        remaining = message.deadline - wall
        pending = Pending(
            message.request_id,
            message.rows,
            now,
            now + remaining,
            taken,
            shape_key=tuple((name, x.shape[1:]) for name, x in sorted(message.inputs.items())),
        )
        key = (stream, int(message.route["version_id"]))
        self._queues.setdefault(key, BatchQueue(self._policy())).submit(pending, now)

    # -- executing --
    def step(self) -> None:
        """One turn: read what arrived (waiting at most until a batch is due), run due batches."""
        now = time.monotonic()
        wake = [w for q in self._queues.values() if (w := q.wake_at(now)) is not None]
        block_s = min([ASSIGNMENT_CHECK_S, *(max(0.0, w - now) for w in wake)])
        entries = self._read(block_s) if block_s > 0 or not wake else []
        if now - self._last_assignment_check >= ASSIGNMENT_CHECK_S:
            self._last_assignment_check = now
            self.refresh_streams()
        if now - self._last_claim >= self.config.claim_idle_s / 2:
            self._last_claim = now
            entries += self._claim_orphans()
        for stream, message_id, fields in entries:
            self._accept(stream, message_id, fields)
        if self._generating:
            self._read_cancels()
        now = time.monotonic()
        for queue in list(self._queues.values()):
            for pending in queue.expired(now):
                # never run, never billed: the gateway answers 504
                self._answer_error(pending.payload, DeadlineExceeded.code, "the request waited in the queue past its deadline")
            while (batch := queue.take_batch(now)) is not None:
                self._execute(batch, busy=len(queue) > 0)

    def _execute(self, batch: list[Pending], busy: bool = False) -> None:
        self._running = len(batch)
        try:
            self._execute_batch(batch, busy)
        finally:
            self._running = 0
            self._last_active = time.time()

    def _execute_batch(self, batch: list[Pending], busy: bool) -> None:
        started = time.monotonic()
        route = Route(**batch[0].payload.message.route)
        queue = self._queues[(batch[0].payload.stream, route.version_id)]
        if queue.batch_seconds is None or route.artifact_key not in self.runtime.loaded_keys:
            notify = batch
        else:
            notify = [p for p in batch if p.deadline - started < STARTED_NOTICE_S + 4 * queue.batch_seconds]
        if notify:
            with self.redis.pipeline(transaction=False) as pipe:
                for pending in notify:
                    reply = wire.ReplyMessage(pending.request_id, "started")
                    pipe.xadd(pending.payload.message.reply_to, reply.to_fields(), maxlen=100_000, approximate=True)
                pipe.execute()

        def run(part: list[Pending]) -> list[tuple[InferenceResult, Usage]]:
            results, usages = run_priced(self.runtime, self.config.prices, route, part, self.observer, busy)
            return list(zip(results, usages))

        outcomes = run_isolating(run, batch, route.model_name)
        ran = [o[0].batch_exec_seconds for _, o in outcomes if not isinstance(o, BaseException)]
        if ran:
            queue.record_execution(max(ran))
        answers: list[tuple[Taken, wire.ReplyMessage, Usage | None]] = []
        for pending, outcome in outcomes:
            taken: Taken = pending.payload
            if isinstance(outcome, BaseException):
                code = outcome.code if isinstance(outcome, LuminalError) else "internal_error"
                message = outcome.message if isinstance(outcome, LuminalError) else f"internal error ({type(outcome).__name__})"
                answers.append((taken, wire.ReplyMessage(taken.message.request_id, "error", code=code, message=message), None))
                continue
            result, usage = outcome
            cold_start = taken.waited_for_runtime + result.cold_start_seconds
            if cold_start:
                log.info("cold start of %s v%s: %.3f s waiting for a runtime, %.3f s loading; ran in %.4f s",
                         route.model_name, route.version, taken.waited_for_runtime, result.cold_start_seconds,
                         result.batch_exec_seconds)
            reply = wire.ReplyMessage(
                pending.request_id,
                "ok",
                batch_size=result.batch_size,
                batch_rows=result.batch_rows,
                exec_seconds=result.exec_seconds,
                batch_exec_seconds=result.batch_exec_seconds,
                queue_seconds=started - pending.enqueued_at,
                cold_start_seconds=cold_start,
                outputs=result.outputs,
            )
            answers.append((taken, reply, usage))
        self._finish(answers)

    def _finish(self, answers: list[tuple[Taken, wire.ReplyMessage, Usage | None]]) -> None:
        """Each request's usage event, reply and acknowledgement, all or none; a batch's in one
        transaction, one round trip."""
        with self.redis.pipeline(transaction=True) as pipe:
            for taken, reply, usage in answers:
                if usage is not None:
                    pipe.xadd(wire.USAGE_STREAM, {"usage": json.dumps(asdict(usage))})
                pipe.xadd(taken.message.reply_to, reply.to_fields(), maxlen=100_000, approximate=True)
                if taken.stream == self.pool:
                    self._ack_and_trim(keys=[self.pool], args=[wire.RUNTIME_GROUP, taken.message_id], client=pipe)
                else:
                    pipe.xack(taken.stream, wire.RUNTIME_GROUP, taken.message_id)
                    pipe.xdel(taken.stream, taken.message_id)
            pipe.execute()
        self._last_active = time.time()

    def _answer_error(self, taken: Taken, code: str, message: str) -> None:
        self._finish([(taken, wire.ReplyMessage(taken.message.request_id, "error", code=code, message=message), None)])

    # -- generating --
    def _start_generation(self, taken: Taken) -> None:
        """Starts a sequence on this runtime; its events go back as "token" replies, the last
        with its usage event and the message's acknowledgement in one transaction."""
        from scheduler.generating import generation_usage
        from scheduler.generator import GenerationRefused, TokenEvent, event_to_json, request_from_json

        message = taken.message
        if self.generation is None and self._make_generation is not None:
            self.generation = self._make_generation()
        if self.generation is None:
            self._answer_error(taken, "unavailable", "this runtime does not generate")
            return
        if message.deadline < time.time():
            self._answer_error(taken, DeadlineExceeded.code, "the generation waited in the queue past its deadline")
            return
        route = Route(**message.route)
        request = request_from_json(message.request_id, message.generation)
        self.redis.xadd(message.reply_to, wire.ReplyMessage(message.request_id, "started").to_fields(), maxlen=100_000, approximate=True)
        with self._generating_lock:
            self._generating[message.request_id] = taken
        price = price_for(route.target, self.config.prices)
        index = 0

        def sink(event: TokenEvent) -> None:
            nonlocal index
            reply = wire.ReplyMessage(message.request_id, "token", event=event_to_json(index, event))
            index += 1
            if event.finish_reason is None:
                if self._gateway_gone(message.reply_to):
                    self._cancel_for(message.reply_to)
                self.redis.xadd(message.reply_to, reply.to_fields(), maxlen=100_000, approximate=True)
                return
            with self._generating_lock:
                self._generating.pop(message.request_id, None)
            if event.finish_reason == "cancelled" and self._stopping.is_set():
                return  # cut by this runtime's stop: left unacknowledged, another generates it
            usage = generation_usage(route, message.request_id, event.usage, price) if event.usage else None
            self._finish([(taken, reply, usage)])
            if event.usage is not None:
                used = event.usage
                self.observer.generation_finished(
                    route.tenant_name, route.model_name, route.target,
                    used.prompt_tokens, used.completion_tokens, used.billed_seconds,
                )

        try:
            self.generation.start(route, request, sink)
        except (LuminalError, GenerationRefused, FileNotFoundError) as exc:
            with self._generating_lock:
                self._generating.pop(message.request_id, None)
            code = exc.code if isinstance(exc, LuminalError) else "invalid_request" if isinstance(exc, GenerationRefused) else "unavailable"
            self._answer_error(taken, code, exc.message if isinstance(exc, LuminalError) else str(exc))
        self._last_active = time.time()

    def _read_cancels(self) -> None:
        """Frees the sequences whose clients left (their gateways said so on the cancel stream)."""
        read = self.redis.xread({wire.CANCEL_STREAM: self._cancels_read}, count=1000)
        for _stream, entries in read or []:
            for message_id, fields in entries:
                self._cancels_read = message_id
                request_id = fields.get(b"request_id", b"").decode()
                with self._generating_lock:
                    taken = self._generating.get(request_id)
                if taken is not None and self.generation is not None:
                    self.generation.cancel(int(taken.message.route["version_id"]), request_id)

    def _gateway_gone(self, reply_to: str) -> bool:
        """Whether the gateway a sequence's replies go to died (its liveness key expired: killed
        with its streams open, it never sends their cancels); looked up at most every
        GATEWAY_CHECK_S per gateway, and only ever true for a gateway seen alive before."""
        now = time.monotonic()
        if now - self._gateway_checked.get(reply_to, float("-inf")) < GATEWAY_CHECK_S:
            return False
        self._gateway_checked[reply_to] = now
        if self.redis.exists(wire.gateway_key(reply_to)):
            self._gateways_seen.add(reply_to)
            return False
        return reply_to in self._gateways_seen

    def _cancel_for(self, reply_to: str) -> None:
        """Frees every sequence whose replies go to a dead gateway, as if its client had left:
        nobody reads them. Each ends at its next step, billed for what it generated."""
        with self._generating_lock:
            orphans = [t for t in self._generating.values() if t.message.reply_to == reply_to]
        if orphans and self.generation is not None:
            log.warning("the gateway of %d sequences (%s) is gone: freeing them", len(orphans), reply_to)
            for taken in orphans:
                self.generation.cancel(int(taken.message.route["version_id"]), taken.message.request_id)

    def _free_orphans(self) -> None:
        """At each heartbeat: the sequences of dead gateways, those that emit no tokens (waiting for
        the KV cache) too."""
        with self._generating_lock:
            gateways = {t.message.reply_to for t in self._generating.values()}
        for reply_to in gateways:
            if self._gateway_gone(reply_to):
                self._cancel_for(reply_to)

    def _keep_generations_claimed(self) -> None:
        """A sequence can outlive the claim time: its message is claimed again by this runtime
        (its idle time reset), so that no other runtime takes over a sequence still generating."""
        with self._generating_lock:
            held = list(self._generating.values())
        if not held:
            return
        with self.redis.pipeline(transaction=False) as pipe:
            for taken in held:
                pipe.xclaim(taken.stream, wire.RUNTIME_GROUP, self.runtime_id, 0, [taken.message_id], justid=True)
            pipe.execute()

    # -- running --
    def serve(self) -> None:
        self.announce()
        self.refresh_streams()
        heartbeat = threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True)
        heartbeat.start()
        self._serving_since = time.time()
        up = seconds_since_process_start()
        log.info("runtime %s serving device %s%s", self.runtime_id, self.config.device,
                 f" ({up:.2f} s after its process started)" if up is not None else "")
        try:
            while not self._stopping.is_set():
                try:
                    self.step()
                except redis.RedisError as exc:
                    log.warning("Redis unreachable (%s); retrying", exc)
                    self._stopping.wait(1.0)
            # gone from the placements first, so that gateways send nothing more this way while
            # what was taken runs
            heartbeat.join(timeout=5.0)
            self._withdraw_quietly()
            self._drain()
        finally:
            self._stopping.set()
            self._withdraw_quietly()

    def _withdraw_quietly(self) -> None:
        try:
            self.withdraw()
        except redis.RedisError:
            pass  # the heartbeat expires on its own

    def _drain(self) -> None:
        """On a stop: what this runtime took runs now, rather than waiting to be claimed; the
        sequences it generates finish (for at most DRAIN_GENERATION_S), the rest are taken over."""
        for queue in self._queues.values():
            while (batch := queue.take_batch(float("inf"))) is not None:
                self._execute(batch)
        if self.generation is not None:
            deadline = time.monotonic() + DRAIN_GENERATION_S
            while self._generating and time.monotonic() < deadline:
                try:
                    self._read_cancels()
                except redis.RedisError:
                    pass
                time.sleep(0.05)
            self.generation.close()

    def stop(self, *_: object) -> None:
        self._stopping.set()


def seconds_since_process_start() -> float | None:
    """How long ago this process was started (interpreter, imports, connecting), from Linux's
    /proc at its 10 ms resolution; None elsewhere."""
    try:
        started_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return max(0.0, uptime - started_ticks / os.sysconf("SC_CLK_TCK"))

