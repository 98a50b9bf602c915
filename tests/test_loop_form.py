"""A matrix-vector product's loop form (GemmCall.loops): a depthwise convolution lowers to a
product per image and channel whose windows would be stored as a matrix first; the schedule
e-graph offers the same product as its reduction loop, reading the windows in place, and the C
renderer prints whichever measurement chose, leaving the kernel that stored the windows out.
Also: axes of extent 1 do not split a product into dot products (a 1x1 image's convolution)."""

from __future__ import annotations

import numpy as np
import onnxruntime
import pytest
from onnx import helper

from compiler.frontends.onnx import load_graph
from compiler.kernels.epilogue import fuse_epilogues
from compiler.kernels.fusion import fuse
from compiler.kernels.ir import GemmCall, Ix
from compiler.kernels.ir_walk import exclusive_feeders
from compiler.kernels.lower import lower
from compiler.kernels.schedule import KernelSchedule
from compiler.pipeline import sample_inputs
from compiler.render.c import CRenderer
from compiler.search.cpu_schedules import kernel_terms
from compiler.search.schedule import schedule_space
from tests.onnx_models import init, make_model, tensor

LOOPS = KernelSchedule("loops")
INSIDE = KernelSchedule("loops-inside")
COLUMNS = KernelSchedule("loops-columns")


def _depthwise(channels: int = 6, size: int = 9, relu: bool = True) -> bytes:
    """Conv(group = channels, 3x3, pad 1, bias), then Relu: MobileNet's depthwise layer."""
    rng = np.random.default_rng(0)
    w = init("w", rng.standard_normal((channels, 1, 3, 3)).astype(np.float32))
    bias = init("bias", rng.standard_normal(channels).astype(np.float32))
    conv = helper.make_node("Conv", ["x", "w", "bias"], ["c" if relu else "y"], group=channels, pads=[1, 1, 1, 1])
    nodes = [conv, helper.make_node("Relu", ["c"], ["y"])] if relu else [conv]
    shape = ["n", channels, size, size]
    return make_model(nodes, [tensor("x", shape)], [tensor("y", shape)], [w, bias]).SerializeToString()


def _programs(data: bytes):
    graph = load_graph(data)
    return graph, fuse_epilogues(fuse(lower(graph)))


def _onnxruntime(data: bytes, inputs):
    session = onnxruntime.InferenceSession(data, providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in session.get_outputs()], session.run(None, inputs), strict=True))


def test_a_depthwise_convolution_has_a_loop_form_that_makes_its_window_matrix_dead():
    _, program = _programs(_depthwise())
    (number,) = [n for n, k in enumerate(program.kernels) if isinstance(k, GemmCall)]
    call = program.kernels[number]
    assert call.loops is not None and call.loops.reduce is not None
    (feeder,) = exclusive_feeders(program, number)
    assert program.kernels[feeder].out in (call.a, call.b)  # the windows, stored as a matrix
    looped = CRenderer(program, {number: "loops"})
    assert "(void)B;" in looped.kernel(feeder, program.kernels[feeder])  # nothing computed
    assert "scipy_cblas" not in looped.kernel(number, call) and "+=" in looped.kernel(number, call)
    # the plain program still stores the windows and calls the library
    plain = CRenderer(program)
    assert "(void)B;" not in plain.kernel(feeder, program.kernels[feeder])
    assert "scipy_cblas" in plain.kernel(number, call)


def _dense_row() -> bytes:
    """A dense layer at one row, [1, 24] @ [24, 40] + bias, then Relu: a matrix-vector product,
    its bias and relu fused into it as an epilogue."""
    rng = np.random.default_rng(2)
    inits = [init("w", rng.standard_normal((24, 40)).astype(np.float32)), init("bias", rng.standard_normal(40).astype(np.float32))]
    nodes = [helper.make_node("MatMul", ["x", "w"], ["p"]), helper.make_node("Add", ["p", "bias"], ["c"]), helper.make_node("Relu", ["c"], ["y"])]
    return make_model(nodes, [tensor("x", [1, 24])], [tensor("y", [1, 40])], inits).SerializeToString()


