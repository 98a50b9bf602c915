"""The generation core without a compiler: the paged KV cache, the iteration scheduler and the
step loop, driven by a toy decoder whose next token is the sum of every token it attends to
(mod the vocabulary). Any slip in the cache (a block read twice, a token lost, padding not
masked, a preempted sequence resumed wrong) changes the tokens."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from compiler.artifact import TensorSpec
from compiler.errors import UnsupportedModel
from compiler.kv_layout import KV_SLOTS, CacheLayout, find_cache_layout, pool_input
from runtime.kv_cache import BlockAllocator, HostKVStorage, OutOfBlocks, PagedKVCache
from runtime.sampling import Sampler, SamplingParams
from runtime.tokenizer import IncrementalText, TextCodec
from scheduler.continuous import IterationScheduler, SequenceState
from scheduler.generator import GenerationRefused, GenerationRequest, Generator, GeneratorLimits, TokenEvent

VOCAB = 97
LAYOUT = CacheLayout(
    layers=2,
    kv_heads=1,
    head_dim=2,
    dtype="float32",
    vocab=VOCAB,
    past_keys=("past_key_values.0.key", "past_key_values.1.key"),
    past_values=("past_key_values.0.value", "past_key_values.1.value"),
    present_keys=("present.0.key", "present.1.key"),
    present_values=("present.0.value", "present.1.value"),
    mask_input="attention_mask",
    position_input="position_ids",
)


def toy_decoder(inputs: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], float]:
    """Layer l stores (token, position) as its key and (token * (l + 1), 1) as its value; the
    logits at each position point at (sum of the attended values of layer 0 + position of the
    query) % VOCAB: a sum over the unmasked past and the chunk's causal prefix."""
    ids = inputs["input_ids"]
    mask = inputs["attention_mask"]
    positions = inputs["position_ids"]
    batch, count = ids.shape
    outputs: dict[str, np.ndarray] = {}
    for layer in range(2):
        new_k = np.stack([ids, positions], axis=-1).astype(np.float32)[:, None]  # [b, 1, n, 2]
        new_v = np.stack([ids * (layer + 1), np.ones_like(ids)], axis=-1).astype(np.float32)[:, None]
        outputs[f"present.{layer}.key"] = np.concatenate(
            [inputs[f"past_key_values.{layer}.key"], new_k], axis=2
        )
        outputs[f"present.{layer}.value"] = np.concatenate(
            [inputs[f"past_key_values.{layer}.value"], new_v], axis=2
        )
    values = outputs["present.0.value"][:, 0, :, 0]  # [b, past + n]
    past = values.shape[1] - count
    logits = np.zeros((batch, count, VOCAB), np.float32)
    for b in range(batch):
        for q in range(count):
            visible = mask[b, : past + q + 1].astype(bool)
            total = int(values[b, : past + q + 1][visible].sum()) + int(positions[b, q])
            logits[b, q, total % VOCAB] = 1.0
    outputs["logits"] = logits
    return outputs, 0.001 * batch * count


def toy_paged_decoder(inputs: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], float]:
    """toy_decoder as a paged decode program (compiler.kv_layout.paged_decode_graph): the past
    read from the layers' pools at kv_slots, the new tokens' keys and values returned alone."""
    slots = inputs[KV_SLOTS]
    unpaged = {
        name: value for name, value in inputs.items() if name != KV_SLOTS and not name.startswith("kv_pool.")
    }
    for layer in range(2):
        for part, past in (("key", LAYOUT.past_keys[layer]), ("value", LAYOUT.past_values[layer])):
            unpaged[past] = inputs[pool_input(layer, part)][slots].transpose(0, 2, 1, 3)
    outputs, seconds = toy_decoder(unpaged)
    for name in (*LAYOUT.present_keys, *LAYOUT.present_values):
        outputs[name] = outputs[name][:, :, -1:]
    return outputs, seconds


def reference(prompt: list[int], steps: int) -> list[int]:
    tokens = list(prompt)
    out = []
    for _ in range(steps):
        nxt = (sum(tokens) + len(tokens) - 1) % VOCAB
        tokens.append(nxt)
        out.append(nxt)
    return out


class FakeCodec:
    """Token i is the character chr(65 + i % 26); no end-of-sequence token."""

    def eos_token_ids(self) -> tuple[int, ...]:
        return ()

    def decode(self, ids) -> str:
        return "".join(chr(65 + i % 26) for i in ids)


DTYPES = {"input_ids": "int64", "attention_mask": "int64", "position_ids": "int64"}


