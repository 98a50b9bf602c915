"""The `luminal-cloud` command.

The SDK's own commands talk to a server over HTTP (deploy, predict, generate, models, status,
versions, promote, rollback, delete, usage). Commands that run the server itself (serve, demo, admin) come
from the server distribution through the entry-point group `luminal_cloud.commands`, so this
module imports nothing from the server.

Every failure is one line on stderr and an exit code (EXIT_CODES below), never a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Callable
from importlib.metadata import entry_points
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from luminal_cloud import _table

if TYPE_CHECKING:
    from luminal_cloud.client import Client
from luminal_cloud.errors import LuminalCloudError, ServerUnreachable, Unauthorized

DEFAULT_URL = "http://127.0.0.1:8000"
# the first bytes of every .npy file (numpy.lib.format)
NPY_MAGIC = b"\x93NUMPY"

EXIT_OK, EXIT_API, EXIT_USAGE, EXIT_UNREACHABLE = 0, 1, 2, 3
EXIT_CODES = f"""exit codes:
  {EXIT_OK}  success
  {EXIT_API}  the server answered with an error (a refused API key, an unknown model, a failed compile, ...)
  {EXIT_USAGE}  usage error: bad arguments, a missing file, an unreadable .npy input
  {EXIT_UNREACHABLE}  the server cannot be reached (down, or a wrong --url)

environment: LUMINAL_URL (default {DEFAULT_URL}) and LUMINAL_API_KEY stand in for --url and --api-key"""


class UsageError(Exception):
    """The command cannot run as given (exit code 2): no key, a missing or unreadable file."""


def _client(args: argparse.Namespace) -> Client:
    if not args.api_key:
        raise UsageError("no API key: pass --api-key or set LUMINAL_API_KEY")
    from luminal_cloud.client import Client  # (httpx: not for the server's commands)

    return Client(args.url, args.api_key)


def _print_json(value: Any) -> None:
    print(json.dumps(value, indent=2, default=str))


def _say(args: argparse.Namespace, answer: Any, line: str) -> None:
    """The server's answer as JSON with --json, else one line for a person."""
    if args.json:
        _print_json(answer)
    else:
        print(line)


# -- the verbs


def _deploy(args: argparse.Namespace) -> None:
    path = Path(args.file)
    if not path.is_file() and not (path.is_dir() and args.task == "text-generation"):
        if path.is_dir():
            raise UsageError(f"{path} is a directory: a language model's, with --task text-generation")
        raise UsageError(f"no such file: {path}")
    with _client(args) as client:
        try:
            version = client.deploy(
                path,
                args.name,
                target=args.target,
                wait=not args.no_wait,
                progress=not args.json,
                precision=args.precision,
                task=args.task,
            )
        except (ValueError, FileNotFoundError) as exc:  # the files to upload (no tokenizer.json, ...)
            raise UsageError(str(exc)) from None
    if args.json:
        _print_json(version)
    else:
        number = version.get("version")
        precision = version.get("precision", args.precision)
        # only a narrow precision is named: "exported" is the default
        shown = "" if precision == "exported" else f", {precision}"
        shown += f", {args.task}" if args.task != "inference" else ""
        print(f"{args.name} v{number}: {version['status']} (target {version.get('target', args.target)}{shown})")


def _load_input(spec: str) -> tuple[str, np.ndarray]:
    name, sep, path = spec.partition("=")
    if not sep or not name:
        raise UsageError(f"--input takes NAME=FILE.npy, got {spec!r}")
    if not Path(path).is_file():
        raise UsageError(f"no such file: {path} (input {name!r})")
    try:
        with open(path, "rb") as file:
            magic = file.read(len(NPY_MAGIC))
        if magic != NPY_MAGIC:
            # np.load would try it as a pickle and answer with its allow_pickle hint
            raise UsageError(f"{path} (input {name!r}) is not a .npy array file; write one with numpy.save")
        return name, np.load(Path(path), allow_pickle=False)
    except (OSError, ValueError, EOFError) as exc:
        reason = " ".join(str(exc).split()) or type(exc).__name__
        if "allow_pickle" in reason:
            reason = "it holds Python objects (dtype object); save an array of numbers"
        raise UsageError(f"cannot read {path} (input {name!r}) as a .npy array: {reason}") from None