@pytest.mark.parametrize("model", ["depthwise+relu", "depthwise", "dense-row+bias+relu"])
def test_both_forms_of_a_matrix_vector_product_match_onnxruntime(model):
    data = {"depthwise+relu": _depthwise(relu=True), "depthwise": _depthwise(relu=False), "dense-row+bias+relu": _dense_row()}[model]
    graph, program = _programs(data)
    (number,) = [n for n, k in enumerate(program.kernels) if isinstance(k, GemmCall)]
    call = program.kernels[number]
    assert call.loops is not None
    if model != "depthwise":
        assert call.epilogue is not None and call.loops.out == call.c  # the loop writes what the epilogue rewrites
    for batch in (1, 3):
        inputs = sample_inputs(graph, seed=batch, symbol_size=batch)
        want = _onnxruntime(data, inputs)["y"]
        for gemm in ("blas", {number: "loops"}, {number: "loops-inside"}, {number: "loops-columns"}):
            got = _run(graph, program, gemm, inputs)
            np.testing.assert_allclose(got["y"], want, rtol=1e-5, atol=1e-5, err_msg=f"{gemm} batch {batch}")


def _run(graph, program, gemm, inputs):
    from compiler.backends import native_cpu
    from compiler.render.c import render

    library = native_cpu.build(render(program, gemm=gemm))
    return native_cpu.NativeProgram(native_cpu.describe(program, graph.size_limits), program.weights, library).run(inputs)


def test_the_cpu_rules_offer_the_loop_form_and_the_gpu_rules_do_not():
    _, program = _programs(_depthwise())
    terms = kernel_terms(program)
    assert [t.loop_form for t in terms] == [True]
    cpu = schedule_space(terms, None, target="cpu")
    assert {LOOPS, INSIDE, COLUMNS} <= set(next(iter(cpu.alternatives.values())))
    assert cpu.default()[terms[0].number].kind == "library"  # OpenBLAS first; the loop is measured
    cuda = schedule_space(terms, None, target="cuda")
    assert all(LOOPS not in a and INSIDE not in a and COLUMNS not in a for a in cuda.alternatives.values())
    # a product with no loop form (a dense layer over many rows) is not offered one
    _, dense = _programs(make_model(
        [helper.make_node("MatMul", ["x", "w"], ["y"])], [tensor("x", ["n", 8])], [tensor("y", ["n", 4])],
        [init("w", np.ones((8, 4), np.float32))],
    ).SerializeToString())
    (term,) = kernel_terms(dense)
    assert not term.loop_form and LOOPS not in schedule_space([term], None, target="cpu").alternatives[term.number]


def test_a_loop_form_label_round_trips_and_a_product_without_one_refuses_it():
    assert KernelSchedule.from_label(LOOPS.label) == LOOPS and LOOPS.term == "(ReductionLoops k)"
    assert KernelSchedule.from_label(INSIDE.label) == INSIDE and INSIDE.term == "(ReductionLoopsInside k)"
    assert KernelSchedule.from_label(COLUMNS.label) == COLUMNS and COLUMNS.term == "(ReductionLoopsColumns k)"
    _, dense = _programs(make_model(
        [helper.make_node("MatMul", ["x", "w"], ["y"])], [tensor("x", ["n", 8])], [tensor("y", ["n", 4])],
        [init("w", np.ones((8, 4), np.float32))],
    ).SerializeToString())
    with pytest.raises(ValueError, match="no loop form"):
        CRenderer(dense, {0: "loops"})


def test_a_convolution_of_a_one_pixel_image_is_one_product_per_image_not_dot_products():
    """[n, 96, 1, 1] by a 1x1 kernel to 16 channels: C is [16, 1] per image with k = 96 (or its
    transpose), where extent-1 axes used to make every output channel a batch index."""
    rng = np.random.default_rng(1)
    w = init("w", rng.standard_normal((16, 96, 1, 1)).astype(np.float32))
    data = make_model(
        [helper.make_node("Conv", ["x", "w"], ["y"])], [tensor("x", ["n", 96, 1, 1])], [tensor("y", ["n", 16, 1, 1])], [w],
    ).SerializeToString()
    graph, program = _programs(data)
    (call,) = [k for k in program.kernels if isinstance(k, GemmCall)]
    assert call.k == 96 and 16 in (call.m, call.n) and 16 not in call.batch
    inputs = sample_inputs(graph, seed=0, symbol_size=4)
    np.testing.assert_allclose(_run(graph, program, "blas", inputs)["y"], _onnxruntime(data, inputs)["y"], rtol=1e-5, atol=1e-5)