def run_all(
    generator: Generator, prompts: dict[str, list[int]], params: SamplingParams, timeout: float = 30
) -> dict[str, list[TokenEvent]]:
    events: dict[str, list[TokenEvent]] = {key: [] for key in prompts}
    done = threading.Barrier(len(prompts) + 1, timeout=timeout)

    def sink_for(key: str):
        def sink(event: TokenEvent) -> None:
            events[key].append(event)
            if event.finish_reason is not None:
                threading.Thread(target=done.wait).start()

        return sink

    for key, prompt in prompts.items():
        generator.submit(GenerationRequest(key, prompt, params), sink_for(key))
    done.wait()
    return events


def tokens_of(events: list[TokenEvent]) -> list[int]:
    return [e.token_id for e in events if e.token_id is not None]


@pytest.mark.parametrize(
    "limits",
    [
        GeneratorLimits(
            num_blocks=64, block_size=4, max_step_tokens=64, prefill_chunk=64, context_length=512
        ),
        # chunked prompts, a step budget smaller than the decodes, blocks of one token
        GeneratorLimits(num_blocks=200, block_size=1, max_step_tokens=5, prefill_chunk=3, context_length=512),
        # a pool too small for all at once: sequences wait, and running ones are preempted
        GeneratorLimits(num_blocks=12, block_size=4, max_step_tokens=32, prefill_chunk=8, context_length=512),
    ],
    ids=["roomy", "chunked", "preempting"],
)
@pytest.mark.parametrize("paged", [False, True], ids=["gathered", "paged"])
def test_continuous_batching_generates_what_one_sequence_alone_would(
    limits: GeneratorLimits, paged: bool
) -> None:
    generator = Generator(
        LAYOUT,
        toy_decoder,
        FakeCodec(),  # type: ignore[arg-type]
        DTYPES,
        limits,
        paged_step=toy_paged_decoder if paged else None,
    )
    try:
        rng = np.random.default_rng(0)
        prompts = {
            f"s{i}": [int(t) for t in rng.integers(0, VOCAB, size=length)]
            for i, length in enumerate([1, 7, 13, 2, 21, 5])
        }
        params = SamplingParams(max_tokens=17, temperature=0)
        events = run_all(generator, prompts, params)
        for key, prompt in prompts.items():
            assert tokens_of(events[key]) == reference(prompt, 17), key
            last = events[key][-1]
            assert last.finish_reason == "length"
            assert last.usage is not None and last.usage.completion_tokens == 17
            assert last.usage.prompt_tokens == len(prompt)
            assert last.usage.billed_seconds > 0
        assert generator.free_blocks == limits.num_blocks  # every block back in the pool
        assert (generator.decoder.paged_steps > 0) == paged
        if limits.num_blocks == 12:
            assert sum(events[k][-1].usage.preemptions for k in prompts) > 0  # the pool did run short
    finally:
        generator.close()


def test_billed_seconds_add_up_to_the_device_time_of_the_steps() -> None:
    seen: list[float] = []

    def timed(inputs):
        outputs, seconds = toy_decoder(inputs)
        seen.append(seconds)
        return outputs, seconds

    generator = Generator(LAYOUT, timed, FakeCodec(), DTYPES, GeneratorLimits(num_blocks=64, block_size=4))  # type: ignore[arg-type]
    try:
        events = run_all(
            generator, {"a": [1, 2, 3], "b": [4] * 9}, SamplingParams(max_tokens=5, temperature=0)
        )
        billed = sum(events[k][-1].usage.billed_seconds for k in events)
        assert billed == pytest.approx(sum(seen))
    finally:
        generator.close()


def test_a_cancelled_sequence_is_freed_and_the_others_go_on() -> None:
    started = threading.Event()
    release = threading.Event()

    def slow(inputs):
        started.set()
        release.wait(5)
        return toy_decoder(inputs)

    generator = Generator(LAYOUT, slow, FakeCodec(), DTYPES, GeneratorLimits(num_blocks=32, block_size=4))  # type: ignore[arg-type]
    try:
        got: list[TokenEvent] = []
        generator.submit(
            GenerationRequest("gone", [1, 2, 3], SamplingParams(max_tokens=50, temperature=0)), got.append
        )
        started.wait(5)
        generator.cancel("gone")
        release.set()
        for _ in range(200):
            if got and got[-1].finish_reason:
                break
            threading.Event().wait(0.01)
        assert got[-1].finish_reason == "cancelled"
        assert len(tokens_of(got)) < 50
        events = run_all(generator, {"next": [5, 6]}, SamplingParams(max_tokens=4, temperature=0))
        assert tokens_of(events["next"]) == reference([5, 6], 4)
        assert generator.free_blocks == 32
    finally:
        generator.close()


