"""A convolution's windows, recognized in a panel's loop nest, for renderers that multiply them in
place (an implicit GEMM) instead of storing im2col panels.

A `Panels` kernel of a 2-D convolution computes B[batch..., c, i, j, y, x] =
X[base + c*cs + (step_y*y + dil_y*i - pad_y)*sy + (step_x*x + dil_x*j - pad_x)*sx], zero where a
position falls outside the input (its padding guards). `window_geometry` reads those numbers off
the loop nest, or says None when the nest is anything else (symbolic sizes, other guards, a
non-zero fill), so a renderer can fall back to the panels it always supports.

With the positions split by phase (position = step*(o + q) + r, where dil*k = step*q + r), every
window reads its input at stride 1 in one phase plane: a renderer copies the planes (about the
input's size, once) and B's row (c, i, j) is then a fixed offset into them plus the column.

The same windows read by a max or sum (a pooling's window reduction) are `pooling_windows`.
"""

from __future__ import annotations

from dataclasses import dataclass

from compiler.kernels.ir import Apply, Guarded, Ix, Load, LoopKernel, Panels


@dataclass(frozen=True)
class Axis:
    """One spatial axis: window extent `kernel`, `dilation`, `step` (stride), `pad` (before),
    the input's `size` along it, its element `stride` in the source, and the output's extent."""

    kernel: int
    dilation: int
    step: int
    pad: int
    size: int
    stride: int
    out: int

    def phases(self) -> tuple[int, ...]:
        """The phases (dil*k mod step) the windows read, in order."""
        return tuple(sorted({(self.dilation * k) % self.step for k in range(self.kernel)}))

    def reach(self) -> int:
        """How far past an output position, in its phase plane, the last window element lies."""
        return self.dilation * (self.kernel - 1) // self.step


@dataclass(frozen=True)
class WindowGeometry:
    """B read from `source` at `base` (an offset over the loop variables of the panel's batch axes,
    o0.. as in its kernel) + c*channel_stride + the rows and columns of `axes` (y, then x)."""

    source: int
    base: Ix
    channels: int
    channel_stride: int
    axes: tuple[Axis, Axis]


def window_geometry(panels: Panels) -> WindowGeometry | None:
    """The 2-D convolution windows `panels` computes, or None when it computes anything else."""
    kernel = panels.kernel
    lead = len(panels.batch_axes)
    if panels.k_axes != 3 or len(kernel.shape) != lead + 5:
        return None
    extents = kernel.shape[lead:]
    if not all(isinstance(d, int) and d > 0 for d in extents):
        return None
    channels, kh, kw, oh, ow = extents
    value, guards = kernel.value, ()
    if isinstance(value, Guarded):
        if value.fill != 0:
            return None
        value, guards = value.value, value.guards
    if not isinstance(value, Load):
        return None
    names = [f"o{j}" for j in range(lead + 5)]
    batch_vars, (c, i, j, y, x) = set(names[:lead]), names[lead:]
    coef: dict[str, int] = {}
    base_terms = []
    for var, factor in value.index.terms:
        if var in batch_vars:
            base_terms.append((var, factor))
        elif isinstance(var, str) and var in (c, i, j, y, x) and isinstance(factor, int):
            coef[var] = factor
        else:
            return None
    if not isinstance(value.index.const, int):
        return None
    found = _spatial_axes(guards, coef, value.index.const, (i, j, y, x), (kh, kw, oh, ow))
    if found is None or (channels > 1 and coef.get(c, 0) <= 0):
        return None
    axes, const = found
    return WindowGeometry(value.buffer, Ix(tuple(base_terms), const), channels, coef.get(c, 0), axes)


