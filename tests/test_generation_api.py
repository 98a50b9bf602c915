"""Text generation through HTTP, as users drive it: a decoder with its KV cache uploaded with its
tokenizer (a zip bundle, or parts), compiled, and served through the OpenAI-compatible routes,
tested with the official `openai` package against a live server: greedy text matches
transformers' generate, streaming gives the same text, chat uses the bundle's template, bad
requests get OpenAI-shaped 4xx, clients that leave free their cache blocks, and the ledger
counts tokens and device time."""

from __future__ import annotations

import concurrent.futures
import json
import time

import httpx
import openai
import pytest
from sqlalchemy import select

from api.server import BackgroundServer
from cloud.db import UsageRecord, open_database
from registry.bundle import zip_bytes
from runtime.tokenizer import TextCodec
from tests.conftest import FIXTURES, auth, make_settings

GENERATION = FIXTURES / "generation"
MANIFEST = json.loads((GENERATION / "manifest.json").read_text())
BUNDLE_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "config.json")
# blocks of 16 tokens of the tiny GPT-2 (2 layers, 4 heads of 8) take 8 KiB: 24 blocks, 384
# tokens in all, so that 30 concurrent generations must wait for each other's blocks
KV_BYTES = 24 * 8 * 1024


def bundle(arch: str = "gpt2", exporter: str = "torchscript") -> dict[str, bytes]:
    folder = GENERATION / arch
    return {
        "model.onnx": (folder / f"model_{exporter}.onnx").read_bytes(),
        **{name: (folder / name).read_bytes() for name in BUNDLE_FILES if (folder / name).exists()},
    }


class Live:
    def __init__(self, server: BackgroundServer, key: str, other_key: str) -> None:
        self.server = server
        self.url = server.url
        self.key = key
        self.other_key = other_key
        self.http = httpx.Client(base_url=server.url, headers=auth(key), timeout=120)
        self.ai = openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=120)

    @property
    def services(self):
        return self.server.app.state.services

    def upload(self, name: str, files: dict, data: dict | None = None) -> httpx.Response:
        return self.http.post("/v1/models", files=files, data={"name": name, **(data or {})})

    def wait_ready(self, name: str, timeout: float = 180) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            version = self.http.get(f"/v1/models/{name}").json()["versions"][-1]
            if version["status"] in ("ready", "failed"):
                return version
            time.sleep(0.1)
        raise AssertionError(f"{name} did not compile in {timeout} s")

    def free_blocks(self, name: str) -> int | None:
        """The free cache blocks of the model's newest version, if it is loaded."""
        for version in reversed(self.services.registry.get_model(self.tenant_id, name).versions):
            blocks = self.services.engine.generation.free_blocks(version.id)
            if blocks is not None:
                return blocks
        return None

    @property
    def tenant_id(self) -> int:
        return self.services.auth(f"Bearer {self.key}").id


@pytest.fixture(scope="module")
def live(tmp_path_factory) -> Live:
    from cloud.auth import create_key
    from cloud.db import open_database as open_db

    data = tmp_path_factory.mktemp("generation") / "data"
    settings = make_settings(
        data,
        max_upload_bytes=8 * 1024 * 1024,
        generation_kv_cache_bytes=KV_BYTES,
        generation_block_tokens=16,
        generation_step_tokens=64,
        generation_prefill_tokens=16,
    )
    db = open_db(settings)
    try:
        key, other = create_key(db, "alice"), create_key(db, "bob")
    finally:
        db.dispose()
    with BackgroundServer(settings) as server:
        live = Live(server, key, other)
        files = {"file": ("gpt2.zip", zip_bytes(bundle()), "application/zip")}
        reply = live.upload("tiny-gpt2", files, {"task": "text-generation"})
        assert reply.status_code == 202, reply.text
        assert reply.json()["task"] == "text-generation"
        version = live.wait_ready("tiny-gpt2")
        assert version["status"] == "ready", version
        try:
            yield live
        finally:
            live.http.close()
            live.ai.close()


def codec() -> TextCodec:
    return TextCodec.from_files({name: data for name, data in bundle().items() if name != "model.onnx"})


