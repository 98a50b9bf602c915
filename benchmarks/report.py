"""What the benchmarks write with their tables: the commit measured, and their own marked section
of a markdown file (docs/performance.md), replaced on each run."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def revision() -> str:
    """The commit measured, with -dirty when tracked files differ from it."""
    try:
        command = ["git", "-C", str(ROOT), "describe", "--always", "--dirty"]
        described = subprocess.run(command, capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return described.stdout.strip()


def write_section(path: Path, body: list[str], begin: str, end: str) -> None:
    """Replaces the section of `path` between the markers `begin` and `end`, appending it the
    first time."""
    text = path.read_text() if path.exists() else ""
    section = "\n".join([begin, *body, end])
    if begin in text and end in text:
        before, rest = text.split(begin, 1)
        text = before + section + rest.split(end, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    path.write_text(text)
