"""Lowerings of the recurrent layers RNN, GRU and LSTM, unrolled over a static sequence length.

The input projections of every time step are one matmul up front; each step then adds its
recurrent matmul and applies the gate equations. A run-time sequence_lens (forward direction
only) holds each batch row's state once its sequence has ended and zeroes its later outputs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import onnx

from compiler import composite as C
from compiler.dtypes import is_float
from compiler.frontends.onnx_context import Context, attrs, lowers, refuse, text
from compiler.ir import GraphBuilder
from compiler.shape import ShapeError

Activation = Callable[[GraphBuilder, int], int]

# gates use the cheaper tanh (2 sigmoid(2x) - 1); the Tanh op itself is the precise one
_ACTIVATIONS: dict[str, Activation] = {"tanh": C.tanh_by_sigmoid, "sigmoid": C.sigmoid, "relu": C.relu}

# op type -> (gate count, default activations per direction)
_CELLS = {
    "RNN": (1, ("Tanh",)),
    "GRU": (3, ("Sigmoid", "Tanh")),
    "LSTM": (4, ("Sigmoid", "Tanh", "Tanh")),
}


@dataclass
class _Direction:
    """One direction's weights, already transposed for `state @ weight`."""

    w: int  # [input, gates*H]
    r: int  # [H, gates*H]
    bias_w: int | None  # [gates*H]
    bias_r: int | None  # [gates*H]
    peephole: int | None  # [3*H] (LSTM: i, o, f)
    activations: list[Activation]
    reverse: bool


def _gate(b: GraphBuilder, x: int, index: int, hidden: int) -> int:
    """Gate `index` of a [batch, gates*H] tensor."""
    return b.view(x, ("slice", ((0, None, 1), (index * hidden, (index + 1) * hidden, 1))))


def _row(b: GraphBuilder, vector: int, index: int, hidden: int) -> int:
    return b.view(vector, ("slice", ((index * hidden, (index + 1) * hidden, 1),)))


def _plus_bias(b: GraphBuilder, x: int, bias: int | None) -> int:
    return x if bias is None else C.add(b, x, bias)


def _clipped(b: GraphBuilder, act: Activation, clip: float | None) -> Activation:
    if clip is None:
        return act

    def clipped(b: GraphBuilder, x: int) -> int:
        return act(b, C.clamp(b, x, -clip, clip))

    return clipped


@lowers("RNN", "GRU", "LSTM")
def _recurrent(ctx: Context, node: onnx.NodeProto) -> list[int]:
    b = ctx.b
    a = attrs(node)
    kind = node.op_type
    gates, default_acts = _CELLS[kind]
    hidden = a["hidden_size"]
    direction = text(a.get("direction", b"forward"))
    if direction not in ("forward", "reverse", "bidirectional"):
        raise refuse(node, f"direction={direction}")
    if a.get("input_forget", 0):
        raise refuse(node, "input_forget=1")
    layout = a.get("layout", 0)
    x = ctx.value(node, 0)
    if layout:
        x = b.permute(x, (1, 0, 2))
    seq, batch, _ = b.shape(x)
    if not isinstance(seq, int):
        raise refuse(node, "a symbolic sequence length")
    if not is_float(b.dtype(x)):
        raise refuse(node, f"{b.dtype(x)} input")
    num_dirs = 2 if direction == "bidirectional" else 1
    lengths = _sequence_lengths(ctx, node, seq, direction)
    names = [text(n).lower() for n in a.get("activations", [])] or [
        n.lower() for n in default_acts
    ] * num_dirs
    if len(names) != len(default_acts) * num_dirs:
        raise ShapeError(f"{kind} has {len(names)} activations for {num_dirs} direction(s)")
    if any(n not in _ACTIVATIONS for n in names) or a.get("activation_alpha") or a.get("activation_beta"):
        raise refuse(node, f"activations {names}")
    clip = a.get("clip")
    if clip is not None and kind == "LSTM":
        # runtimes differ on whether the cell output activation h(C) is clipped too
        raise refuse(node, "clip")
    w_all, r_all = ctx.value(node, 1), ctx.value(node, 2)
    if b.shape(w_all)[:2] != (num_dirs, gates * hidden):
        raise ShapeError(f"{kind} W of shape {list(b.shape(w_all))} for {num_dirs} direction(s)")
    bias_all = ctx.optional(node, 3)
    peephole_all = ctx.optional(node, 7) if kind == "LSTM" else None
    initial_h = ctx.optional(node, 5)
    initial_c = ctx.optional(node, 6) if kind == "LSTM" else None
    if layout:
        initial_h = None if initial_h is None else b.permute(initial_h, (1, 0, 2))
        initial_c = None if initial_c is None else b.permute(initial_c, (1, 0, 2))

    def pick(tensor: int, d: int) -> int:
        """Direction d of a [num_dirs, ...] tensor, without its leading axis."""
        shape = b.shape(tensor)
        part = b.view(tensor, ("slice", ((d, d + 1, 1), *[(0, None, 1)] * (len(shape) - 1))))
        return b.reshape(part, shape[1:])

    outputs_y, outputs_h, outputs_c = [], [], []
    for d in range(num_dirs):
        bias = None if bias_all is None else pick(bias_all, d)
        spec = _Direction(
            w=b.permute(pick(w_all, d), (1, 0)),
            r=b.permute(pick(r_all, d), (1, 0)),
            bias_w=None if bias is None else _row(b, bias, 0, gates * hidden),
            bias_r=None if bias is None else _row(b, bias, 1, gates * hidden),
            peephole=None if peephole_all is None else pick(peephole_all, d),
            activations=[
                _clipped(b, _ACTIVATIONS[n], clip)
                for n in names[d * len(default_acts) :][: len(default_acts)]
            ],
            reverse=direction == "reverse" or d == 1,
        )
        zeros = b.expand(b.constant(np.zeros((1, 1), dtype=b.dtype(x))), (batch, hidden))
        h = zeros if initial_h is None else pick(initial_h, d)
        c = zeros if initial_c is None else pick(initial_c, d)
        ys, h, c = _run_direction(b, kind, x, spec, h, c, hidden, node, lengths, zeros, a)
        outputs_y.append(C.concat(b, [b.unsqueeze(y, 0) for y in ys], 0))
        outputs_h.append(b.unsqueeze(h, 0))
        outputs_c.append(b.unsqueeze(c, 0))
    y = C.concat(b, [b.unsqueeze(y, 1) for y in outputs_y], 1)  # [seq, dirs, batch, H]
    y_h = C.concat(b, outputs_h, 0)  # [dirs, batch, H]
    y_c = C.concat(b, outputs_c, 0)
    if layout:
        y = b.permute(y, (2, 0, 1, 3))
        y_h, y_c = b.permute(y_h, (1, 0, 2)), b.permute(y_c, (1, 0, 2))
    return [y, y_h, y_c] if kind == "LSTM" else [y, y_h]


