"""Text generation in the distributed mode, with real processes: a gateway that runs no model,
a Celery compile worker, two `luminal-cloud runtime` processes. A sequence stays on one runtime
and its tokens flow back over the gateway's reply stream; a client that leaves frees it; a
runtime SIGKILLed mid-sequence has it generated again by the other, and the client still gets
the whole text once, billed once."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import redis
from sqlalchemy import select

from api.server import BackgroundServer
from api.services import open_database
from cloud.db import UsageRecord
from registry.bundle import zip_bytes
from runtime.tokenizer import TextCodec
from scheduler import wire
from tests.conftest import FIXTURES, auth
from tests.processes import flushed_redis
from tests.test_distributed import Stack, distributed_settings, ledger_ids, runtime_id, wait_until

REDIS_DB = 15
GPT2 = FIXTURES / "generation" / "gpt2"
MANIFEST = json.loads((FIXTURES / "generation" / "manifest.json").read_text())
FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "config.json")


@pytest.fixture
def redis_url() -> Iterator[str]:
    yield from flushed_redis(REDIS_DB)


def codec() -> TextCodec:
    return TextCodec.from_files({name: (GPT2 / name).read_bytes() for name in FILES})


def tokens_billed(settings, request_id: str) -> tuple[int, int]:
    db = open_database(settings)
    try:
        with db.session() as session:
            record = session.scalar(select(UsageRecord).where(UsageRecord.request_id == request_id))
            return record.prompt_tokens, record.completion_tokens
    finally:
        db.dispose()


def deploy_tiny_gpt2(http: httpx.Client) -> None:
    """The tiny GPT-2 bundle uploaded as "tiny-gpt2" (task text-generation), once it is ready."""
    bundle = {"model.onnx": (GPT2 / "model_torchscript.onnx").read_bytes()} | {
        n: (GPT2 / n).read_bytes() for n in FILES
    }
    reply = http.post(
        "/v1/models",
        files={"file": ("gpt2.zip", zip_bytes(bundle), "application/zip")},
        data={"name": "tiny-gpt2", "task": "text-generation"},
    )
    assert reply.status_code == 202, reply.text
    wait_until(
        lambda: http.get("/v1/models/tiny-gpt2").json()["versions"][-1]["status"] in ("ready", "failed"),
        180,
        "compile",
    )
    assert http.get("/v1/models/tiny-gpt2").json()["versions"][-1]["status"] == "ready"


def holder(client: redis.Redis, runtimes: list):
    """The runtime process holding a generation's message (its consumer in the runtimes' group)."""
    for stream in (wire.request_stream(1), wire.pool_stream("cpu")):
        for entry in client.xpending_range(stream, wire.RUNTIME_GROUP, "-", "+", 10):
            consumer = entry["consumer"].decode()
            found = [r for r in runtimes if runtime_id(r) == consumer]
            if found:
                return found[0]
    raise AssertionError("no runtime holds the generation: it ended before the kill")


def held_by(client: redis.Redis, runtime: str) -> int:
    return int(client.hget(wire.heartbeat_key(runtime), "held") or 0)


def test_generation_runs_on_runtime_processes_survives_a_kill_and_frees_what_clients_leave(
    tmp_path, redis_url
) -> None:
    stack = Stack(distributed_settings(tmp_path / "data", redis_url, compile_timeout_s=120.0), tmp_path)
    watcher = redis.Redis.from_url(redis_url)
    try:
        stack.worker()
        runtimes = [stack.runtime(), stack.runtime()]
        with BackgroundServer(stack.settings) as server:
            http = httpx.Client(base_url=server.url, headers=auth(stack.key), timeout=120)
            ai = openai.OpenAI(base_url=f"{server.url}/v1", api_key=stack.key, max_retries=0, timeout=120)
            deploy_tiny_gpt2(http)

            # greedy text as transformers generates it, answered and streamed
            case = MANIFEST["models"]["gpt2"]["greedy"][3]
            greedy = {"temperature": 0, "max_tokens": 32, "extra_body": {"min_tokens": 32}}
            answer = ai.completions.create(model="tiny-gpt2", prompt=case["prompt_text"], **greedy)
            assert answer.choices[0].text == codec().decode(case["generated_ids"])
            assert answer.usage.completion_tokens == 32
            streamed = "".join(
                c.choices[0].text
                for c in ai.completions.create(
                    model="tiny-gpt2", prompt=case["prompt_text"], stream=True, **greedy
                )
                if c.choices
            )
            assert streamed == answer.choices[0].text

            # concurrent streams, batched on the runtimes
            def one(i: int) -> str:
                chunks = ai.completions.create(
                    model="tiny-gpt2",
                    prompt=f"The dog {i}",
                    max_tokens=24,
                    temperature=0,
                    stream=True,
                    extra_body={"ignore_eos": True},
                )
                return "".join(c.choices[0].text for c in chunks if c.choices)

            with ThreadPoolExecutor(12) as pool:
                texts = list(pool.map(one, range(12)))
            assert (
                texts[3]
                == ai.completions.create(
                    model="tiny-gpt2",
                    prompt="The dog 3",
                    max_tokens=24,
                    temperature=0,
                    extra_body={"ignore_eos": True},
                )
                .choices[0]
                .text
            )

            # a client that leaves mid-stream: its runtime frees the sequence
            with httpx.stream(
                "POST",
                f"{server.url}/v1/completions",
                headers=auth(stack.key),
                timeout=60,
                json={
                    "model": "tiny-gpt2",
                    "prompt": "The",
                    "max_tokens": 120,
                    "ignore_eos": True,
                    "stream": True,
                },
            ) as leaving:
                next(line for line in leaving.iter_lines() if line.startswith("data:"))
            ids = [runtime_id(r) for r in runtimes]
            wait_until(
                lambda: all(held_by(watcher, i) == 0 for i in ids), 10, "a left sequence was not freed"
            )

            # the runtime generating a sequence is killed mid-stream: the other generates it again,
            # and the client gets the same text, whole, once
            with httpx.stream(
                "POST",
                f"{server.url}/v1/completions",
                headers=auth(stack.key),
                timeout=60,
                json={
                    "model": "tiny-gpt2",
                    "prompt": "The cache",
                    "max_tokens": 100,
                    "temperature": 0,
                    "min_tokens": 100,
                    "stream": True,
                },
            ) as surviving:
                survivor_id = surviving.headers["X-Request-Id"]
                lines = surviving.iter_lines()
                first = [next(line for line in lines if line.startswith("data:")) for _ in range(3)]
                generating = holder(watcher, runtimes)
                generating.signal(signal.SIGSTOP)  # frozen where it is, then killed
                generating.signal(signal.SIGKILL)
                rest = [line for line in lines if line.startswith("data:")]
            chunks = [json.loads(line[5:]) for line in first + rest if line != "data: [DONE]"]
            assert rest[-1] == "data: [DONE]", rest[-3:]
            text = "".join(c["choices"][0]["text"] for c in chunks if c.get("choices"))
            alone = ai.completions.create(
                model="tiny-gpt2",
                prompt="The cache",
                max_tokens=100,
                temperature=0,
                extra_body={"min_tokens": 100},
            )
            assert text == alone.choices[0].text
            wait_until(lambda: survivor_id in ledger_ids(stack.settings), 20, "the survivor's usage event")
            # billed once, for the whole sequence: the killed runtime's part was never recorded
            assert tokens_billed(stack.settings, survivor_id) == (5, 100)
            http.close()
            ai.close()
    finally:
        watcher.close()
        stack.close()
