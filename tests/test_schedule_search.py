"""The schedule e-graph and extraction by measurement (compiler.search.schedule), with a fake
device timer: what the rules derive, which alternative measurement keeps, the kernel cache."""

from __future__ import annotations

import pytest

from compiler.kernels.schedule import KernelSchedule
from compiler.search.schedule import (
    DirectoryKernelCache,
    KernelTerm,
    RoundFailed,
    extract_by_measurement,
    schedule_space,
)

TILE64 = KernelSchedule("tiled", 64)
TILE128 = KernelSchedule("tiled", 128)
CUBLAS = KernelSchedule("library", library="cublas")


def _product(number: int = 0, signature: str = "p", library: bool = True) -> KernelTerm:
    return KernelTerm(number, "product", signature, "float32", libraries=("cublas",) if library else ())


def test_the_rules_derive_a_library_call_only_where_the_library_computes_the_product():
    space = schedule_space([_product(0, "a"), _product(1, "b", library=False)], tensor_cores=None)
    assert set(space.alternatives[0]) == {TILE64, TILE128, CUBLAS}
    assert set(space.alternatives[1]) == {TILE64, TILE128}
    assert space.alternatives[0][0] == TILE64  # the default is tried first
    assert space.report()["programs"] == 6


def test_tensor_core_tiles_replace_cuda_core_tiles_where_the_program_multiplies_on_tensor_cores():
    space = schedule_space([_product(0), KernelTerm(1, "product", "i", "int32")], tensor_cores="float16")
    assert set(space.alternatives[0]) == {KernelSchedule("tensor-core-tiled", 64), KernelSchedule("tensor-core-tiled", 128), CUBLAS}
    assert set(space.alternatives[1]) == {TILE64, TILE128}  # (an integer product has no tensor-core form)


def test_loops_get_threads_and_reductions_a_warp_or_a_block_per_row():
    space = schedule_space(
        [KernelTerm(0, "elementwise", "e"), KernelTerm(1, "reduction", "short", extent=384), KernelTerm(2, "reduction", "long", extent=0),
         KernelTerm(3, "attention", "att")],
        tensor_cores=None,
    )
    assert {a.size for a in space.alternatives[0]} == {128, 256, 512} and space.alternatives[0][0].size == 256
    assert space.alternatives[1][0] == KernelSchedule("warp-rows", 8)
    assert space.alternatives[2][0] == KernelSchedule("block-rows", 256)  # (a symbolic extent: a block per row first)
    assert 3 not in space.alternatives  # nothing to choose for the fused attention's kernel


def _timer(ms: dict[KernelSchedule, float], calls: list | None = None):
    def measure_round(choices):
        if calls is not None:
            calls.append(dict(choices))
        return {n: {"b1": ms[s], "b8": 4 * ms[s]} for n, s in choices.items()}
    return measure_round


def test_extraction_follows_the_timings_a_library_call_at_one_size_a_generated_kernel_at_another():
    space = schedule_space([_product(0)], tensor_cores=None)
    small = extract_by_measurement(space, _timer({TILE64: 0.05, TILE128: 0.08, CUBLAS: 0.02}), budget_seconds=60)
    large = extract_by_measurement(space, _timer({TILE64: 0.9, TILE128: 0.6, CUBLAS: 0.7}), budget_seconds=60)
    assert small.choices[0] == CUBLAS
    assert large.choices[0] == TILE128
    kernel = large.report["kernels"]["0"]
    assert kernel["chosen"] == "tile128" and set(kernel["measured"]) == {"tile64", "tile128", "cublas"}
    assert large.report["space"]["alternatives"] == 3 and len(large.report["rounds"]) == 3


def test_each_size_weighs_the_same_in_the_choice():
    space = schedule_space([_product(0, library=False)], tensor_cores=None)

    def measure_round(choices):
        # tile64 wins batch 1 by 3x, tile128 the large size by 10%: the sum of times would pick
        # tile128, the normalized sum tile64
        table = {TILE64: {"b1": 0.01, "b32": 1.1}, TILE128: {"b1": 0.03, "b32": 1.0}}
        return {n: table[s] for n, s in choices.items()}

    assert extract_by_measurement(space, measure_round, 60).choices[0] == TILE64


def test_a_size_one_alternative_missed_still_decides_between_those_measured_at_it():
    space = schedule_space([_product(0)], tensor_cores=None)

    def measure_round(choices):
        # cuBLAS's round skipped the large size; between the tiles, which both ran it, tile64
        # loses at batch 1 by 10% and wins the large size by 2x: over the sizes every alternative
        # has (batch 1 alone) tile128 would win
        table = {
            TILE64: {"b1": 0.011, "b32": 0.5}, TILE128: {"b1": 0.010, "b32": 1.0}, CUBLAS: {"b1": 0.03},
        }
        return {n: table[s] for n, s in choices.items()}

    assert extract_by_measurement(space, measure_round, 60).choices[0] == TILE64