def test_requests_that_can_never_fit_are_refused_naming_the_limit() -> None:
    limits = GeneratorLimits(num_blocks=4, block_size=4, context_length=64)
    generator = Generator(LAYOUT, toy_decoder, FakeCodec(), DTYPES, limits)  # type: ignore[arg-type]
    try:
        with pytest.raises(GenerationRefused, match="KV cache"):
            generator.submit(
                GenerationRequest("big", [1] * 10, SamplingParams(max_tokens=10)), lambda e: None
            )
        with pytest.raises(GenerationRefused, match="context is 64 tokens"):
            generator.check(60, SamplingParams(max_tokens=10))
        with pytest.raises(GenerationRefused, match="empty"):
            generator.check(0, SamplingParams(max_tokens=1))
    finally:
        generator.close()


def test_block_allocator_refuses_double_frees_and_overdrafts() -> None:
    allocator = BlockAllocator(4, 2)
    blocks = allocator.allocate(3)
    with pytest.raises(OutOfBlocks):
        allocator.allocate(2)
    allocator.free(blocks)
    with pytest.raises(ValueError, match="freed twice"):
        allocator.free(blocks[:1])
    assert allocator.free_count == 4


def test_paged_cache_gathers_what_was_written_across_blocks() -> None:
    cache = PagedKVCache(LAYOUT, num_blocks=8, block_size=3)
    table = cache.allocator.allocate(3)
    rng = np.random.default_rng(1)
    keys = [rng.standard_normal((1, 7, 2)).astype(np.float32) for _ in range(2)]
    values = [rng.standard_normal((1, 7, 2)).astype(np.float32) for _ in range(2)]
    for start, stop in ((0, 4), (4, 7)):  # two steps' writes, [batch, heads, n, dim] per layer
        slots = cache.slots([table], [start], [stop], stop - start)
        cache.write(slots, [k[None, :, start:stop] for k in keys], [v[None, :, start:stop] for v in values])
    past_k, past_v = cache.gather([table], [7], width=9)
    for layer in range(2):
        np.testing.assert_array_equal(past_k[layer][0, :, 2:], keys[layer])
        np.testing.assert_array_equal(past_v[layer][0, :, 2:], values[layer])
        assert np.isfinite(past_k[layer][0, :, :2]).all()  # padding: finite, hidden by the mask
        # the pool a paged program reads is the cache itself, the same tokens at the same slots
        key_pool, value_pool = cache.pools(layer)
        assert np.shares_memory(key_pool, cache.storage.keys) and key_pool.flags.c_contiguous
        slots = cache.slots([table], [0], [7], 9)
        np.testing.assert_array_equal(key_pool[slots[0, 2:]].transpose(1, 0, 2), keys[layer])
        np.testing.assert_array_equal(value_pool[slots[0, 2:]].transpose(1, 0, 2), values[layer])


def test_scheduler_decodes_before_prefilling_newcomers() -> None:
    scheduler = IterationScheduler(BlockAllocator(100, 4), max_step_tokens=10, prefill_chunk=8)
    old = SequenceState("old", [1] * 5)
    scheduler.add(old)
    scheduler.advance(first := scheduler.plan())
    assert [c.seq_id for c in first.prefills] == ["old"] and first.prefills[0].count == 5
    old.tokens.append(2)  # sampled
    scheduler.add(SequenceState("new", [3] * 30))
    plan = scheduler.plan()
    assert [c.seq_id for c in plan.decodes] == ["old"]
    assert [(c.seq_id, c.count, c.samples) for c in plan.prefills] == [
        ("new", 8, False)
    ]  # a chunk, in budget


def test_sampling_is_reproducible_under_a_seed_and_respects_top_k() -> None:
    logits = np.linspace(0, 3, 50).astype(np.float32)
    params = SamplingParams(temperature=1.0, top_k=3, seed=7)
    first = [Sampler(params).choose(logits) for _ in range(3)]
    draws = Sampler(params)
    many = {draws.choose(logits) for _ in range(300)}
    assert first == [first[0]] * 3
    assert many <= {47, 48, 49} and len(many) == 3
    assert Sampler(SamplingParams(temperature=0)).choose(logits) == 49
    nucleus = Sampler(SamplingParams(temperature=1.0, top_p=0.01, seed=1))
    assert {nucleus.choose(logits) for _ in range(20)} == {49}
    assert SamplingParams(max_tokens=0).problems() == ["max_tokens must be at least 1, not 0"]
    assert SamplingParams(seed=-1).problems() == ["seed must be between 0 and 2**64 - 1, not -1"]