GREEDY = {"temperature": 0, "max_tokens": 32, "extra_body": {"min_tokens": 32}}


def test_the_version_says_its_task_and_context_and_openai_lists_it(live: Live) -> None:
    version = live.http.get("/v1/models/tiny-gpt2").json()["versions"][-1]
    assert (version["task"], version["context_length"]) == ("text-generation", 128)
    # two programs: the prompts' (symbolic length) and the decode step's (one token a sequence)
    assert version["report"]["decode_phase"]["chosen"], version["report"].get("decode_phase")
    listed = [m.id for m in live.ai.models.list()]
    assert "tiny-gpt2" in listed


@pytest.mark.parametrize("case", MANIFEST["models"]["gpt2"]["greedy"][1:4], ids=lambda c: c["prompt_text"])
def test_openai_completions_give_transformers_greedy_text(live: Live, case: dict) -> None:
    answer = live.ai.completions.create(model="tiny-gpt2", prompt=case["prompt_text"], **GREEDY)
    assert answer.object == "text_completion"
    assert answer.choices[0].text == codec().decode(case["generated_ids"])
    assert answer.choices[0].finish_reason == "length"
    assert answer.usage.prompt_tokens == len(case["prompt_ids"])
    assert answer.usage.completion_tokens == 32
    assert answer.usage.total_tokens == len(case["prompt_ids"]) + 32


def test_streamed_completion_is_the_same_text_in_pieces_with_usage_last(live: Live) -> None:
    case = MANIFEST["models"]["gpt2"]["greedy"][4]
    chunks = list(
        live.ai.completions.create(
            model="tiny-gpt2",
            prompt=case["prompt_text"],
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    pieces = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(pieces) == codec().decode(case["generated_ids"])
    assert len([p for p in pieces if p]) > 5  # streamed, not one lump
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 32


def test_a_stream_opens_before_its_first_token_is_made(live: Live) -> None:
    """The response (headers, the opening chunk) starts once the sequence is accepted, so its
    first token travels to the client like the others rather than behind the response's start."""
    import threading

    live.ai.completions.create(model="tiny-gpt2", prompt="warm", max_tokens=1)  # loaded
    served = list(live.services.engine.generation._served.values())
    assert len(served) == 1
    decoder = served[0].generator.decoder
    release, original = threading.Event(), decoder.run_step

    def held_step(inputs):
        assert release.wait(60), "the test never released the step"
        return original(inputs)

    decoder.run_step = held_step
    try:
        body = {"model": "tiny-gpt2", "prompt": "The dog", "max_tokens": 3, "stream": True, "temperature": 0}
        with live.http.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            opening = json.loads(next(line for line in lines if line.startswith("data: "))[6:])
            assert not release.is_set()  # the step that makes the first token has not run
            assert opening["choices"][0]["text"] == "" and opening["choices"][0]["finish_reason"] is None
            release.set()
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        text = "".join(json.loads(line[6:])["choices"][0]["text"] or "" for line in rest[:-1])
        want = live.ai.completions.create(model="tiny-gpt2", prompt="The dog", max_tokens=3, temperature=0)
        assert text == want.choices[0].text
    finally:
        release.set()
        decoder.run_step = original


def test_chat_uses_the_bundles_template_streaming_and_not(live: Live) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "The dog"}]
    answer = live.ai.chat.completions.create(model="tiny-gpt2", messages=messages, **GREEDY)
    text = answer.choices[0].message.content
    assert answer.choices[0].message.role == "assistant" and answer.object == "chat.completion"
    prompt = codec().render_chat(messages)
    assert answer.usage.prompt_tokens == len(codec().encode(prompt, add_special_tokens=False))
    # the same prompt as a completion gives the same text
    same = live.ai.completions.create(
        model="tiny-gpt2", prompt=codec().encode(prompt, add_special_tokens=False), **GREEDY
    )
    assert same.choices[0].text == text
    stream = live.ai.chat.completions.create(model="tiny-gpt2", messages=messages, stream=True, **GREEDY)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text