def _predict(args: argparse.Namespace) -> None:
    inputs = dict(_load_input(s) for s in args.input)
    if not inputs:
        raise UsageError("no inputs: give --input NAME=FILE.npy for each input of the model")
    if args.output_dir and not Path(args.output_dir).is_dir():
        raise UsageError(f"no such directory: {args.output_dir}")
    with _client(args) as client:
        outputs = client.predict(args.name, inputs, version=_version_ref(args.version))
    if args.json:
        _print_json({k: {"dtype": str(v.dtype), "shape": list(v.shape), "data": v.tolist()} for k, v in outputs.items()})
        return
    for name, value in outputs.items():
        if args.output_dir:
            path = Path(args.output_dir) / f"{name}.npy"
            np.save(path, value)
            print(f"{name}: {value.dtype}{list(value.shape)} -> {path}")
        else:
            print(f"{name}: {value.dtype}{list(value.shape)}\n{value}")


def _generate(args: argparse.Namespace) -> None:
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    text, messages = (None, [{"role": "user", "content": prompt}]) if args.chat else (prompt, None)
    options: dict[str, Any] = {
        "messages": messages,
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "seed": args.seed,
        "stop": args.stop or None,
        "version": _version_ref(args.version),
    }
    with _client(args) as client:
        if args.json:  # the whole answer at once
            _print_json(dataclasses.asdict(client.generate(args.name, text, **options)))
            return
        written = False
        try:
            with client.stream(args.name, text, **options) as pieces:
                for piece in pieces:
                    sys.stdout.write(piece)
                    sys.stdout.flush()
                    written = True
        finally:
            if written or sys.exc_info()[0] is None:
                sys.stdout.write("\n")
                sys.stdout.flush()


def _version_ref(text: str | None) -> int | str | None:
    return int(text) if text is not None and text.isdigit() else text


def _models(args: argparse.Namespace) -> None:
    with _client(args) as client:
        models = client.models()
    if args.json:
        _print_json(models)
        return
    if not models:
        print("no models yet: luminal-cloud deploy FILE --name NAME")
        return
    rows = [[m["name"], m["versions"], m["latest_version"], m["latest_status"], m["created_at"]] for m in models]
    print(_table.render(["name", "versions", "latest", "status", "created"], rows))


def _status(args: argparse.Namespace) -> None:
    with _client(args) as client:
        model = client.versions(args.name)
        detail = client.model(args.name)
    versions = model["versions"]
    ref = _version_ref(args.version)
    if ref is None:
        chosen = versions[-1]
    else:
        number = ref if isinstance(ref, int) else next((a["version"] for a in model["aliases"] if a["alias"] == ref), None)
        chosen = next((v for v in versions if v["version"] == number), None)
        if chosen is None:
            raise UsageError(f"model {args.name!r} has no version {args.version}")
    full = next((v for v in detail["versions"] if v["version"] == chosen["version"]), {})
    if args.json:
        _print_json({**full, "aliases": chosen["aliases"]})
        return
    report = full.get("report") or {}
    fields: list[tuple[str, object]] = [
        ("model", args.name),
        ("version", f"{chosen['version']}" + ("" if ref is not None else " (newest)")),
        ("status", chosen["status"]),
        ("target", chosen["target"]),
        ("precision", chosen.get("precision", "exported")),
        ("created", _table.cell(chosen["created_at"])),
        ("aliases", ", ".join(chosen["aliases"]) or "-"),
    ]
    if full.get("progress"):
        fields.append(("progress", _progress_text(full["progress"])))
    if report:
        compiled = f"{report.get('seconds', '?')} s, chosen {report.get('chosen', '?')}"
        fields.append(("compiled", f"{compiled}, {report.get('kernels', '?')} kernels"))
    if report.get("unmeasured"):  # compiled without its GPU: say so, and what happens next
        unmeasured = report["unmeasured"]
        fields.append(("unmeasured", f"{unmeasured.get('why')}; compiled again when {unmeasured.get('recompile_when')}"))
    if chosen.get("error"):
        fields.append(("error", " ".join(str(chosen["error"]).split())))
    width = max(len(k) for k, _ in fields)
    for key, value in fields:
        print(f"{key:<{width}}  {value}")