def test_incremental_text_holds_back_a_stop_string_and_never_sends_it() -> None:
    text = IncrementalText(FakeCodec(), stop=["CD"])  # type: ignore[arg-type]
    pieces = [text.add(i) for i in [0, 1, 2, 3, 4]]  # A B C D E
    assert pieces[:2] == ["A", "B"]
    assert pieces[2] == ""  # "C" may begin "CD"
    assert text.stopped and "".join(pieces) == "AB"


def _specs(names_shapes):
    return [TensorSpec(name, tuple(shape), dtype) for name, shape, dtype in names_shapes]


def test_cache_layout_is_found_and_a_graph_it_cannot_map_is_refused_naming_the_input() -> None:
    inputs = _specs(
        [
            ("input_ids", ["batch", "seq"], "int64"),
            ("attention_mask", ["batch", "total"], "int64"),
            ("past_key_values.0.key", ["batch", 2, "past", 8], "float32"),
            ("past_key_values.0.value", ["batch", 2, "past", 8], "float32"),
        ]
    )
    outputs = _specs(
        [
            ("logits", ["batch", "seq", 320], "float32"),
            ("present.0.key", ["batch", 2, "total", 8], "float32"),
            ("present.0.value", ["batch", 2, "total", 8], "float32"),
        ]
    )
    layout = find_cache_layout(inputs, outputs)
    assert (layout.layers, layout.kv_heads, layout.head_dim, layout.vocab) == (1, 2, 8, 320)
    assert layout.position_input is None and layout.mask_input == "attention_mask"
    assert CacheLayout.from_json(layout.to_json()) == layout
    assert layout.cache_branch_input is None and "cache_branch_input" not in layout.to_json()
    # a merged decoder's use_cache_branch is known (bound to True before it is compiled) ...
    merged = find_cache_layout([*inputs, *_specs([("use_cache_branch", [1], "bool")])], outputs)
    assert merged.cache_branch_input == "use_cache_branch" and CacheLayout.from_json(merged.to_json()) == merged
    # ... but only as a one-element bool
    with pytest.raises(UnsupportedModel, match="'use_cache_branch' .* must be a bool of shape \\[1\\], not \\['1'\\] int64"):
        find_cache_layout([*inputs, *_specs([("use_cache_branch", [1], "int64")])], outputs)
    with pytest.raises(UnsupportedModel, match="'use_cache_branch' .* must be a bool of shape"):
        find_cache_layout([*inputs, *_specs([("use_cache_branch", ["batch"], "bool")])], outputs)
    with pytest.raises(UnsupportedModel, match="input 'token_type_ids' is not one a decoder step can be given"):
        find_cache_layout([*inputs, *_specs([("token_type_ids", ["batch", "seq"], "int64")])], outputs)
    with pytest.raises(UnsupportedModel, match="layer 0 has no value"):
        find_cache_layout(inputs[:3], outputs)
    with pytest.raises(UnsupportedModel, match="no input named 'input_ids'"):
        find_cache_layout(inputs[1:], outputs)
    with pytest.raises(UnsupportedModel, match="no past_key_values"):
        find_cache_layout(inputs[:2], outputs)


def test_chat_template_renders_and_a_failing_template_is_named(tmp_path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0, "hi": 1, "there": 2}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
    files = {
        "tokenizer.json": tokenizer.to_str().encode(),
        "tokenizer_config.json": f'{{"chat_template": {__import__("json").dumps(template)}}}'.encode(),
    }
    codec = TextCodec.from_files(files)
    assert codec.render_chat([{"role": "user", "content": "hi"}]) == "user: hi\nassistant:"
    assert codec.encode("hi there") == [1, 2]
    strict = {
        **files,
        "tokenizer_config.json": b'{"chat_template": "{{ raise_exception(\'no system role\') }}"}',
    }
    from runtime.tokenizer import TokenizerError

    with pytest.raises(TokenizerError, match="no system role"):
        TextCodec.from_files(strict).render_chat([{"role": "system", "content": "x"}])
    with pytest.raises(TokenizerError, match="does not parse"):
        TextCodec.from_files({**files, "tokenizer_config.json": b'{"chat_template": "{% for %}"}'})
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        TextCodec.from_files({"tokenizer.json": b"{not json"})