def _axis(guard, k_var: str, o_var: str, k_ext: int, o_ext: int, k_coef: int, o_coef: int) -> Axis | None:
    """An axis from its guard (0 <= dil*k + step*o - pad < size), or without one (no padding:
    every position read lies inside the input)."""
    if guard is not None:
        ix, size = guard
        terms = dict(ix.terms)
        if set(terms) - {k_var, o_var} or not isinstance(size, int) or not isinstance(ix.const, int):
            return None
        dilation, step, pad = terms.get(k_var, 1 if k_ext == 1 else 0), terms.get(o_var, 1 if o_ext == 1 else 0), -ix.const
        if not all(isinstance(v, int) for v in (dilation, step)) or dilation <= 0 or step <= 0 or pad < 0:
            return None
        stride = _stride(k_coef, dilation, k_ext) if k_ext > 1 else _stride(o_coef, step, o_ext)
        if stride is None or (k_ext > 1 and k_coef != dilation * stride) or (o_ext > 1 and o_coef != step * stride):
            return None
        return Axis(k_ext, dilation, step, pad, size, stride, o_ext)
    # no padding: take the element stride as the coefficient's, unit dilation or step
    if k_ext > 1 and o_ext > 1:
        stride = k_coef
        if stride <= 0 or o_coef % stride:
            return None
        dilation, step = 1, o_coef // stride
    elif k_ext > 1:
        stride, dilation, step = k_coef, 1, 1
    elif o_ext > 1:
        stride, dilation, step = o_coef, 1, 1
    else:
        stride, dilation, step = 1, 1, 1
    if stride <= 0 or step <= 0:
        return None
    return Axis(k_ext, dilation, step, 0, step * (o_ext - 1) + dilation * (k_ext - 1) + 1, stride, o_ext)


def _stride(coef: int, factor: int, extent: int) -> int | None:
    if extent <= 1 or factor <= 0 or coef % factor:
        return None
    return coef // factor


@dataclass(frozen=True)
class DepthwiseWindows:
    """A depthwise convolution as a product's loop form: out[planes..., y, x] = sum over (i, j) of
    weight[weight_base + i*weight_steps[0] + j*weight_steps[1]] * source[base + the windows of
    `axes`], one input plane per output plane; the bases are offsets over the loop variables of
    the planes' axes (o0..), as in the loop."""

    source: int
    base: Ix
    weight: int
    weight_base: Ix
    weight_steps: tuple[int, int]
    axes: tuple[Axis, Axis]


def depthwise_windows(loops: LoopKernel) -> DepthwiseWindows | None:
    """The depthwise convolution a product's loop form computes (a sum over one channel's kh x kw
    window of a weight times the input, padding guards on the input alone), or None."""
    if loops.reduce is None or loops.reduce[0] != "sum" or loops.lets or len(loops.shape) < 3:
        return None
    nest = _window_nest(loops)
    value = loops.value
    if nest is None or not (isinstance(value, Apply) and value.op == "mul" and len(value.args) == 2):
        return None
    for windows, weight in (value.args, value.args[::-1]):
        guards = ()
        if isinstance(windows, Guarded):
            if windows.fill != 0:
                continue
            windows, guards = windows.value, windows.guards
        if not (isinstance(windows, Load) and isinstance(weight, Load)):
            continue
        found = _depthwise(windows, guards, weight, nest)
        if found is not None:
            return found
    return None


def _depthwise(windows: Load, guards, weight: Load, nest: _WindowNest) -> DepthwiseWindows | None:
    read = _windows_read(windows, guards, nest)
    if read is None:
        return None
    _, _, i, j = nest.names
    steps, weight_terms = {}, []
    for var, factor in weight.index.terms:
        if var in nest.planes:
            weight_terms.append((var, factor))
        elif var in (i, j) and isinstance(factor, int):
            steps[var] = factor
        elif var not in nest.ones:
            return None
    if not isinstance(weight.index.const, int):
        return None
    base, axes = read
    return DepthwiseWindows(
        windows.buffer, base, weight.buffer, Ix(tuple(weight_terms), weight.index.const), (steps.get(i, 0), steps.get(j, 0)), axes,
    )


@dataclass(frozen=True)
class PoolingWindows:
    """A 2-D window reduction (pooling): out[planes..., y, x] = the `kind` ("max" or "sum") over
    (i, j) of source[base + the windows of `axes`], `fill` where a window reaches past the input;
    the base is an offset over the loop variables of the planes' axes (o0..), as in the loop."""

    kind: str
    source: int
    base: Ix
    fill: float
    axes: tuple[Axis, Axis]


