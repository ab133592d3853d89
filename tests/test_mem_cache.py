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


def test_decode_batch_inputs_come_from_one_tensor_and_fill_the_table():
    """A decode step's ForwardBatch: ids, positions, rows and lengths of every request, each new token's slot written
    at (row, position) of the request->token table, every row a logits row."""
    from sglang.bench_one_batch import make_reqs
    from sglang.srt.forward_batch import ForwardMode
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.mem_cache.memory_pools import KVCacheSpec, build_memory_pools

    mem = build_memory_pools(KVCacheSpec(1, 1, 8, torch.float32), torch.device("cpu"), 64, 128, 0.5, 4, False)
    reqs = make_reqs(3, 5, 4, 1000)
    extend = ScheduleBatch(reqs, is_decode=False)
    extend.prepare_for_extend(mem)
    for i, req in enumerate(reqs):
        req.kv_committed_len = len(req.fill_ids)
        req.output_ids.extend([7 + i] * (i + 1))  # sequences of 6, 7 and 8 tokens: the last one is new
    batch = ScheduleBatch(reqs, is_decode=True)
    batch.prepare_for_decode(mem)
    fb, sampling = batch.forward_inputs(mem, 1000, torch.device("cpu"))
    assert fb.forward_mode == ForwardMode.DECODE and fb.batch_size == 3
    assert fb.input_ids.tolist() == [7, 8, 9]
    assert fb.positions.tolist() == [5, 6, 7] and fb.seq_lens.tolist() == [6, 7, 8] == fb.seq_lens_cpu
    assert fb.req_pool_indices.tolist() == [r.req_pool_idx for r in reqs]
    assert fb.logits_indices is None and not fb.return_input_logprobs
    assert all(t.dtype == torch.int64 and t.is_contiguous() for t in
               (fb.input_ids, fb.positions, fb.req_pool_indices, fb.seq_lens))
    table = mem.req_to_token_pool.req_to_token
    slots = fb.out_cache_loc.tolist()
    assert len(set(slots)) == 3 and 0 not in slots
    assert [int(table[r.req_pool_idx, p]) for r, p in zip(reqs, [5, 6, 7])] == slots
    # each request's slots run to its last possible position (max_new_tokens 4: 3, 2 and 1 positions left)
    assert [r.kv_allocated_len for r in reqs] == [8, 8, 8]
    assert sampling is not None and sampling.logit_rows == [0, 1, 2] and sampling.is_all_greedy


def _prefilled_pools(total: int, radix: bool = True):
    """Memory pools of `total` slots and three requests with 5-token prompts prefilled and one output token each."""
    from sglang.bench_one_batch import make_reqs
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.mem_cache.memory_pools import KVCacheSpec, build_memory_pools

    mem = build_memory_pools(KVCacheSpec(1, 1, 8, torch.float32), torch.device("cpu"), 512, total, 0.5, 4, not radix)
    reqs = make_reqs(3, 5, 1000, 1000)
    ScheduleBatch(reqs, is_decode=False).prepare_for_extend(mem)
    for req in reqs:
        req.kv_committed_len = len(req.fill_ids)
        req.output_ids.append(9)
    return mem, reqs


def _decode_steps(mem, reqs, steps: int) -> None:
    from sglang.srt.managers.schedule_batch import ScheduleBatch

    for _ in range(steps):
        batch = ScheduleBatch(reqs, is_decode=True)
        batch.prepare_for_decode(mem)
        for req in reqs:
            req.kv_committed_len = req.seqlen
            req.output_ids.append(11)


def test_concurrent_decodes_take_their_slots_in_runs_and_give_back_the_rest():
    """Sequences decoding together each get runs of DECODE_SLOT_RUN consecutive free slots, not one interleaved slot
    per step, so a sequence's K/V rows lie together; a short free list gives one slot each; a finished request's
    unused slots go back to the allocator."""
    from sglang.srt.mem_cache.memory_pools import DECODE_SLOT_RUN

    mem, reqs = _prefilled_pools(1024)
    steps = DECODE_SLOT_RUN + 8
    _decode_steps(mem, reqs, steps)
    table = mem.req_to_token_pool.req_to_token
    for req in reqs:
        slots = table[req.req_pool_idx, 5 : 5 + steps]
        assert len(set(slots.tolist())) == steps and 0 not in slots.tolist()
        gaps = (slots[1:] - slots[:-1]).tolist()
        assert gaps.count(1) >= steps - 2  # one jump between the two runs at most
        assert req.kv_allocated_len == 5 + 2 * DECODE_SLOT_RUN
    held = sum(r.kv_allocated_len for r in reqs)
    assert mem.allocator.available_size() == 1024 - held
    for req in reqs:
        mem.tree_cache.cache_finished_req(req)
    assert mem.allocator.available_size() + mem.tree_cache.total_size() == 1024
    assert mem.tree_cache.total_size() == 3 * (5 + steps)  # only computed positions were cached

    # A free list shorter than the runs: one slot per request and step, as without runs.
    small, reqs = _prefilled_pools(40, radix=False)
    _decode_steps(small, reqs, 2)
    assert [r.kv_allocated_len for r in reqs] == [7, 7, 7] and small.allocator.available_size() == 40 - 21


def test_kv_pool_is_head_major_on_cpu_only():
    """On CPU each KV head's rows lie together (decode attention reads one head at a time); other devices keep
    contiguous slot-major buffers. Both are [slots, kv_heads, head_dim] tensors to every reader."""
    from sglang.srt.mem_cache.kv_pool import KVPool

    cpu = KVPool(16, 2, 3, 8, torch.float32)
    assert cpu.head_major
    k, v = cpu.get_kv_buffer(1)
    assert k.shape == v.shape == (17, 3, 8) and k.stride() == (8, 17 * 8, 1)
    other = KVPool(16, 2, 3, 8, torch.float32, device="meta")
    assert not other.head_major and other.k_buffer[0].is_contiguous()
    cpu.set_kv_buffer(1, torch.tensor([2, 7]), torch.ones(2, 3, 8), 2 * torch.ones(2, 3, 8))
    assert torch.equal(k[[2, 7]], torch.ones(2, 3, 8)) and torch.equal(v[[2, 7]], 2 * torch.ones(2, 3, 8))
