"""ONNX lowerings, one module per kind of op; importing this package registers them all."""

from compiler.frontends.onnx_ops import basic, elementwise, nn, reduce, tensor  # noqa: F401
