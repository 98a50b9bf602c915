"""Text generation on CPU: decode tokens/s of our compiled decoder under scheduler.generator (one
stream, and 16 concurrent streams batched by the continuous scheduler) against onnxruntime-genai
and a plain onnxruntime greedy loop on the same ONNX export, and how long a streamed token takes
from being sampled to reaching an HTTP client of the embedded server.

The model is benchmarks/llama_onnx.py's Llama-shaped decoder (2 layers, hidden 512, 8 query
heads, 4 KV heads of 64, SwiGLU 1408, vocab 32000, random weights). Every side decodes greedily
from the same prompt(s) and is timed from its first generated token to its last, so the prompt's
prefill is excluded: tokens/s = tokens after each stream's first / (last token - first token).
Our greedy tokens are checked against onnxruntime's (the run fails if they differ).

    .venv/bin/python -m benchmarks.generation [--quick] [--write docs/performance.md]

Targets (the issue's, CPU part): ours >= onnxruntime-genai at one stream; our 16-stream aggregate
>= 4x our one stream; a streamed token reaches the client within 2 ms of being sampled.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from benchmarks.llama_onnx import LlamaConfig, greedy_ort, model_bytes, word_tokenizer_files

BEGIN, END = "<!-- generation-benchmark:begin -->", "<!-- generation-benchmark:end -->"


def loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "n/a"


def cpu_model() -> str:
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return platform.processor() or "unknown"


def prompts(config: LlamaConfig, count: int, length: int, seed: int = 7) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(1, config.vocab, size=length)] for _ in range(count)]


def decode_rate(times: list[list[float]]) -> float:
    """Tokens after each stream's first / (the last token's time - the first token's time)."""
    tokens = sum(len(t) - 1 for t in times)
    span = max(t[-1] for t in times) - min(t[0] for t in times)
    return tokens / span


def write_model(folder: Path, config: LlamaConfig) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model.onnx").write_bytes(model_bytes(config))
    for name, data in word_tokenizer_files(config).items():
        (folder / name).write_bytes(data)
    (folder / "genai_config.json").write_text(json.dumps(genai_config(config), indent=2))


def genai_config(config: LlamaConfig) -> dict:
    """onnxruntime-genai's description of the export: a llama-type decoder whose past and present
    are separate tensors (the graph concatenates; no shared past/present buffer)."""
    c = config
    return {
        "model": {
            "type": "llama",
            "bos_token_id": 0,
            "eos_token_id": 0,
            "pad_token_id": 0,
            "context_length": c.context,
            "vocab_size": c.vocab,
            "decoder": {
                "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
                "filename": "model.onnx",
                "head_size": c.head_dim,
                "hidden_size": c.hidden,
                "num_attention_heads": c.heads,
                "num_hidden_layers": c.layers,
                "num_key_value_heads": c.kv_heads,
                "inputs": {
                    "input_ids": "input_ids",
                    "attention_mask": "attention_mask",
                    "position_ids": "position_ids",
                    "past_key_names": "past_key_values.%d.key",
                    "past_value_names": "past_key_values.%d.value",
                },
                "outputs": {
                    "logits": "logits",
                    "present_key_names": "present.%d.key",
                    "present_value_names": "present.%d.value",
                },
            },
        },
        "search": {
            "do_sample": False,
            "max_length": c.context,
            "min_length": 0,
            "num_beams": 1,
            "num_return_sequences": 1,
            "past_present_share_buffer": False,
            "top_k": 1,
            "top_p": 1.0,
            "temperature": 1.0,
            "repetition_penalty": 1.0,
            "early_stopping": True,
            "length_penalty": 1.0,
            "no_repeat_ngram_size": 0,
            "diversity_penalty": 0.0,
        },
    }


# ---------------------------------------------------------------- ours