def _progress_text(progress: dict[str, Any]) -> str:
    text = str(progress.get("phase", ""))
    if progress.get("candidate"):
        text += f" {progress['candidate']}"
    if progress.get("candidates_total"):
        text += f", {progress.get('candidates_measured', 0)}/{progress['candidates_total']} candidates measured"
    return text


def _versions(args: argparse.Namespace) -> None:
    with _client(args) as client:
        model = client.versions(args.name)
    if args.json:
        _print_json(model)
        return
    rows = [
        [v["version"], v["status"], v["target"], v["created_at"], v["aliases"] or None, v.get("error")]
        for v in model["versions"]
    ]
    print(_table.render(["version", "status", "target", "created", "aliases", "error"], rows))


def _alias_line(alias: dict[str, Any]) -> str:
    before = f" (rollback goes to v{alias['previous']})" if alias.get("previous") else ""
    return f"{alias['model']}: {alias['alias']} -> v{alias['version']}{before}"


def _promote(args: argparse.Namespace) -> None:
    with _client(args) as client:
        alias = client.promote(args.name, args.alias, args.version)
    _say(args, alias, _alias_line(alias))


def _rollback(args: argparse.Namespace) -> None:
    with _client(args) as client:
        alias = client.rollback(args.name, args.alias)
    _say(args, alias, _alias_line(alias))


def _delete(args: argparse.Namespace) -> None:
    with _client(args) as client:
        if args.alias:
            result = client.delete_alias(args.name, args.alias)
            said = f"{args.name}: alias {args.alias} deleted"
        elif args.version is not None:
            result = client.delete_version(args.name, args.version)
            said = f"{args.name}: v{args.version} deleted"
        else:
            result = client.delete(args.name)
            said = f"{args.name}: deleted with its {result.get('versions', 0)} version(s)"
    _say(args, result, said)


def _usage(args: argparse.Namespace) -> None:
    with _client(args) as client:
        bill = client.usage(start=args.start, end=args.end, group_by=args.group_by)
    if args.json:
        _print_json(bill)
        return
    items = bill.get("items", [])
    groups = [k for k in ("tenant", "model", "version", "target", "day") if any(k in i for i in items)]
    headers = [*groups, "requests", "rows", "billed_seconds", "cost"]
    print(_table.render(headers, [[item.get(h) for h in headers] for item in items]))
    print(f"total: {bill.get('total_billed_seconds', 0):.6g} s billed, "
          f"{bill.get('total_cost', 0):.6g} {bill.get('currency', 'USD')}")


# -- the parser


def _add_connection(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--url", default=os.environ.get("LUMINAL_URL", DEFAULT_URL),
        help=f"the server's address (default: LUMINAL_URL, else {DEFAULT_URL})",
    )
    parser.add_argument(
        "--api-key", default=os.environ.get("LUMINAL_API_KEY"), help="your API key (default: LUMINAL_API_KEY)"
    )
    parser.add_argument("--json", action="store_true", help="print the server's answer as JSON, for scripts")


