"""On a GPU runtime the KV cache is the runtime's state in device memory
(runtime.cuda.DeviceKVStorage), run here on the CUDA emulator's driver: the pools are allocated
once through the program's driver, the paged decode program reads them in place, the new tokens'
keys and values are scattered into them on the device, the fallback programs get their past
gathered there, and closing the generator frees them. Greedy generation of the tiny GPT-2
through all of it gives transformers' tokens, and no pool byte is ever downloaded."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import onnx
import pytest

from cloud.storage import LocalObjectStore, load_artifact
from compiler import Artifact, compile_onnx
from compiler.backends.cuda import DeviceTensor, SlotCopies
from compiler.backends.cuda_emulator import EmulatedDriver
from compiler.kv_layout import decoder_dims, find_cache_layout, onnx_specs
from compiler.targets import EXPORTED
from runtime import CudaDevice, Runtime
from runtime.kv_cache import HostKVStorage, PagedKVCache
from runtime.sampling import SamplingParams
from scheduler.generating import GenerationService, GenerationSettings
from scheduler.generator import GenerationRequest
from scheduler.observer import NO_OBSERVER
from tests.test_generation_core import LAYOUT
from tests.test_generation_models import CaseEvents, codec_of
from worker.compile import _decode_phase, compile_here

FIXTURES = Path(__file__).parent / "fixtures" / "generation"
MANIFEST = json.loads((FIXTURES / "manifest.json").read_text())
GPT2 = FIXTURES / "gpt2/model_torchscript.onnx"
# emulated steps are slow: a few prompts, a few tokens each (greedy: the reference's first ones)
CASES = MANIFEST["models"]["gpt2"]["greedy"][:3]
NEW_TOKENS = 8


class RecordingDriver(EmulatedDriver):
    """The emulated device, recording each download's source range and what is still allocated."""

    def __init__(self) -> None:
        super().__init__()
        self.downloads: list[tuple[int, int]] = []

    def download(self, address: int, array: np.ndarray) -> None:
        self.downloads.append((address, array.nbytes))
        super().download(address, array)

    def live(self) -> set[int]:
        return set(self._blocks)


@pytest.fixture(scope="module")
def gpu_programs(tmp_path_factory) -> dict[str, Artifact]:
    """The tiny GPT-2 for an H100 as the worker ships it: its general program, and the paged decode
    program the worker's decode phase compiles for a GPU target now (with the gathered and
    one-sequence ones)."""
    store = LocalObjectStore(tmp_path_factory.mktemp("store"))
    data = GPT2.read_bytes()
    store.put("graph", data)
    version = SimpleNamespace(id=1, target="h100", bundle={}, graph_key="graph", precision=EXPORTED)
    keys, report = _decode_phase(version, store, "program", compile_here)
    assert keys == {
        "decode_paged_key": "program-decode-paged",
        "decode_artifact_key": "program-decode",
        "decode_one_key": "program-decode-one",
    }, report
    assert report["paged"]["chosen"] and "paged_refused" not in report
    general = compile_onnx(data, "h100", dims=decoder_dims(onnx_specs(onnx.load_from_string(data))[0]))
    return {
        "prefill": general,
        "decode-paged": load_artifact(store, keys["decode_paged_key"], Artifact.from_files),
    }


@pytest.mark.parametrize("dtype", ["float32", "float16", "float64"])
def test_device_pools_store_and_gather_what_host_pools_do(dtype: str) -> None:
    layout = dataclasses.replace(LAYOUT, dtype=dtype)
    driver = RecordingDriver()
    device = Runtime(CudaDevice("h100", driver), {}.__getitem__).kv_storage(layout, 8 * 3)
    caches = [PagedKVCache(layout, 8, 3, device), PagedKVCache(layout, 8, 3, HostKVStorage(layout, 8 * 3))]
    rng = np.random.default_rng(1)
    shape = (2, layout.kv_heads, 7, layout.head_dim)
    keys = [rng.standard_normal(shape).astype(dtype) for _ in range(layout.layers)]
    values = [rng.standard_normal(shape).astype(dtype) for _ in range(layout.layers)]
    tables = [[5, 3, 7], [2, 6, 1]]  # block 0 unused: the padding reads its slot 0
    for cache in caches:
        for start, stop in ((0, 4), (4, 7)):  # two steps' writes, [batch, heads, n, dim] per layer
            slots = cache.slots(tables, [start] * 2, [stop] * 2, stop - start)
            cache.write(slots, [k[:, :, start:stop] for k in keys], [v[:, :, start:stop] for v in values])
    gathered = [cache.gather(tables, [7, 5], width=9) for cache in caches]
    for part in range(2):
        for layer in range(layout.layers):
            on_device, on_host = gathered[0][part][layer], gathered[1][part][layer]
            assert on_device.dtype == np.dtype(dtype)
            np.testing.assert_array_equal(on_device, on_host)
    np.testing.assert_array_equal(gathered[0][0][1][0, :, 2:], keys[1][0])
    np.testing.assert_array_equal(gathered[0][1][0][1, :, 4:], values[0][1, :, :5])
    assert np.all(gathered[0][0][0][1, :, :4] == 0)  # the padding: a fresh device pool is zeros too
    pools = {caches[0].pools(layer)[i].address for layer in range(layout.layers) for i in range(2)}
    assert not any(address in pools for address, _ in driver.downloads)
    caches[0].close()
    assert not driver.live()