def test_a_cpu_compile_keeps_the_loop_form_where_it_measured_faster(monkeypatch):
    """With a fake timer that makes the loop form fastest, the searched program runs the depthwise
    product as its loop and leaves the window matrix out; the compile verified its outputs."""
    from compiler import compile_onnx
    from tests.test_schedule_search import fake_kernel_timer

    fake_kernel_timer(monkeypatch, lambda choices, n: (0.001 if choices[n] == LOOPS else 0.003) if n in choices else 0.0005)
    data = _depthwise()
    artifact = compile_onnx(data, "cpu", ("native-searched",))
    schedule = artifact.report["search"]["schedule"]
    assert artifact.report["chosen"] == "native-searched" and schedule["products"] == {"loops": 1}
    (record,) = schedule["kernels"].values()
    # the library's time includes the kernel that stored the windows for it (at every measuring size)
    library, loops = record["measured"]["openblas"], record["measured"]["loops"]
    assert library.keys() == loops.keys() and "8" in library, (library, loops)
    assert all(ms == pytest.approx(3.5) for ms in library.values()) and all(ms == pytest.approx(1.5) for ms in loops.values())
    source = artifact.kernels[0]["source"]
    assert "scipy_cblas_sgemm(101" not in source and "scipy_cblas_sgemv(101" not in source
    assert "its product runs as its loop form" in source


def test_a_channels_bias_runs_inside_the_product_whose_batch_runs_over_images_and_channels():
    """The depthwise product's batch index t is (image, channel): the bias reads bias[t % 6], a
    digit of t, in the epilogue, on the CPU and in the GPU's code (run by its emulation)."""
    from compiler import compile_onnx
    from compiler.kernels.ir import Atom, Load
    from compiler.kernels.ir_walk import walk

    _, program = _programs(_depthwise(relu=True))
    (call,) = [k for k in program.kernels if isinstance(k, GemmCall)]
    assert len(program.kernels) == 2  # the windows and the product: the bias and relu are inside
    bias_loads = [e for e in walk(call.epilogue.value) if isinstance(e, Load) and e.buffer != call.c]
    assert [var for load in bias_loads for var, _ in load.index.terms] == [Atom("mod", (Ix.var("t"), 6))]
    artifact = compile_onnx(_depthwise(relu=True), "h100")
    assert artifact.report["verified_on"] == "cpu emulation" and artifact.report["verify_max_abs_error"] < 1e-4
    assert "((t) % 6LL)" in artifact.kernels[0]["source"]


@pytest.mark.parametrize("kind", ["loops", "loops-inside", "loops-columns"])
def test_a_loop_form_with_an_epilogue_applies_it_once_however_many_threads_run_it(kind):
    """Workers run a kernel's function too: the epilogue after a loop form's parallel loop is the
    caller's alone, once every task is done (workers that ran it added the bias twice, from the
    second run on, once they were up: MobileNetV2 at batch 8 was off by 1.8)."""
    data = _depthwise(channels=64, size=32, relu=True)  # enough work to share among the threads
    graph, program = _programs(data)
    (number,) = [n for n, k in enumerate(program.kernels) if isinstance(k, GemmCall)]
    assert program.kernels[number].epilogue is not None
    from compiler.backends import native_cpu
    from compiler.render.c import render

    source = render(program, gemm={number: kind})
    # where a task is an output row, the epilogue follows each row in it, on every thread; the
    # columns form applies it once after the loop, on the caller's
    kernel = source[source.index(f"static void k{number}(") :].split("\n}\n")[0]
    assert ("if (lc_is_worker) return;" in kernel) == (kind == "loops-columns")
    library = native_cpu.build(source)
    loaded = native_cpu.NativeProgram(native_cpu.describe(program, graph.size_limits), program.weights, library)
    inputs = sample_inputs(graph, seed=4, symbol_size=4)
    want = _onnxruntime(data, inputs)["y"]
    for run in range(6):
        np.testing.assert_allclose(loaded.run(inputs)["y"], want, rtol=1e-5, atol=1e-5, err_msg=f"run {run}")


