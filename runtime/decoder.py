"""One step of a generative model on its device: the compiled decoder run on the rows' new
tokens, their keys and values written into the rows' blocks of the paged KV cache, and each
row's last logits returned. A decode step (one token per row) runs the paged decode program
where there is one: it reads each row's past from the pool through the rows' slots, and
returns only the new tokens' keys and values. Any other step (and a decode step the service
finds faster on the general program) gathers the rows' past out of the pool into the
program's past inputs. What runs when is the scheduler's (scheduler/generator.py); the cache
and the programs are the runtime's: on a GPU runtime the pools stay in device memory
(runtime.cuda.DeviceKVStorage) and a paged step runs there.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from compiler.kv_layout import KV_SLOTS, CacheLayout
from runtime.kv_cache import KVStorage, PagedKVCache

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
    """The decoder and its cache. Not thread-safe: one step loop drives it. `paged_step` runs
    the paged decode program (compiler.kv_layout.paged_decode_graph), when there is one, for the
    one-token steps whose rows and past width `paged_for` accepts (the others gather their past for
    `run_step`: the service runs whichever program measures faster at each batch size). With a
    `storage` in a GPU's memory (runtime.cuda.DeviceKVStorage), `paged_step` is the runner that
    storage takes (KVStorage.run_paged); the default, host memory, takes a StepRunner.
    `on_gathered` is told the seconds each gather of the past took, just before `run_step` runs
    on it: the paged program needs none, so a choice between them counts it."""

    def __init__(
        self,
        layout: CacheLayout,
        run_step: StepRunner,
        input_dtypes: Mapping[str, str],
        num_blocks: int,
        block_size: int,
        paged_step: Callable | None = None,
        paged_for: Callable[[int, int], bool] = lambda rows, past: True,
        storage: KVStorage | None = None,
        on_gathered: Callable[[float], None] | None = None,
    ) -> None:
        self.layout = layout
        self.on_gathered = on_gathered
        self.run_step = run_step
        self.paged_step = paged_step
        self.paged_for = paged_for
        self.input_dtypes = dict(input_dtypes)
        self.cache = PagedKVCache(layout, num_blocks, block_size, storage)
        self.paged_steps = 0  # steps the paged decode program ran

    @property
    def allocator(self):
        return self.cache.allocator

    def close(self) -> None:
        """The cache's memory goes back (a GPU's pools); no step may run after."""
        self.cache.close()

    def run(self, rows: Sequence[StepRow]) -> tuple[list[np.ndarray], float]:
        """Runs the decoder on `rows` (one batch; rows of equal length), stores the keys and
        values they made, and returns each row's last logits and the device seconds."""
        layout = self.layout
        cache = self.cache
        count = len(rows[0].tokens)
        tables = [r.blocks for r in rows]
        starts = [r.start for r in rows]
        # a past of at least one slot (masked when empty): no program sees a zero-size tensor
        width = max(1, max(starts))
        inputs = self._tokens(rows, width)
        paged = self.paged_step is not None and count == 1 and self.paged_for(len(rows), width)
        new_slots = cache.slots(tables, starts, [s + count for s in starts], count)
        if paged:
            inputs[KV_SLOTS] = cache.slots(tables, [0] * len(rows), starts, width)
            # the storage passes the pools and stores the new tokens (the outputs hold those only)
            outputs, seconds = cache.run_paged(self.paged_step, inputs, new_slots)
            self.paged_steps += 1
        else:
            started = time.perf_counter()
            past_keys, past_values = cache.gather(tables, starts, width)
            if self.on_gathered is not None:
                self.on_gathered(time.perf_counter() - started)
            for layer in range(layout.layers):
                inputs[layout.past_keys[layer]] = past_keys[layer]
                inputs[layout.past_values[layer]] = past_values[layer]
            outputs, seconds = self.run_step(inputs)
            new = slice(width, width + count)  # the outputs hold the past, then the new tokens
            cache.write(
                new_slots,
                [outputs[name][:, :, new] for name in layout.present_keys],
                [outputs[name][:, :, new] for name in layout.present_values],
            )
        logits = outputs["logits"]
        return [np.asarray(logits[b, -1], dtype=np.float32) for b in range(len(rows))], seconds

    def _tokens(self, rows: Sequence[StepRow], width: int) -> dict[str, np.ndarray]:
        """The step's input_ids, and its attention mask and positions where the graph takes them."""
        layout = self.layout
        count = len(rows[0].tokens)
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
        return inputs


__all__ = ["DecoderSteps", "StepRow", "StepRunner"]