class Ours:
    """The export compiled as the service compiles it for the CPU (compile_onnx's defaults; the
    prompts' program and the decode step programs: one taking its past gathered, one reading the
    paged cache in place, one for a single sequence, as worker.compile does), run by a Generator with the
    service's default limits (scheduler.generating.GenerationSettings), one-token steps on
    whichever program measures fastest at their batch size, as the service picks them."""

    def __init__(self, folder: Path, config: LlamaConfig, precision: str = "exported") -> None:
        import onnx

        from compiler import compile_onnx, executable
        from compiler.errors import CompilerError
        from compiler.kv_layout import (
            decode_step_graph,
            decoder_dims,
            find_cache_layout,
            one_sequence_graph,
            onnx_specs,
            paged_decode_graph,
        )

        data = (folder / "model.onnx").read_bytes()
        inputs, _ = onnx_specs(onnx.load_from_string(data))
        started = time.perf_counter()
        artifact = compile_onnx(data, "cpu", dims=decoder_dims(inputs), precision=precision)
        self.layout = find_cache_layout(artifact.signature.inputs, artifact.signature.outputs)
        decode_model = onnx.load_from_string(data)
        decode_step_graph(decode_model)
        self.programs = {
            "prefill": executable(artifact),
            "decode": executable(compile_onnx(decode_model.SerializeToString(), "cpu", precision=precision)),
        }
        one_model = onnx.ModelProto.FromString(decode_model.SerializeToString())
        one_sequence_graph(one_model)
        self.programs["one"] = executable(compile_onnx(one_model.SerializeToString(), "cpu", precision=precision))
        try:
            paged_decode_graph(decode_model, self.layout)
            paged = compile_onnx(
                decode_model.SerializeToString(), "cpu", dims=decoder_dims(onnx_specs(decode_model)[0]), precision=precision
            )
            self.programs["paged"] = executable(paged)
        except (CompilerError, ValueError) as exc:  # as the worker: the gathered programs serve
            print(f"no paged decode program: {exc}", file=sys.stderr)
        self.compile_seconds = time.perf_counter() - started
        self.artifact = artifact
        self.dtypes = {spec.name: spec.dtype for spec in artifact.signature.inputs}
        self.config = config
        self.folder = folder
        self.chosen: dict[tuple[int, int], str] = {}  # the one-token program by (batch, past) bucket

    def generator(self):
        from runtime.kv_cache import blocks_that_fit
        from runtime.tokenizer import TextCodec
        from scheduler.generating import GenerationSettings, ProgramChooser
        from scheduler.generator import Generator, GeneratorLimits

        settings = GenerationSettings()
        programs = self.programs
        chooser = ProgramChooser(
            [name for name in ("paged", "one", "decode") if name in programs] + ["prefill"], one_row=["one"]
        )
        self._chooser = chooser

        def timed(name: str, inputs):
            started = time.perf_counter()
            outputs = programs[name].run(inputs)
            return outputs, time.perf_counter() - started

        gathered = [0.0]  # the step's gather of its past, which the paged program does without

        def run_step(inputs):
            rows, tokens = inputs["input_ids"].shape
            past = inputs[self.layout.past_keys[0]].shape[2]
            name = chooser.pick(rows, past) if tokens == 1 else "prefill"
            outputs, seconds = timed(name, inputs)
            if tokens == 1:
                chooser.record(name, seconds + gathered[0])
            return outputs, seconds

        def paged_step(inputs):
            outputs, seconds = timed("paged", inputs)
            chooser.record("paged", seconds)
            return outputs, seconds

        limits = GeneratorLimits(
            num_blocks=blocks_that_fit(self.layout, settings.block_tokens, settings.kv_cache_bytes),
            block_size=settings.block_tokens,
            max_step_tokens=settings.step_tokens,
            max_running=settings.max_sequences,
            prefill_chunk=min(settings.prefill_tokens, settings.step_tokens),
            context_length=self.config.context,
        )
        codec = TextCodec.from_files(word_tokenizer_files(self.config))
        return Generator(
            self.layout,
            run_step,
            codec,
            self.dtypes,
            limits,
            name="benchmark",
            paged_step=paged_step if "paged" in programs else None,
            paged_for=lambda rows, past: chooser.pick(rows, past) == "paged",
            on_gathered=lambda seconds: gathered.__setitem__(0, seconds),
        )

    def run(self, batch: list[list[int]], tokens: int) -> tuple[list[list[float]], list[list[int]]]:
        """All of `batch` submitted at once: each stream's token times and tokens."""
        from runtime.sampling import SamplingParams
        from scheduler.generator import GenerationRequest

        generator = self.generator()
        times: list[list[float]] = [[] for _ in batch]
        ids: list[list[int]] = [[] for _ in batch]
        done = threading.Semaphore(0)

        def sink(i: int):
            def take(event) -> None:
                if event.token_id is not None:
                    times[i].append(time.perf_counter())
                    ids[i].append(event.token_id)
                if event.finish_reason:
                    done.release()

            return take

        params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
        try:
            for i, prompt in enumerate(batch):
                generator.submit(GenerationRequest(f"s{i}", prompt, params), sink(i))
            for _ in batch:
                if not done.acquire(timeout=600):
                    raise RuntimeError("our generation did not finish in 600 s")
        finally:
            generator.close()
            self.chosen.update(self._chooser.chosen())
        return times, ids


