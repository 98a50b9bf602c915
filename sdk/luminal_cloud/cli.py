"""The `luminal-cloud` command.

The SDK's own commands talk to a server over HTTP (deploy, predict, models, usage). Commands
that run the server itself (serve, demo, admin) come from the server distribution through the
entry-point group `luminal_cloud.commands`, so this module imports nothing from the server.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from importlib.metadata import entry_points
from pathlib import Path

import numpy as np

from luminal_cloud.client import Client
from luminal_cloud.errors import LuminalCloudError

DEFAULT_URL = "http://127.0.0.1:8000"


def _client(args: argparse.Namespace) -> Client:
    if not args.api_key:
        raise SystemExit("no API key: pass --api-key or set LUMINAL_API_KEY")
    return Client(args.url, args.api_key)


def _add_connection(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default=os.environ.get("LUMINAL_URL", DEFAULT_URL))
    parser.add_argument("--api-key", default=os.environ.get("LUMINAL_API_KEY"))


def _deploy(args: argparse.Namespace) -> None:
    with _client(args) as client:
        version = client.deploy(args.file, args.name, target=args.target, wait=not args.no_wait)
    print(json.dumps(version, indent=2, default=str))


def _load_input(spec: str) -> tuple[str, np.ndarray]:
    name, sep, path = spec.partition("=")
    if not sep:
        raise SystemExit(f"--input takes name=file.npy, got {spec!r}")
    return name, np.load(Path(path), allow_pickle=False)


def _predict(args: argparse.Namespace) -> None:
    inputs = dict(_load_input(s) for s in args.input)
    with _client(args) as client:
        outputs = client.predict(args.name, inputs, version=args.version)
    for name, value in outputs.items():
        if args.output_dir:
            path = Path(args.output_dir) / f"{name}.npy"
            np.save(path, value)
            print(f"{name}: {value.dtype}{list(value.shape)} -> {path}")
        else:
            print(f"{name}: {value.dtype}{list(value.shape)}\n{value}")


def _models(args: argparse.Namespace) -> None:
    with _client(args) as client:
        print(json.dumps(client.models(), indent=2, default=str))


def _usage(args: argparse.Namespace) -> None:
    with _client(args) as client:
        print(json.dumps(client.usage(), indent=2))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="luminal-cloud", description="Luminal Cloud")
    commands = parser.add_subparsers(dest="command", required=True)

    deploy = commands.add_parser("deploy", help="upload an ONNX model and wait until it is ready")
    deploy.add_argument("file")
    deploy.add_argument("--name", required=True)
    deploy.add_argument("--target", default="cpu")
    deploy.add_argument("--no-wait", action="store_true")
    _add_connection(deploy)
    deploy.set_defaults(run=_deploy)

    predict = commands.add_parser("predict", help="run a model on inputs from .npy files")
    predict.add_argument("name")
    predict.add_argument("--input", action="append", default=[], metavar="NAME=FILE.npy")
    predict.add_argument("--version", type=int)
    predict.add_argument("--output-dir", help="write each output to DIR/NAME.npy")
    _add_connection(predict)
    predict.set_defaults(run=_predict)

    for name, run, help_text in (("models", _models, "list models"), ("usage", _usage, "show the bill")):
        sub = commands.add_parser(name, help=help_text)
        _add_connection(sub)
        sub.set_defaults(run=run)

    for plugin in entry_points(group="luminal_cloud.commands"):
        plugin.load()(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.run(args)
    except LuminalCloudError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
