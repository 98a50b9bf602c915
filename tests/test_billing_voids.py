"""A request answered with an error is never billed, even where a runtime ran it: the gateway
voids it (Ledger.void), and the ledger keeps no record of a voided request, whichever of the
record and the void comes first (SQLite and PostgreSQL, concurrently too)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
import redis
import redis.asyncio as aioredis
from sqlalchemy import select

from api.services import open_database
from benchmarks.reliability import PrivateRedis
from cloud.db import Database, UsageRecord, UsageVoid
from cloud.errors import NoRuntimeStarted, Unavailable
from cloud.metering import Ledger
from cloud.settings import Settings
from cloud.usage import Usage
from scheduler import wire
from scheduler.engine import Route
from scheduler.generator import GenerationRequest, SamplingParams
from scheduler.streams import StreamEngine, _create_group

ROUTE = Route(version_id=1, tenant_id=7, tenant_name="t", model_name="m", version=1, target="cpu",
              artifact_key="artifacts/m", batchable=True)


@pytest.fixture(params=["sqlite", "postgresql"])
def database(request, tmp_path: Path) -> Iterator[Database]:
    """As a server opens it: SQLite by create_all, a new PostgreSQL database by the migrations."""
    url = "" if request.param == "sqlite" else request.getfixturevalue("postgres_url")
    db = open_database(Settings(data_dir=tmp_path / "data", database_url=url))
    yield db
    db.dispose()


def usage(request_id: str, seconds: float = 0.002) -> Usage:
    return Usage(request_id, ROUTE.tenant_id, ROUTE.model_name, ROUTE.version, ROUTE.target, 1, 1, 1,
                 seconds, seconds, 0.5)


def billed(db: Database) -> set[str]:
    with db.session() as session:
        return set(session.scalars(select(UsageRecord.request_id)))


def voided(db: Database) -> set[str]:
    with db.session() as session:
        return set(session.scalars(select(UsageVoid.request_id)))


def test_a_void_deletes_the_record_written_before_it(database: Database) -> None:
    ledger = Ledger(database)
    kept, gone = uuid.uuid4().hex, uuid.uuid4().hex
    ledger.record([usage(kept, 0.001), usage(gone, 0.004)])
    ledger.void([gone])
    ledger.void([gone])  # voiding again changes nothing
    assert billed(database) == {kept} and voided(database) == {gone}
    [summary] = ledger.summary(ROUTE.tenant_id)
    assert summary["requests"] == 1 and summary["billed_seconds"] == pytest.approx(0.001)


def test_a_record_after_the_void_is_never_written(database: Database) -> None:
    ledger = Ledger(database)
    kept, gone = uuid.uuid4().hex, uuid.uuid4().hex
    ledger.void([gone])
    ledger.record([usage(gone), usage(kept)])
    ledger.record([usage(gone)])  # a runtime that took it over sends it again
    assert billed(database) == {kept} and voided(database) == {gone}
    assert [s["requests"] for s in ledger.summary(ROUTE.tenant_id)] == [1]


def test_records_and_voids_racing_leave_no_voided_request_billed(database: Database) -> None:
    """Gateways void while other gateways record the same requests' usage: each record batch
    and each void run at once from threads, in either order."""
    ledger = Ledger(database)
    ids = [uuid.uuid4().hex for _ in range(600)]
    gone = set(ids[::2])
    batches = [ids[i:i + 6] for i in range(0, len(ids), 6)]
    start = threading.Barrier(2)

    def record_all() -> None:
        start.wait()
        for batch in batches:
            ledger.record([usage(i) for i in batch])

    def void_all() -> None:
        start.wait()
        for batch in batches:
            ledger.void([i for i in batch if i in gone])

    with ThreadPoolExecutor(2) as pool:
        for done in [pool.submit(record_all), pool.submit(void_all)]:
            done.result()
    assert billed(database) == set(ids) - gone
    assert voided(database) == gone


# -- the gateway: a usage event for a request it answered with an error --


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A redis-server of this module's own: the gateway's streams have fixed names."""
    server = PrivateRedis(tmp_path_factory.mktemp("voids"))
    server.start()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture
def sqlite(tmp_path: Path) -> Iterator[Database]:
    db = open_database(Settings(data_dir=tmp_path / "data", database_url=""))
    yield db
    db.dispose()


class FakeRuntime:
    """Takes requests from the pool stream, as a runtime process does, and answers one the way
    runtime.process._finish does: its usage event and its reply, whenever the test says."""

    def __init__(self, client: aioredis.Redis) -> None:
        self.redis = client
        self.stream = wire.pool_stream(ROUTE.target)

    async def take(self) -> wire.RequestMessage:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            read = await self.redis.xreadgroup(wire.RUNTIME_GROUP, "fake", {self.stream: ">"}, count=1, block=100)
            for _stream, entries in read or []:
                return wire.RequestMessage.from_fields(entries[0][1])
        raise AssertionError("no request reached the pool stream")

    async def bill(self, message: wire.RequestMessage) -> None:
        await self.redis.xadd(wire.USAGE_STREAM, {"usage": json.dumps(asdict(usage(message.request_id)))})

    async def answer(self, message: wire.RequestMessage) -> None:
        reply = wire.ReplyMessage(message.request_id, "ok", batch_size=1, batch_rows=1, exec_seconds=0.002,
                                   batch_exec_seconds=0.002, outputs={"y": np.ones((1, 1))})
        await self.redis.xadd(message.reply_to, reply.to_fields())


async def _settled(engine: StreamEngine, client: aioredis.Redis) -> None:
    """Until every usage event is recorded (the consumer deletes them) and every void written."""
    deadline = time.monotonic() + 10
    while await client.xlen(wire.USAGE_STREAM) or engine._unbilled:
        assert time.monotonic() < deadline, "usage events or voids still waiting"
        await asyncio.sleep(0.05)


async def _gateway(redis_url: str, db: Database, scenario, request_timeout_s: float = 1.0) -> None:
    client = aioredis.Redis.from_url(redis_url)
    await client.flushdb()
    await _create_group(client, wire.pool_stream(ROUTE.target))
    engine = StreamEngine(redis_url, Ledger(db), max_queue_requests=100, max_batch_rows=4,
                          request_timeout_s=request_timeout_s, retry_after_s=1, claim_idle_s=2.0,
                          masked_redis_url=redis_url)
    try:
        await scenario(engine, FakeRuntime(client), db)
        await _settled(engine, client)
    finally:
        await engine.close()
        await client.aclose()


def _infer(engine: StreamEngine, request_id: str) -> asyncio.Task:
    return asyncio.ensure_future(engine.infer(ROUTE, {"x": np.ones((1, 1), np.float32)}, 1, request_id))


def test_a_request_answered_200_is_billed(redis_url: str, sqlite: Database) -> None:
    """The control: a usage event with its reply in time is a record."""
    request_id = uuid.uuid4().hex

    async def scenario(engine: StreamEngine, runtime: FakeRuntime, db: Database) -> None:
        asked = _infer(engine, request_id)
        message = await runtime.take()
        await runtime.bill(message)
        await runtime.answer(message)
        assert (await asked).batch_size == 1

    asyncio.run(_gateway(redis_url, sqlite, scenario))
    assert billed(sqlite) == {request_id} and not voided(sqlite)


@pytest.mark.parametrize("usage_first", [False, True], ids=["usage-after-the-error", "usage-before-the-error"])
def test_a_request_answered_at_its_deadline_while_its_runtime_ran_it_is_not_billed(
    redis_url: str, sqlite: Database, usage_first: bool
) -> None:
    """The deadline race: the runtime started the request just before its deadline and answers
    just after it (its "started" notice or its reply late, Redis restarting meanwhile); the
    gateway answered at the deadline (503: no start seen from the pool it waited in). Its usage
    event is recorded before the void or after."""
    request_id = uuid.uuid4().hex

    async def scenario(engine: StreamEngine, runtime: FakeRuntime, db: Database) -> None:
        asked = _infer(engine, request_id)
        message = await runtime.take()
        if usage_first:
            await runtime.bill(message)
            deadline = time.monotonic() + 5
            while request_id not in await asyncio.to_thread(billed, db):
                assert time.monotonic() < deadline, "the usage event was never recorded"
                await asyncio.sleep(0.02)
        with pytest.raises(NoRuntimeStarted):
            await asked
        if not usage_first:
            await runtime.bill(message)
        await runtime.answer(message)

    asyncio.run(_gateway(redis_url, sqlite, scenario))
    assert billed(sqlite) == set() and voided(sqlite) == {request_id}


