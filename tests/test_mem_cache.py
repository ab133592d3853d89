"""TokenSlotAllocator and ReqToTokenPool bookkeeping."""

import pytest
import torch

from sglang.srt.mem_cache.allocator import TokenSlotAllocator
from sglang.srt.mem_cache.req_to_token import ReqToTokenPool


def test_allocator_hands_out_slots_1_to_size_never_the_dummy():
    alloc = TokenSlotAllocator(8)
    assert alloc.size == 8
    assert alloc.available_size() == 8
    slots = alloc.alloc(8)
    assert slots.dtype == torch.int64
    assert sorted(slots.tolist()) == list(range(1, 9))
    assert alloc.available_size() == 0


def test_allocator_returns_none_when_short_and_keeps_its_slots():
    alloc = TokenSlotAllocator(5)
    first = alloc.alloc(3)
    assert alloc.alloc(3) is None  # only 2 left: refused, nothing taken
    assert alloc.available_size() == 2
    rest = alloc.alloc(2)
    assert alloc.alloc(1) is None
    assert set(first.tolist()).isdisjoint(rest.tolist())
    assert alloc.alloc(0).numel() == 0


def test_allocator_free_then_alloc_again():
    alloc = TokenSlotAllocator(4)
    slots = alloc.alloc(4)
    alloc.free(slots[1:3])
    assert alloc.available_size() == 2
    again = alloc.alloc(2)
    assert sorted(again.tolist()) == sorted(slots[1:3].tolist())
    alloc.free(torch.empty(0, dtype=torch.int64))  # empty frees are allowed
    assert alloc.available_size() == 0
    alloc.free(slots[:1])
    alloc.free(slots[3:])
    alloc.free(again)
    assert sorted(alloc.alloc(4).tolist()) == [1, 2, 3, 4]


def test_allocator_free_group_batches_frees_into_one_concat():
    alloc = TokenSlotAllocator(10)
    slots = alloc.alloc(10)
    free_list_before = alloc.free_slots
    alloc.free_group_begin()
    for i in range(5):
        alloc.free(slots[2 * i : 2 * i + 2])
    # Frees are counted at once but the free list itself is untouched until the group ends.
    assert alloc.available_size() == 10
    assert alloc.free_slots is free_list_before
    alloc.free_group_end()
    assert len(alloc.free_slots) == 10
    assert sorted(alloc.free_slots.tolist()) == list(range(1, 11))
    # Outside a group, frees apply immediately again.
    taken = alloc.alloc(3)
    alloc.free(taken)
    assert len(alloc.free_slots) == 10


def test_allocator_can_alloc_inside_a_free_group():
    alloc = TokenSlotAllocator(4)
    slots = alloc.alloc(4)
    alloc.free_group_begin()
    alloc.free(slots[:2])
    got = alloc.alloc(2)
    assert got is not None and sorted(got.tolist()) == sorted(slots[:2].tolist())
    assert alloc.alloc(1) is None
    alloc.free_group_end()
    assert alloc.available_size() == 0


def test_allocator_clear_restores_everything():
    alloc = TokenSlotAllocator(6)
    alloc.alloc(4)
    alloc.clear()
    assert alloc.available_size() == 6
    assert sorted(alloc.alloc(6).tolist()) == list(range(1, 7))


def test_req_to_token_rows_until_full_then_none():
    pool = ReqToTokenPool(3, max_context_len=16)
    assert pool.req_to_token.shape == (3, 16)
    assert pool.req_to_token.dtype == torch.int64
    assert int(pool.req_to_token.abs().sum()) == 0  # unused entries point at the dummy slot
    rows = [pool.alloc() for _ in range(3)]
    assert sorted(rows) == [0, 1, 2]
    assert pool.available_size() == 0
    assert pool.alloc() is None
    pool.free(rows[1])
    assert pool.available_size() == 1
    assert pool.alloc() == rows[1]
    assert pool.alloc() is None


def test_req_to_token_rejects_double_free_and_clear_resets():
    pool = ReqToTokenPool(2, max_context_len=4)
    row = pool.alloc()
    pool.free(row)
    with pytest.raises(ValueError):
        pool.free(row)
    pool.alloc()
    pool.alloc()
    pool.clear()
    assert pool.available_size() == 2
    assert pool.alloc() is not None
