"""The KV cache of a generative model, in fixed-size blocks (vLLM's PagedAttention layout):
every layer's keys and values live in one pool of `num_blocks` blocks of `block_size` tokens,
and a sequence holds a block table, the blocks its tokens occupy in order. Sequences of any
length share the pool without fragmentation; a finished sequence's blocks return at once.

The allocator is plain bookkeeping; `PagedKVCache` adds the storage and moves a step's past in
and its present out. On a CPU runtime the pool is host memory, which is the device's.
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
    """The pool's storage: keys[layer, block, head, slot, dim] and values alike."""

    def __init__(self, layout: CacheLayout, num_blocks: int, block_size: int) -> None:
        self.layout = layout
        self.allocator = BlockAllocator(num_blocks, block_size)
        shape = (layout.layers, num_blocks, layout.kv_heads, block_size, layout.head_dim)
        dtype = np.dtype(layout.dtype if layout.dtype != "bfloat16" else "float32")
        self.keys = np.zeros(shape, dtype)
        self.values = np.zeros(shape, dtype)

    @property
    def block_size(self) -> int:
        return self.allocator.block_size

    def gather(
        self, tables: Sequence[Sequence[int]], lengths: Sequence[int], width: int
    ) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Each layer's past for a step, [batch, heads, width, dim]: sequence b's `lengths[b]`
        cached tokens right-aligned (left padding, which the step's attention mask hides; it
        holds whatever block 0 holds, finite values the mask zeroes). One indexed copy for the
        whole batch and every layer."""
        size = self.block_size
        blocks = np.zeros((len(tables), width), np.intp)
        slots = np.zeros((len(tables), width), np.intp)
        for b, (table, length) in enumerate(zip(tables, lengths, strict=True)):
            if length:
                tokens = np.arange(length)
                blocks[b, width - length :] = np.asarray(table, np.intp)[tokens // size]
                slots[b, width - length :] = tokens % size
        # [layers, blocks, heads, slots, dim] at (blocks, slots) -> [batch, width, layers, heads, dim]
        keys = np.ascontiguousarray(self.keys[:, blocks, :, slots].transpose(2, 0, 3, 1, 4))
        values = np.ascontiguousarray(self.values[:, blocks, :, slots].transpose(2, 0, 3, 1, 4))
        return list(keys), list(values)

    def write(
        self, table: Sequence[int], start: int, keys: Sequence[np.ndarray], values: Sequence[np.ndarray]
    ) -> None:
        """Stores the new tokens of one sequence, [heads, n, dim] per layer, at positions
        start..start+n of its block table (which must already hold them)."""
        count = keys[0].shape[1]
        size = self.block_size
        position = start
        while position < start + count:
            block = table[position // size]
            slot = position % size
            take = min(size - slot, start + count - position)
            offset = position - start
            for layer in range(self.layout.layers):
                self.keys[layer, block, :, slot : slot + take] = keys[layer][:, offset : offset + take]
                self.values[layer, block, :, slot : slot + take] = values[layer][:, offset : offset + take]
            position += take


def blocks_that_fit(layout: CacheLayout, block_size: int, memory_bytes: int) -> int:
    """How many blocks a memory budget holds."""
    return max(1, memory_bytes // layout.block_bytes(block_size))


__all__ = ["BlockAllocator", "OutOfBlocks", "PagedKVCache", "blocks_that_fit"]
