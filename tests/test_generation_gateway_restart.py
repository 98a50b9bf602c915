"""A gateway SIGKILLed while it streams generations (distributed mode, real processes: a Celery
compile worker, one `luminal-cloud runtime`, the gateway as its own `luminal-cloud serve`).

No cancel is ever sent for the streams it held (a client that leaves is another case: its gateway
publishes the cancel). The clients' connections close: each stream ends with a read error and
no `[DONE]`, never a hang. The runtime frees the orphaned sequences within a bound: it sees the
gateway's liveness key (scheduler.wire.gateway_key, renewed by every gateway) expire and cancels
the sequences whose replies went to it, as if their clients had left, instead of generating them
to max_tokens into a reply stream nobody reads.

A new gateway on the same settings serves at once: a streamed greedy completion equals the
answered one, and the runtime holds nothing afterwards.

The usage ledger: each killed stream is recorded exactly once (its usage event is emitted by the
runtime when the cancelled sequence ends, and the new gateway's ledger consumer writes it), for
its prompt and the tokens generated before the cancel, fewer than max_tokens: what the runtime
really computed, as for a client that leaves (before the fix each ran to max_tokens, 120 here,
and was billed for it). The requests after the restart are answered whole.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import redis
from sqlalchemy import select

from api.services import open_database
from cloud.db import UsageRecord
from scheduler import wire
from tests.conftest import auth
from tests.processes import ServiceProcess, flushed_redis, free_port, settings_env
from tests.test_distributed import Stack, distributed_settings, runtime_id, wait_until
from tests.test_generation_distributed import MANIFEST, codec, deploy_tiny_gpt2, held_by

REDIS_DB = 15  # (test_generation_distributed.py's: the suite runs one test at a time)
MAX_TOKENS = 120  # the tiny GPT-2 has 128 positions
STREAMS = 3


@pytest.fixture
def redis_url() -> Iterator[str]:
    yield from flushed_redis(REDIS_DB)


class Gateway(ServiceProcess):
    """`luminal-cloud serve --port N` with the distributed settings as environment variables."""

    def __init__(self, stack: Stack, log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self.ready_text = "Application startup complete"
        env = settings_env(stack.settings) | {"LUMINAL_REQUEST_TIMEOUT_S": str(stack.settings.request_timeout_s)}
        with open(log, "ab") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "luminal_cloud.cli", "serve", "--port", str(self.port)],
                env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            )
        stack.processes.append(self)
        self.wait_ready()


def usage_records(settings, request_ids: list[str]) -> dict[str, list[tuple[int, int]]]:
    db = open_database(settings)
    try:
        with db.session() as session:
            rows = session.scalars(select(UsageRecord).where(UsageRecord.request_id.in_(request_ids)))
            found: dict[str, list[tuple[int, int]]] = {}
            for row in rows:
                found.setdefault(row.request_id, []).append((row.prompt_tokens, row.completion_tokens))
            return found
    finally:
        db.dispose()


def test_a_gateway_killed_mid_stream_frees_its_sequences_and_a_new_one_serves(tmp_path, redis_url) -> None:
    stack = Stack(distributed_settings(tmp_path / "data", redis_url, compile_timeout_s=120.0), tmp_path)
    watcher = redis.Redis.from_url(redis_url)
    try:
        stack.worker()
        runtime = stack.runtime()
        rid = runtime_id(runtime)
        gateway = Gateway(stack, tmp_path / "gateway-1.log")
        with httpx.Client(base_url=gateway.url, headers=auth(stack.key), timeout=120) as http:
            deploy_tiny_gpt2(http)
            # loaded and warm before the streams that matter
            warm = http.post("/v1/completions", json={"model": "tiny-gpt2", "prompt": "The", "max_tokens": 4})
            assert warm.status_code == 200, warm.text

        # a few long streams, a couple of chunks read from each; the runtime is frozen where it
        # is (the tiny model would otherwise generate the whole context in well under a second),
        # the gateway is killed, its liveness key expires, and the runtime goes on
        gateway_keys = watcher.keys(wire.gateway_key(wire.reply_stream("*")))
        assert len(gateway_keys) == 1, gateway_keys
        body = {"model": "tiny-gpt2", "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True}
        read_two = threading.Barrier(STREAMS + 1)
        killed = threading.Event()

        def orphan(i: int) -> tuple[str, str, float]:
            with httpx.stream(
                "POST", f"{gateway.url}/v1/completions", headers=auth(stack.key),
                json=body | {"prompt": f"The dog {i}"}, timeout=httpx.Timeout(30.0),
            ) as response:
                assert response.status_code == 200
                lines = response.iter_lines()
                try:
                    for _ in range(2):
                        assert next(line for line in lines if line.startswith("data:")) != "data: [DONE]"
                finally:
                    read_two.wait(30)
                killed.wait(30)
                started = time.monotonic()
                try:
                    rest = [line for line in lines if line.startswith("data:")]
                    outcome = "ended" if rest and rest[-1] == "data: [DONE]" else "cut"
                except httpx.HTTPError as exc:  # the connection closed mid-response
                    outcome = type(exc).__name__
                return response.headers["X-Request-Id"], outcome, time.monotonic() - started

        with ThreadPoolExecutor(STREAMS) as pool:
            futures = [pool.submit(orphan, i) for i in range(STREAMS)]
            read_two.wait(60)
            runtime.signal(signal.SIGSTOP)
            gateway.kill()
            killed_at = time.monotonic()
            killed.set()
            ended = [future.result() for future in futures]
        killed_ids = [request_id for request_id, _, _ in ended]
        outcomes = [outcome for _, outcome, _ in ended]
        # no [DONE]: each client sees its stream cut, at once, not after a timeout
        assert all(outcome not in ("ended", "cut") for outcome in outcomes), outcomes
        assert all(seconds < 5 for _, _, seconds in ended), ended
        wait_until(lambda: not watcher.exists(*gateway_keys), wire.GATEWAY_TTL_S + 5, "the gateway key did not expire")
        expired_after = time.monotonic() - killed_at
        runtime.signal(signal.SIGCONT)
        resumed_at = time.monotonic()

        # the runtime frees the orphaned sequences: none is generated to max_tokens unread
        # (its heartbeat key expired while it was frozen: held counts once it is announced again)
        def usage_events() -> dict[str, dict]:
            return {
                (u := json.loads(fields[b"usage"]))["request_id"]: u
                for _, fields in watcher.xrange(wire.USAGE_STREAM)
            }

        wait_until(
            lambda: watcher.exists(wire.heartbeat_key(rid)) and held_by(watcher, rid) == 0
            and set(killed_ids) <= set(usage_events()),
            30, "the runtime kept the orphaned sequences",
        )
        freed_after = time.monotonic() - resumed_at
        events = usage_events()
        generated = {i: events[i]["completion_tokens"] for i in killed_ids if i in events}
        print(f"\nthe gateway key expired {expired_after:.2f} s after the kill; the runtime, resumed, freed the "
              f"sequences in {freed_after:.2f} s; tokens generated per orphaned sequence: {generated}; "
              f"client outcomes: {outcomes}")
        assert set(generated) == set(killed_ids), generated
        assert all(tokens < MAX_TOKENS for tokens in generated.values()), generated
        assert "is gone: freeing them" in runtime.text()

        # a new gateway on the same settings serves at once
        second = Gateway(stack, tmp_path / "gateway-2.log")
        ai = openai.OpenAI(base_url=f"{second.url}/v1", api_key=stack.key, max_retries=0, timeout=60)
        case = MANIFEST["models"]["gpt2"]["greedy"][3]
        greedy = {"temperature": 0, "max_tokens": 32, "extra_body": {"min_tokens": 32}}
        answer = ai.completions.create(model="tiny-gpt2", prompt=case["prompt_text"], **greedy)
        assert answer.choices[0].text == codec().decode(case["generated_ids"])
        streamed = ai.completions.create(model="tiny-gpt2", prompt=case["prompt_text"], stream=True, **greedy)
        chunks = list(streamed)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == answer.choices[0].text
        wait_until(lambda: held_by(watcher, rid) == 0, 10, "the runtime holds a sequence after the restart")
        ai.close()

        # the ledger: each killed stream once, for what was generated; the later requests whole
        wait_until(
            lambda: set(usage_records(stack.settings, killed_ids)) == set(killed_ids), 30,
            "the killed streams' usage events were not recorded",
        )
        records = usage_records(stack.settings, killed_ids)
        print(f"ledger for the killed streams: {records}")
        for request_id in killed_ids:
            assert len(records[request_id]) == 1, records
            assert records[request_id][0][1] == generated[request_id]
    finally:
        watcher.close()
        stack.close()
