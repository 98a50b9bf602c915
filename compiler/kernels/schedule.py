"""The schedule vocabulary: how one kernel of a program runs, as the search extracted it.

A `KernelSchedule` is one alternative of a kernel's e-class in the schedule e-graph
(compiler.search.schedule), read back from its term:

    (Tiled 64 k)            a product computed a 64x64 square of C per block (128: the larger tile)
    (TensorCoreTiled 64 k)  the same on tensor cores (mma.sync / WMMA), where the program multiplies
                            in a tensor-core format
    (LibraryCall "cublas" k) a product a library computes
    (Threads 256 k)         an elementwise loop, 256 threads per block
    (WarpRows 8 k)          a reduction, a warp per output, 8 outputs per block
    (BlockRows 256 k)       a reduction, a block of 256 threads per output
    (GeneratedTiles k)      (C) a product in the generated register-tiled code, a weight B packed
                            at compile time
    (WindowRows k)          (C) a convolution's product reading its windows in place, rows of the
                            output at a time
    (GeneratedPanels k)     (C) a convolution's product computing its windows a panel at a time
    (TransposedTiles k)     (C) a product whose A is a weight computed transposed, C^T = B^T A^T,
                            A^T packed at compile time (a small image's positions along the tile's
                            rows); a convolution's windows a panel at a time
    (DirectWindows k)       (C) a convolution's product computed transposed with its windows read in
                            place from a channels-last copy of the input rows: a register tile of
                            output positions by output channels, A^T packed at compile time
    (DepthwisePlanes k)     (C) a depthwise convolution's product plane by plane: each input plane
                            padded and split by phase into cache, each output row a vector loop
    (DepthwiseRegisters k)  (C) the same a plane a vector register, where both planes fit one: each
                            tap a permutation of the input plane (a 4x4 image's 2x2 output)
    (ReductionLoops k)      (C) a matrix-vector product as its reduction loop, reading its operands
                            where the graph has them (no operand packed or windows stored), the
                            reduced loops around the output row
    (ReductionLoopsInside k) (C) the same with each element's sum inside the output row's loop
    (ReductionLoopsColumns k) (C) the same with the reduced loops outside the output row, whose
                            columns the threads share (B's rows streamed, however few C's rows)
    (DequantizedTiles k)    (C) a product by an int8 weight with B widened a strip at a time into
                            scratch that the register tiles read, for all of A's rows at once

Renderers print what a schedule says; they choose nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

# term constructor -> kind
KINDS = {
    "Tiled": "tiled",
    "TensorCoreTiled": "tensor-core-tiled",
    "LibraryCall": "library",
    "Threads": "threads",
    "WarpRows": "warp-rows",
    "BlockRows": "block-rows",
    "GeneratedTiles": "generated-tiles",
    "WindowRows": "window-rows",
    "GeneratedPanels": "generated-panels",
    "TransposedTiles": "transposed-tiles",
    "DirectWindows": "direct-windows",
    "DepthwisePlanes": "depthwise-planes",
    "DepthwiseRegisters": "depthwise-registers",
    "ReductionLoops": "loops",
    "ReductionLoopsInside": "loops-inside",
    "ReductionLoopsColumns": "loops-columns",
    "DequantizedTiles": "dequantized-tiles",
}
# kinds whose term has no argument
SIZELESS = frozenset({
    "generated-tiles", "window-rows", "generated-panels", "transposed-tiles", "direct-windows", "depthwise-planes", "depthwise-registers", "loops",
    "loops-inside",
    "loops-columns", "dequantized-tiles",
})
_CONSTRUCTORS = {kind: name for name, kind in KINDS.items()}


@dataclass(frozen=True, order=True)
class KernelSchedule:
    kind: str
    # the tile's edge, threads per block, or outputs per block (warp-rows)
    size: int = 0
    # the library of a library call
    library: str = ""

    def __post_init__(self) -> None:
        if self.kind not in _CONSTRUCTORS:
            raise ValueError(f"unknown kernel schedule kind {self.kind!r}; known: {sorted(_CONSTRUCTORS)}")

    @property
    def term(self) -> str:
        """The schedule as the e-graph spells it, around the kernel `k`."""
        if self.kind in SIZELESS:
            return f"({_CONSTRUCTORS[self.kind]} k)"
        argument = f'"{self.library}"' if self.kind == "library" else str(self.size)
        return f"({_CONSTRUCTORS[self.kind]} {argument} k)"

    @property
    def label(self) -> str:
        """A short name for reports: tile64, tc-tile64, cublas, threads256, warp-rows8, block-rows256."""
        if self.kind == "library":
            return self.library
        if self.kind in SIZELESS:
            return self.kind
        prefix = {"tiled": "tile", "tensor-core-tiled": "tc-tile"}.get(self.kind, self.kind)
        return f"{prefix}{self.size}"

    @staticmethod
    def from_label(label: str) -> KernelSchedule:
        """The schedule a report's label names (the inverse of `label`; a kernel cache keeps labels)."""
        if label in SIZELESS:
            return KernelSchedule(label)
        for prefix, kind in (("tc-tile", "tensor-core-tiled"), ("tile", "tiled"), ("threads", "threads"),
                             ("warp-rows", "warp-rows"), ("block-rows", "block-rows")):
            if label.startswith(prefix) and label[len(prefix):].isdigit():
                return KernelSchedule(kind, int(label[len(prefix):]))
        if label.isidentifier():
            return KernelSchedule("library", library=label)
        raise ValueError(f"not a kernel schedule label: {label!r}")