def _depthwise_conv(channels: int, size: int, kernel: int, stride: int, dilation: int, activation: str) -> bytes:
    """Conv(group = channels, kernel x kernel, stride, dilation, padded to keep the size / stride,
    bias), then an activation (Relu, or Clip to [0, 6] as MobileNetV2 spells it)."""
    rng = np.random.default_rng(channels + size + kernel)
    w = init("w", rng.standard_normal((channels, 1, kernel, kernel)).astype(np.float32))
    bias = init("bias", rng.standard_normal(channels).astype(np.float32))
    pad = dilation * (kernel - 1) // 2
    conv = helper.make_node(
        "Conv", ["x", "w", "bias"], ["c"], group=channels, pads=[pad] * 4, strides=[stride] * 2, dilations=[dilation] * 2
    )
    inits = [w, bias]
    if activation == "clip":
        inits += [init("low", np.array(0.0, np.float32)), init("high", np.array(6.0, np.float32))]
        act = helper.make_node("Clip", ["c", "low", "high"], ["y"])
    else:
        act = helper.make_node("Relu", ["c"], ["y"])
    out = (size + 2 * pad - dilation * (kernel - 1) - 1) // stride + 1
    return make_model(
        [conv, act], [tensor("x", ["n", channels, size, size])], [tensor("y", ["n", channels, out, out])], inits
    ).SerializeToString()


@pytest.mark.parametrize("searched", [False, True], ids=["windows-as-b", "windows-as-a"])
@pytest.mark.parametrize(
    ("channels", "size", "kernel", "stride", "dilation", "activation"),
    [(6, 9, 3, 1, 1, "relu"), (48, 16, 3, 2, 1, "clip"), (5, 7, 7, 1, 1, "relu"), (4, 12, 3, 1, 2, "clip"), (3, 17, 5, 2, 1, "relu"), (8, 4, 3, 1, 1, "clip")],
)
def test_a_depthwise_convolution_plane_by_plane_equals_onnxruntime(channels, size, kernel, stride, dilation, activation, searched):
    """The "depthwise" kind: each input plane padded and split by phase into scratch (stride 2
    reads two phases, dilation 2 one at a step), each output row one vector loop over the taps,
    the epilogues after a chunk's planes; read off the loop form whichever operand the windows are (the e-graph
    search turns the product around), and the kernel that would store the windows is left out."""
    from compiler.render.c import depthwise_of, render

    data, graph, program, number = _depthwise_program(channels, size, kernel, stride, dilation, activation, searched)
    call = program.kernels[number]
    assert depthwise_of(call) is not None and call.epilogue is not None
    (term,) = kernel_terms(program)
    assert term.depthwise and KernelSchedule("depthwise-planes") in schedule_space([term], None, target="cpu").alternatives[number]
    source = render(program, gemm={number: "depthwise"})
    assert "its product runs as its loop form" in source  # the windows' kernel is dead
    _built_equals_onnxruntime(data, graph, program, source)


def _depthwise_program(channels, size, kernel, stride, dilation, activation, searched):
    """A depthwise convolution's model, graph (as the e-graph search rewrote it, or as exported),
    program and the number of its product."""
    from compiler.search.extract import search_graph

    data = _depthwise_conv(channels, size, kernel, stride, dilation, activation)
    graph = load_graph(data)
    if searched:
        graph, _ = search_graph(graph, True)
    program = fuse_epilogues(fuse(lower(graph)))
    (number,) = [n for n, k in enumerate(program.kernels) if isinstance(k, GemmCall)]
    return data, graph, program, number


