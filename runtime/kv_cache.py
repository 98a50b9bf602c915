"""The KV cache of a generative model, in fixed-size blocks (vLLM's PagedAttention layout):
every layer's keys and values live in one pool of `num_blocks` blocks of `block_size` tokens,
and a sequence holds a block table, the blocks its tokens occupy in order. Sequences of any
length share the pool without fragmentation; a finished sequence's blocks return at once.

The allocator is plain bookkeeping; `PagedKVCache` adds the storage, hands a paged decode
program each layer's pools to read in place (or gathers a step's past for a program that takes
it whole) and stores the new tokens' keys and values. On a CPU runtime the pools are host memory,
which is the device's (HostKVStorage); on a GPU runtime they are the GPU's
(runtime.cuda.DeviceKVStorage) and never travel through the host between steps.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from compiler.kv_layout import CacheLayout, pool_input


class OutOfBlocks(Exception):
    """Fewer free blocks than asked for: the scheduler preempts or waits, never fails a request."""


class BlockAllocator:
    """Free-list bookkeeping of `num_blocks` blocks; thread-safe."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"a KV cache needs at least one block of one token, not {num_blocks} x {block_size}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free = list(range(num_blocks - 1, -1, -1))  # popped from the end: block 0 first
        self._lock = threading.Lock()

    @property
    def free_count(self) -> int:
        with self._lock:
            return len(self._free)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def allocate(self, count: int) -> list[int]:
        with self._lock:
            if count > len(self._free):
                raise OutOfBlocks(f"{count} blocks asked, {len(self._free)} free")
            taken = [self._free.pop() for _ in range(count)]
        return taken

    def free(self, blocks: Sequence[int]) -> None:
        with self._lock:
            held = set(self._free)
            for block in blocks:
                if block in held or not 0 <= block < self.num_blocks:
                    raise ValueError(f"block {block} freed twice or never allocated")
                held.add(block)
            self._free.extend(reversed(blocks))


def pool_dtype(layout: CacheLayout) -> np.dtype:
    """The dtype the pools hold: the cache's, bfloat16 in float32 (as paged_decode_graph reads them)."""
    return np.dtype(layout.dtype if layout.dtype != "bfloat16" else "float32")


class KVStorage(Protocol):
    """Where the pools lie: host memory (HostKVStorage, a CPU runtime's, which is its device's) or
    a GPU's memory (runtime.cuda.DeviceKVStorage). Slots are PagedKVCache.slots."""

    # the number of token slots each pool holds (num_blocks * block_size)
    pool_slots: int
    # whether run_paged's step runs a function on the loaded program (Runtime.run_on_device),
    # rather than the program on host inputs (a StepRunner)
    runs_on_device: bool

    def pools(self, layer: int) -> tuple[Any, Any]:
        """The layer's key and value pools, [pool_slots, heads, dim], as a paged program reads them."""

    def gather(self, slots: np.ndarray) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Each layer's keys and values at `slots` [batch, width], [batch, heads, width, dim], on the host."""

    def write(self, slots: np.ndarray, keys: Sequence[np.ndarray], values: Sequence[np.ndarray]) -> None:
        """Stores host arrays of new tokens, [batch, heads, n, dim] per layer, at `slots` [batch, n]."""

    def run_paged(self, step: Callable, inputs: dict[str, Any], new_slots: np.ndarray) -> tuple[dict[str, np.ndarray], float]:
        """Runs a paged decode step on `inputs` (tokens and kv_slots) with the pools, stores its new
        keys and values at `new_slots` and returns its outputs (the logits at least) and device seconds."""

    def close(self) -> None:
        """The pools' memory goes back (a device's; host memory goes with the object)."""