def _verb(
    commands: argparse._SubParsersAction, name: str, run: Callable[[argparse.Namespace], None], help_text: str
) -> argparse.ArgumentParser:
    parser = commands.add_parser(
        name, help=help_text, description=help_text, epilog=EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.set_defaults(run=run)
    return parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="luminal-cloud", description="Luminal Cloud: deploy models, run them, read the bill.",
        epilog=EXIT_CODES, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    deploy = _verb(commands, "deploy", _deploy, "upload an ONNX model and wait until it is ready")
    deploy.add_argument(
        "file",
        help="the ONNX file to upload; with --task text-generation also a directory holding one .onnx "
        "file and the tokenizer files (tokenizer.json, tokenizer_config.json, generation_config.json, "
        "config.json), or a .zip bundle of them",
    )
    deploy.add_argument("--name", required=True, help="the model's name (a new version when it exists)")
    deploy.add_argument("--target", default="cpu", help="the device type to compile for (default: cpu)")
    deploy.add_argument(
        "--precision",
        default="exported",
        help="run in the model's own dtypes (exported, the default), or tf32, float16 or bfloat16 on a GPU target",
    )
    deploy.add_argument("--no-wait", action="store_true", help="return once uploaded, without waiting for the compile")
    deploy.add_argument(
        "--task",
        choices=("inference", "text-generation"),
        default="inference",
        help="inference (the default), or text-generation: a decoder with its KV cache and its tokenizer, "
        "for generate",
    )

    predict = _verb(commands, "predict", _predict, "run a model on inputs from .npy files")
    predict.add_argument("name", help="the model's name")
    predict.add_argument(
        "--input", action="append", default=[], metavar="NAME=FILE.npy", help="an input's array (repeat for each input)"
    )
    predict.add_argument("--version", help="a version number or an alias such as prod (default: the newest ready)")
    predict.add_argument("--output-dir", help="write each output to DIR/NAME.npy instead of printing it")

    generate = _verb(
        commands, "generate", _generate, "generate text with a language model, streamed to stdout as it comes"
    )
    generate.add_argument("name", help="the model's name (deployed with --task text-generation)")
    generate.add_argument("prompt", help="the prompt to complete ('-': read it from stdin)")
    generate.add_argument(
        "--chat", action="store_true", help="send the prompt as one user message (the chat template)"
    )
    generate.add_argument("--max-tokens", type=int, default=16, help="new tokens at most (default: 16)")
    generate.add_argument(
        "--temperature", type=float, default=1.0, help="sampling temperature; 0 is greedy (default: 1)"
    )
    generate.add_argument(
        "--top-p", type=float, default=1.0, help="nucleus sampling's probability mass (default: 1)"
    )
    generate.add_argument(
        "--top-k", type=int, default=0, help="sample among the k likeliest tokens; 0: all (default)"
    )
    generate.add_argument("--seed", type=int, help="a seed, for the same text each time")
    generate.add_argument(
        "--stop", action="extend", nargs="+", default=[], metavar="STR", help="stop at any of these strings"
    )
    generate.add_argument(
        "--version", help="a version number or an alias such as prod (default: the newest ready)"
    )

    _verb(commands, "models", _models, "list your models")

    status = _verb(commands, "status", _status, "show one version: status, compile progress or report, error")
    status.add_argument("name", help="the model's name")
    status.add_argument("--version", help="a version number or an alias (default: the newest version)")

    versions = _verb(commands, "versions", _versions, "list a model's versions with their status and aliases")
    versions.add_argument("name", help="the model's name")

    promote = _verb(commands, "promote", _promote, "point an alias (prod, canary) at a ready version")
    promote.add_argument("name", help="the model's name")
    promote.add_argument("alias", help="the alias: a lowercase letter, then letters, digits, '_' or '-'")
    promote.add_argument("version", type=int, help="the version number it points at from now on")

    rollback = _verb(commands, "rollback", _rollback, "move an alias back to the version it pointed at before")
    rollback.add_argument("name", help="the model's name")
    rollback.add_argument("alias", help="the alias to move back")

    delete = _verb(commands, "delete", _delete, "delete a model, one version of it (--version) or an alias (--alias)")
    delete.add_argument("name", help="the model's name")
    which = delete.add_mutually_exclusive_group()
    which.add_argument("--version", type=int, help="delete only this version (refused while an alias points at it)")
    which.add_argument("--alias", help="delete only this alias (the versions stay)")

    usage = _verb(commands, "usage", _usage, "show the bill: requests, billed seconds and cost")
    usage.add_argument("--from", dest="start", help="from this UTC date or time (ISO 8601), inclusive")
    usage.add_argument("--to", dest="end", help="up to this UTC date or time (ISO 8601), exclusive")
    usage.add_argument("--group-by", choices=("model", "version", "day"), help="one row per model, version or day")

    models = commands.choices["models"]
    for verb in (deploy, predict, generate, models, status, versions, promote, rollback, delete, usage):
        _add_connection(verb)

    for plugin in entry_points(group="luminal_cloud.commands"):
        plugin.load()(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    where = f"luminal-cloud {args.command}"
    try:
        args.run(args)
    except UsageError as exc:
        print(f"{where}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except ServerUnreachable as exc:
        print(f"{where}: {exc}", file=sys.stderr)
        return EXIT_UNREACHABLE
    except Unauthorized as exc:
        print(f"{where}: the server refused the API key ({exc.message}); check --api-key or LUMINAL_API_KEY",
              file=sys.stderr)
        return EXIT_API
    except LuminalCloudError as exc:
        print(f"{where}: {' '.join(str(exc).split())}", file=sys.stderr)
        return EXIT_API
    except KeyboardInterrupt:
        print(f"{where}: interrupted", file=sys.stderr)
        return 130
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
