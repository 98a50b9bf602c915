"""Text generation in OpenAI's API: POST /v1/completions and /v1/chat/completions, streamed as
server-sent events with `stream: true`, errors in OpenAI's shape (api.errors), so that the
`openai` package, LangChain or LiteLLM talk to a generative model here unchanged. GET
/v1/models lists the generative models in OpenAI's shape too (api.routes.models).

The gateway tokenizes (the prompt's length is checked against the model's context before any
work) and renders the chat template; the engine generates (scheduler.generating).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from api.deps import CurrentTenant, ServicesDep
from api.inference import route_of
from api.services import Services
from cloud import metrics
from cloud.db import Tenant
from cloud.errors import ClientDisconnected, InvalidRequest, LuminalError, NotFound, Unavailable
from registry.bundle import GENERATION
from registry.registry import ServedVersion, version_ref
from runtime.sampling import SamplingParams
from runtime.tokenizer import TextCodec, TokenizerError
from scheduler.generator import GenerationRefused, GenerationRequest, TokenEvent

router = APIRouter(prefix="/v1", tags=["generation (OpenAI-compatible)"])


class _Sampling(BaseModel):
    """The fields both routes share. Unknown fields are ignored, as OpenAI's clients send many."""

    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = 1
    stream: bool | None = False
    stream_options: dict[str, Any] | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = 0
    frequency_penalty: float | None = 0
    logprobs: Any = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # beyond OpenAI's fields, as vLLM takes them
    top_k: int | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None


ROLES = ("system", "user", "assistant", "developer", "tool")
# completions' default, as OpenAI's; chat's default is what the context leaves
COMPLETION_DEFAULT_MAX_TOKENS = 16


def _refuse(message: str, param: str | None = None) -> InvalidRequest:
    return InvalidRequest(message, param=param) if param else InvalidRequest(message)


def _unsupported(body: _Sampling) -> None:
    if (body.n or 1) != 1:
        raise _refuse(f"n must be 1: this service returns one choice per request (n={body.n})", "n")
    if body.logprobs not in (None, False, 0):
        raise _refuse("logprobs are not returned by this service", "logprobs")
    if body.presence_penalty or body.frequency_penalty:
        raise _refuse("presence and frequency penalties are not supported", "presence_penalty")
    if body.logit_bias:
        raise _refuse("logit_bias is not supported", "logit_bias")
    if isinstance(body, CompletionRequest):
        if body.echo:
            raise _refuse("echo is not supported", "echo")
        if body.best_of not in (None, 1):
            raise _refuse("best_of must be 1", "best_of")
        if body.suffix:
            raise _refuse("suffix is not supported", "suffix")
    if isinstance(body, ChatRequest) and body.tools:
        raise _refuse("tools are not supported", "tools")


async def _generative_version(services: Services, tenant: Tenant, model: str) -> tuple[str, ServedVersion]:
    """`model` is a model's name, or name:version (a number or an alias)."""
    name, _, ref = model.partition(":")
    try:
        reference = version_ref(ref) if ref else None
        found = await run_in_threadpool(services.registry.resolve, tenant.id, name, reference)
    except NotFound as exc:
        raise NotFound(f"The model {model!r} does not exist: {exc.message}", param="model") from None
    if found.task != GENERATION or not found.bundle:
        raise _refuse(
            f"model {model!r} is not a generative model (task {found.task!r}): run it with POST /v1/models/{name}/infer",
            "model",
        )
    return name, found


def _stop_strings(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(stop)


def _params(body: _Sampling, max_tokens: int) -> SamplingParams:
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=body.top_k or 0,
        seed=body.seed,
        stop=_stop_strings(body.stop),
        stop_token_ids=tuple(body.stop_token_ids or ()),
        ignore_eos=bool(body.ignore_eos),
        min_tokens=body.min_tokens or 0,
    )
    problems = params.problems()
    if problems:
        raise _refuse("; ".join(problems), problems[0].split(" ", 1)[0])
    return params


