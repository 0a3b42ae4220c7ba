"""The BFC allocator replay: rounding, best fit, whole-chunk grants, regions, coalescing."""

import pytest

from graphrewrite.analysis import bfc

MIB = 2**20


def test_requests_round_up_to_256_bytes_and_count_whole_chunks():
    allocator = bfc.Allocator()
    allocator.allocate(1)
    allocator.allocate(257)
    assert allocator.in_use == 256 + 512
    assert allocator.allocate(0) is None and allocator.in_use == 256 + 512


def test_a_free_chunk_under_twice_the_request_is_handed_out_whole():
    allocator = bfc.Allocator()
    big = allocator.allocate(3 * MIB)        # a 4 MiB region, held whole (under twice 3 MiB)
    assert allocator.in_use == 4 * MIB
    allocator.free(big)
    allocator.allocate(5 * MIB // 2)         # the same chunk again, whole
    assert allocator.in_use == 4 * MIB
    allocator.free(big)
    allocator.allocate(2 * MIB)              # twice the request: split
    assert allocator.in_use == 2 * MIB


def test_a_chunk_twice_the_request_is_split():
    allocator = bfc.Allocator(growth=False, limit=64 * MIB)
    first = allocator.allocate(MIB)
    assert first.size == MIB and allocator.in_use == MIB
    allocator.free(first)                    # merges back into the one region
    assert allocator.allocate(30 * MIB).size == 30 * MIB
    assert allocator.allocate(20 * MIB).size == 34 * MIB  # the rest, under twice 20 MiB


def test_regions_double_and_freed_chunks_do_not_merge_across_them():
    allocator = bfc.Allocator()
    a = allocator.allocate(2 * MIB)          # region 1: 2 MiB
    b = allocator.allocate(2 * MIB)          # region 2: 4 MiB, split
    assert allocator.reserved == 6 * MIB and allocator.regions == 2
    allocator.free(a)
    allocator.free(b)
    allocator.allocate(5 * MIB)              # fits neither region: a third, of 8 MiB
    assert allocator.regions == 3 and allocator.reserved == 14 * MIB


def test_best_fit_takes_the_smallest_free_chunk_that_fits():
    allocator = bfc.Allocator(growth=False, limit=64 * MIB)
    chunks = [allocator.allocate(size * MIB) for size in (4, 1, 3, 1)]
    allocator.free(chunks[0])                # a free 4 MiB hole
    allocator.free(chunks[2])                # and a free 3 MiB hole
    taken = allocator.allocate(2 * MIB)
    assert taken.address == chunks[2].address  # the 3 MiB hole, whole (under twice 2 MiB)
    assert allocator.in_use == 1 * MIB + 3 * MIB + 1 * MIB


def test_a_request_beyond_the_limit_is_an_error():
    with pytest.raises(MemoryError):
        bfc.Allocator(growth=False, limit=4 * MIB).allocate(8 * MIB)
