"""A small lazy tensor API that records a static graph and exports it as ONNX for upload.

    g = Graph()
    x = g.input("x", ("batch", 784))
    y = (x @ g.constant(w, name="w") + g.constant(b)).relu().softmax(-1)
    g.output("y", y)
    client.deploy(g, name="mlp")

A dim is an int (static) or a string (symbolic: the same string is the same size everywhere).
Shapes are inferred as the graph is built, so a shape that cannot work raises GraphError at the
call that builds it. Nothing is computed here: the server compiles and runs the exported graph.
It needs numpy and onnx only.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from itertools import zip_longest
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from luminal_cloud.errors import GraphError

__all__ = ["Graph", "GraphError", "Tensor", "attention", "concat", "embedding", "where"]

Dim = int | str
Shape = tuple[Dim, ...]

OPSET = 18
# the oldest IR version that carries opset 18, so older runtimes load the file too
IR_VERSION = 8
# a Slice end that means "to the end of the axis"
SLICE_END = np.iinfo(np.int64).max


# ---- symbolic dims ----------------------------------------------------------------------------
# A derived dim is a string: a product of factors joined by "*" ("batch*seq", "64*batch"), where a
# factor that is no plain product (a concatenation's sum, a window's size) is kept in parentheses.


def _show(shape: Sequence[Dim]) -> str:
    inside = ", ".join(str(d) for d in shape)
    return f"({inside},)" if len(shape) == 1 else f"({inside})"


def _opaque(text: str) -> Dim:
    return f"({text})"


def _factors(dim: Dim) -> tuple[int, Counter[str]]:
    """A dim as an integer times a product of symbols: "64*batch" -> (64, {batch: 1})."""
    if isinstance(dim, int):
        return dim, Counter()
    coefficient, symbols, depth, start = 1, Counter[str](), 0, 0
    for index, char in enumerate(dim + "*"):
        depth += (char == "(") - (char == ")")
        if char == "*" and depth == 0:
            part, start = dim[start:index], index + 1
            if part.isdigit():
                coefficient *= int(part)
            else:
                symbols[part] += 1
    return coefficient, symbols


def _product(dims: Sequence[Dim]) -> tuple[int, Counter[str]]:
    coefficient, symbols = 1, Counter[str]()
    for dim in dims:
        factor, factor_symbols = _factors(dim)
        coefficient *= factor
        symbols += factor_symbols
    return coefficient, symbols


def _as_dim(coefficient: int, symbols: Counter[str]) -> Dim:
    if not symbols:
        return coefficient
    return "*".join(([str(coefficient)] if coefficient != 1 else []) + sorted(symbols.elements()))


def _dims_agree(a: Dim, b: Dim) -> bool:
    """Equal, or one static and one symbolic (then the symbol must take that size at run time)."""
    return a == b or isinstance(a, int) != isinstance(b, int)


def _known(a: Dim, b: Dim) -> Dim:
    """Of two dims that agree, the one that says more: the static one."""
    return a if isinstance(a, int) else b


def _broadcast(op: str, *shapes: Shape) -> Shape:
    out: list[Dim] = []
    for dims in zip_longest(*(reversed(s) for s in shapes), fillvalue=1):
        result: Dim = 1
        for dim in dims:
            if dim == 1 or dim == result:
                continue
            if result != 1 and not _dims_agree(result, dim):
                raise GraphError(f"{op}: shapes {' and '.join(_show(s) for s in shapes)} do not broadcast")
            result = dim if result == 1 else _known(result, dim)
        out.append(result)
    return tuple(reversed(out))


def _axis(op: str, axis: int, ndim: int) -> int:
    if not -ndim <= axis < ndim:
        raise GraphError(f"{op}: axis {axis} is out of range for a tensor of {ndim} dims")
    return axis % ndim


def _axes(op: str, axes: int | Sequence[int] | None, ndim: int) -> list[int]:
    if axes is None:
        return list(range(ndim))
    listed = [axes] if isinstance(axes, int) else list(axes)
    normalized = sorted({_axis(op, a, ndim) for a in listed})
    if len(normalized) != len(listed):
        raise GraphError(f"{op}: axes {listed} repeat an axis")
    return normalized


def _shape_arg(shape: tuple) -> tuple:
    """reshape(2, -1) and reshape((2, -1)) alike."""
    return tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else tuple(shape)


def _pair(value: int | Sequence[int]) -> tuple[int, int]:
    return (value, value) if isinstance(value, int) else (value[0], value[1])


def _window_dim(op: str, shape: Shape, axis: int, kernel: int, stride: int, pad: int, dilation: int) -> Dim:
    size, reach = shape[axis], dilation * (kernel - 1) + 1
    if isinstance(size, str):
        return _opaque(f"({size}+{2 * pad}-{reach})/{stride}+1")
    if size + 2 * pad < reach:
        raise GraphError(
            f"{op}: window of {reach} is larger than dim {axis} of {_show(shape)} padded by {pad}"
        )
    return (size + 2 * pad - reach) // stride + 1


def _sliced_dim(dim: Dim, start: int | None, stop: int | None, step: int) -> Dim:
    if isinstance(dim, int):
        return len(range(*slice(start, stop, step).indices(dim)))
    start_at, stop_at = start or 0, stop
    if step == 1 and start_at >= 0 and stop_at is not None and stop_at >= 0:
        return max(stop_at - start_at, 0)  # assumes the symbol reaches the stop
    if step == 1 and start_at < 0 and stop_at is None:
        return -start_at
    if (start_at, stop_at, step) == (0, None, 1):
        return dim
    if step == 1 and start_at >= 0 and (stop_at is None or stop_at < 0):
        return _opaque(f"{dim}-{start_at - (stop_at or 0)}")
    return _opaque(f"{dim}[{start}:{stop}:{step}]")


def _onnx_dtype(dtype: str) -> int:
    return helper.np_dtype_to_tensor_dtype(np.dtype(dtype))


# ---- tensors ----------------------------------------------------------------------------------


type Operand = Tensor | np.ndarray | float | int | bool


class Tensor:
    """A value in a Graph: its ONNX name, shape and dtype. Operators record nodes; nothing runs."""

    # a NumPy array on the left of an operator defers to the reflected one here
    __array_ufunc__ = None

    def __init__(self, graph: Graph, name: str, shape: Shape, dtype: str, from_input: bool) -> None:
        self.graph = graph
        self.name = name
        self.shape = shape
        self.dtype = dtype
        # whether any graph input flows into it: an output that no input reaches is a mistake
        self.from_input = from_input

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __repr__(self) -> str:
        return f"Tensor({self.name!r}, shape={_show(self.shape)}, dtype={self.dtype})"

    # -- arithmetic, with broadcasting; Python scalars and arrays become constants --

    def _binary(
        self, op_type: str, other: Operand, reflected: bool = False, dtype: str | None = None
    ) -> Tensor:
        other = self.graph._operand(other, like=self)
        a, b = (other, self) if reflected else (self, other)
        if a.dtype != b.dtype:
            raise GraphError(f"{op_type.lower()}: dtypes {a.dtype} and {b.dtype} differ")
        shape = _broadcast(op_type.lower(), a.shape, b.shape)
        return self.graph._op(op_type, [a, b], shape, dtype)

    def __add__(self, other: Operand) -> Tensor:
        return self._binary("Add", other)

    def __radd__(self, other: Operand) -> Tensor:
        return self._binary("Add", other, reflected=True)

    def __sub__(self, other: Operand) -> Tensor:
        return self._binary("Sub", other)

    def __rsub__(self, other: Operand) -> Tensor:
        return self._binary("Sub", other, reflected=True)

    def __mul__(self, other: Operand) -> Tensor:
        return self._binary("Mul", other)

    def __rmul__(self, other: Operand) -> Tensor:
        return self._binary("Mul", other, reflected=True)

    def __truediv__(self, other: Operand) -> Tensor:
        return self._binary("Div", other)

    def __rtruediv__(self, other: Operand) -> Tensor:
        return self._binary("Div", other, reflected=True)

    def __pow__(self, exponent: Operand) -> Tensor:
        return self._binary("Pow", exponent)

    def __neg__(self) -> Tensor:
        return self._unary("Neg")

    def __lt__(self, other: Operand) -> Tensor:
        return self._binary("Less", other, dtype="bool")

    def __le__(self, other: Operand) -> Tensor:
        return self._binary("LessOrEqual", other, dtype="bool")

    def __gt__(self, other: Operand) -> Tensor:
        return self._binary("Greater", other, dtype="bool")

    def __ge__(self, other: Operand) -> Tensor:
        return self._binary("GreaterOrEqual", other, dtype="bool")

    def __matmul__(self, other: Operand) -> Tensor:
        return _matmul(self, self.graph._operand(other, like=self))

    def __rmatmul__(self, other: Operand) -> Tensor:
        return _matmul(self.graph._operand(other, like=self), self)

    # -- element-wise functions --

    def _unary(self, op_type: str) -> Tensor:
        return self.graph._op(op_type, [self], self.shape)

    def relu(self) -> Tensor:
        return self._unary("Relu")

    def sigmoid(self) -> Tensor:
        return self._unary("Sigmoid")

    def tanh(self) -> Tensor:
        return self._unary("Tanh")

    def exp(self) -> Tensor:
        return self._unary("Exp")

    def log(self) -> Tensor:
        return self._unary("Log")

    def sqrt(self) -> Tensor:
        return self._unary("Sqrt")

    def rsqrt(self) -> Tensor:
        return self.sqrt()._unary("Reciprocal")

    def abs(self) -> Tensor:
        return self._unary("Abs")

    def erf(self) -> Tensor:
        return self._unary("Erf")

    def gelu(self, approximate: str = "none") -> Tensor:
        """x * Phi(x): exact through erf, or with approximate="tanh" the tanh form (GPT-2's)."""
        if approximate == "none":
            return self * 0.5 * (1.0 + (self * (1 / math.sqrt(2.0))).erf())
        if approximate == "tanh":
            inner = (self + self * self * self * 0.044715) * math.sqrt(2.0 / math.pi)
            return self * 0.5 * (1.0 + inner.tanh())
        raise GraphError(f"gelu: approximate must be 'none' or 'tanh', not {approximate!r}")

    def cast(self, dtype: str) -> Tensor:
        return self.graph._op("Cast", [self], self.shape, np.dtype(dtype).name, to=_onnx_dtype(dtype))

    def masked_fill(self, mask: Tensor, value: float) -> Tensor:
        """value where mask is true, this tensor elsewhere."""
        return where(mask, value, self)

    # -- softmax and normalizations --

    def softmax(self, axis: int = -1) -> Tensor:
        return self.graph._op("Softmax", [self], self.shape, axis=_axis("softmax", axis, self.ndim))

    def log_softmax(self, axis: int = -1) -> Tensor:
        return self.graph._op("LogSoftmax", [self], self.shape, axis=_axis("log_softmax", axis, self.ndim))

    def layer_norm(
        self, weight: Operand | None = None, bias: Operand | None = None, eps: float = 1e-5, axis: int = -1
    ) -> Tensor:
        """Normalizes over the dims from axis on; weight and bias have those dims' shape."""
        axis = _axis("layer_norm", axis, self.ndim)
        normalized = self.shape[axis:]
        if weight is None:
            if not all(isinstance(d, int) for d in normalized):
                raise GraphError(f"layer_norm: dims {_show(normalized)} are symbolic; pass a weight")
            weight = np.ones(normalized, self.dtype)
        operands = [self.graph._operand(weight, like=self)]
        if bias is not None:
            operands.append(self.graph._operand(bias, like=self))
        for operand in operands:
            if len(operand.shape) != len(normalized) or not all(map(_dims_agree, operand.shape, normalized)):
                raise GraphError(
                    f"layer_norm: weight and bias must have shape {_show(normalized)} "
                    f"(dims {axis}.. of {_show(self.shape)}), not {_show(operand.shape)}"
                )
        return self.graph._op("LayerNormalization", [self, *operands], self.shape, axis=axis, epsilon=eps)

    def rms_norm(self, weight: Operand | None = None, eps: float = 1e-6, axis: int = -1) -> Tensor:
        """x / sqrt(mean(x^2) + eps) over the dims from axis on, times weight."""
        axes = range(_axis("rms_norm", axis, self.ndim), self.ndim)
        normalized = self * ((self * self).mean(axes, keepdims=True) + eps).rsqrt()
        return normalized if weight is None else normalized * weight

    # -- reductions --

    def _reduce(self, op_type: str, axes: int | Sequence[int] | None, keepdims: bool) -> Tensor:
        op = op_type.removeprefix("Reduce").lower()
        reduced = _axes(op, axes, self.ndim)
        shape = tuple(
            1 if i in reduced else d for i, d in enumerate(self.shape) if keepdims or i not in reduced
        )
        axes_tensor = self.graph._literal(np.array(reduced, np.int64))
        return self.graph._op(op_type, [self, axes_tensor], shape, keepdims=int(keepdims))

    def sum(self, axes: int | Sequence[int] | None = None, keepdims: bool = False) -> Tensor:
        return self._reduce("ReduceSum", axes, keepdims)

    def mean(self, axes: int | Sequence[int] | None = None, keepdims: bool = False) -> Tensor:
        return self._reduce("ReduceMean", axes, keepdims)

    def max(self, axes: int | Sequence[int] | None = None, keepdims: bool = False) -> Tensor:
        return self._reduce("ReduceMax", axes, keepdims)

    # -- layout --

    def reshape(self, *shape: Dim | Sequence[Dim]) -> Tensor:
        """Ints, at most one -1, and symbols that some input's shape carries."""
        target = _shape_arg(shape)
        result = _reshaped(self.shape, target)
        return self.graph._op("Reshape", [self, self.graph._shape_tensor(self, target, result)], result)

    def flatten(self, axis: int = 1) -> Tensor:
        """Two dims: those before axis multiplied together, and those from axis on."""
        axis = axis + self.ndim if axis < 0 else axis
        if not 0 <= axis <= self.ndim:
            raise GraphError(f"flatten: axis {axis} is out of range for a tensor of {self.ndim} dims")
        shape = (_as_dim(*_product(self.shape[:axis])), _as_dim(*_product(self.shape[axis:])))
        return self.graph._op("Flatten", [self], shape, axis=axis)

    def permute(self, *axes: int | Sequence[int]) -> Tensor:
        perm = [_axis("permute", a, self.ndim) for a in _shape_arg(axes)]
        if sorted(perm) != list(range(self.ndim)):
            raise GraphError(
                f"permute: {list(_shape_arg(axes))} is not a permutation of the dims of {_show(self.shape)}"
            )
        return self.graph._op("Transpose", [self], tuple(self.shape[p] for p in perm), perm=perm)

    def transpose(self, dim0: int = -2, dim1: int = -1) -> Tensor:
        """Swaps two dims (the last two by default)."""
        perm = list(range(self.ndim))
        a, b = _axis("transpose", dim0, self.ndim), _axis("transpose", dim1, self.ndim)
        perm[a], perm[b] = perm[b], perm[a]
        return self.permute(perm)

    def unsqueeze(self, axis: int) -> Tensor:
        axis = _axis("unsqueeze", axis, self.ndim + 1)
        shape = self.shape[:axis] + (1,) + self.shape[axis:]
        return self.graph._op("Unsqueeze", [self, self.graph._literal(np.array([axis], np.int64))], shape)

    def squeeze(self, axes: int | Sequence[int] | None = None) -> Tensor:
        """Drops dims of size 1 (by default every static one)."""
        if axes is None:
            dropped = [i for i, d in enumerate(self.shape) if d == 1]
        else:
            dropped = _axes("squeeze", axes, self.ndim)
            for i in dropped:
                if self.shape[i] != 1:
                    raise GraphError(f"squeeze: dim {i} of {_show(self.shape)} is not 1")
        shape = tuple(d for i, d in enumerate(self.shape) if i not in dropped)
        return self.graph._op("Squeeze", [self, self.graph._literal(np.array(dropped, np.int64))], shape)

    def split(self, sizes: Sequence[int], axis: int = 0) -> list[Tensor]:
        axis = _axis("split", axis, self.ndim)
        total = self.shape[axis]
        if isinstance(total, int) and sum(sizes) != total:
            raise GraphError(f"split: sizes {list(sizes)} do not add up to dim {axis} of {_show(self.shape)}")
        shapes = [self.shape[:axis] + (size,) + self.shape[axis + 1 :] for size in sizes]
        sizes_tensor = self.graph._literal(np.array(sizes, np.int64))
        return self.graph._node("Split", [self, sizes_tensor], shapes, axis=axis)

    def __getitem__(self, key: int | slice | tuple) -> Tensor:
        """Integers and slices (positive steps) per dim, with one ... for the dims not named."""
        picks = _expand_index(key if isinstance(key, tuple) else (key,), self.shape)
        starts, stops, steps, axes, dropped, sliced_shape = [], [], [], [], [], []
        for axis, (pick, dim) in enumerate(zip(picks, self.shape)):
            sliced_shape.append(dim)
            if pick == slice(None):
                continue
            if isinstance(pick, int):
                if isinstance(dim, int) and not -dim <= pick < dim:
                    raise GraphError(f"index: {pick} is out of range for dim {axis} of {_show(self.shape)}")
                start, stop, step = pick, (pick + 1 if pick != -1 else SLICE_END), 1
                sliced_shape[-1] = 1
                dropped.append(axis)
            else:
                start, stop, step = pick.start, pick.stop, pick.step or 1
                if step <= 0:
                    raise GraphError(f"index: step {step} is not positive")
                sliced_shape[-1] = _sliced_dim(dim, start, stop, step)
            starts.append(start if start is not None else 0)
            stops.append(stop if stop is not None else SLICE_END)
            steps.append(step)
            axes.append(axis)
        if not axes:
            return self
        bounds = [self.graph._literal(np.array(v, np.int64)) for v in (starts, stops, axes, steps)]
        sliced = self.graph._op("Slice", [self, *bounds], tuple(sliced_shape))
        return sliced.squeeze(dropped) if dropped else sliced

    def gather(self, indices: Tensor, axis: int = 0) -> Tensor:
        """Rows (or slices along axis) picked by an integer tensor: an embedding lookup on axis 0."""
        axis = _axis("gather", axis, self.ndim)
        indices = self.graph._operand(indices, like=self)
        if indices.dtype not in ("int32", "int64"):
            raise GraphError(f"gather: indices must be int32 or int64, not {indices.dtype}")
        shape = self.shape[:axis] + indices.shape + self.shape[axis + 1 :]
        return self.graph._op("Gather", [self, indices], shape, axis=axis)

    def _dim_size(self, axis: int) -> Tensor:
        """The size of one dim as a 1-element int64 tensor, read at run time."""
        axis = _axis("shape", axis, self.ndim)
        return self.graph._op("Shape", [self], (1,), "int64", start=axis, end=axis + 1)

    # -- layers --

    def linear(self, weight: Operand, bias: Operand | None = None) -> Tensor:
        """self @ weight + bias, with weight of shape (in_features, out_features)."""
        product = self @ weight
        return product if bias is None else product + bias

    def conv2d(
        self,
        weight: Operand,
        bias: Operand | None = None,
        stride: int | Sequence[int] = 1,
        padding: int | Sequence[int] = 0,
        dilation: int | Sequence[int] = 1,
        groups: int = 1,
    ) -> Tensor:
        """NCHW input, weight (out_channels, in_channels / groups, kernel_h, kernel_w)."""
        weight = self.graph._operand(weight, like=self)
        if self.ndim != 4 or weight.ndim != 4:
            raise GraphError(
                f"conv2d: input {_show(self.shape)} and weight {_show(weight.shape)} must have 4 dims"
            )
        out_channels, per_group, *kernel = weight.shape
        if not all(isinstance(d, int) for d in weight.shape):
            raise GraphError(f"conv2d: weight shape {_show(weight.shape)} must be static")
        channels = self.shape[1]
        if isinstance(channels, int) and channels != per_group * groups:
            raise GraphError(
                f"conv2d: input {_show(self.shape)} has {channels} channels but weight {_show(weight.shape)} "
                f"with groups={groups} takes {per_group * groups}"
            )
        if out_channels % groups:
            raise GraphError(
                f"conv2d: weight {_show(weight.shape)} has {out_channels} out channels, not a "
                f"multiple of groups={groups}"
            )
        operands = [self, weight]
        if bias is not None:
            operands.append(self.graph._operand(bias, like=self))
            if operands[-1].shape != (out_channels,):
                raise GraphError(f"conv2d: bias shape {_show(operands[-1].shape)} is not ({out_channels},)")
        strides, pads, dilations = _pair(stride), _pair(padding), _pair(dilation)
        spatial = [
            _window_dim("conv2d", self.shape, 2 + i, kernel[i], strides[i], pads[i], dilations[i])
            for i in (0, 1)
        ]
        return self.graph._op(
            "Conv",
            operands,
            (self.shape[0], out_channels, *spatial),
            kernel_shape=kernel,
            strides=strides,
            pads=[*pads, *pads],
            dilations=dilations,
            group=groups,
        )

    def _pool(self, op_type: str, kernel_size, stride, padding, **attrs) -> Tensor:
        op = {"MaxPool": "max_pool2d", "AveragePool": "avg_pool2d"}[op_type]
        if self.ndim != 4:
            raise GraphError(f"{op}: input {_show(self.shape)} must have 4 dims (NCHW)")
        kernel, pads = _pair(kernel_size), _pair(padding)
        strides = _pair(stride) if stride is not None else kernel
        spatial = [_window_dim(op, self.shape, 2 + i, kernel[i], strides[i], pads[i], 1) for i in (0, 1)]
        return self.graph._op(
            op_type,
            [self],
            (*self.shape[:2], *spatial),
            kernel_shape=kernel,
            strides=strides,
            pads=[*pads, *pads],
            **attrs,
        )

    def max_pool2d(
        self, kernel_size: int | Sequence[int], stride=None, padding: int | Sequence[int] = 0
    ) -> Tensor:
        """stride defaults to the kernel size."""
        return self._pool("MaxPool", kernel_size, stride, padding)

    def avg_pool2d(
        self,
        kernel_size: int | Sequence[int],
        stride=None,
        padding: int | Sequence[int] = 0,
        count_include_pad: bool = False,
    ) -> Tensor:
        """stride defaults to the kernel size; padding counts in the average only if asked."""
        return self._pool(
            "AveragePool", kernel_size, stride, padding, count_include_pad=int(count_include_pad)
        )

    def global_avg_pool(self) -> Tensor:
        """NCHW -> (N, C, 1, 1)."""
        if self.ndim < 3:
            raise GraphError(f"global_avg_pool: input {_show(self.shape)} needs spatial dims")
        return self.graph._op("GlobalAveragePool", [self], (*self.shape[:2], *[1] * (self.ndim - 2)))


def _expand_index(key: tuple, shape: Shape) -> list[int | slice]:
    if sum(k is Ellipsis for k in key) > 1:
        raise GraphError("index: only one ... is allowed")
    for k in key:
        if k is not Ellipsis and not isinstance(k, (int, slice)):
            raise GraphError(f"index: {k!r} is not an int, a slice or ...")
    named = [k for k in key if k is not Ellipsis]
    if len(named) > len(shape):
        raise GraphError(f"index: {len(named)} indices for a tensor of shape {_show(shape)}")
    fill = [slice(None)] * (len(shape) - len(named))
    if Ellipsis in key:
        at = key.index(Ellipsis)
        return [*key[:at], *fill, *key[at + 1 :]]
    return [*named, *fill]


def _matmul(a: Tensor, b: Tensor) -> Tensor:
    if a.dtype != b.dtype:
        raise GraphError(f"matmul: dtypes {a.dtype} and {b.dtype} differ")
    if a.ndim == 0 or b.ndim == 0:
        raise GraphError(f"matmul: {_show(a.shape)} @ {_show(b.shape)}: scalars are not matrices")
    left = a.shape if a.ndim > 1 else (1, *a.shape)
    right = b.shape if b.ndim > 1 else (*b.shape, 1)
    if not _dims_agree(left[-1], right[-2]):
        raise GraphError(f"matmul: inner dims differ: {_show(a.shape)} @ {_show(b.shape)}")
    batch = _broadcast("matmul", left[:-2], right[:-2])
    rows = (left[-2],) if a.ndim > 1 else ()
    cols = (right[-1],) if b.ndim > 1 else ()
    return a.graph._op("MatMul", [a, b], (*batch, *rows, *cols))


def _reshaped(source: Shape, target: tuple) -> Shape:
    """The shape a reshape gives, with its -1 worked out; GraphError if the sizes cannot match."""
    for dim in target:
        if not (isinstance(dim, str) or (isinstance(dim, int) and (dim >= 1 or dim == -1))):
            raise GraphError(f"reshape: {dim!r} is not a dim (ints >= 1, -1 or a symbol)")
    if target.count(-1) > 1:
        raise GraphError(f"reshape: {_show(target)} has more than one -1")
    have_coefficient, have_symbols = _product(source)
    want_coefficient, want_symbols = _product([d for d in target if d != -1])
    mismatch = GraphError(
        f"reshape: {_show(source)} cannot become {_show(target)}: the element counts differ"
    )
    if -1 not in target:
        if (have_coefficient, have_symbols) != (want_coefficient, want_symbols):
            raise mismatch
        return target
    missing_symbols = have_symbols.copy()
    missing_symbols.subtract(want_symbols)
    if have_coefficient % want_coefficient or any(n < 0 for n in missing_symbols.values()):
        raise mismatch
    inferred = _as_dim(have_coefficient // want_coefficient, +missing_symbols)
    return tuple(inferred if d == -1 else d for d in target)


# ---- functions of several tensors ---------------------------------------------------------------


def concat(tensors: Sequence[Tensor], axis: int = 0) -> Tensor:
    if not tensors:
        raise GraphError("concat: no tensors")
    first = tensors[0]
    axis = _axis("concat", axis, first.ndim)
    shapes = " and ".join(_show(t.shape) for t in tensors)
    shape = list(first.shape)
    for t in tensors[1:]:
        if t.ndim != first.ndim or t.dtype != first.dtype:
            raise GraphError(
                f"concat: shapes {shapes} (dtypes {[t.dtype for t in tensors]}) do not concatenate"
            )
        for i, (have, dim) in enumerate(zip(shape, t.shape)):
            if i != axis and not _dims_agree(have, dim):
                raise GraphError(f"concat: shapes {shapes} differ outside axis {axis}")
            shape[i] = _known(have, dim) if i != axis else have
    lengths = [t.shape[axis] for t in tensors]
    if all(isinstance(d, int) for d in lengths):
        shape[axis] = sum(lengths)
    else:
        shape[axis] = _opaque("+".join(str(d) for d in lengths))
    return first.graph._op("Concat", list(tensors), tuple(shape), axis=axis)


def where(condition: Tensor, a: Operand, b: Operand) -> Tensor:
    """a where condition is true, b elsewhere; all three broadcast together."""
    if not isinstance(condition, Tensor):
        raise GraphError(f"where: the condition must be a Tensor, not {condition!r}")
    graph = condition.graph
    if condition.dtype != "bool":
        raise GraphError(f"where: the condition must be bool, not {condition.dtype}")
    like = next((v for v in (a, b) if isinstance(v, Tensor)), None)
    if like is None:
        raise GraphError("where: a or b must be a Tensor")
    a, b = graph._operand(a, like=like), graph._operand(b, like=like)
    if a.dtype != b.dtype:
        raise GraphError(f"where: dtypes {a.dtype} and {b.dtype} differ")
    shape = _broadcast("where", condition.shape, a.shape, b.shape)
    return graph._op("Where", [condition, a, b], shape, a.dtype)


def embedding(ids: Tensor, table: Operand) -> Tensor:
    """The rows of table (vocabulary, width) at integer ids: ids.shape + (width,)."""
    return ids.graph._operand(table, like=ids).gather(ids, axis=0)


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    causal: bool = False,
    scale: float | None = None,
    mask: Tensor | None = None,
) -> Tensor:
    """softmax(q @ k^T * scale) @ v over (..., seq, head_dim) tensors; scale defaults to
    1/sqrt(head_dim). causal keeps position i from seeing keys after i; mask (bool, broadcast to the
    scores) keeps the scores where it is true."""
    if scale is None:
        head_dim = q.shape[-1]
        if not isinstance(head_dim, int):
            raise GraphError(f"attention: head dim of {_show(q.shape)} is symbolic; pass scale")
        scale = 1.0 / math.sqrt(head_dim)
    scores = (q @ k.transpose(-2, -1)) * scale
    # masked scores become the lowest finite value: a blend of it with zero stays finite
    masked = float(np.finfo(scores.dtype).min)
    if causal:
        scores = where(_causal_mask(q, k), scores, masked)
    if mask is not None:
        scores = where(mask, scores, masked)
    return scores.softmax(-1) @ v


def _causal_mask(q: Tensor, k: Tensor) -> Tensor:
    """(q_len, k_len) bool, true where the key's position is not after the query's."""
    graph, q_len, k_len = q.graph, q.shape[-2], k.shape[-2]
    if isinstance(q_len, int) and isinstance(k_len, int):
        return graph._literal(np.tril(np.ones((q_len, k_len), bool)))
    rows, cols = graph._positions(q, -2), graph._positions(k, -2)
    return cols.unsqueeze(0) <= rows.unsqueeze(1)


# ---- the graph ----------------------------------------------------------------------------------


class Graph:
    """Records inputs, constants, nodes and outputs; to_onnx() exports them."""

    def __init__(self, name: str = "graph") -> None:
        self.name = name
        self._nodes: list[onnx.NodeProto] = []
        self._initializers: dict[str, onnx.TensorProto] = {}
        self._inputs: dict[str, Tensor] = {}
        self._outputs: dict[str, Tensor] = {}
        # every value and node name so far, so generated ones never collide with the user's
        self._taken: set[str] = set()
        self._counts: Counter[str] = Counter()
        # symbol -> (input, axis) that carries it, for reshapes to symbolic dims
        self._symbols: dict[str, tuple[Tensor, int]] = {}
        # literal arrays (Python scalars, axes, shapes) already stored, by dtype, shape and bytes
        self._literals: dict[tuple, Tensor] = {}

    # -- public --

    def input(self, name: str, shape: Sequence[Dim], dtype: str = "float32") -> Tensor:
        shape = tuple(shape)
        for dim in shape:
            if isinstance(dim, str) and not dim.isidentifier():
                raise GraphError(f"input {name!r}: symbolic dim {dim!r} must be an identifier")
            if not isinstance(dim, (int, str)) or isinstance(dim, int) and dim < 1:
                raise GraphError(f"input {name!r}: {dim!r} is not a dim (an int >= 1 or a symbol)")
        tensor = Tensor(self, self._claim(name, "input"), shape, np.dtype(dtype).name, from_input=True)
        self._inputs[name] = tensor
        for axis, dim in enumerate(shape):
            if isinstance(dim, str):
                self._symbols.setdefault(dim, (tensor, axis))
        return tensor

    def constant(
        self, value: np.ndarray | float | Sequence, name: str | None = None, dtype: str | None = None
    ) -> Tensor:
        """A weight, stored in the model. Python floats become float32 unless dtype says."""
        array = np.asarray(value, dtype=dtype)
        if dtype is None and not isinstance(value, np.ndarray) and array.dtype == np.float64:
            array = array.astype(np.float32)
        tensor_name = self._claim(name, "constant") if name is not None else self._fresh("const")
        self._initializers[tensor_name] = numpy_helper.from_array(array, tensor_name)
        return Tensor(self, tensor_name, array.shape, array.dtype.name, from_input=False)

    def output(self, name: str, tensor: Tensor) -> None:
        if not isinstance(tensor, Tensor) or tensor.graph is not self:
            raise GraphError(f"output {name!r}: {tensor!r} is not a Tensor of this graph")
        if not tensor.from_input:
            raise GraphError(f"output {name!r} depends on no input: it would be a constant")
        self._claim(name, "output")
        self._nodes.append(helper.make_node("Identity", [tensor.name], [name], name=self._fresh("Identity")))
        self._outputs[name] = tensor

    def to_model_proto(self) -> onnx.ModelProto:
        if not self._outputs:
            raise GraphError("the graph has no outputs: call graph.output(name, tensor)")
        nodes = self._reachable_nodes()
        read = {name for node in nodes for name in node.input}
        graph = helper.make_graph(
            nodes,
            self.name,
            [_value_info(t.name, t) for t in self._inputs.values()],
            [_value_info(name, t) for name, t in self._outputs.items()],
            [init for name, init in self._initializers.items() if name in read],
        )
        model = helper.make_model(
            graph,
            opset_imports=[helper.make_opsetid("", OPSET)],
            ir_version=IR_VERSION,
            producer_name="luminal_cloud",
        )
        try:
            onnx.checker.check_model(model, full_check=True)
        except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as exc:
            raise GraphError(f"the exported graph is invalid: {exc}") from None
        return model

    def to_onnx(self) -> bytes:
        return self.to_model_proto().SerializeToString()

    def save(self, path: str | Path) -> None:
        Path(path).write_bytes(self.to_onnx())

    # -- used by Tensor and the functions above --

    def _node(
        self,
        op_type: str,
        inputs: Sequence[Tensor],
        shapes: Sequence[Shape],
        dtype: str | None = None,
        **attrs,
    ) -> list[Tensor]:
        for tensor in inputs:
            if tensor.graph is not self:
                raise GraphError(f"{op_type}: {tensor!r} belongs to another graph")
        names = [self._fresh(op_type.lower()) for _ in shapes]
        node = helper.make_node(op_type, [t.name for t in inputs], names, name=self._fresh(op_type), **attrs)
        self._nodes.append(node)
        from_input = any(t.from_input for t in inputs)
        out_dtype = dtype or inputs[0].dtype
        return [Tensor(self, n, tuple(s), out_dtype, from_input) for n, s in zip(names, shapes)]

    def _op(
        self, op_type: str, inputs: Sequence[Tensor], shape: Shape, dtype: str | None = None, **attrs
    ) -> Tensor:
        return self._node(op_type, inputs, [shape], dtype, **attrs)[0]

    def _operand(self, value: Operand, like: Tensor) -> Tensor:
        """A Tensor of this graph; a Python number takes like's dtype, an array keeps its own."""
        if isinstance(value, Tensor):
            if value.graph is not self:
                raise GraphError(f"{value!r} belongs to another graph")
            return value
        if isinstance(value, np.ndarray):
            return self._literal(value)
        if isinstance(value, (bool, int, float, np.generic)):
            if isinstance(value, float) and not np.issubdtype(like.dtype, np.floating):
                raise GraphError(f"{value!r} is not a {like.dtype}: cast the tensor first")
            return self._literal(np.array(value, like.dtype))
        raise GraphError(f"{value!r} is not a Tensor, an array or a number")

    def _literal(self, array: np.ndarray) -> Tensor:
        """A constant for a value the graph needs (a scalar, axes, a shape), stored once."""
        key = (array.dtype.str, array.shape, array.tobytes())
        if key not in self._literals:
            self._literals[key] = self.constant(array)
        return self._literals[key]

    def _shape_tensor(self, tensor: Tensor, target: tuple, result: Shape) -> Tensor:
        """Reshape's shape input: literals where they can be, a dim read at run time where not."""
        pieces: list[Tensor | int] = []
        free_dim = -1 not in target  # a dim that can only be a product of symbols may become the -1
        for axis, (want, got) in enumerate(zip(target, result)):
            if isinstance(want, int):
                pieces.append(want)
            elif axis < tensor.ndim and tensor.shape[axis] == got:
                pieces.append(0)  # ONNX copies the input's dim here
            elif want in tensor.shape:
                pieces.append(tensor._dim_size(tensor.shape.index(want)))
            elif want in self._symbols:
                source, source_axis = self._symbols[want]
                pieces.append(source._dim_size(source_axis))
            elif free_dim:
                pieces.append(-1)
                free_dim = False
            else:
                raise GraphError(
                    f"reshape: no input has the dim {want!r} of {_show(target)}; write -1 for it"
                )
        if all(isinstance(p, int) for p in pieces):
            return self._literal(np.array(pieces, np.int64))
        parts = [p if isinstance(p, Tensor) else self._literal(np.array([p], np.int64)) for p in pieces]
        return concat(parts, axis=0)

    def _positions(self, tensor: Tensor, axis: int) -> Tensor:
        """0, 1, ... up to the size of one of tensor's dims, as int64."""
        length = tensor._dim_size(axis).squeeze(0)
        start, step = self._literal(np.array(0, np.int64)), self._literal(np.array(1, np.int64))
        return self._op("Range", [start, length, step], (tensor.shape[axis],))

    def _claim(self, name: str, kind: str) -> str:
        if not isinstance(name, str) or not name:
            raise GraphError(f"{kind} name must be a non-empty string, not {name!r}")
        if name in self._taken:
            raise GraphError(f"{kind} name {name!r} is already used in this graph")
        self._taken.add(name)
        return name

    def _fresh(self, base: str) -> str:
        while True:
            self._counts[base] += 1
            name = f"{base}_{self._counts[base]}"
            if name not in self._taken:
                self._taken.add(name)
                return name

    def _reachable_nodes(self) -> list[onnx.NodeProto]:
        """The nodes some output needs, in the order they were recorded (a topological order)."""
        needed = set(self._outputs)
        kept = []
        for node in reversed(self._nodes):
            if needed.intersection(node.output):
                kept.append(node)
                needed.update(node.input)
        return kept[::-1]


def _value_info(name: str, tensor: Tensor) -> onnx.ValueInfoProto:
    # a derived symbolic dim ("batch*seq") is left unnamed: the compiler would read it as a new symbol
    dims = [d if isinstance(d, int) or d.isidentifier() else None for d in tensor.shape]
    return helper.make_tensor_value_info(name, _onnx_dtype(tensor.dtype), dims)