def test_one_token_steps_run_the_program_that_measures_faster_at_their_batch_size() -> None:
    from scheduler.generating import ProgramChooser

    chooser = ProgramChooser(["decode", "general"])
    speed = {("decode", 1): 1.0, ("general", 1): 2.0, ("decode", 16): 5.0, ("general", 16): 3.0}
    for rows in [1, 16, 12, 1, 9, 16, 1, 16, 1, 16, 1, 16, 1]:  # 12 and 9 fall in 16's bucket
        program = chooser.pick(rows)
        chooser.record(program, speed[(program, 1 if rows == 1 else 16)])
    assert chooser.chosen() == {(1, 64): "decode", (16, 64): "general"}
    assert chooser.pick(1) == "decode" and chooser.pick(13) == "general"
    assert ProgramChooser(["only"]).pick(5) == "only"


def test_the_choice_is_made_again_as_the_past_grows() -> None:
    """A program reading the cache in place loses at a short past and wins at a long one."""
    from scheduler.generating import ProgramChooser

    chooser = ProgramChooser(["paged", "gathered"])
    for past in range(1, 300):
        program = chooser.pick(8, past)
        chooser.record(program, {"paged": 2.0, "gathered": 1.0 + past / 100}[program])
    assert chooser.chosen() == {(8, 64): "gathered", (8, 128): "gathered", (8, 256): "paged", (8, 512): "paged"}
    assert chooser.pick(8, 40) == "gathered" and chooser.pick(5, 400) == "paged"


def test_a_program_for_one_sequence_is_tried_and_run_on_one_row_steps_only() -> None:
    from scheduler.generating import ProgramChooser

    chooser = ProgramChooser(["one", "decode", "general"], one_row=["one"])
    speed = {"one": 1.0, "decode": 2.0, "general": 3.0}
    ran: dict[int, set[str]] = {1: set(), 16: set()}
    for rows in [1, 16, 3] * 12:
        program = chooser.pick(rows)
        ran[1 if rows == 1 else 16].add(program)
        chooser.record(program, speed[program])
    assert ran == {1: {"one", "decode", "general"}, 16: {"decode", "general"}}
    assert chooser.chosen() == {(1, 64): "one", (4, 64): "decode", (16, 64): "decode"}
    assert chooser.pick(2) != "one"


def test_the_service_refuses_past_its_waiting_limit_and_bills_each_sequence_once() -> None:
    from types import SimpleNamespace

    from cloud.errors import Overloaded
    from scheduler.generating import GenerationService, GenerationSettings
    from scheduler.observer import NO_OBSERVER

    gate = threading.Event()

    class GatedRuntime:
        def signature(self, key):
            return SimpleNamespace(inputs=[TensorSpec(name, (), dtype) for name, dtype in DTYPES.items()])

        def kv_storage(self, layout, pool_slots):
            return HostKVStorage(layout, pool_slots)

        def run_batch(self, key, requests, rows):
            gate.wait(10)
            outputs, seconds = toy_decoder(requests[0])
            return SimpleNamespace(outputs=[outputs], exec_seconds=seconds)

    class Ledger:
        def __init__(self) -> None:
            self.usages = []

        def record(self, usages) -> None:
            self.usages.extend(usages)

    ledger = Ledger()
    settings = GenerationSettings(
        kv_cache_bytes=64 * LAYOUT.block_bytes(4), block_tokens=4, max_sequences=1, max_waiting=1
    )
    service = GenerationService(
        {"cpu": GatedRuntime()}, lambda bundle: FakeCodec(), ledger, {"cpu": 2.0}, settings, NO_OBSERVER
    )
    route = SimpleNamespace(
        version_id=1,
        target="cpu",
        artifact_key="k",
        model_name="m",
        version=1,
        tenant_id=7,
        tenant_name="t",
        bundle={"layout": LAYOUT.to_json(), "context_length": 512},
    )
    finished = threading.Semaphore(0)

    def sink(event: TokenEvent) -> None:
        if event.finish_reason:
            finished.release()

    try:
        params = SamplingParams(max_tokens=3, temperature=0)
        service.start(route, GenerationRequest("a", [1, 2], params), sink)  # runs
        service.start(route, GenerationRequest("b", [3], params), sink)  # waits: one waiting, the limit
        with pytest.raises(Overloaded, match="waiting"):
            service.start(route, GenerationRequest("c", [4], params), sink)
        gate.set()
        assert finished.acquire(timeout=10) and finished.acquire(timeout=10)
        service._writer.submit(lambda: None).result(timeout=10)  # the ledger's writes are done
        assert sorted(u.request_id for u in ledger.usages) == ["a", "b"]
        assert all(
            u.completion_tokens == 3 and u.tenant_id == 7 and u.price_per_second == 2.0 for u in ledger.usages
        )
        assert [u.prompt_tokens for u in sorted(ledger.usages, key=lambda u: u.request_id)] == [2, 1]
        assert service.free_blocks(1) == 64
    finally:
        gate.set()
        service.close()


