"""ONNX lowerings, one module per concept; importing this package registers them all.

The math they emit (erf, rounding, activations, max/min, equality...) is spelled once, in
compiler.composite.

- basic: Identity/Dropout, Gemm, MatMul, Softmax, Reshape, Flatten, Transpose, Concat, Constant
- elementwise: element-wise math, comparison, logic and bit ops
- reduce: the Reduce ops, ArgMax/ArgMin, Hardmax, LogSoftmax, CumSum/CumProd, Einsum, losses, TopK
- norm: every normalization (Batch-, Layer-, RMS-, Instance-, Group-, Lp-, MeanVariance-, LRN)
- nn: convolutions, pooling, Trilu, DepthToSpace/SpaceToDepth, Pad, Resize/Upsample
- indexing: gathers (Gather, GatherElements, GatherND, OneHot, Compress), scatters
  (ScatterElements, Scatter, ScatterND, TensorScatter) and GridSample
- tensor: casts, shape computation and data movement (Slice, Split, Range, Expand, Tile...)
- quant: quantization ((De)QuantizeLinear, DynamicQuantizeLinear, QLinear*, MatMulInteger)
- recurrent: RNN, GRU, LSTM
- control: If, Loop and Scan, unrolled
"""

from compiler.frontends.onnx_ops import (  # noqa: F401
    basic,
    control,
    elementwise,
    indexing,
    nn,
    norm,
    quant,
    recurrent,
    reduce,
    tensor,
)
