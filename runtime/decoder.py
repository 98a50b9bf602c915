"""One step of a generative model on its device: the past of each row gathered from the paged
KV cache, the compiled decoder run on the rows' new tokens, their keys and values written back
into the rows' blocks, and each row's last logits returned. What runs when is the scheduler's
(scheduler/generator.py); the cache and the program are the runtime's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from compiler.kv_layout import CacheLayout
from runtime.kv_cache import PagedKVCache

# runs the decoder once: inputs by name -> (outputs by name, device seconds)
StepRunner = Callable[[dict[str, np.ndarray]], tuple[dict[str, np.ndarray], float]]


@dataclass(frozen=True)
class StepRow:
    """One sequence's part of a step: `tokens` fed at positions start.., after the `start`
    tokens its `blocks` hold."""

    tokens: Sequence[int]
    start: int
    blocks: Sequence[int]


class DecoderSteps:
    """The decoder and its cache. Not thread-safe: one step loop drives it."""

    def __init__(
        self,
        layout: CacheLayout,
        run_step: StepRunner,
        input_dtypes: Mapping[str, str],
        num_blocks: int,
        block_size: int,
    ) -> None:
        self.layout = layout
        self.run_step = run_step
        self.input_dtypes = dict(input_dtypes)
        self.cache = PagedKVCache(layout, num_blocks, block_size)

    @property
    def allocator(self):
        return self.cache.allocator

    def run(self, rows: Sequence[StepRow]) -> tuple[list[np.ndarray], float]:
        """Runs the decoder on `rows` (one batch; rows of equal length), stores the keys and
        values they made, and returns each row's last logits and the device seconds."""
        layout = self.layout
        count = len(rows[0].tokens)
        # a past of at least one slot (masked when empty): no program sees a zero-size tensor
        width = max(1, max(r.start for r in rows))
        past_keys, past_values = self.cache.gather([r.blocks for r in rows], [r.start for r in rows], width)
        ids = np.array([list(r.tokens) for r in rows])
        inputs: dict[str, np.ndarray] = {"input_ids": ids.astype(self.input_dtypes.get("input_ids", "int64"))}
        if layout.mask_input is not None:
            mask = np.zeros(
                (len(rows), width + count), dtype=self.input_dtypes.get(layout.mask_input, "int64")
            )
            for b, row in enumerate(rows):
                mask[b, width - row.start :] = 1
            inputs[layout.mask_input] = mask
        if layout.position_input is not None:
            positions = np.array([np.arange(r.start, r.start + count) for r in rows])
            inputs[layout.position_input] = positions.astype(
                self.input_dtypes.get(layout.position_input, "int64")
            )
        for layer in range(layout.layers):
            inputs[layout.past_keys[layer]] = past_keys[layer]
            inputs[layout.past_values[layer]] = past_values[layer]
        outputs, seconds = self.run_step(inputs)
        for b, row in enumerate(rows):
            keys = [outputs[name][b, :, width : width + count] for name in layout.present_keys]
            values = [outputs[name][b, :, width : width + count] for name in layout.present_values]
            self.cache.write(row.blocks, row.start, keys, values)
        logits = outputs["logits"]
        return [np.asarray(logits[b, -1], dtype=np.float32) for b in range(len(rows))], seconds


__all__ = ["DecoderSteps", "StepRow", "StepRunner"]
