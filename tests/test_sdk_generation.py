"""The SDK's text generation against fake servers (httpx.MockTransport): the bodies sent to
/v1/completions and /v1/chat/completions, their answers, streamed server-sent events, OpenAI-shaped
errors, the `generate` command, and deploying a language model with its tokenizer files."""

from __future__ import annotations

import asyncio
import email.parser
import email.policy
import io
import json
import subprocess
import sys
import zipfile
from collections.abc import AsyncIterator, Callable, Iterator

import httpx
import pytest

from luminal_cloud import (
    APIError,
    AsyncClient,
    AsyncTextStream,
    Client,
    Generation,
    InvalidRequest,
    LuminalCloudError,
    NotFound,
    Overloaded,
    TextStream,
    Unavailable,
    cli,
)
from luminal_cloud import client as client_module

URL = "http://luminal.test"

COMPLETION = {
    "id": "cmpl-1",
    "object": "text_completion",
    "created": 1700000000,
    "model": "gpt2",
    "choices": [{"index": 0, "text": " there was a cat", "finish_reason": "length", "logprobs": None}],
    "usage": {"prompt_tokens": 4, "completion_tokens": 5, "total_tokens": 9},
}
CHAT = {
    "id": "chatcmpl-1",
    "object": "chat.completion",
    "created": 1700000000,
    "model": "gpt2",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello!"}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9},
}


class Recorder:
    """A fake server: answers each request with `answer(request)` and keeps the requests."""

    def __init__(self, answer: Callable[[httpx.Request], httpx.Response]) -> None:
        self.answer = answer
        self.requests: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        request.read()
        self.requests.append(request)
        return self.answer(request)

    def body(self, index: int = -1) -> dict:
        return json.loads(self.requests[index].content)

    def client(self, **options) -> Client:
        return Client(URL, "lc_x", transport=httpx.MockTransport(self), **options)

    def async_client(self, **options) -> AsyncClient:
        return AsyncClient(URL, "lc_x", transport=httpx.MockTransport(self), **options)


def chunk(text: str | None = None, finish: str | None = None, chat: bool = False, **fields) -> dict:
    if chat:
        delta = {"role": "assistant"} if text is None else {"content": text}
        choice = {"index": 0, "delta": delta, "finish_reason": finish}
    else:
        choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
    kind = "chat.completion.chunk" if chat else "text_completion"
    return {"id": "cmpl-7", "object": kind, "created": 1, "model": "gpt2", "choices": [choice], **fields}


USAGE = {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}


def sse(*events: dict | str, newline: str = "\n") -> bytes:
    """A stream's bytes: each event a `data:` line and a blank line; a str goes as it is."""
    out = []
    for event in events:
        line = event if isinstance(event, str) else f"data: {json.dumps(event, ensure_ascii=False)}"
        out.append(f"{line}{newline}{newline}")
    return "".join(out).encode()


def cut(data: bytes, size: int) -> list[bytes]:
    return [data[i : i + size] for i in range(0, len(data), size)]


def streaming(pieces: list[bytes], asynchronous: bool = False, status: int = 200) -> httpx.Response:
    """A response whose body arrives in these network chunks."""
    headers = {"Content-Type": "text/event-stream"}
    if asynchronous:

        async def body() -> AsyncIterator[bytes]:
            for piece in pieces:
                yield piece

        return httpx.Response(status, headers=headers, content=body())

    def sync_body() -> Iterator[bytes]:
        yield from pieces

    return httpx.Response(status, headers=headers, content=sync_body())


# a completion streamed with a comment, a keep-alive, a multi-byte character, usage, [DONE], and
# junk after [DONE] that must never be read
STORY = sse(
    ": keep-alive comment",
    chunk(" Once"),
    chunk(" upon"),
    chunk(" a café", finish="length"),
    {
        "id": "cmpl-7",
        "object": "text_completion",
        "created": 1,
        "model": "gpt2",
        "choices": [],
        "usage": USAGE,
    },
    "data: [DONE]",
    "data: {not json",
)


# -- generate


def test_generate_sends_a_prompt_to_completions_and_reads_the_answer() -> None:
    server = Recorder(lambda request: httpx.Response(200, json=COMPLETION))
    with server.client() as client:
        answer = client.generate(
            "gpt2", "Once upon a time", max_tokens=5, temperature=0.0, top_p=0.9, top_k=40, seed=7,
            stop=("\n", "THE END"), version="prod", min_tokens=2,
        )  # fmt: skip
    [request] = server.requests
    assert (request.method, request.url.path) == ("POST", "/v1/completions")
    assert request.headers["Authorization"] == "Bearer lc_x"
    assert server.body() == {
        "model": "gpt2:prod",
        "prompt": "Once upon a time",
        "max_tokens": 5,
        "temperature": 0.0,
        "top_p": 0.9,
        "top_k": 40,
        "seed": 7,
        "stop": ["\n", "THE END"],
        "min_tokens": 2,
    }
    assert answer == Generation(" there was a cat", "length", 4, 5, "cmpl-1")
    assert answer.total_tokens == 9