def test_a_request_whose_append_answer_was_lost_is_answered_503_and_not_billed(
    redis_url: str, sqlite: Database
) -> None:
    """Redis killed after it appended the request and before its answer reached the gateway: the
    client is told 503, and a runtime runs the request once Redis is back."""
    request_id = uuid.uuid4().hex

    async def scenario(engine: StreamEngine, runtime: FakeRuntime, db: Database) -> None:
        append = engine._append_bounded

        async def appended_then_cut(*args, **kwargs):
            await append(*args, **kwargs)
            raise redis.ConnectionError("Connection closed by server.")

        engine._append_bounded = appended_then_cut
        with pytest.raises(Unavailable):
            await _infer(engine, request_id)
        message = await runtime.take()
        await runtime.bill(message)
        await runtime.answer(message)

    asyncio.run(_gateway(redis_url, sqlite, scenario))
    assert billed(sqlite) == set() and voided(sqlite) == {request_id}


def test_a_void_the_database_refused_is_written_once_it_is_back(redis_url: str, sqlite: Database) -> None:
    """The database down when the gateway answers at the deadline: the error is answered at once, the void
    kept and written again until the database takes it."""
    request_id = uuid.uuid4().hex

    async def scenario(engine: StreamEngine, runtime: FakeRuntime, db: Database) -> None:
        void, refusals = engine.ledger.void, []

        def down_twice(request_ids):
            if len(refusals) < 2:
                refusals.append(list(request_ids))
                raise Unavailable("the database is restarting")
            void(request_ids)

        engine.ledger.void = down_twice
        asked = _infer(engine, request_id)
        message = await runtime.take()
        with pytest.raises(NoRuntimeStarted):
            await asked
        await runtime.bill(message)
        await runtime.answer(message)
        deadline = time.monotonic() + 10
        while engine._unbilled:
            assert time.monotonic() < deadline, "the void was never written"
            await asyncio.sleep(0.05)
        assert refusals == [[request_id], [request_id]]

    asyncio.run(_gateway(redis_url, sqlite, scenario))
    assert billed(sqlite) == set() and voided(sqlite) == {request_id}


@pytest.mark.parametrize("cut", ["append-answer-lost", "no-event-by-the-deadline"])
def test_a_generation_answered_with_an_error_before_any_token_is_not_billed(
    redis_url: str, sqlite: Database, cut: str
) -> None:
    """The same for a sequence: its client told 503 (the append's answer lost, or no event by its
    deadline) before any token, and the runtime that generated it meanwhile billing it."""
    request_id = uuid.uuid4().hex

    async def scenario(engine: StreamEngine, runtime: FakeRuntime, db: Database) -> None:
        if cut == "append-answer-lost":
            append = engine._append_bounded

            async def appended_then_cut(*args, **kwargs):
                await append(*args, **kwargs)
                raise redis.ConnectionError("Connection closed by server.")

            engine._append_bounded = appended_then_cut
        events = engine.generate(ROUTE, GenerationRequest(request_id, [1, 2, 3], SamplingParams(max_tokens=4)))
        first = asyncio.ensure_future(anext(events))
        message = await runtime.take()
        with pytest.raises(Unavailable if cut == "append-answer-lost" else NoRuntimeStarted):
            await first
        await runtime.bill(message)

    asyncio.run(_gateway(redis_url, sqlite, scenario, request_timeout_s=0.5))
    assert billed(sqlite) == set() and voided(sqlite) == {request_id}
