"""TensorFlow's best-fit-with-coalescing (BFC) allocator, replayed: the `bytes_in_use` that a
sequence of allocations and frees reaches, which is what TensorFlow reports as a step's memory.

The allocator does not hand out the bytes a tensor asks for:

- a request is rounded up to a multiple of 256 bytes;
- it is served from the smallest free chunk that fits (free chunks sit in 21 bins of power-of-two
  size classes; within a bin, smallest first, then lowest address);
- that chunk is split only when it is at least twice the request or the rest would be 128 MiB or
  more: a request can hold a chunk of almost twice its size, and `bytes_in_use` counts the
  whole chunk;
- memory comes from regions. With growth (TensorFlow's CPU allocator; a GPU with
  `allow_growth`) the first region is 2 MiB and the next one is twice the last, or the first
  doubling that fits the request; without growth (a GPU by default) one region holds the whole
  device. A freed chunk merges with its free neighbours in the same region, never across two.

Written from the algorithm as `bfc_allocator.cc` (TensorFlow 2.15) describes it, without the
parts a single-stream step does not reach (retry, garbage collection, timestamped chunks).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

__all__ = ["MIN_ALLOCATION", "BINS", "MAX_WASTE", "FIRST_REGION", "CPU_LIMIT", "Chunk", "rounded",
           "bin_of", "Allocator"]

MIN_ALLOCATION = 256
BINS = 21
MAX_WASTE = 128 << 20          # a larger remainder is always split off
FIRST_REGION = 2 << 20         # with growth
CPU_LIMIT = 64 << 30           # TensorFlow's default for its CPU BFC allocator


@dataclass(eq=False)
class Chunk:
    address: int
    size: int
    region: int
    in_use: bool = False
    prev: "Chunk | None" = None
    next: "Chunk | None" = None


def rounded(nbytes: int) -> int:
    return max(MIN_ALLOCATION, -(-nbytes // MIN_ALLOCATION) * MIN_ALLOCATION)


def bin_of(size: int) -> int:
    return min((size // MIN_ALLOCATION).bit_length() - 1, BINS - 1)


class Allocator:
    """One BFC allocator. `growth` False puts the whole `limit` in its first region (a GPU)."""

    def __init__(self, growth: bool = True, limit: int = CPU_LIMIT):
        self.limit = limit
        self.region_size = FIRST_REGION if growth else limit
        self.regions = 0
        self.reserved = 0
        self.in_use = 0
        self.peak = 0
        self._bins: list[list[tuple[int, int]]] = [[] for _ in range(BINS)]
        self._free: dict[tuple[int, int], Chunk] = {}
        self._next_address = 0

    def allocate(self, nbytes: int) -> Chunk | None:
        """The chunk that holds a tensor of `nbytes` (None for an empty tensor)."""
        if nbytes <= 0:
            return None
        size = rounded(nbytes)
        chunk = self._take(size)
        if chunk is None:
            self._extend(size)
            chunk = self._take(size)
        if chunk is None:
            raise MemoryError(f"the allocator's {self.limit} bytes cannot hold {size} more")
        if chunk.size >= 2 * size or chunk.size - size >= MAX_WASTE:
            self._split(chunk, size)
        chunk.in_use = True
        self.in_use += chunk.size
        self.peak = max(self.peak, self.in_use)
        return chunk

    def free(self, chunk: Chunk | None) -> None:
        if chunk is None:
            return
        chunk.in_use = False
        self.in_use -= chunk.size
        following = chunk.next
        if following is not None and not following.in_use:
            self._unlist(following)
            self._merge(chunk, following)
        previous = chunk.prev
        if previous is not None and not previous.in_use:
            self._unlist(previous)
            self._merge(previous, chunk)
            chunk = previous
        self._list(chunk)

    def _take(self, size: int) -> Chunk | None:
        for number in range(bin_of(size), BINS):
            entries = self._bins[number]
            at = bisect.bisect_left(entries, (size, -1))
            if at < len(entries):
                chunk = self._free[entries[at]]
                self._unlist(chunk)
                return chunk
        return None

    def _extend(self, size: int) -> None:
        available = (self.limit - self.reserved) // MIN_ALLOCATION * MIN_ALLOCATION
        if size > available:
            return
        grown = False
        while size > self.region_size:
            self.region_size *= 2
            grown = True
        region = min(self.region_size, available)
        if not grown:
            self.region_size *= 2
        self.regions += 1
        self.reserved += region
        chunk = Chunk(self._next_address, region, self.regions)
        self._next_address += region + MIN_ALLOCATION  # regions are never adjacent
        self._list(chunk)

    def _split(self, chunk: Chunk, size: int) -> None:
        rest = Chunk(chunk.address + size, chunk.size - size, chunk.region,
                     prev=chunk, next=chunk.next)
        if chunk.next is not None:
            chunk.next.prev = rest
        chunk.next, chunk.size = rest, size
        self._list(rest)

    def _merge(self, first: Chunk, second: Chunk) -> None:
        first.size += second.size
        first.next = second.next
        if second.next is not None:
            second.next.prev = first

    def _list(self, chunk: Chunk) -> None:
        key = (chunk.size, chunk.address)
        bisect.insort(self._bins[bin_of(chunk.size)], key)
        self._free[key] = chunk

    def _unlist(self, chunk: Chunk) -> None:
        key = (chunk.size, chunk.address)
        entries = self._bins[bin_of(chunk.size)]
        del entries[bisect.bisect_left(entries, key)]
        del self._free[key]