def test_generate_sends_messages_to_chat_completions_on_both_clients() -> None:
    server = Recorder(lambda request: httpx.Response(200, json=CHAT))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]

    async def ask() -> Generation:
        async with server.async_client() as client:
            return await client.generate("gpt2", messages=messages, version=3, stop="\n")

    with server.client() as client:
        sync_answer = client.generate("gpt2", messages=messages)
    async_answer = asyncio.run(ask())
    assert [r.url.path for r in server.requests] == ["/v1/chat/completions"] * 2
    first, second = server.body(0), server.body(1)
    assert first["model"] == "gpt2" and first["messages"] == messages and "prompt" not in first
    assert "seed" not in first and "stop" not in first and "stream" not in first
    assert (second["model"], second["stop"]) == ("gpt2:3", "\n")
    assert sync_answer == async_answer == Generation("Hello!", "stop", 7, 2, "chatcmpl-1")


def test_a_prompt_or_messages_not_both_and_no_fields_the_sdk_sets() -> None:
    server = Recorder(lambda request: httpx.Response(200, json=COMPLETION))
    with server.client() as client:
        with pytest.raises(ValueError, match="either a prompt or messages"):
            client.generate("gpt2", "hi", messages=[{"role": "user", "content": "hi"}])
        with pytest.raises(ValueError, match="either a prompt or messages"):
            client.generate("gpt2")
        with pytest.raises(TypeError, match="stream"):
            client.generate("gpt2", "hi", stream=True)
    assert server.requests == []


# -- streaming


@pytest.mark.parametrize("size", [1, 3, 7, 10_000])
def test_stream_yields_the_pieces_in_order_however_the_network_cuts_them(size: int) -> None:
    server = Recorder(lambda request: streaming(cut(STORY, size)))
    with server.client() as client:
        stream = client.stream("gpt2", "Tell me", max_tokens=3, seed=1)
        assert isinstance(stream, TextStream)
        assert server.requests == []  # sent at the first piece asked for
        pieces = list(stream)
    assert pieces == [" Once", " upon", " a café"]
    assert (stream.finish_reason, stream.usage, stream.id) == ("length", USAGE, "cmpl-7")
    assert stream.text == " Once upon a café"
    assert stream.generation() == Generation(" Once upon a café", "length", 3, 3, "cmpl-7")
    [request] = server.requests
    assert request.url.path == "/v1/completions"
    body = server.body()
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert (body["prompt"], body["max_tokens"], body["seed"]) == ("Tell me", 3, 1)


def test_stream_reads_crlf_lines_multiline_data_and_named_events() -> None:
    two_lines = 'data: {"id": "c", "choices": [{"index": 0,\r\ndata:  "text": "Hi", "finish_reason": null}]}'
    body = (
        sse(two_lines, newline="\r\n")
        + b"event: message\rid: 4\rretry: 10\r"
        + sse(chunk("!", finish="stop"), newline="\r")
        + b"data: [DONE]\r\n\r\n"
    )
    server = Recorder(lambda request: streaming(cut(body, 2)))
    with server.client() as client:
        stream = client.stream("gpt2", "x")
        assert list(stream) == ["Hi", "!"]
    assert stream.finish_reason == "stop" and stream.usage is None


def test_async_chat_stream_yields_the_delta_contents() -> None:
    events = sse(
        chunk(chat=True),  # the role first, no text
        chunk("Hel", chat=True),
        chunk("lo", chat=True),
        chunk("", finish="stop", chat=True),
        {"id": "cmpl-7", "object": "chat.completion.chunk", "choices": [], "usage": USAGE},
        "data: [DONE]",
    )
    server = Recorder(lambda request: streaming(cut(events, 5), asynchronous=True))

    async def read() -> tuple[list[str], AsyncTextStream]:
        async with server.async_client() as client:
            stream = client.stream("gpt2", messages=[{"role": "user", "content": "Hi"}], temperature=0)
            assert isinstance(stream, AsyncTextStream)
            return [piece async for piece in stream], stream

    pieces, stream = asyncio.run(read())
    assert pieces == ["Hel", "lo"]
    assert (stream.finish_reason, stream.usage) == ("stop", USAGE)
    assert server.requests[0].url.path == "/v1/chat/completions"
    assert (
        server.body()["messages"] == [{"role": "user", "content": "Hi"}] and server.body()["stream"] is True
    )