def _built_equals_onnxruntime(data: bytes, graph, program, source: str) -> None:
    """The program built from `source` answers as onnxruntime at batch 1 and 3, a few runs each."""
    from compiler.backends import native_cpu

    loaded = native_cpu.NativeProgram(native_cpu.describe(program, graph.size_limits), program.weights, native_cpu.build(source))
    for batch in (1, 3):
        inputs = sample_inputs(graph, seed=batch, symbol_size=batch)
        want = _onnxruntime(data, inputs)["y"]
        for run in range(3):  # the later runs shared with the woken worker
            np.testing.assert_allclose(loaded.run(inputs)["y"], want, rtol=1e-5, atol=1e-5, err_msg=f"batch {batch} run {run}")


@pytest.mark.parametrize("searched", [False, True], ids=["windows-as-b", "windows-as-a"])
@pytest.mark.parametrize(
    ("channels", "size", "kernel", "stride", "dilation", "activation"),
    [(48, 4, 3, 1, 1, "clip"), (96, 4, 3, 2, 1, "relu"), (96, 2, 3, 1, 1, "clip"), (5, 3, 3, 1, 1, "relu"),
     (5, 4, 3, 1, 2, "clip"), (6, 4, 7, 1, 1, "relu"), (3, 3, 3, 2, 1, "relu"), (6, 8, 3, 1, 1, "clip"),
     (4, 16, 3, 2, 1, "relu"), (3, 5, 3, 1, 1, "relu"), (2, 7, 3, 1, 1, "clip")],
)
def test_a_depthwise_convolution_a_plane_a_register_equals_onnxruntime(channels, size, kernel, stride, dilation, activation, searched):
    """The "depthwise-registers" kind, for planes of a few vectors (up to a 16x16 image): each
    output vector's taps a two-source permutation of the input vectors with the lanes outside the
    image zero (padding, dilation, stride 2, a 7x7 window wider than the image, odd images whose
    rows straddle vectors, an 8x8 output of four vectors), the epilogues after a chunk's planes; offered by the
    e-graph only where the planes fit and no tap reads more than two input vectors at once."""
    from compiler.render.c import register_planes, render

    data, graph, program, number = _depthwise_program(channels, size, kernel, stride, dilation, activation, searched)
    assert register_planes(program.kernels[number]) is not None
    (term,) = kernel_terms(program)
    assert term.register_planes
    assert KernelSchedule("depthwise-registers") in schedule_space([term], None, target="cpu").alternatives[number]
    source = render(program, gemm={number: "depthwise-registers"})
    assert "_mm512_maskz_permutex2var_ps" in source and "its product runs as its loop form" in source
    _built_equals_onnxruntime(data, graph, program, source)


# 289 floats a plane (more than 16 vectors); a 6x6 output whose vectors span rows of three input vectors
@pytest.mark.parametrize(("size", "stride"), [(17, 1), (12, 2)])
def test_a_depthwise_convolution_whose_plane_does_not_fit_registers_is_not_offered_the_register_kind(size, stride):
    from compiler.render.c import depthwise_of, register_planes, render

    graph = load_graph(_depthwise_conv(8, size, 3, stride, 1, "relu"))
    program = fuse_epilogues(fuse(lower(graph)))
    (number,) = [n for n, k in enumerate(program.kernels) if isinstance(k, GemmCall)]
    assert depthwise_of(program.kernels[number]) is not None and register_planes(program.kernels[number]) is None
    (term,) = kernel_terms(program)
    assert term.depthwise and not term.register_planes
    assert KernelSchedule("depthwise-registers") not in schedule_space([term], None, target="cpu").alternatives[number]
    with pytest.raises(ValueError, match="cannot run as 'depthwise-registers'"):
        render(program, gemm={number: "depthwise-registers"})


def test_a_product_that_is_not_a_depthwise_convolution_refuses_the_depthwise_kind():
    from compiler.render.c import depthwise_of, render

    _, dense = _programs(make_model(
        [helper.make_node("MatMul", ["x", "w"], ["y"])], [tensor("x", ["n", 8])], [tensor("y", ["n", 4])],
        [init("w", np.ones((8, 4), np.float32))],
    ).SerializeToString())
    (number,) = [n for n, k in enumerate(dense.kernels) if isinstance(k, GemmCall)]
    assert depthwise_of(dense.kernels[number]) is None
    assert not kernel_terms(dense)[0].depthwise
    with pytest.raises(ValueError, match="cannot run as 'depthwise'"):
        render(dense, gemm={number: "depthwise"})