# ---------------------------------------------------------------- onnxruntime-genai and plain onnxruntime


def genai_run(model, batch: list[list[int]], tokens: int) -> tuple[list[list[float]], list[list[int]]]:
    import onnxruntime_genai as og

    length = len(batch[0]) + tokens
    params = og.GeneratorParams(model)
    # min_length keeps the end token (0) from stopping a stream early: every side makes `tokens`
    params.set_search_options(max_length=length, min_length=length, do_sample=False, batch_size=len(batch))
    generator = og.Generator(model, params)
    generator.append_tokens(np.array(batch, np.int32))
    times: list[list[float]] = [[] for _ in batch]
    ids: list[list[int]] = [[] for _ in batch]
    while not generator.is_done():
        generator.generate_next_token()
        chosen = generator.get_next_tokens()
        now = time.perf_counter()
        for i in range(len(batch)):
            times[i].append(now)
            ids[i].append(int(chosen[i]))
    return times, ids


def ort_run(session, config: LlamaConfig, prompt: list[int], tokens: int) -> tuple[list[float], list[int]]:
    """A greedy loop with the KV cache at batch 1, as an onnxruntime user writes it."""
    names = [o.name for o in session.get_outputs()]
    past = {
        f"past_key_values.{i}.{part}": np.zeros((1, config.kv_heads, 0, config.head_dim), np.float32)
        for i in range(config.layers)
        for part in ("key", "value")
    }
    feed = np.array([prompt], np.int64)
    fed = 0
    times: list[float] = []
    ids: list[int] = []
    for _ in range(tokens):
        total = fed + feed.shape[1]
        outputs = dict(
            zip(
                names,
                session.run(
                    None,
                    {
                        "input_ids": feed,
                        "attention_mask": np.ones((1, total), np.int64),
                        "position_ids": np.arange(fed, total, dtype=np.int64)[None],
                        **past,
                    },
                ),
                strict=True,
            )
        )
        token = int(np.argmax(outputs["logits"][0, -1]))
        times.append(time.perf_counter())
        ids.append(token)
        fed = total
        feed = np.array([[token]], np.int64)
        past = {
            f"past_key_values.{i}.{part}": outputs[f"present.{i}.{part}"]
            for i in range(config.layers)
            for part in ("key", "value")
        }
    return times, ids


# ---------------------------------------------------------------- streaming latency through HTTP


# a client in a process of its own (as any client is: in the server's process it would wait for
# the server's threads' interpreter lock): the arrival time of each SSE chunk that carries text,
# on CLOCK_MONOTONIC (time.perf_counter), which every process on the machine shares
_CLIENT = """
import json, sys, time, httpx
url, key, body = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
arrived = []
with httpx.Client(base_url=url, headers={"Authorization": "Bearer " + key}, timeout=600) as http:
    with http.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            now = time.perf_counter()
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                arrived.append(now)
print(json.dumps(arrived))
"""


def _arrivals_in_another_process(url: str, key: str, body: dict) -> list[float]:
    import subprocess

    done = subprocess.run(
        [sys.executable, "-c", _CLIENT, url, key, json.dumps(body)], capture_output=True, text=True, timeout=600, check=True
    )
    return json.loads(done.stdout)