def test_a_stream_cut_before_its_end_raises() -> None:
    server = Recorder(lambda request: streaming([sse(chunk(" Once"), chunk(" upon"))]))
    with server.client() as client:
        stream = client.stream("gpt2", "x")
        assert next(stream) == " Once" and next(stream) == " upon"
        with pytest.raises(LuminalCloudError, match="closed the stream before"):
            next(stream)


def test_a_stream_that_ends_with_its_finish_reason_but_no_done_is_complete() -> None:
    server = Recorder(lambda request: streaming([sse(chunk(" Once", finish="stop"))[:-2]]))  # no blank line
    with server.client() as client:
        stream = client.stream("gpt2", "x")
        assert list(stream) == [" Once"] and stream.finish_reason == "stop"


def test_stream_retries_a_429_before_the_stream_starts() -> None:
    answers = [
        httpx.Response(
            429, headers={"Retry-After": "0"}, json={"error": {"message": "busy", "type": "rate_limit_error"}}
        ),
        streaming([STORY]),
    ]
    server = Recorder(lambda request: answers.pop(0))
    with server.client() as client:
        assert "".join(client.stream("gpt2", "x")) == " Once upon a café"
    assert len(server.requests) == 2


# -- errors


OPENAI_404 = {
    "error": {
        "message": "The model 'nope' does not exist",
        "type": "not_found_error",
        "param": "model",
        "code": None,
    }
}
OPENAI_400 = {
    "error": {
        "message": "max_tokens must be at least 1",
        "type": "invalid_request_error",
        "param": "max_tokens",
        "code": "invalid_value",
    }
}


def test_openai_shaped_errors_raise_the_typed_error_with_their_message() -> None:
    server = Recorder(lambda request: httpx.Response(404 if "nope" in request.content.decode() else 400,
                                                     json=OPENAI_404 if "nope" in request.content.decode() else OPENAI_400))  # fmt: skip
    with server.client() as client:
        with pytest.raises(NotFound) as missing:
            client.generate("nope", "x")
        with pytest.raises(InvalidRequest) as invalid:
            client.generate("gpt2", "x", max_tokens=0)
    assert missing.value.message == "The model 'nope' does not exist"
    assert (missing.value.status, missing.value.type, missing.value.param) == (
        404,
        "not_found_error",
        "model",
    )
    assert (invalid.value.code, invalid.value.param, invalid.value.message) == (
        "invalid_value",
        "max_tokens",
        "max_tokens must be at least 1",
    )


def test_an_error_status_before_the_stream_raises_on_both_clients() -> None:
    # the error's body comes over the network too: read before it is parsed
    sync_server = Recorder(lambda request: streaming(cut(json.dumps(OPENAI_404).encode(), 9), status=404))
    with sync_server.client() as client, pytest.raises(NotFound, match="does not exist"):
        next(client.stream("nope", "x"))

    async def first() -> str:
        body = cut(json.dumps(OPENAI_400).encode(), 9)
        server = Recorder(lambda request: streaming(body, asynchronous=True, status=400))
        async with server.async_client() as client:
            return await anext(client.stream("gpt2", "x", max_tokens=0))

    with pytest.raises(InvalidRequest, match="max_tokens must be at least 1"):
        asyncio.run(first())


def test_an_error_event_mid_stream_raises_after_the_pieces_before_it() -> None:
    failure = {"error": {"message": "the worker died", "type": "server_error", "param": None, "code": None}}
    server = Recorder(
        lambda request: streaming([sse(chunk(" Once"), f"event: error\ndata: {json.dumps(failure)}")])
    )
    pieces: list[str] = []
    with server.client() as client, pytest.raises(APIError, match="the worker died") as raised:
        pieces.extend(client.stream("gpt2", "x"))
    assert pieces == [" Once"] and raised.value.status == 500


def test_an_error_chunk_with_the_projects_code_raises_its_type() -> None:
    failure = {"error": {"message": "the generation failed", "type": "server_error", "code": "unavailable"}}
    server = Recorder(lambda request: streaming([sse(chunk(chat=True), failure)]))
    with server.client() as client, pytest.raises(Unavailable, match="the generation failed") as raised:
        list(client.stream("gpt2", messages=[{"role": "user", "content": "x"}]))
    assert (raised.value.status, raised.value.code, raised.value.type) == (503, "unavailable", "server_error")


