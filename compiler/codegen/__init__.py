"""Code generators that need no build: one module a target, each with generate(graph) -> kernels
and an Executable that runs them."""

from compiler.codegen import numpy_cpu

# target name -> code generator module (generate(graph) -> kernels, Executable)
CODEGENS = {numpy_cpu.TARGET: numpy_cpu}

__all__ = ["CODEGENS"]