def streaming_latency(folder: Path, prompt_words: int, tokens: int, streams: int) -> dict:
    """A live embedded server: the bundle uploaded as a zip (task text-generation), then `streams`
    streamed completions one after another, each read by a client process of its own; each
    token's sampling time is taken in the server by wrapping the sink the GenerationService hands
    its Generator, each SSE chunk's arrival time by the client, on the clock both share."""
    import httpx

    from api.server import BackgroundServer
    from cloud.auth import create_key
    from cloud.db import open_database
    from cloud.settings import Settings
    from registry.bundle import zip_bytes

    with tempfile.TemporaryDirectory(prefix="generation-bench-") as tmp:
        bundle = {
            name: (folder / name).read_bytes()
            for name in (
                "model.onnx",
                "tokenizer.json",
                "tokenizer_config.json",
                "generation_config.json",
                "config.json",
            )
        }
        archive = zip_bytes(bundle)
        settings = Settings(
            data_dir=Path(tmp) / "data",
            max_upload_bytes=len(archive) + sum(map(len, bundle.values())) + 16 * 1024 * 1024,
            # one C build: this part measures delivery of tokens, not the decoder's speed
            compile_candidates=("native-blas",),
        )
        db = open_database(settings)
        try:
            key = create_key(db, "bench")
        finally:
            db.dispose()
        with (
            BackgroundServer(settings) as server,
            httpx.Client(
                base_url=server.url, headers={"Authorization": f"Bearer {key}"}, timeout=600
            ) as http,
        ):
            reply = http.post(
                "/v1/models",
                files={"file": ("llama.zip", archive, "application/zip")},
                data={"name": "llama-bench", "task": "text-generation"},
            )
            if reply.status_code != 202:
                raise RuntimeError(f"upload failed: {reply.status_code} {reply.text}")
            deadline = time.monotonic() + 1800
            while True:
                version = http.get("/v1/models/llama-bench").json()["versions"][-1]
                if version["status"] in ("ready", "failed"):
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError("the server did not compile the model in 30 min")
                time.sleep(0.5)
            if version["status"] != "ready":
                raise RuntimeError(f"the server's compile failed: {version}")
            prompt = " ".join(f"w{i + 1}" for i in range(prompt_words))
            body = {
                "model": "llama-bench",
                "prompt": prompt,
                "max_tokens": tokens,
                "temperature": 0,
                "ignore_eos": True,
            }
            warm = http.post("/v1/completions", json={**body, "max_tokens": 4})
            warm.raise_for_status()
            service = server.app.state.services.engine.generation
            generators = [served.generator for served in service._served.values()]
            if len(generators) != 1:
                raise RuntimeError(f"expected one loaded generator, found {len(generators)}")
            generator = generators[0]
            sampled: list[float] = []
            original_submit = generator.submit

            def submit(request, sink: Callable) -> None:
                def timed(event) -> None:
                    if event.token_id is not None:
                        sampled.append(time.perf_counter())
                    sink(event)

                original_submit(request, timed)

            generator.submit = submit
            latencies: list[float] = []
            positions: list[int] = []  # each latency's token index in its stream (0: the first)
            for _ in range(streams):
                sampled.clear()
                arrived = _arrivals_in_another_process(server.url, key, {**body, "stream": True})
                if len(arrived) != len(sampled) or len(arrived) != tokens:
                    raise RuntimeError(
                        f"{len(arrived)} chunks for {len(sampled)} sampled tokens ({tokens} asked)"
                    )
                latencies.extend(a - s for a, s in zip(arrived, sampled, strict=True))
                positions.extend(range(len(arrived)))
            generator.submit = original_submit
    ms = np.array(latencies) * 1000
    later = ms[np.array(positions) > 0]
    return {
        "median_ms": float(np.median(ms)),
        "p99_ms": float(np.percentile(ms, 99)),
        "max_ms": float(ms.max()),
        "tokens": int(ms.size),
        "streams": streams,
        # the first token of a stream also waits for the response's start (its headers)
        "first_median_ms": float(np.median(ms[np.array(positions) == 0])),
        "later_p99_ms": float(np.percentile(later, 99)) if later.size else float("nan"),
        "latencies_ms": [round(float(x), 4) for x in ms],
        "positions": positions,
    }


# ---------------------------------------------------------------- the run