def test_the_projects_own_error_shape_still_parses() -> None:
    body = {"error": {"code": "overloaded", "message": "queue full"}}
    server = Recorder(lambda request: httpx.Response(429, headers={"Retry-After": "0"}, json=body))
    with server.client(max_attempts=1) as client, pytest.raises(Overloaded, match="queue full") as raised:
        client.generate("gpt2", "x")
    assert raised.value.code == "overloaded" and raised.value.type is None


# -- the command


@pytest.fixture
def fake_server(monkeypatch) -> Callable[[Callable[[httpx.Request], httpx.Response]], Recorder]:
    """The CLI's Client talks to the Recorder made from the given answer."""

    def install(answer: Callable[[httpx.Request], httpx.Response]) -> Recorder:
        server = Recorder(answer)
        real = client_module.Client
        monkeypatch.setattr(
            client_module, "Client", lambda url, key: real(url, key, transport=httpx.MockTransport(server))
        )
        return server

    return install


class Terminal(io.StringIO):
    """stdout that remembers each write and flush, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def write(self, text: str) -> int:
        self.calls.append(f"write {text}")
        return super().write(text)

    def flush(self) -> None:
        self.calls.append("flush")


def test_cli_generate_streams_each_piece_to_stdout_as_it_arrives(fake_server, monkeypatch) -> None:
    server = fake_server(lambda request: streaming(cut(STORY, 4)))
    terminal = Terminal()
    monkeypatch.setattr(sys, "stdout", terminal)
    argv = ["generate", "gpt2", "Tell me", "--max-tokens", "3", "--temperature", "0.5", "--top-p", "0.8"]
    argv += ["--seed", "4", "--stop", "\n", "END", "--version", "2", "--api-key", "lc_x", "--url", URL]
    assert cli.main(argv) == 0
    assert terminal.getvalue() == " Once upon a café\n"
    written = [" Once", " upon", " a café", "\n"]
    assert terminal.calls == [call for piece in written for call in (f"write {piece}", "flush")]
    body = server.body()
    assert server.requests[0].url.path == "/v1/completions"
    assert {
        k: body[k]
        for k in ("model", "prompt", "max_tokens", "temperature", "top_p", "seed", "stop", "stream")
    } == {
        "model": "gpt2:2",
        "prompt": "Tell me",
        "max_tokens": 3,
        "temperature": 0.5,
        "top_p": 0.8,
        "seed": 4,
        "stop": ["\n", "END"],
        "stream": True,
    }


def test_cli_generate_chat_sends_one_user_message(fake_server, capsys) -> None:
    events = sse(
        chunk(chat=True), chunk("Hi", chat=True), chunk(" you", finish="stop", chat=True), "data: [DONE]"
    )
    server = fake_server(lambda request: streaming([events]))
    assert cli.main(["generate", "gpt2", "Hello?", "--chat", "--api-key", "lc_x", "--url", URL]) == 0
    assert capsys.readouterr().out == "Hi you\n"
    assert server.requests[0].url.path == "/v1/chat/completions"
    assert server.body()["messages"] == [{"role": "user", "content": "Hello?"}]


def test_cli_generate_names_the_servers_error(fake_server, capsys) -> None:
    fake_server(lambda request: httpx.Response(404, json=OPENAI_404))
    assert cli.main(["generate", "nope", "x", "--api-key", "lc_x", "--url", URL]) == cli.EXIT_API
    out, err = capsys.readouterr()
    assert out == "" and "The model 'nope' does not exist" in err


def test_cli_generate_json_prints_the_whole_generation(fake_server, capsys) -> None:
    server = fake_server(lambda request: httpx.Response(200, json=COMPLETION))
    assert cli.main(["generate", "gpt2", "x", "--json", "--api-key", "lc_x", "--url", URL]) == 0
    assert json.loads(capsys.readouterr().out)["text"] == " there was a cat"
    assert "stream" not in server.body()


def test_the_cli_still_imports_without_httpx() -> None:
    check = "import sys, luminal_cloud.cli; assert 'httpx' not in sys.modules, 'httpx loaded'"
    subprocess.run([sys.executable, "-c", check], check=True)


# -- deploying a language model

TOKENIZER_FILES = {
    "tokenizer.json": b'{"model": {"type": "BPE"}}',
    "tokenizer_config.json": b'{"eos_token": "<|endoftext|>"}',
    "generation_config.json": b'{"eos_token_id": 50256}',
    "config.json": b'{"n_positions": 1024}',
    "chat_template.jinja": b"{% for m in messages %}{{ m.content }}{% endfor %}",
}


def uploaded(request: httpx.Request) -> dict[str, tuple[str | None, bytes]]:
    """The multipart form's parts: name -> (filename, content)."""
    head = f"Content-Type: {request.headers['Content-Type']}\r\n\r\n".encode()
    message = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(head + request.content)
    return {
        part.get_param("name", header="content-disposition"): (
            part.get_filename(),
            part.get_payload(decode=True),
        )
        for part in message.iter_parts()
    }