def test_every_kernel_is_measured_in_the_same_rounds_and_keeps_its_own_winner():
    kernels = [_product(0, "a"), KernelTerm(1, "elementwise", "e"), _product(2, "b", library=False)]
    space = schedule_space(kernels, tensor_cores=None)
    calls: list = []
    fastest = {0: CUBLAS, 1: KernelSchedule("threads", 512), 2: TILE128}

    def measure_round(choices):
        calls.append(choices)
        return {n: {"b1": 0.1 if s == fastest[n] else 0.3} for n, s in choices.items()}

    found = extract_by_measurement(space, measure_round, 60)
    assert found.choices == fastest
    assert len(calls) == 3  # the most alternatives any kernel has, not their product (18)


def test_a_round_that_fails_marks_its_alternatives_and_the_others_still_win():
    space = schedule_space([_product(0)], tensor_cores=None)

    def measure_round(choices):
        if choices[0] == TILE128:
            raise RoundFailed("disagrees with the reference")
        return {0: {"b1": 0.05 if choices[0] == CUBLAS else 0.1}}

    found = extract_by_measurement(space, measure_round, 60)
    assert found.choices[0] == CUBLAS
    assert found.report["kernels"]["0"]["failed"] == {"tile128": "disagrees with the reference"}


def test_the_default_round_failing_fails_the_search():
    space = schedule_space([_product(0)], tensor_cores=None)

    def measure_round(choices):
        raise RoundFailed("nvrtc: error")

    with pytest.raises(RoundFailed, match="nvrtc"):
        extract_by_measurement(space, measure_round, 60)


def test_a_spent_budget_stops_after_the_default_round():
    space = schedule_space([_product(0)], tensor_cores=None)
    calls: list = []
    found = extract_by_measurement(space, _timer({TILE64: 0.1, TILE128: 0.05, CUBLAS: 0.01}, calls), budget_seconds=0)
    assert len(calls) == 1 and found.choices[0] == TILE64
    assert found.report["rounds"][-1]["skipped"] == "the search's budget was spent"


def test_passes_measure_every_round_again_and_each_kernel_keeps_its_least_time():
    """A slow spell falls on tile128's round in the first pass only: with one pass cuBLAS wins,
    with three tile128 does, measured at its least time."""
    space = schedule_space([_product(0)], tensor_cores=None)
    calls: list = []

    def measure_round(choices):
        calls.append(choices[0])
        spell = 10.0 if choices[0] == TILE128 and calls.count(TILE128) == 1 else 1.0
        return {0: {"b1": spell * {TILE64: 0.3, TILE128: 0.1, CUBLAS: 0.2}[choices[0]]}}

    assert extract_by_measurement(space, measure_round, 60).choices[0] == CUBLAS
    calls.clear()
    found = extract_by_measurement(space, measure_round, 60, passes=3)
    assert found.choices[0] == TILE128 and len(calls) == 9
    assert found.report["kernels"]["0"]["measured"]["tile128"] == {"b1": 0.1}
    assert [r["pass"] for r in found.report["rounds"]] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    # a spent budget ends the passes (round 0 of the first still runs)
    calls.clear()
    extract_by_measurement(space, measure_round, 0, passes=3)
    assert len(calls) == 1


def test_the_order_of_alternatives_is_deterministic_under_a_seed():
    kernels = [KernelTerm(0, "elementwise", "e"), _product(1)]
    assert schedule_space(kernels, None, seed=3).alternatives == schedule_space(kernels, None, seed=3).alternatives
    orders = {tuple(schedule_space(kernels, None, seed=s).alternatives[1]) for s in range(8)}
    assert len(orders) > 1 and all(order[0] == TILE64 for order in orders)