def _prompt_ids(body: CompletionRequest, codec: TextCodec) -> list[int]:
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
        if len(prompt) != 1:
            raise _refuse("one prompt per request: this service returns one choice", "prompt")
        prompt = prompt[0]
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        if len(prompt) != 1:
            raise _refuse("one prompt per request: this service returns one choice", "prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        return codec.encode(prompt)
    ids = [int(t) for t in prompt]
    bad = [t for t in ids if not 0 <= t < codec.vocab_size]
    if bad:
        raise _refuse(
            f"prompt token {bad[0]} is outside the vocabulary (0..{codec.vocab_size - 1})", "prompt"
        )
    return ids


def _chat_ids(body: ChatRequest, codec: TextCodec) -> list[int]:
    messages = []
    for index, message in enumerate(body.messages):
        if message.role not in ROLES:
            raise _refuse(
                f"messages[{index}].role {message.role!r} is not one of {', '.join(ROLES)}", "messages"
            )
        content = message.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise _refuse(f"messages[{index}].content: only text parts are supported", "messages")
                texts.append(part["text"])
            content = "".join(texts)
        messages.append({"role": message.role, "content": content or ""})
    try:
        prompt = codec.render_chat(messages)
    except TokenizerError as exc:
        raise _refuse(str(exc), "messages") from None
    return codec.encode(prompt, add_special_tokens=False)


def _max_tokens(asked: int | None, default: int | None, prompt: int, context: int) -> int:
    room = context - prompt
    if room < 1:
        raise _refuse(
            f"This model's maximum context length is {context} tokens, and the prompt has {prompt}: "
            "shorten the prompt",
            "messages",
        )
    if asked is None:
        return min(default, room) if default is not None else room
    if asked < 1:
        raise _refuse(f"max_tokens must be at least 1, not {asked}", "max_tokens")
    if asked > room:
        raise _refuse(
            f"This model's maximum context length is {context} tokens. However, you requested {prompt + asked} "
            f"tokens ({prompt} in the prompt, {asked} for the completion). Reduce the prompt or max_tokens.",
            "max_tokens",
        )
    return asked


class _Call:
    """One generation on its way: what the answer and the chunks need."""

    def __init__(
        self, kind: Literal["text_completion", "chat.completion"], model: str, request_id: str
    ) -> None:
        self.kind = kind
        self.model = model
        self.id = ("cmpl-" if kind == "text_completion" else "chatcmpl-") + request_id
        self.created = int(time.time())

    def choice(self, text: str | None, finish: str | None, first: bool = False) -> dict[str, Any]:
        if self.kind == "text_completion":
            return {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if text:
            delta["content"] = text
        return {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}

    def chunk(self, choices: list, usage: dict | None = None) -> str:
        body: dict[str, Any] = {
            "id": self.id,
            "object": self.kind if self.kind == "text_completion" else "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if usage is not None:
            body["usage"] = usage
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    def answer(self, text: str, finish: str, usage: dict) -> dict[str, Any]:
        if self.kind == "text_completion":
            choice: dict[str, Any] = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
        else:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": finish,
                "logprobs": None,
            }
        return {
            "id": self.id,
            "object": self.kind,
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": usage,
        }


def _usage(event: TokenEvent) -> dict[str, int]:
    used = event.usage
    prompt = used.prompt_tokens if used else 0
    completion = used.completion_tokens if used else 0
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _ended_badly(event: TokenEvent) -> LuminalError | None:
    if event.finish_reason == "error":
        return Unavailable(f"the generation failed: {event.error or 'the decoder failed'}")
    if event.finish_reason == "cancelled":
        return Unavailable("the generation was stopped: the model was deleted or is being unloaded")
    return None


async def _first(events: AsyncIterator[TokenEvent]) -> TokenEvent:
    try:
        return await anext(events)
    except GenerationRefused as exc:
        raise _refuse(str(exc), "max_tokens") from None


async def _generate(
    services: Services,
    tenant: Tenant,
    request: Request,
    body: CompletionRequest | ChatRequest,
    kind: Literal["text_completion", "chat.completion"],
):
    started = time.perf_counter()
    outcome = "error"
    label = metrics.UNKNOWN_MODEL
    try:
        _unsupported(body)
        name, found = await _generative_version(services, tenant, body.model)
        label = name
        codec: TextCodec = await run_in_threadpool(services.codecs, found.bundle)
        if isinstance(body, ChatRequest):
            ids = _chat_ids(body, codec)
            max_tokens = _max_tokens(
                body.max_completion_tokens or body.max_tokens, None, len(ids), found.bundle["context_length"]
            )
        else:
            ids = _prompt_ids(body, codec)
            max_tokens = _max_tokens(
                body.max_tokens, COMPLETION_DEFAULT_MAX_TOKENS, len(ids), found.bundle["context_length"]
            )
        if not ids:
            raise _refuse("the prompt is empty: it needs at least one token", "prompt")
        params = _params(body, max_tokens)
        route = route_of(found, tenant, name, batchable=True)
        request_id = uuid.uuid4().hex
        call = _Call(kind, body.model, request_id)
        events = services.engine.generate(route, GenerationRequest(request_id, ids, params))
        first = await _first(events)
        if body.stream:
            include_usage = bool((body.stream_options or {}).get("include_usage"))
            outcome = "ok"
            return StreamingResponse(
                _sse(call, first, events, include_usage),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Request-Id": request_id},
            )
        answer = await _collect(request, call, first, events)
        outcome = "ok"
        return JSONResponse(answer, headers={"X-Request-Id": request_id})
    except LuminalError as exc:
        outcome = str(exc.status)
        raise
    finally:
        metrics.REQUESTS.labels(tenant.name, label, outcome).inc()
        metrics.REQUEST_LATENCY.labels(tenant.name, label).observe(time.perf_counter() - started)


async def _collect(
    request: Request, call: _Call, first: TokenEvent, events: AsyncIterator[TokenEvent]
) -> dict:
    """The whole answer; a client that leaves meanwhile cancels the sequence."""
    pieces = [first.text]
    last = first

    async def rest() -> TokenEvent:
        final = first
        async for event in events:
            pieces.append(event.text)
            final = event
        return final

    if first.finish_reason is None:
        collecting = asyncio.ensure_future(rest())
        watching = asyncio.ensure_future(_disconnected(request))
        try:
            done, _ = await asyncio.wait({collecting, watching}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watching.cancel()
        if collecting not in done:
            collecting.cancel()
            await asyncio.gather(collecting, return_exceptions=True)
            await events.aclose()
            raise ClientDisconnected("the client disconnected before the generation finished")
        last = collecting.result()
    failure = _ended_badly(last)
    if failure is not None:
        raise failure
    return call.answer("".join(pieces), last.finish_reason or "stop", _usage(last))


async def _disconnected(request: Request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(0.25)


async def _sse(call: _Call, first: TokenEvent, events: AsyncIterator[TokenEvent], include_usage: bool):
    """The stream's chunks; closing it early (the client left) closes `events`, which cancels."""
    try:
        event: TokenEvent | None = first
        opened = False
        while event is not None:
            failure = _ended_badly(event)
            if failure is not None:
                yield f"data: {json.dumps({'error': {'message': failure.message, 'type': 'server_error', 'param': None, 'code': failure.code}})}\n\n"
                return
            if event.text or not opened:
                yield call.chunk([call.choice(event.text, None, first=not opened)])
                opened = True
            if event.finish_reason is not None:
                yield call.chunk([call.choice(None, event.finish_reason)])
                if include_usage:
                    yield call.chunk([], _usage(event))
                yield "data: [DONE]\n\n"
                return
            event = await anext(events, None)
    finally:
        await events.aclose()


@router.post("/completions", summary="Complete a prompt (OpenAI's completions API)")
async def completions(
    body: CompletionRequest, tenant: CurrentTenant, services: ServicesDep, request: Request
):
    return await _generate(services, tenant, request, body, "text_completion")


@router.post("/chat/completions", summary="Answer a chat (OpenAI's chat completions API)")
async def chat_completions(body: ChatRequest, tenant: CurrentTenant, services: ServicesDep, request: Request):
    return await _generate(services, tenant, request, body, "chat.completion")


__all__ = ["router"]