def created(request: httpx.Request) -> httpx.Response:
    return httpx.Response(202, json={"name": "gpt2", "version": 1, "status": "queued", "target": "cpu"})


def test_deploy_of_a_directory_sends_the_task_the_onnx_file_and_the_tokenizer_parts(tmp_path) -> None:
    (tmp_path / "decoder.onnx").write_bytes(b"ONNX bytes")
    for name, data in TOKENIZER_FILES.items():
        (tmp_path / name).write_bytes(data)
    (tmp_path / "README.md").write_text("not sent")
    server = Recorder(created)
    with server.client(progress_stream=io.StringIO()) as client:
        client.deploy(tmp_path, name="gpt2", wait=False, task="text-generation")
    [request] = server.requests
    parts = uploaded(request)
    assert parts["task"][1] == b"text-generation" and parts["name"][1] == b"gpt2"
    assert parts["file"] == ("decoder.onnx", b"ONNX bytes")
    for part, filename in (
        ("tokenizer", "tokenizer.json"),
        ("tokenizer_config", "tokenizer_config.json"),
        ("generation_config", "generation_config.json"),
        ("config", "config.json"),
        ("chat_template", "chat_template.jinja"),
    ):
        assert parts[part] == (filename, TOKENIZER_FILES[filename])
    assert set(parts) == {"name", "target", "precision", "task", "file", "tokenizer", "tokenizer_config",
                          "generation_config", "config", "chat_template"}  # fmt: skip


def test_deploy_of_a_zip_sends_it_as_it_is_and_a_plain_model_says_inference(tmp_path) -> None:
    bundle = tmp_path / "gpt2.zip"
    with zipfile.ZipFile(bundle, "w") as archive:
        archive.writestr("decoder.onnx", b"ONNX bytes")
        for name, data in TOKENIZER_FILES.items():
            archive.writestr(name, data)
    server = Recorder(created)
    with server.client(progress_stream=io.StringIO()) as client:
        client.deploy(str(bundle), name="gpt2", wait=False, task="text-generation")
        client.deploy(b"onnx", name="mlp", wait=False)
    zipped, plain = (uploaded(r) for r in server.requests)
    assert zipped["file"] == ("gpt2.zip", bundle.read_bytes()) and zipped["task"][1] == b"text-generation"
    assert "tokenizer" not in zipped
    assert plain["task"][1] == b"inference" and plain["file"] == ("mlp.onnx", b"onnx")


def test_deploy_refuses_a_directory_it_cannot_send(tmp_path) -> None:
    server = Recorder(created)
    (tmp_path / "a.onnx").write_bytes(b"a")
    with server.client(progress_stream=io.StringIO()) as client:
        with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
            client.deploy(tmp_path, name="gpt2", wait=False, task="text-generation")
        with pytest.raises(ValueError, match="only task='text-generation'"):
            client.deploy(tmp_path, name="gpt2", wait=False)
        (tmp_path / "b.onnx").write_bytes(b"b")
        with pytest.raises(ValueError, match=r"exactly one \.onnx file \(found a.onnx, b.onnx\)"):
            client.deploy(tmp_path, name="gpt2", wait=False, task="text-generation")
        with pytest.raises(ValueError, match="task is one of"):
            client.deploy(b"x", name="gpt2", wait=False, task="generation")
    assert server.requests == []


def test_cli_deploy_sends_the_task(fake_server, tmp_path, capsys) -> None:
    (tmp_path / "decoder.onnx").write_bytes(b"ONNX bytes")
    (tmp_path / "tokenizer.json").write_bytes(TOKENIZER_FILES["tokenizer.json"])
    server = fake_server(created)
    argv = ["deploy", str(tmp_path), "--name", "gpt2", "--task", "text-generation", "--no-wait"]
    assert cli.main([*argv, "--api-key", "lc_x", "--url", URL]) == 0
    parts = uploaded(server.requests[0])
    assert parts["task"][1] == b"text-generation" and parts["tokenizer"][0] == "tokenizer.json"
    assert "text-generation" in capsys.readouterr().out
    # a directory without --task is a usage error, sent nowhere
    assert (
        cli.main(["deploy", str(tmp_path), "--name", "gpt2", "--api-key", "lc_x", "--url", URL])
        == cli.EXIT_USAGE
    )
    assert len(server.requests) == 1