def test_a_second_model_sharing_a_kernel_reuses_its_measured_winner(tmp_path):
    cache = DirectoryKernelCache(tmp_path)
    first = schedule_space([_product(0, "shared"), KernelTerm(1, "elementwise", "e1")], None)
    calls: list = []
    timings = {TILE64: 0.3, TILE128: 0.2, CUBLAS: 0.1, **{KernelSchedule("threads", t): 0.1 for t in (128, 256, 512)}}
    found = extract_by_measurement(first, _timer(timings, calls), 60, cache, device="h100", sizes=("b1",), version="1")
    assert found.choices[0] == CUBLAS and len(calls) == 3
    assert found.report["cache"] == {"hits": 0, "misses": 2}

    # another model: the same product (another number), a new elementwise loop
    second = schedule_space([KernelTerm(0, "elementwise", "e2"), _product(5, "shared")], None)
    calls.clear()
    found = extract_by_measurement(second, _timer(timings, calls), 60, cache, device="h100", sizes=("b1",), version="1")
    assert found.choices[5] == CUBLAS and found.report["kernels"]["5"]["cached"] is True
    assert found.report["cache"] == {"hits": 1, "misses": 1}
    assert all(c[5] == CUBLAS for c in calls)  # the cached product is never measured again

    # another device, or another compiler version, measures again
    calls.clear()
    found = extract_by_measurement(second, _timer(timings, calls), 60, cache, device="a100", sizes=("b1",), version="1")
    assert found.report["cache"]["hits"] == 0


def test_a_torn_cache_record_is_measured_again(tmp_path):
    cache = DirectoryKernelCache(tmp_path)
    space = schedule_space([_product(0)], None)
    extract_by_measurement(space, _timer({TILE64: 0.3, TILE128: 0.2, CUBLAS: 0.1}), 60, cache, device="d")
    for record in tmp_path.glob("*.json"):
        record.write_text("{not json")
    found = extract_by_measurement(space, _timer({TILE64: 0.3, TILE128: 0.2, CUBLAS: 0.1}), 60, cache, device="d")
    assert found.report["cache"]["hits"] == 0 and found.choices[0] == CUBLAS


def test_kernel_schedule_labels_round_trip_and_terms_read_as_the_rules_spell_them():
    for schedule in (TILE64, CUBLAS, KernelSchedule("tensor-core-tiled", 128), KernelSchedule("warp-rows", 8)):
        assert KernelSchedule.from_label(schedule.label) == schedule
    assert CUBLAS.term == '(LibraryCall "cublas" k)' and TILE128.term == "(Tiled 128 k)"
    with pytest.raises(ValueError, match="unknown kernel schedule kind"):
        KernelSchedule("split", 2)


def test_the_service_keeps_the_kernel_cache_in_its_object_store(tmp_path):
    from cloud.storage import LocalObjectStore
    from worker.kernel_cache import ObjectStoreKernelCache

    store = LocalObjectStore(tmp_path)
    cache = ObjectStoreKernelCache(store)
    space = schedule_space([_product(0, "shared")], None)
    timings = {TILE64: 0.3, TILE128: 0.2, CUBLAS: 0.1}
    extract_by_measurement(space, _timer(timings), 60, cache, device="h100", sizes=("b1",), version="1")
    records = list((tmp_path / "kernels").glob("*.json"))
    assert len(records) == 1 and '"chosen": "cublas"' in records[0].read_text()
    # another worker (another cache object on the same store) reuses it
    calls: list = []
    found = extract_by_measurement(space, _timer(timings, calls), 60, ObjectStoreKernelCache(store), device="h100", sizes=("b1",), version="1")
    assert found.report["cache"] == {"hits": 1, "misses": 0} and len(calls) == 1
    records[0].write_bytes(b"\x00torn")
    assert ObjectStoreKernelCache(store).get(records[0].stem) is None


# ---- the CPU: products' schedules, measured in the helper process ------------------------------

FIXTURES = __import__("pathlib").Path(__file__).parent / "fixtures"


def _lowered(name: str):
    from compiler.frontends.onnx import load_graph
    from compiler.kernels.fusion import fuse
    from compiler.kernels.lower import lower

    return fuse(lower(load_graph((FIXTURES / f"{name}.onnx").read_bytes()), use_gemm=True))


def test_the_cpu_rules_offer_generated_products_and_a_convolution_its_windows_in_place_or_by_panels():
    from compiler.search.cpu_schedules import kernel_terms

    cnn = schedule_space(kernel_terms(_lowered("torch_cnn")), None, target="cpu")
    mlp = schedule_space(kernel_terms(_lowered("torch_mlp")), None, target="cpu")
    labels = [{a.label for a in alternatives} for alternatives in cnn.alternatives.values()]
    # a convolution's weight is its product's A: it can also run transposed, that weight packed, from
    # a panel of its windows or from its windows in place ("direct-windows")
    assert {"openblas", "generated-tiles", "window-rows", "generated-panels", "transposed-tiles", "direct-windows"} in labels
    assert all(set(a) == {KernelSchedule("library", library="openblas"), KernelSchedule("generated-tiles")} for a in mlp.alternatives.values())
    assert all(a[0].kind == "library" for a in [*cnn.alternatives.values(), *mlp.alternatives.values()])  # OpenBLAS first
    # the MLP's three products are three kernels with different shapes: three signatures
    assert len({k.signature for k in kernel_terms(_lowered("torch_mlp"))}) == 3