def test_a_seed_reproduces_a_sampled_completion(live: Live) -> None:
    ask = {
        "model": "tiny-gpt2",
        "prompt": "Once upon",
        "max_tokens": 12,
        "temperature": 0.8,
        "top_p": 0.95,
        "seed": 5,
    }
    first, again = (live.ai.completions.create(**ask).choices[0].text for _ in range(2))
    assert first == again


def test_bad_requests_get_openai_shaped_4xx_naming_the_problem(live: Live) -> None:
    with pytest.raises(openai.BadRequestError, match="maximum context length is 128"):
        live.ai.completions.create(model="tiny-gpt2", prompt="the dog " * 200, max_tokens=5)
    with pytest.raises(openai.BadRequestError, match="max_tokens must be at least 1"):
        live.ai.completions.create(model="tiny-gpt2", prompt="The", max_tokens=0)
    with pytest.raises(openai.BadRequestError, match="you requested 1000001 tokens"):
        live.ai.completions.create(model="tiny-gpt2", prompt="The", max_tokens=1_000_000)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        live.ai.completions.create(model="no-such-model", prompt="The")
    with pytest.raises(openai.BadRequestError, match="n must be 1"):
        live.ai.completions.create(model="tiny-gpt2", prompt="The", n=2)
    with pytest.raises(openai.BadRequestError, match="role 'wizard'"):
        live.ai.chat.completions.create(model="tiny-gpt2", messages=[{"role": "wizard", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="messages"):
        live.ai.chat.completions.create(model="tiny-gpt2", messages=[])
    with pytest.raises(openai.BadRequestError, match="temperature"):
        live.ai.completions.create(model="tiny-gpt2", prompt="The", temperature=7)
    with pytest.raises(openai.BadRequestError, match="seed must be between"):
        live.ai.completions.create(model="tiny-gpt2", prompt="The", seed=-3)
    reply = live.http.post("/v1/completions", json={"model": "tiny-gpt2", "prompt": "The", "max_tokens": 0})
    error = reply.json()["error"]
    assert (
        reply.status_code == 400
        and error["type"] == "invalid_request_error"
        and error["param"] == "max_tokens"
    )
    assert error["code"] == "invalid_request" and "max_tokens" in error["message"]
    unauthorised = httpx.post(f"{live.url}/v1/completions", json={"model": "tiny-gpt2", "prompt": "x"})
    assert unauthorised.status_code == 401 and unauthorised.json()["error"]["type"] == "authentication_error"
    # another tenant does not see the model
    stranger = openai.OpenAI(base_url=f"{live.url}/v1", api_key=live.other_key, max_retries=0)
    with stranger, pytest.raises(openai.NotFoundError):
        stranger.completions.create(model="tiny-gpt2", prompt="The")


def test_a_model_that_is_not_generative_is_refused_on_the_generation_routes(live: Live) -> None:
    mlp = (FIXTURES / "torch_mlp.onnx").read_bytes()
    assert live.upload("plain-mlp", {"file": ("m.onnx", mlp, "application/octet-stream")}).status_code == 202
    assert live.wait_ready("plain-mlp")["status"] == "ready"
    with pytest.raises(openai.BadRequestError, match="not a generative model"):
        live.ai.completions.create(model="plain-mlp", prompt="The")
    assert "plain-mlp" not in [m.id for m in live.ai.models.list()]


def test_uploads_a_generative_model_cannot_be_served_from_are_refused_naming_why(live: Live) -> None:
    files = bundle()
    mlp = (FIXTURES / "torch_mlp.onnx").read_bytes()
    cases = [
        # a graph without a KV cache
        (
            {
                "file": ("m.onnx", mlp, "application/octet-stream"),
                "tokenizer": ("t.json", files["tokenizer.json"]),
            },
            "input_ids",
        ),
        # no tokenizer
        ({"file": ("m.onnx", files["model.onnx"], "application/octet-stream")}, "tokenizer.json"),
        # a zip without its graph, and one that is no zip
        (
            {"file": ("b.zip", zip_bytes({"tokenizer.json": files["tokenizer.json"]}), "application/zip")},
            "exactly one .onnx",
        ),
        ({"file": ("b.zip", b"PK\x03\x04 broken", "application/zip")}, "not a readable zip"),
        # a template that does not parse, a tokenizer that is not one
        (
            {
                "file": ("m.onnx", files["model.onnx"], "application/octet-stream"),
                "tokenizer": ("t.json", files["tokenizer.json"]),
                "tokenizer_config": ("c.json", b'{"chat_template": "{% for %}"}'),
            },
            "chat template does not parse",
        ),
        (
            {
                "file": ("m.onnx", files["model.onnx"], "application/octet-stream"),
                "tokenizer": ("t.json", b"{}"),
            },
            "tokenizer.json",
        ),
    ]
    for parts, expected in cases:
        reply = live.upload("refused", parts, {"task": "text-generation"})
        assert reply.status_code == 400, (expected, reply.text)
        assert expected in reply.json()["error"]["message"], reply.text
    reply = live.upload("refused", {"file": ("m.onnx", mlp, "application/octet-stream")}, {"task": "poetry"})
    assert reply.status_code == 400 and "unknown task 'poetry'" in reply.text
    assert live.http.get("/v1/models/refused").status_code == 404


def test_a_bundle_sent_as_parts_serves_the_same_text(live: Live) -> None:
    files = bundle()
    parts = {
        "file": ("model.onnx", files["model.onnx"], "application/octet-stream"),
        "tokenizer": ("tokenizer.json", files["tokenizer.json"]),
        "tokenizer_config": ("tokenizer_config.json", files["tokenizer_config.json"]),
        "generation_config": ("generation_config.json", files["generation_config.json"]),
    }
    reply = live.upload("tiny-gpt2-parts", parts, {"task": "text-generation"})
    assert reply.status_code == 202, reply.text
    assert live.wait_ready("tiny-gpt2-parts")["status"] == "ready"
    ask = dict(prompt="The cache", **GREEDY)
    assert (
        live.ai.completions.create(model="tiny-gpt2-parts", **ask).choices[0].text
        == live.ai.completions.create(model="tiny-gpt2", **ask).choices[0].text
    )


def test_clients_that_leave_mid_stream_free_their_blocks(live: Live) -> None:
    live.ai.completions.create(model="tiny-gpt2", prompt="warm", max_tokens=1)
    start = live.free_blocks("tiny-gpt2")
    assert start is not None

    def leave_after_the_opening_chunk(_) -> None:
        with httpx.stream(
            "POST",
            f"{live.url}/v1/completions",
            headers=auth(live.key),
            json={
                "model": "tiny-gpt2",
                "prompt": "The dog",
                "max_tokens": 100,
                "ignore_eos": True,
                "stream": True,
            },
            timeout=30,
        ) as reply:
            assert reply.status_code == 200
            lines = reply.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))
        # the connection is closed here, mid-generation (or before its first token)

    for _ in range(5):
        leave_after_the_opening_chunk(None)
    with concurrent.futures.ThreadPoolExecutor(20) as pool:  # and twenty at once
        list(pool.map(leave_after_the_opening_chunk, range(20)))
    deadline = time.monotonic() + 10
    while live.free_blocks("tiny-gpt2") != start and time.monotonic() < deadline:
        time.sleep(0.05)
    assert live.free_blocks("tiny-gpt2") == start
    # and no step waits for the tokens they never read (scheduler.generating._Deliveries)
    generation = live.services.engine.generation
    pending = [served.deliveries.pending for served in generation._served.values()]
    assert pending and not any(pending), pending