def test_a_bfloat16_token_is_scattered_into_a_float32_pool_widened() -> None:
    driver = EmulatedDriver()
    copies = SlotCopies(driver)
    values = np.array([1.5, -2.25, 3.0, 0.0078125], np.float32).reshape(1, 1, 2, 2)
    bits = (values.view(np.uint32) >> 16).astype(np.uint16)  # exact in bfloat16
    tokens, pool, slots = driver.alloc(bits.nbytes), driver.alloc(4 * 2 * 4), driver.alloc(16)
    driver.upload(tokens, bits)
    driver.upload(pool, np.zeros((4, 1, 2), np.float32))
    driver.upload(slots, np.array([[3, 1]], np.int64))
    copies.scatter(
        [(DeviceTensor(tokens, (1, 1, 2, 2), "bfloat16"), DeviceTensor(pool, (4, 1, 2), "float32"))],
        DeviceTensor(slots, (1, 2), "int64"),
    )
    got = np.empty((4, 1, 2), np.float32)
    driver.download(pool, got)
    np.testing.assert_array_equal(got[[3, 1], 0], values[0, 0])
    assert not got[[0, 2]].any()
    with pytest.raises(ValueError, match="no slot gather from float32 to float16"):
        copies.gather(
            [(DeviceTensor(pool, (4, 1, 2), "float32"), DeviceTensor(tokens, (1, 1, 2, 2), "float16"))],
            DeviceTensor(slots, (1, 2), "int64"),
        )


def test_greedy_generation_on_a_gpu_runtime_keeps_the_cache_in_device_memory(gpu_programs) -> None:
    driver = RecordingDriver()
    batches: list[tuple[str, int]] = []  # (program, tokens per row) of the steps run from the host

    class RecordingRuntime(Runtime):
        def run_batch(self, key, requests, rows, busy=False):
            batches.append((key, requests[0]["input_ids"].shape[1]))
            return super().run_batch(key, requests, rows, busy)

    runtime = RecordingRuntime(CudaDevice("h100", driver), gpu_programs.__getitem__)
    layout = find_cache_layout(*onnx_specs(onnx.load(str(GPT2))))
    settings = GenerationSettings(
        kv_cache_bytes=32 * layout.block_bytes(4), block_tokens=4, step_tokens=24, prefill_tokens=8
    )
    service = GenerationService(
        {"h100": runtime}, lambda bundle: codec_of("gpt2"), None, {"h100": 1.0}, settings, NO_OBSERVER
    )
    route = SimpleNamespace(
        version_id=1,
        target="h100",
        artifact_key="prefill",
        model_name="gpt2",
        version=1,
        tenant_id=7,
        tenant_name="t",
        bundle={"layout": layout.to_json(), "context_length": 128, "decode_paged_key": "decode-paged"},
    )
    collected = CaseEvents(len(CASES))

    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, min_tokens=NEW_TOKENS)
    generator = service.generator(route)
    storage = generator.decoder.cache.storage
    pools = [tensor for layer in range(layout.layers) for tensor in storage.pools(layer)]
    assert storage.runs_on_device and {p.address for p in pools} <= driver.live()
    try:
        for i, case in enumerate(CASES):
            service.start(route, GenerationRequest(f"r{i}", case["prompt_ids"], params), collected.sink(i))
        collected.wait(300)
        for i, case in enumerate(CASES):
            assert collected.tokens(i) == case["generated_ids"][:NEW_TOKENS], f"prompt {case['prompt_ids']}"
        # one-token steps ran on the paged program reading the pools in place, and on the general
        # one with their past gathered on the device (the chooser tries both)
        assert generator.decoder.paged_steps > 0 and ("prefill", 1) in batches
        assert all(key == "prefill" for key, _ in batches)  # the paged program never runs from the host
        assert service.free_blocks(1) == generator.decoder.allocator.num_blocks
        # no byte of a pool ever came to the host: the paged steps downloaded their logits, the
        # fallbacks their gathered past
        pool_bytes = int(np.prod(pools[0].shape)) * 4
        for address, nbytes in driver.downloads:
            overlapped = [
                p.address for p in pools if p.address < address + nbytes and address < p.address + pool_bytes
            ]
            assert not overlapped, f"{nbytes} bytes downloaded from the pool at {overlapped[0]}"
    finally:
        service.close()
    # closing the generator freed its pools; unloading the programs frees the rest
    assert not {p.address for p in pools} & driver.live()
    for key in runtime.loaded_keys:
        runtime.unload(key)
    assert not driver.live()