@pytest.mark.parametrize("fixture", ["llama", "gpt2", "qwen2"])
def test_incremental_text_decodes_a_window_yet_hands_out_what_the_whole_decode_gives(fixture) -> None:
    from pathlib import Path

    folder = Path(__file__).parent / "fixtures" / "generation" / fixture
    codec = TextCodec.from_files(
        {f.name: f.read_bytes() for f in folder.iterdir() if f.is_file() and f.suffix in (".json", ".txt", ".model")}
    )
    rng = np.random.default_rng(3)
    text = "Héllo wörld, 你好 — 🙂🙂 tabs\t and  spaces. Don't stop! ü ." * 3
    cases = [codec.encode(text)[:n] for n in (1, 7, 40, 120)]
    cases += [rng.integers(0, codec.vocab_size, n).tolist() for n in (1, 30, 150)]  # byte pieces too
    for ids in cases:
        whole = codec.decode(ids)
        for stop in ((), ("ö",), ("stop",)):
            pieces = IncrementalText(codec, stop)
            streamed = "".join(pieces.add(i) for i in ids) + pieces.flush()
            cut = whole.find(stop[0]) if stop else -1
            assert streamed == (whole[:cut] if cut >= 0 else whole), (ids, stop)


def test_a_decode_token_is_sent_before_a_newcomer_prompt_of_the_same_step_runs() -> None:

    order: list[str] = []

    def decoder(inputs):
        rows, count = inputs["input_ids"].shape
        order.append(f"run {rows}x{count}")
        return toy_decoder(inputs)

    generator = Generator(LAYOUT, decoder, FakeCodec(), DTYPES, GeneratorLimits(num_blocks=64, block_size=4))
    try:
        events: dict[str, list[TokenEvent]] = {"a": [], "b": []}
        done = threading.Semaphore(0)

        def sink_for(key: str):
            def sink(event: TokenEvent) -> None:
                events[key].append(event)
                if event.token_id is not None:
                    order.append(f"token {key}")
                    if key == "a" and len(events["a"]) == 1:  # a's prompt ran: b joins the next step
                        generator.submit(GenerationRequest("b", [5] * 9, params), sink_for("b"))
                if event.finish_reason is not None:
                    done.release()

            return sink

        params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
        generator.submit(GenerationRequest("a", [1, 2], params), sink_for("a"))
        assert done.acquire(timeout=10) and done.acquire(timeout=10)
        # in the step b's prompt joined, a's token went out between a's decode and b's prompt
        joined = order.index("run 1x9")
        assert order[joined - 2 : joined] == ["run 1x1", "token a"]
        assert tokens_of(events["a"]) == reference([1, 2], 3)
        assert all(e[-1].usage is not None and e[-1].usage.billed_seconds > 0 for e in events.values())
    finally:
        generator.close()


def test_a_step_program_waits_for_the_tokens_before_it_to_be_written_up_to_its_limit() -> None:
    import time

    from scheduler.generating import _Deliveries

    deliveries = _Deliveries(limit_s=5.0)
    one, two = deliveries.open(), deliveries.open()
    deliveries.handed(one)
    deliveries.handed(two)
    threading.Timer(0.05, deliveries.written, (one,)).start()
    threading.Timer(0.1, deliveries.close, (two,)).start()  # a stream closed with a token unread
    started = time.monotonic()
    deliveries.wait()
    assert 0.08 < time.monotonic() - started < 4 and deliveries.pending == 0
    deliveries.handed(two)  # a closed stream's tokens are never waited for
    assert deliveries.pending == 0
    slow = _Deliveries(limit_s=0.05)
    slow.handed(slow.open())  # never written: the step goes on after the limit
    started = time.monotonic()
    slow.wait()
    assert time.monotonic() - started < 2
