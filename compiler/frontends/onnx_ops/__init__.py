"""ONNX lowerings, one module per kind of op; importing this package registers them all."""

from compiler.frontends.onnx_ops import basic, control, elementwise, nn, quant, recurrent, reduce, tensor  # noqa: F401