def _sequence_lengths(ctx: Context, node: onnx.NodeProto, seq: int, direction: str) -> int | None:
    """A run-time [batch] int64 of sequence lengths, or None when every sequence is full."""
    if len(node.input) <= 4 or not node.input[4]:
        return None
    known = ctx.consts.get(node.input[4])
    if known is not None and (known == seq).all():
        return None
    if direction != "forward":
        raise refuse(node, "sequence_lens in a reverse direction")
    return ctx.b.cast(ctx.value(node, 4), "int64")


def _run_direction(b, kind, x, spec: _Direction, h, c, hidden, node, lengths, zeros, a):
    """Unroll one direction; returns the per-step outputs in time order and the final states."""
    seq, batch, _ = b.shape(x)
    # every step's input projection at once: [seq, batch, gates*H]
    projected = _plus_bias(b, C.matmul(b, x, spec.w), spec.bias_w)
    steps = range(seq - 1, -1, -1) if spec.reverse else range(seq)
    ys: dict[int, int] = {}
    for t in steps:
        xt = b.reshape(
            b.view(projected, ("slice", ((t, t + 1, 1), (0, None, 1), (0, None, 1)))), b.shape(projected)[1:]
        )
        recurrent = C.matmul(b, h, spec.r)
        if kind == "RNN":
            new_h, new_c = spec.activations[0](b, C.add(b, xt, _plus_bias(b, recurrent, spec.bias_r))), c
        elif kind == "GRU":
            new_h, new_c = _gru_step(b, xt, h, recurrent, spec, hidden, a.get("linear_before_reset", 0)), c
        else:
            new_h, new_c = _lstm_step(b, C.add(b, xt, _plus_bias(b, recurrent, spec.bias_r)), c, spec, hidden)
        if lengths is not None:
            # rows whose sequence has ended keep their state and output zeros
            live = C.less(b, b.expand(b.constant(np.asarray([t], dtype=np.int64)), (batch,)), lengths)
            live = b.expand(b.reshape(live, (batch, 1)), (batch, hidden))
            ys[t] = C.where(b, live, new_h, zeros)
            h, c = C.where(b, live, new_h, h), C.where(b, live, new_c, c)
        else:
            ys[t], h, c = new_h, new_h, new_c
    return [ys[t] for t in range(seq)], h, c


def _gru_step(b, xt, h, recurrent, spec: _Direction, hidden, linear_before_reset):
    f, g = spec.activations
    recurrent_b = _plus_bias(b, recurrent, spec.bias_r)
    z = f(b, C.add(b, _gate(b, xt, 0, hidden), _gate(b, recurrent_b, 0, hidden)))
    r = f(b, C.add(b, _gate(b, xt, 1, hidden), _gate(b, recurrent_b, 1, hidden)))
    if linear_before_reset:
        candidate_in = C.mul(b, r, _gate(b, recurrent_b, 2, hidden))
    else:
        r_h = C.mul(b, r, h)
        w_h = b.view(spec.r, ("slice", ((0, None, 1), (2 * hidden, 3 * hidden, 1))))
        bias_h = None if spec.bias_r is None else _row(b, spec.bias_r, 2, hidden)
        candidate_in = _plus_bias(b, C.matmul(b, r_h, w_h), bias_h)
    candidate = g(b, C.add(b, _gate(b, xt, 2, hidden), candidate_in))
    return C.add(b, C.mul(b, C.one_minus(b, z), candidate), C.mul(b, z, h))


def _lstm_step(b, gates, c, spec: _Direction, hidden):
    f, g, h_act = spec.activations

    def with_peep(gate: int, index: int, state: int) -> int:
        if spec.peephole is None:
            return gate
        return C.add(b, gate, C.mul(b, _row(b, spec.peephole, index, hidden), state))

    i = f(b, with_peep(_gate(b, gates, 0, hidden), 0, c))
    forget = f(b, with_peep(_gate(b, gates, 2, hidden), 2, c))
    cell = g(b, _gate(b, gates, 3, hidden))
    new_c = C.add(b, C.mul(b, forget, c), C.mul(b, i, cell))
    o = f(b, with_peep(_gate(b, gates, 1, hidden), 1, new_c))
    return C.mul(b, o, h_act(b, new_c)), new_c