def test_two_hundred_concurrent_streams_over_the_cache_budget_all_finish_and_free_every_block(
    live: Live,
) -> None:
    live.ai.completions.create(model="tiny-gpt2", prompt="warm", max_tokens=1)
    start = live.free_blocks("tiny-gpt2")

    def one(i: int) -> tuple[str, str | None]:
        stream = live.ai.completions.create(
            model="tiny-gpt2",
            prompt=f"The dog {i}",
            max_tokens=16,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        pieces, finish = [], None
        for chunk in stream:
            if chunk.choices:
                pieces.append(chunk.choices[0].text)
                finish = chunk.choices[0].finish_reason or finish
        return "".join(pieces), finish

    with concurrent.futures.ThreadPoolExecutor(200) as pool:
        results = list(pool.map(one, range(200)))
    assert all(finish == "length" for _, finish in results), results
    alone = live.ai.completions.create(
        model="tiny-gpt2", prompt="The dog 7", max_tokens=16, temperature=0, extra_body={"ignore_eos": True}
    )
    assert results[7][0] == alone.choices[0].text  # waiting and batching changed nothing
    assert live.free_blocks("tiny-gpt2") == start


def test_every_generation_is_billed_once_with_its_tokens(live: Live) -> None:
    answer = live.ai.completions.create(model="tiny-gpt2", prompt="Every", **GREEDY)
    request_id = answer.id.removeprefix("cmpl-")
    db = open_database(live.services.settings)
    try:
        deadline = time.monotonic() + 10
        record = None
        while record is None and time.monotonic() < deadline:
            with db.session() as session:
                record = session.scalar(select(UsageRecord).where(UsageRecord.request_id == request_id))
            time.sleep(0.05)
    finally:
        db.dispose()
    assert record is not None
    assert (record.prompt_tokens, record.completion_tokens) == (answer.usage.prompt_tokens, 32)
    assert record.billed_seconds > 0 and record.model_name == "tiny-gpt2"
    usage = live.http.get("/v1/usage", params={"group_by": "model"}).json()["items"]
    mine = next(item for item in usage if item["model"] == "tiny-gpt2")
    assert mine["completion_tokens"] >= 32 and mine["prompt_tokens"] >= answer.usage.prompt_tokens
    as_csv = live.http.get("/v1/usage", params={"group_by": "model", "format": "csv"}).text
    assert as_csv.splitlines()[0].endswith("prompt_tokens,completion_tokens")


def test_deleting_a_model_mid_stream_ends_the_stream_and_frees_the_name(live: Live) -> None:
    files = {"file": ("gpt2.zip", zip_bytes(bundle()), "application/zip")}
    assert live.upload("doomed", files, {"task": "text-generation"}).status_code == 202
    assert live.wait_ready("doomed")["status"] == "ready"
    with httpx.stream(
        "POST",
        f"{live.url}/v1/completions",
        headers=auth(live.key),
        json={"model": "doomed", "prompt": "The", "max_tokens": 120, "ignore_eos": True, "stream": True},
        timeout=30,
    ) as reply:
        lines = reply.iter_lines()
        next(line for line in lines if line.startswith("data:"))
        assert live.http.delete("/v1/models/doomed").status_code == 200
        rest = [line for line in lines if line.startswith("data:")]
    assert rest[-1] == "data: [DONE]" or "error" in rest[-1]
    with pytest.raises(openai.NotFoundError):
        live.ai.completions.create(model="doomed", prompt="The")


def test_openai_streams_a_chat_from_an_optimum_onnx_export(live: Live) -> None:
    folder = GENERATION / "gpt2" / "optimum"
    files = {path.name: path.read_bytes() for path in folder.iterdir() if path.is_file()}
    assert "chat_template.jinja" in files and "model.onnx" in files  # optimum keeps the template apart
    reply = live.upload(
        "optimum-gpt2",
        {"file": ("optimum.zip", zip_bytes(files), "application/zip")},
        {"task": "text-generation"},
    )
    assert reply.status_code == 202, reply.text
    assert live.wait_ready("optimum-gpt2")["status"] == "ready"
    messages = [{"role": "user", "content": "The dog sleeps in"}]
    chunks = list(
        live.ai.chat.completions.create(model="optimum-gpt2", messages=messages, stream=True, **GREEDY)
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "length" and len(text) > 0
    # the same weights exported by torch.onnx.export answer the same
    same = live.ai.chat.completions.create(model="tiny-gpt2", messages=messages, **GREEDY)
    assert text == same.choices[0].message.content
