"""Every role of the distributed mode killed under load, with nothing lost (issue 32, part 4):
the scenarios of benchmarks/reliability.py at the tests' durations (QUICK), one after another on
one stack of real processes (two workers, two runtimes, two gateways; a PostgreSQL and a Redis of
the stack's own, and moto's S3), as a chaos run goes. Each scenario sends 16 clients' requests,
compiles an upload, kills one role and checks every rule (benchmarks/reliability.py's judge)
before the dead role starts again: every request answered 200 or a JSON 429/503/504, never a 500
or a hang; the right outputs; one usage record per 200 and none twice; every upload compiled.

Each takes 15 to 20 s but the worker's (about 50 s), which waits for the broker to hand the killed
compile out again (LUMINAL_COMPILE_TIMEOUT_S + 20 s); the stack starts once, in about 20 s. The
last two tests, without the stack, are the regression tests of what the scenarios found."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from fastapi.testclient import TestClient

from api.main import create_app
from api.server import free_port
from benchmarks.reliability import QUICK, Outcome, PrivateRedis, Stack, Unavailable, run_scenario, table
from cloud.db import Database
from tests.conftest import auth, make_settings, upload
from tests.onnx_models import mlp
from worker.celery_app import compile_queue


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    try:
        with Stack.running(tmp_path_factory.mktemp("reliability"), QUICK) as running:
            yield running
    except Unavailable as exc:
        pytest.fail(str(exc))


def kept(stack: Stack, name: str) -> Outcome:
    """The scenario's outcome, once every rule held."""
    try:
        outcome = run_scenario(stack, name)
    except Unavailable as exc:
        pytest.fail(str(exc))
    assert not outcome.violations, f"logs in {stack.workdir}\n{table([outcome])}"
    return outcome


def after_kill(outcome: Outcome) -> list:
    return [a for a in outcome.answers if a.sent >= outcome.killed_at]


def test_a_runtime_killed_under_load_loses_no_request_and_bills_each_once(stack: Stack) -> None:
    outcome = kept(stack, "runtime")
    # the other runtime takes the model and the requests the dead one took: a few seconds of
    # waiting (its heartbeat expiring, the claim), and few failures
    assert sum(outcome.errors.values()) <= outcome.requests // 4, outcome.errors
    assert outcome.steady_s is not None and outcome.steady_s < 3 * QUICK.heartbeat_s + QUICK.claim_idle_s + 5


def test_a_worker_killed_mid_compile_has_its_compile_finished_by_another(stack: Stack) -> None:
    outcome = kept(stack, "worker")
    assert "the compile ended before the kill: nothing was tested" not in outcome.notes
    # inference never needed the worker
    assert not outcome.errors and outcome.first_ok_s is not None and outcome.first_ok_s < 1


def test_a_gateway_killed_under_load_sends_its_clients_to_the_other_and_bills_nothing_twice(stack: Stack) -> None:
    outcome = kept(stack, "gateway")
    # nothing but connection errors to the dead gateway, and its clients served by the other
    assert not outcome.errors, outcome.errors
    assert all(a.gateway == 0 for a in outcome.answers if a.status is None)
    assert any(a.status == 200 and a.gateway == 1 and a.client % 2 == 0 for a in after_kill(outcome))


def test_redis_restarted_under_load_answers_503_meanwhile_and_loses_nothing(stack: Stack) -> None:
    outcome = kept(stack, "redis")
    # (a request that waited out its deadline for a runtime to register again: 504 while running, 503 before)
    assert set(outcome.errors) <= {"503 unavailable", "503 no_runtime_started", "504 deadline_exceeded"}, outcome.errors


def test_postgres_restarted_under_load_answers_503_meanwhile_and_loses_nothing(stack: Stack) -> None:
    outcome = kept(stack, "postgres")
    assert set(outcome.errors) <= {"503 backend_unreachable", "503 unavailable"}, outcome.errors
    # the upload sent while the database was down was refused with 503 until it was back
    during = next(u for u in outcome.uploads if u.name == "postgres-upload-2")
    assert during.status == "ready" and all(r == "503 backend_unreachable" for r in during.refusals), during


def test_a_database_gone_away_is_a_503_naming_it_never_a_500(client, keys) -> None:
    """What the postgres scenario found: a request whose key or model had to be looked up while
    the database was down got a 500 (an unhandled OperationalError, its connection then closed by
    uvicorn), on the key check before the body as well as in the routes."""
    gone = Database(f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/gone")
    services = client.app.state.services
    services.auth.db = services.registry.db = gone
    try:
        infer = client.post("/v1/models/m/infer", headers=auth(keys["alice"]), json={"inputs": {"x": [[1.0]]}})
        listing = client.get("/v1/models", headers=auth(keys["bob"]))
    finally:
        gone.dispose()
    for reply in (infer, listing):
        assert reply.status_code == 503, reply.text
        error = reply.json()["error"]
        assert error["code"] == "backend_unreachable" and "the database at postgresql+psycopg://postgres@127.0.0.1:" in error["message"]


def test_an_upload_is_answered_once_the_broker_holds_its_compile(tmp_path: Path, keys) -> None:
    """What the gateway kill found: the compile of an upload answered 202 went to the broker from
    a thread moments later, so a gateway killed in between left it queued until some gateway
    started again. Now the answer waits for the send; with the broker known down, a second at
    most, the outbox keeping the job."""
    broker = PrivateRedis(tmp_path)
    settings = make_settings(tmp_path / "data", compile_backend="celery", redis_url=broker.url)
    with TestClient(create_app(settings)) as client:
        compiler = client.app.state.services.compiler
        upload(client, keys["alice"], "down", mlp(seed=1).SerializeToString())  # no broker: a try fails
        started = time.monotonic()
        upload(client, keys["alice"], "down-too", mlp(seed=2).SerializeToString())
        # the broker is known to be down: the outbox keeps the job, the upload waits a second at most
        assert time.monotonic() - started < 2.5 and compiler.pending() == 2
        broker.start()
        queued = redis.Redis.from_url(broker.url)
        try:
            # an upload wakes the outbox, which sends what it kept once the broker answers
            upload(client, keys["alice"], "up", mlp(seed=3).SerializeToString())
            deadline = time.monotonic() + 20
            while compiler.pending() and time.monotonic() < deadline:
                time.sleep(0.05)
            assert queued.llen(compile_queue("cpu")) == 3
            # the broker up, and the send slow (a busy gateway): the answer comes once the
            # broker holds the compile, not before
            send = compiler.app.send_task
            compiler.app.send_task = lambda *args, **kwargs: time.sleep(0.5) or send(*args, **kwargs)
            upload(client, keys["alice"], "up-too", mlp(seed=4).SerializeToString())
            assert queued.llen(compile_queue("cpu")) == 4
        finally:
            queued.close()
            broker.stop()
