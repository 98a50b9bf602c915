"""The benchmarks' timing statistics: runtimes take turns in rounds, and ratios pair the rounds."""

from __future__ import annotations

import statistics

import pytest

from benchmarks.cpu_latency import interleaved_rounds_ms, paired_ratio


def test_runtimes_take_turns_in_rotating_blocks_each_after_an_untimed_run() -> None:
    calls: list[str] = []
    runners = {name: (lambda name=name: calls.append(name)) for name in ("ours", "ort", "openvino")}
    rounds = interleaved_rounds_ms(runners, repeats=6, rounds=3, settle_s=0.0)
    assert {name: [len(block) for block in blocks] for name, blocks in rounds.items()} == {
        "ours": [2, 2, 2], "ort": [2, 2, 2], "openvino": [2, 2, 2],
    }
    timed = calls[9:]  # after each runner's 3 warm-ups
    blocks = [timed[i:i + 3] for i in range(0, len(timed), 3)]  # an untimed run, then the block's 2
    assert [block[0] for block in blocks] == ["ours", "ort", "openvino", "ort", "openvino", "ours", "openvino", "ours", "ort"]
    assert all(len(set(block)) == 1 for block in blocks)


def test_a_ratio_pairs_the_rounds_so_a_slow_spell_on_one_side_moves_one_round() -> None:
    # the machine slowed 4x during our blocks of rounds 2 and 3 but only during theirs in round 3
    ours = [[1.0, 1.0], [4.0, 4.0], [4.0, 4.0]]
    theirs = [[2.0, 2.0], [2.0, 2.0], [8.0, 8.0]]
    assert paired_ratio(ours, theirs) == pytest.approx(0.5)
    # the quotient of the medians of all runs takes the spell for ours running 2x theirs
    assert statistics.median([t for block in ours for t in block]) / statistics.median([t for block in theirs for t in block]) == pytest.approx(2.0)
    with pytest.raises(ValueError):
        paired_ratio(ours, theirs[:2])
