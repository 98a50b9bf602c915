"""What a compile for a GPU type costs and makes, on this machine: search, rendering, NVRTC (PTX
and a cubin), and verification (on a GPU of that type when this machine has one, else in the CPU
emulation), for the models of benchmarks/models.py in each precision. Prints a markdown table.

    .venv/bin/python benchmarks/cuda_compile.py                        # bert_minilm, resnet50_light
    .venv/bin/python benchmarks/cuda_compile.py --models gpt2_decoder --precisions exported,float16
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.models import BUILDERS
from compiler import compile_onnx

NAMES = {"bert_minilm": "MiniLM-shaped BERT", "gpt2_decoder": "GPT-2-shaped decoder", "resnet50_light": "ResNet-50 (light zoo)"}
HEADER = ["model", "precision", "compile s", "NVRTC s", "launches", "functions", "fused attention", "product tiles", "max error", "verified on"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="bert_minilm,resnet50_light")
    parser.add_argument("--precisions", default="exported,float16")
    parser.add_argument("--target", default="h100")
    args = parser.parse_args()
    print("| " + " | ".join(HEADER) + " |")
    print("|" + "---|" * len(HEADER))
    for model in args.models.split(","):
        data = BUILDERS[model]()
        for precision in args.precisions.split(","):
            started = time.perf_counter()
            report = compile_onnx(data, args.target, precision=precision).report
            seconds = time.perf_counter() - started
            tiles = ", ".join(f"{n}x{tile}" for tile, n in report["product_tiles"].items())
            cells = [
                NAMES.get(model, model), precision, f"{seconds:.1f}", f"{report['build_seconds']:.1f}", str(report["kernels"]),
                str(report["functions"]), str(report["fused_attention"]), tiles, f"{report['verify_max_abs_error']:.1e}",
                report["verified_on"],
            ]
            print("| " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