def run(args) -> dict:
    import onnxruntime as ort
    import onnxruntime_genai as og

    config = LlamaConfig()
    results: dict = {
        "load_before": loadavg(),
        "tokens": args.tokens,
        "prompt": args.prompt,
        "repeats": args.repeats,
        "streams": args.streams,
    }
    with tempfile.TemporaryDirectory(prefix="llama-onnx-") as tmp:
        folder = Path(tmp)
        write_model(folder, config)
        one = prompts(config, 1, args.prompt, seed=1)
        many = prompts(config, args.streams, args.prompt, seed=2)

        if args.streaming_only:
            print(f"streaming through a live server (load {loadavg()}) ...", file=sys.stderr, flush=True)
            results["streaming"] = streaming_latency(folder, args.prompt, args.tokens, args.stream_repeats)
            results["load_after"] = loadavg()
            return results
        session = ort.InferenceSession(str(folder / "model.onnx"), providers=["CPUExecutionProvider"])
        want = greedy_ort(session, config, one[0], min(args.tokens, 16))
        print(f"compiling with compile_onnx's defaults (load {loadavg()}) ...", file=sys.stderr, flush=True)
        ours = Ours(folder, config)
        results["compile_seconds"] = ours.compile_seconds
        results["candidate"] = ours.artifact.report.get("chosen")
        print(f"compiled in {ours.compile_seconds:.0f} s", file=sys.stderr, flush=True)

        # warm-ups (first runs load code and touch memory), and our tokens against onnxruntime's
        _, got = ours.run(one, min(args.tokens, 16))
        if got[0] != want:
            raise AssertionError(f"our greedy tokens {got[0]} differ from onnxruntime's {want}")
        print(f"compiling in precision int8 (load {loadavg()}) ...", file=sys.stderr, flush=True)
        ours8 = Ours(folder, config, "int8")
        quantized = ours8.artifact.report["precision"]
        results["int8"] = {
            "compile_seconds": ours8.compile_seconds,
            "error_vs_float": quantized["error_vs_float"],
            "weight_bytes_before": quantized["weight_bytes_before"],
            "weight_bytes_after": quantized["weight_bytes_after"],
        }
        _, got8 = ours8.run(one, min(args.tokens, 16))
        # how many greedy tokens int8 gives as the float model does before it first differs
        results["int8"]["tokens_matching"] = next(
            (i for i, (a, b) in enumerate(zip(got8[0], want)) if a != b), min(len(got8[0]), len(want))
        )
        results["genai_version"] = og.__version__
        genai_model = og.Model(str(folder))
        _, genai_ids = genai_run(genai_model, one, min(args.tokens, 16))
        results["genai_tokens_match"] = genai_ids[0] == want
        ort_run(session, config, one[0], 4)

        rates: dict[str, list[float]] = {
            k: [] for k in ("ours_1", "ours_n", "int8_1", "int8_n", "genai_1", "genai_n", "ort_1")
        }
        for repeat in range(args.repeats):
            times, _ = ours.run(one, args.tokens)
            rates["ours_1"].append(decode_rate(times))
            times, _ = ours.run(many, args.tokens)
            rates["ours_n"].append(decode_rate(times))
            times, _ = ours8.run(one, args.tokens)
            rates["int8_1"].append(decode_rate(times))
            times, _ = ours8.run(many, args.tokens)
            rates["int8_n"].append(decode_rate(times))
            times, _ = genai_run(genai_model, one, args.tokens)
            rates["genai_1"].append(decode_rate(times))
            times, _ = genai_run(genai_model, many, args.tokens)
            rates["genai_n"].append(decode_rate(times))
            times, _ = ort_run(session, config, one[0], args.tokens)
            rates["ort_1"].append(decode_rate([times]))
            print(
                f"repeat {repeat + 1}/{args.repeats} (load {loadavg()}): "
                + ", ".join(f"{k} {v[-1]:.1f}" for k, v in rates.items()),
                file=sys.stderr,
                flush=True,
            )
        results["rates"] = rates
        results["median"] = {k: statistics.median(v) for k, v in rates.items()}
        results["one_token_programs"] = {
            precision: {f"{rows}x{past}": name for (rows, past), name in sorted(chosen.items())}
            for precision, chosen in (("float32", ours.chosen), ("int8", ours8.chosen))
        }
        del ours, ours8, genai_model, session
        if not args.no_server:
            print(f"streaming through a live server (load {loadavg()}) ...", file=sys.stderr, flush=True)
            results["streaming"] = streaming_latency(folder, args.prompt, args.tokens, args.stream_repeats)
    results["load_after"] = loadavg()
    return results