def fake_kernel_timer(monkeypatch, seconds) -> None:
    """The CPU search's kernel timings faked: `seconds(choices, n)` is kernel n's time in a round
    whose products run as `choices` (the search's own rounds, built and verified for real)."""
    from compiler.devices import CpuDevice
    from compiler.search import cpu_schedules

    chosen_by_name: dict[str, dict] = {}
    built = cpu_schedules._built

    def recording(program, graph, choices, name, device, tracker, profile):
        chosen_by_name[name] = dict(choices)
        return built(program, graph, choices, name, device, tracker, profile)

    def fake_profile(self, program, inputs, kernels):
        return [seconds(chosen_by_name[program], n) for n in range(kernels)]

    monkeypatch.setattr(cpu_schedules, "_built", recording)
    monkeypatch.setattr(CpuDevice, "profile", fake_profile)


def test_a_cpu_compile_gives_each_product_the_schedule_that_measured_fastest_for_it(monkeypatch):
    """With a fake timer (OpenBLAS fastest for the first product, generated tiles for the
    others), the searched program calls OpenBLAS in kernel 0 only; its outputs are verified."""
    from compiler import compile_onnx

    def seconds(choices, n):
        if n not in choices:
            return 0.0005
        return 0.001 if (choices[n].kind == "library") == (n == min(choices)) else 0.003

    fake_kernel_timer(monkeypatch, seconds)
    artifact = compile_onnx((FIXTURES / "torch_mlp.onnx").read_bytes(), "cpu", ("native-searched",))
    report = artifact.report
    assert report["chosen"] == "native-searched"
    schedule = report["search"]["schedule"]
    assert schedule["products"] == {"generated-tiles": 2, "openblas": 1}
    products = sorted(int(n) for n in schedule["kernels"])
    assert [schedule["kernels"][str(n)]["chosen"] for n in products] == ["openblas", "generated-tiles", "generated-tiles"]
    source = artifact.kernels[0]["source"]
    calls = [source[source.index(f"static void k{n}("):].split("\nstatic void ", 1)[0] for n in products]
    assert ["scipy_cblas_sgemm" in body for body in calls] == [True, False, False]


def test_the_search_budget_bounds_the_rounds_of_a_compile():
    from compiler import compile_onnx

    data = (FIXTURES / "torch_mlp.onnx").read_bytes()
    spent = compile_onnx(data, "cpu", ("native-searched",), search_seconds=0).report["search"]["schedule"]
    assert [r["round"] for r in spent["rounds"]] == [0, 1] and spent["rounds"][1]["skipped"] == "the search's budget was spent"
    assert all(k["chosen"] == "openblas" for k in spent["kernels"].values())  # every product's first alternative
    full = compile_onnx(data, "cpu", ("native-searched",), search_seconds=60).report["search"]["schedule"]
    # every round measured SCHEDULE_MEASURE_PASSES times, in turn
    assert [(r["pass"], r["round"]) for r in full["rounds"]] == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]
    assert all("kernel_ms" in r for r in full["rounds"])


def test_the_budget_is_a_setting():
    from cloud.settings import Settings

    assert Settings(compile_search_seconds=5).compile_search_seconds == 5
    with pytest.raises(ValueError, match="greater than or equal to 0"):
        Settings(compile_search_seconds=-1)


def test_every_round_is_handed_to_prebuild_before_the_first_is_measured():
    space = schedule_space([_product(0), KernelTerm(1, "elementwise", "e")], None)
    planned: list = []

    def measure_round(choices):
        assert planned, "measured before the rounds were built"
        return {n: {"b1": 0.1} for n in choices}

    found = extract_by_measurement(space, measure_round, 60, prebuild=planned.extend)
    assert len(planned) == 3 and planned[0] == space.default()
    assert [c for c, _ in found.rounds] == planned  # the rounds measured are the ones built


def test_rounds_are_measured_as_their_builds_land_and_a_build_past_the_budget_costs_its_round():
    import time

    space = schedule_space([_product(0)], None)
    waited: list = []
    measured: list = []

    def prebuild(planned):
        def wait(r):
            waited.append(r)
            if r == 1:
                time.sleep(0.3)  # a build that lands after the budget
        return [lambda r=r: wait(r) for r in range(len(planned))]

    def measure_round(choices):
        measured.append(choices[0])
        return {0: {"b1": 0.1}}

    found = extract_by_measurement(space, measure_round, 0.2, prebuild=prebuild)
    assert waited == [0, 1] and len(measured) == 1  # round 0 measured; round 1's build outlasted the budget
    assert found.report["rounds"][-1] == {"round": 1, "skipped": "the search's budget was spent while it was built"}
