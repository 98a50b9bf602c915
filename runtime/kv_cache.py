"""The KV cache of a generative model, in fixed-size blocks (vLLM's PagedAttention layout):
every layer's keys and values live in one pool of `num_blocks` blocks of `block_size` tokens,
and a sequence holds a block table, the blocks its tokens occupy in order. Sequences of any
length share the pool without fragmentation; a finished sequence's blocks return at once.

The allocator is plain bookkeeping; `PagedKVCache` adds the storage, hands a paged decode
program each layer's pools to read in place (or gathers a step's past for a program that takes
it whole) and stores the new tokens' keys and values. On a CPU runtime the pool is host memory,
which is the device's.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np

from compiler.kv_layout import CacheLayout


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


class PagedKVCache:
    """The pool's storage: keys[layer, block * block_size + slot, head, dim] and values alike,
    so each layer's keys are one contiguous [num_blocks * block_size, heads, dim] array, the
    pool a paged decode program reads in place (compiler.kv_layout.paged_decode_graph)."""

    def __init__(self, layout: CacheLayout, num_blocks: int, block_size: int) -> None:
        self.layout = layout
        self.allocator = BlockAllocator(num_blocks, block_size)
        shape = (layout.layers, num_blocks * block_size, layout.kv_heads, layout.head_dim)
        dtype = np.dtype(layout.dtype if layout.dtype != "bfloat16" else "float32")
        self.keys = np.zeros(shape, dtype)
        self.values = np.zeros(shape, dtype)

    @property
    def block_size(self) -> int:
        return self.allocator.block_size

    def pools(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """The layer's key and value pools, [num_blocks * block_size, heads, dim]: views, not copies."""
        return self.keys[layer], self.values[layer]

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
        cached tokens right-aligned (left padding, which the step's attention mask hides). One
        indexed copy for the whole batch and every layer; a paged decode program reads the
        pools instead."""
        slots = self.slots(tables, [0] * len(tables), lengths, width)
        # [layers, slots, heads, dim] at [batch, width] -> [layers, batch, heads, width, dim]
        keys = np.ascontiguousarray(self.keys[:, slots].transpose(0, 1, 3, 2, 4))
        values = np.ascontiguousarray(self.values[:, slots].transpose(0, 1, 3, 2, 4))
        return list(keys), list(values)

    def write(self, slots: np.ndarray, keys: Sequence[np.ndarray], values: Sequence[np.ndarray]) -> None:
        """Stores a step's new tokens, [batch, heads, n, dim] per layer, at `slots` [batch, n]
        (PagedKVCache.slots of their positions): one indexed assignment per layer."""
        for layer in range(self.layout.layers):
            self.keys[layer][slots] = keys[layer].transpose(0, 2, 1, 3)
            self.values[layer][slots] = values[layer].transpose(0, 2, 1, 3)


def blocks_that_fit(layout: CacheLayout, block_size: int, memory_bytes: int) -> int:
    """How many blocks a memory budget holds."""
    return max(1, memory_bytes // layout.block_bytes(block_size))


__all__ = ["BlockAllocator", "OutOfBlocks", "PagedKVCache", "blocks_that_fit"]