def table(results: dict, command: str) -> str:
    m = results["median"]
    n = results["streams"]
    config = LlamaConfig()
    head_bytes = config.hidden * config.vocab * 4
    layer_bytes = (config.parameters() - 2 * config.vocab * config.hidden - config.hidden) * 4
    share = head_bytes / (head_bytes + layer_bytes)
    lines = [
        (
            f"Text generation on CPU ({cpu_model()}, {os.cpu_count()} logical CPUs), "
            f"{datetime.date.today().isoformat()}, load average {results['load_before']} before and "
            f"{results['load_after']} after (the machine is shared)."
        ),
        "",
        f"Command: `{command}`",
        "",
        (
            f"Model: benchmarks/llama_onnx.py's Llama-shaped decoder (2 layers, hidden 512, 8 query heads and 4 KV heads "
            f"of 64, SwiGLU 1408, vocab 32000, untied head, random float32 weights; {config.parameters() / 1e6:.1f} M "
            f"parameters). The LM head (512 x 32000, {head_bytes / 1e6:.0f} MB) is {share:.0%} of the weight bytes a "
            f"decode step reads, so this 2-layer model's step is mostly one matrix-vector product with the head."
        ),
        "",
        (
            f"Greedy decoding, prompt {results['prompt']} tokens, {results['tokens']} generated tokens per stream; "
            f"tokens/s = tokens after each stream's first / (last token time - first token time), prefill excluded; "
            f"median of {results['repeats']} repeats."
        ),
        "",
        (
            f"| decode tokens/s | ours (compile_onnx + Generator) | ours, precision int8 | "
            f"onnxruntime-genai {results.get('genai_version', '')} | onnxruntime greedy loop |"
        ),
        "|---|---:|---:|---:|---:|",
        f"| 1 stream | {m['ours_1']:.1f} | {m['int8_1']:.1f} | {m['genai_1']:.1f} | {m['ort_1']:.1f} |",
        (
            f"| {n} streams, aggregate | {m['ours_n']:.1f} | {m['int8_n']:.1f} | {m['genai_n']:.1f} (one batch of {n}) "
            "| n/a (batch 1 loop) |"
        ),
        (
            f"| {n} streams / 1 stream | {m['ours_n'] / m['ours_1']:.2f}x | {m['int8_n'] / m['int8_1']:.2f}x | "
            f"{m['genai_n'] / m['genai_1']:.2f}x | |"
        ),
        "",
    ]
    ratio_genai = m["ours_1"] / m["genai_1"]
    ratio_batch = m["ours_n"] / m["ours_1"]
    verdict = [
        f"- ours / onnxruntime-genai at 1 stream: **{ratio_genai:.2f}x** (target >= 1): "
        + ("met." if ratio_genai >= 1 else "**missed**."),
        f"- ours, {n} streams / 1 stream: **{ratio_batch:.2f}x** (target >= 4): "
        + ("met." if ratio_batch >= 4 else "**missed**."),
        f"- ours / plain onnxruntime loop at 1 stream: {m['ours_1'] / m['ort_1']:.2f}x.",
    ]
    q = results["int8"]
    verdict.append(
        f"- precision int8 (weight-only, per-channel scales; the embedding and every product's weight): "
        f"{m['int8_1'] / m['ours_1']:.2f}x ours in float32 at 1 stream, {m['int8_n'] / m['ours_n']:.2f}x at {n} "
        f"streams, {m['int8_1'] / m['genai_1']:.2f}x onnxruntime-genai (float32) at 1 stream; weights "
        f"{q['weight_bytes_before'] / 1e6:.0f} MB -> {q['weight_bytes_after'] / 1e6:.0f} MB, error against the float "
        f"model {q['error_vs_float']:.3g} of the largest logit (compile check), the first {q['tokens_matching']} greedy "
        f"tokens equal to the float model's; compiled in {q['compile_seconds']:.0f} s."
    )
    stream = results.get("streaming")
    if stream:
        verdict.append(
            f"- a streamed token, sampled to its SSE chunk at the client (embedded server, an httpx client in a "
            f"process of its own, one stream at a time, {stream['streams']} streams of {results['tokens']} tokens, {stream['tokens']} tokens): median "
            f"**{stream['median_ms']:.2f} ms**, p99 **{stream['p99_ms']:.2f} ms** (max {stream['max_ms']:.2f} ms) "
            "(target: within 2 ms): "
            + (
                "met."
                if stream["p99_ms"] <= 2
                else "median met, p99 **missed**."
                if stream["median_ms"] <= 2
                else "**missed**."
            )
        )
    verdict.append(
        f"- our compile of the export (compile_onnx's defaults, as the service compiles): "
        f"{results['compile_seconds']:.0f} s, candidate chosen: {results.get('candidate')}."
    )
    if results.get("one_token_programs"):
        verdict.append(
            "- one-token steps ran on (per bucket of batch size x past length, as the service measures and picks "
            "among the paged decode program, the one-sequence one, the gathered one and the general one): "
            + "; ".join(
                f"{precision} " + ", ".join(f"{bucket}: {name}" for bucket, name in chosen.items())
                for precision, chosen in results["one_token_programs"].items()
            )
            + "."
        )
    notes = [
        "",
        "Per-repeat tokens/s: "
        + "; ".join(f"{k} {', '.join(f'{x:.1f}' for x in v)}" for k, v in results["rates"].items())
        + ".",
        "",
        (
            "onnxruntime-genai runs the same model.onnx with a genai_config.json (type llama, separate past and "
            f"present, no shared buffer) written next to it; its {n} streams are one batch of {n} equal-length prompts "
            "(its generator takes a batch at creation, not streams joining later). The sampling time of the "
            "streaming figure is when the Generator hands the token's event to the service's sink (after sampling "
            "and detokenizing); the arrival time is when the client process's httpx yields the chunk's line (both on CLOCK_MONOTONIC)."
        ),
    ]
    return "\n".join([*lines, *verdict, *notes])