def pooling_windows(loops: LoopKernel) -> PoolingWindows | None:
    """The pooling a window reduction computes (a max or sum over the last two output axes' kh x kw
    windows of one input, padding guards on it alone, any fill), or None."""
    if loops.reduce is None or loops.reduce[0] not in ("max", "sum") or loops.lets:
        return None
    nest = _window_nest(loops)
    value, guards, fill = loops.value, (), 0.0
    if isinstance(value, Guarded):
        if not isinstance(value.fill, (int, float)):
            return None
        value, guards, fill = value.value, value.guards, float(value.fill)
    if nest is None or not isinstance(value, Load):
        return None
    read = _windows_read(value, guards, nest)
    return None if read is None else PoolingWindows(loops.reduce[0], value.buffer, read[0], fill, read[1])


@dataclass(frozen=True)
class _WindowNest:
    """A reduction over the last two output axes' windows: (kh, kw, oh, ow), the variables (y, x,
    i, j), the planes' output variables (o0..) and the reduced ones of extent 1 (always 0)."""

    extents: tuple[int, int, int, int]
    names: tuple[str, str, str, str]
    planes: frozenset[str]
    ones: frozenset[str]


def _window_nest(loops: LoopKernel) -> _WindowNest | None:
    extents, shape = loops.reduce[1], loops.shape
    if len(shape) < 2 or len(extents) < 2 or any(e != 1 for e in extents[:-2]):
        return None
    kh, kw, oh, ow = (*extents[-2:], *shape[-2:])
    if not all(isinstance(d, int) and d > 0 for d in (kh, kw, oh, ow)):
        return None
    rank, reduced = len(shape), len(extents)
    names = (f"o{rank - 2}", f"o{rank - 1}", f"r{reduced - 2}", f"r{reduced - 1}")
    return _WindowNest(
        (kh, kw, oh, ow), names, frozenset(f"o{n}" for n in range(rank - 2)), frozenset(f"r{n}" for n in range(reduced - 2)),
    )


def _windows_read(load: Load, guards, nest: _WindowNest) -> tuple[Ix, tuple[Axis, Axis]] | None:
    """Where `load` reads the nest's windows: its base (over the planes' variables, the padding
    taken out) and its (y, x) axes; None where it reads anything else."""
    y, x, i, j = nest.names
    coef, base_terms = {}, []
    for var, factor in load.index.terms:
        if var in nest.planes:
            base_terms.append((var, factor))
        elif var in (y, x, i, j) and isinstance(factor, int):
            coef[var] = factor
        elif var not in nest.ones:
            return None
    if not isinstance(load.index.const, int):
        return None
    found = _spatial_axes(guards, coef, load.index.const, (i, j, y, x), nest.extents)
    if found is None:
        return None
    axes, const = found
    return Ix(tuple(base_terms), const), axes


def _spatial_axes(guards, coef: dict, const: int, names, extents) -> tuple[tuple[Axis, Axis], int] | None:
    """The (y, x) axes of windows read at `coef` (a coefficient per window and output variable,
    names (i, j, y, x)) under their padding guards, and the read's offset with the padding taken
    out (the offset of the input's first element); None where a guard is not one axis's, or left
    over, or the padding reaches before the input."""
    i, j, y, x = names
    kh, kw, oh, ow = extents
    axes, claimed = [], 0
    for k_var, o_var, k_ext, o_ext in ((i, y, kh, oh), (j, x, kw, ow)):
        mine = [g for g in guards if {v for v, _ in g[0].terms} & {k_var, o_var}]
        if len(mine) > 1:
            return None
        claimed += len(mine)
        axis = _axis(mine[0] if mine else None, k_var, o_var, k_ext, o_ext, coef.get(k_var, 0), coef.get(o_var, 0))
        if axis is None:
            return None
        axes.append(axis)
        const += axis.pad * axis.stride
    if claimed != len(guards) or const < 0:
        return None
    return (axes[0], axes[1]), const