class HostKVStorage:
    """The pools in host memory: keys[layer, slot, head, dim] and values alike, so each layer's keys
    are one contiguous [pool_slots, heads, dim] array a paged program reads in place."""

    runs_on_device = False

    def __init__(self, layout: CacheLayout, pool_slots: int) -> None:
        self.layout = layout
        self.pool_slots = pool_slots
        shape = (layout.layers, pool_slots, layout.kv_heads, layout.head_dim)
        self.keys = np.zeros(shape, pool_dtype(layout))
        self.values = np.zeros(shape, pool_dtype(layout))

    def pools(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        return self.keys[layer], self.values[layer]  # views, not copies

    def gather(self, slots: np.ndarray) -> tuple[list[np.ndarray], list[np.ndarray]]:
        # one indexed copy for the whole batch and every layer:
        # [layers, slots, heads, dim] at [batch, width] -> [layers, batch, heads, width, dim]
        keys = np.ascontiguousarray(self.keys[:, slots].transpose(0, 1, 3, 2, 4))
        values = np.ascontiguousarray(self.values[:, slots].transpose(0, 1, 3, 2, 4))
        return list(keys), list(values)

    def write(self, slots: np.ndarray, keys: Sequence[np.ndarray], values: Sequence[np.ndarray]) -> None:
        for layer in range(self.layout.layers):  # one indexed assignment per layer
            self.keys[layer][slots] = keys[layer].transpose(0, 2, 1, 3)
            self.values[layer][slots] = values[layer].transpose(0, 2, 1, 3)

    def run_paged(
        self, step: Callable[[dict[str, np.ndarray]], tuple[dict[str, np.ndarray], float]],
        inputs: dict[str, Any], new_slots: np.ndarray,
    ) -> tuple[dict[str, np.ndarray], float]:
        """`step` runs the program on host arrays: the pools are passed as they lie, and the new
        tokens' keys and values it returns are stored after."""
        layout = self.layout
        for layer in range(layout.layers):
            inputs[pool_input(layer, "key")], inputs[pool_input(layer, "value")] = self.pools(layer)
        outputs, seconds = step(inputs)
        self.write(
            new_slots, [outputs[name] for name in layout.present_keys], [outputs[name] for name in layout.present_values]
        )
        return outputs, seconds

    def close(self) -> None:
        pass  # host memory goes with the object


class PagedKVCache:
    """The allocator and the pools' storage (host memory unless a device's `storage` is given):
    hands a paged decode program each layer's pools to read in place
    (compiler.kv_layout.paged_decode_graph), gathers a step's past for a program that takes it
    whole, and stores the new tokens' keys and values."""

    def __init__(
        self, layout: CacheLayout, num_blocks: int, block_size: int, storage: KVStorage | None = None
    ) -> None:
        self.layout = layout
        self.allocator = BlockAllocator(num_blocks, block_size)
        self.storage = HostKVStorage(layout, num_blocks * block_size) if storage is None else storage
        if self.storage.pool_slots != num_blocks * block_size:
            raise ValueError(
                f"the storage holds {self.storage.pool_slots} slots; {num_blocks} blocks of {block_size} need "
                f"{num_blocks * block_size}"
            )

    @property
    def block_size(self) -> int:
        return self.allocator.block_size

    def pools(self, layer: int) -> tuple[Any, Any]:
        """The layer's key and value pools, [num_blocks * block_size, heads, dim], where they lie."""
        return self.storage.pools(layer)

    def slots(
        self, tables: Sequence[Sequence[int]], starts: Sequence[int], stops: Sequence[int], width: int
    ) -> np.ndarray:
        """[batch, width] int64: the pool slot (block * block_size + slot) of each of row b's
        positions starts[b]..stops[b], right-aligned; the left padding points at slot 0 (finite
        values, which a step's attention mask hides)."""
        size = self.block_size
        slots = np.zeros((len(tables), width), np.int64)
        for b, (table, start, stop) in enumerate(zip(tables, starts, stops, strict=True)):
            if stop > start:
                positions = np.arange(start, stop)
                slots[b, width - (stop - start) :] = (
                    np.asarray(table, np.int64)[positions // size] * size + positions % size
                )
        return slots

    def gather(
        self, tables: Sequence[Sequence[int]], lengths: Sequence[int], width: int
    ) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Each layer's past for a step, [batch, heads, width, dim]: sequence b's `lengths[b]`
        cached tokens right-aligned (left padding, which the step's attention mask hides); a
        paged decode program reads the pools instead."""
        return self.storage.gather(self.slots(tables, [0] * len(tables), lengths, width))

    def write(self, slots: np.ndarray, keys: Sequence[np.ndarray], values: Sequence[np.ndarray]) -> None:
        """Stores a step's new tokens, [batch, heads, n, dim] per layer, at `slots` [batch, n]
        (PagedKVCache.slots of their positions)."""
        self.storage.write(slots, keys, values)

    def run_paged(self, step: Callable, inputs: dict[str, Any], new_slots: np.ndarray) -> tuple[dict[str, np.ndarray], float]:
        """A paged decode step (KVStorage.run_paged): `step` is the runner the storage takes."""
        return self.storage.run_paged(step, inputs, new_slots)

    def close(self) -> None:
        self.storage.close()


def blocks_that_fit(layout: CacheLayout, block_size: int, memory_bytes: int) -> int:
    """How many blocks a memory budget holds."""
    return max(1, memory_bytes // layout.block_bytes(block_size))


__all__ = [
    "BlockAllocator", "HostKVStorage", "KVStorage", "OutOfBlocks", "PagedKVCache", "blocks_that_fit", "pool_dtype",
]