def streaming_lines(results: dict) -> str:
    """The streaming figure alone (--streaming-only)."""
    s = results["streaming"]
    return (
        f"streamed token, sampled to its SSE chunk at the client ({s['streams']} streams of {results['tokens']} "
        f"tokens, load {results['load_before']} before, {results['load_after']} after): median {s['median_ms']:.2f} ms, "
        f"p99 {s['p99_ms']:.2f} ms, max {s['max_ms']:.2f} ms; first tokens' median {s['first_median_ms']:.2f} ms, "
        f"p99 of the others {s['later_p99_ms']:.2f} ms"
    )


def write_section(path: Path, text: str) -> None:
    section = f"{BEGIN}\n{text}\n{END}"
    current = path.read_text() if path.exists() else ""
    if BEGIN in current and END in current:
        before, rest = current.split(BEGIN, 1)
        _, after = rest.split(END, 1)
        path.write_text(before + section + after)
    else:
        heading = "\n## Text generation (benchmarks/generation.py)\n\n"
        path.write_text(current.rstrip("\n") + "\n" + heading + section + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: fewer tokens and repeats")
    parser.add_argument("--tokens", type=int, help="generated tokens per stream (default 128; quick 16)")
    parser.add_argument("--prompt", type=int, default=32, help="prompt tokens (default 32)")
    parser.add_argument("--repeats", type=int, help="repeats of each throughput figure (default 3; quick 1)")
    parser.add_argument("--streams", type=int, default=16, help="concurrent streams (default 16)")
    parser.add_argument("--stream-repeats", type=int, help="streamed completions timed (default 8; quick 2)")
    parser.add_argument("--no-server", action="store_true", help="skip the HTTP streaming latency")
    parser.add_argument(
        "--streaming-only", action="store_true", help="only the HTTP streaming latency (no throughput figures)"
    )
    parser.add_argument("--write", type=Path, help="write the table into this markdown file's marked section")
    parser.add_argument("--json", type=Path, help="also write the raw results as JSON here")
    args = parser.parse_args(argv)
    if args.streaming_only and (args.no_server or args.write):
        parser.error("--streaming-only measures the server alone: not with --no-server or --write")
    args.tokens = args.tokens or (16 if args.quick else 128)
    args.repeats = args.repeats or (1 if args.quick else 3)
    args.stream_repeats = args.stream_repeats or (2 if args.quick else 8)
    command = ".venv/bin/python -m benchmarks.generation " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    results = run(args)
    text = table(results, command.strip()) if "median" in results else streaming_lines(results)
    print(text)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    if args.write:
        write_section(args.write, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