_DRIVE = r"""
import ctypes, sys, threading
sys.path.insert(0, sys.argv[1])
import numpy as np
import compiler.backends.cuda_driver as cuda_driver
from compiler.backends.cuda_driver import CudaDriver
from runtime.cuda import DeviceKVStorage
from tests.test_generation_core import LAYOUT

# NVRTC is not for a process with the stand-in loaded: the PTX the test built, which the
# stand-in parses (it refuses cubins), stands for both images
ptx = open(sys.argv[2], "rb").read()
cuda_driver.compile_cuda = lambda source, arch: (ptx, ptx + b"\0")
fake = ctypes.CDLL("libcuda.so.1")

def state():
    values = (ctypes.c_int * 4)()
    fake.fake_cuda_state(values)
    return dict(zip(("retained", "captures", "modules", "bytes"), values))

driver = CudaDriver(0)
storage = DeviceKVStorage(driver, LAYOUT, 12, threading.Lock())
print("STATE", state())
print("POOLS", " ".join(int(t.address).to_bytes(8, "little").hex() for t in storage.keys + storage.values))
keys = [np.ones((2, 1, 1, 2), np.float32) * (layer + 1) for layer in range(2)]
storage.write(np.array([[3], [9]], np.int64), keys, keys)
past_keys, past_values = storage.gather(np.array([[0, 3], [0, 9]], np.int64))
assert [p.shape for p in past_keys + past_values] == [(2, 1, 2, 2)] * 4
print("STATE", state())
storage.close()
driver.close()
print("STATE", state())
"""


def test_device_pools_go_through_the_driver_adapter_against_a_stand_in_libcuda(tmp_path) -> None:
    """compiler.backends.cuda_driver's side (load_source, the pools' allocations, the copies'
    graphs) through cuda-bindings against tests/fake_libcuda.c, which logs launches rather than
    running them."""
    import ast
    import os
    import subprocess
    import sys

    from compiler.backends.cuda import compile_cuda, slot_copy_source

    root = Path(__file__).resolve().parents[1]
    build = subprocess.run(
        [
            os.environ.get("CC", "gcc"),
            "-shared",
            "-fPIC",
            "-O1",
            str(root / "tests" / "fake_libcuda.c"),
            "-o",
            str(tmp_path / "libcuda.so.1"),
            "-ldl",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert build.returncode == 0, build.stderr
    ptx, cubin = compile_cuda(slot_copy_source(), "sm_90")  # what load_source builds on an H100
    assert cubin[:4] == b"\x7fELF"
    (tmp_path / "slots.ptx").write_bytes(ptx)
    (tmp_path / "drive.py").write_text(_DRIVE)
    log = tmp_path / "launches.log"
    env = {**os.environ, "LD_LIBRARY_PATH": str(tmp_path), "FAKE_CUDA_LOG": str(log)}
    command = [sys.executable, str(tmp_path / "drive.py"), str(root), str(tmp_path / "slots.ptx")]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    states = [ast.literal_eval(line[6:]) for line in lines if line.startswith("STATE ")]
    pools = next(line[6:] for line in lines if line.startswith("POOLS ")).split()
    # four pools of 12 slots of [1, 2] float32, and the copies' module
    assert states[0] == {"retained": 1, "captures": 0, "modules": 1, "bytes": 4 * 12 * 2 * 4}
    # a write and a gather, each one graph of a launch per pool; then everything freed
    assert states[1]["captures"] == 2
    assert states[2] == {"retained": 0, "captures": 2, "modules": 0, "bytes": 0}
    write, gather = [block.strip().splitlines() for block in log.read_text().split("--\n") if block.strip()]
    # each line: function, grid, block, symbols (elements, heads, n, dim), then the three pointers
    scatters, gathers = ([line.split() for line in block] for block in (write, gather))
    # the tokens [2, 1, 1, 2] into each pool at [2, 1] slots, one slots tensor for all
    assert [line[:7] for line in scatters] == [["k1_scatter_32", "1", "1", "1", "128", "1", "1"]] * 4
    assert {line[7] for line in scatters} == {np.array([4, 1, 1, 2], "<i8").tobytes().hex()}
    assert [line[9] for line in scatters] == pools and len({line[10] for line in scatters}) == 1
    # each pool at [2, 2] slots into [2, 1, 2, 2]
    assert [line[0] for line in gathers] == ["k5_gather_32"] * 4 and [line[8] for line in gathers] == pools
    assert {line[7] for line in gathers} == {np.array([8, 1, 2, 2], "<i8").tobytes().hex()}
