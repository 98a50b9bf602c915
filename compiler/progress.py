"""What a compile tells the caller following it (`progress`), phase by phase."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

# the phases a compile tells its `progress` callback as each begins (lower, build and verify
# come once per candidate): reading the ONNX graph, running the reference on the verification
# inputs, the e-graph search, lowering to kernels, building generated C, checking a candidate
# against the reference, timing the candidates
PHASES = ("parse", "reference", "search", "lower", "build", "verify", "measure")
# called with {"phase": one of PHASES, "candidates_total": candidates of the race (those asked
# for, and those the search adds: the fused-attention form), "candidates_measured": those timed so
# far, "search_rounds": rounds of the schedule search timed so far, "candidate": the one worked on,
# when there is one}; it runs in the compile's thread, so it should return at once and must not raise
Progress = Callable[[dict[str, Any]], None]


class Tracker:
    """Tells `progress` (when there is one) what the compile is doing: see Progress."""

    def __init__(self, progress: Progress | None, wanted: Sequence[str]) -> None:
        self._progress = progress
        self._wanted = set(wanted)
        self._state: dict[str, Any] = {
            "phase": None, "candidates_total": len(self._wanted), "candidates_measured": 0, "search_rounds": 0,
        }
        self._timed: set[str] = set()

    def phase(self, phase: str, candidate: str | None = None) -> None:
        self._state["phase"] = phase
        self._state.pop("candidate", None)
        if candidate is not None:
            self._state["candidate"] = candidate
        if self._progress is not None:
            self._progress(dict(self._state))

    def timed(self, candidate: str) -> None:
        """A candidate of the race timed; one not asked for by name joins the total."""
        self._timed.add(candidate)
        self._state["candidates_measured"] = len(self._timed)
        self._state["candidates_total"] = len(self._wanted | self._timed)
        self.phase("measure", candidate)

    def searched(self, round_name: str) -> None:
        """A round of the schedule search timed (a program the race does not see)."""
        self._state["search_rounds"] += 1
        self.phase("measure", round_name)


__all__ = ["PHASES", "Progress", "Tracker"]
