"""Draft trees (speculative/draft_tree.py, ngram_tree.py) and their verify step's KV rows (speculative/verify.py):
the shapes the n-gram knobs give, the rows each node reads, and where the accepted nodes' slots end up."""

from __future__ import annotations

import torch

from sglang.srt.managers.schedule_batch import Req
from sglang.srt.mem_cache.memory_pools import KVCacheSpec, build_memory_pools
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.speculative.draft_tree import DraftTree
from sglang.srt.speculative.ngram_cache import NgramCache, TokenIndex, propose_draft
from sglang.srt.speculative.ngram_tree import TreeShape, build_draft
from sglang.srt.speculative.verify import allocate_verify_slots, fit_trees, verify_inputs, verify_slots_needed


def test_tree_paths_and_pruning():
    # root -> 10 (0) -> 12 (2); root -> 11 (1) -> 13 (3) -> 14 (4)
    tree = DraftTree([10, 11, 12, 13, 14], [-1, -1, 0, 1, 3])
    assert tree.depths() == [1, 1, 2, 2, 3] and tree.depth() == 3
    assert tree.main_path() == [1, 3, 4] and tree.leaves() == [2, 4]
    assert tree.accepted_path([10, 12, 9, 0, 0, 0]) == [0, 2]  # after the root 10, after node 0 12, then a miss
    assert tree.accepted_path([11, 0, 13, 0, 14, 7]) == [1, 3, 4]
    assert tree.accepted_path([99, 0, 0, 0, 0, 0]) == []
    main = tree.pruned(tree.main_path())
    assert main.tokens == [11, 13, 14] and main.is_chain()
    assert tree.add(1, 13) == 3 and len(tree) == 5  # an existing node
    assert not DraftTree() and DraftTree.chain([4, 5]).parents == [-1, 0]


def test_bfs_breadth_follows_match_length():
    shape = TreeShape("BFS", min_breadth=1, max_breadth=4, min_window=1, max_window=4)  # scale 0.75
    candidates = [(1, [7, 8, 9]), (1, [5, 6]), (1, [7, 3]), (1, [2])]
    # a match of the shortest window: 4 - 1 = 3 steps of 0.75 above 1 -> 3 children at the root, 2 below them
    tree = build_draft(candidates, budget=8, shape=shape)
    root_children = [tree.tokens[i] for i, p in enumerate(tree.parents) if p < 0]
    assert root_children == [7, 5, 2]
    assert sorted(tree.tokens[i] for i, p in enumerate(tree.parents) if p == 0) == [3, 8]
    # a match of the longest window: breadth 1 all the way: the best candidate's continuation
    long = build_draft([(4, c) for _, c in candidates], budget=8, shape=shape)
    assert long.tokens == [7, 8, 9] and long.is_chain()
    # the budget caps the nodes, level by level
    assert len(build_draft(candidates, budget=2, shape=shape)) == 2
    assert build_draft(candidates, budget=2, shape=shape).parents == [-1, -1]
    # branch length caps each continuation
    assert build_draft([(4, [1, 2, 3, 4, 5])], 8, TreeShape(branch_length=2, max_window=4)).tokens == [1, 2]


def test_prob_expands_the_likeliest_nodes():
    shape = TreeShape("PROB", max_breadth=2)
    candidates = [(1, [5, 1]), (1, [7, 1]), (1, [7, 2]), (1, [7, 1]), (1, [9])]
    tree = build_draft(candidates, budget=3, shape=shape)
    # 7 (3/4 of the two most frequent children of the root), then 7 -> 1 (3/4 * 2/3), then 5 (1/4)
    assert tree.tokens == [7, 1, 5] and tree.parents == [-1, 0, -1]


def test_ngram_tree_from_own_and_shared_tokens():
    own = TokenIndex(1, 4)
    own.extend([1, 4, 5, 9, 2, 4, 6, 9, 3, 4])
    shared = NgramCache(1, 4, capacity=100)
    shared.add([4, 8, 8])
    tree = propose_draft(own, shared, 6, TreeShape(min_breadth=1, max_breadth=4, min_window=1, max_window=4))
    # 4 matched twice, one token long (6 9 most recent first, then 5 9); the cache's 4 -> 8 8 ranks after them;
    # a one-token match takes (4 - 1) * 0.75 + 1 = 3 children at the root, 2 below
    children = [tree.tokens[i] for i, p in enumerate(tree.parents) if p < 0]
    assert children == [6, 5, 8]
    assert len(tree) == 6 and tree.depth() == 2
    assert tree.path_to(tree.main_path()[-1]) == tree.main_path()


def _req(rid: str, prompt: list[int], out: list[int]) -> Req:
    req = Req(rid, prompt, SamplingParams(temperature=0, max_new_tokens=64), stop_token_ids=set(), sampling_seed=0)
    req.output_ids = list(out)
    return req


def test_tree_verify_rows_and_settle():
    """A tree's off-main-path nodes read spare rows holding the request's prefix and their ancestors' slots; after
    the step the accepted nodes' slots sit at their positions in the request's row and every other slot is free."""
    mem = build_memory_pools(KVCacheSpec(2, 1, 8, torch.float32), torch.device("cpu"), 64, 256, 0.5, 4,
                             disable_radix_cache=True)
    table = mem.req_to_token_pool.req_to_token
    total = mem.allocator.available_size()
    req = _req("a", [1, 2, 3, 4], [5])
    req.req_pool_idx = mem.req_to_token_pool.alloc()
    table[req.req_pool_idx, :5] = mem.alloc_slots(5)
    req.kv_allocated_len = 5
    tree = DraftTree([10, 11, 12, 13, 14], [-1, -1, 0, 1, 3])  # main path 11 -> 13 -> 14
    [tree] = fit_trees(mem, [tree])
    assert len(tree) == 5 and verify_slots_needed([req], [tree]) == 3 + 2
    allocate_verify_slots(mem, [req], [tree])
    spec = verify_inputs(mem, [req], [tree], 32, torch.device("cpu"))
    fb = spec.forward_batch
    own = req.req_pool_idx
    [lent] = spec.spare_rows
    assert fb.input_ids.tolist() == [5, 10, 11, 12, 13, 14]
    assert fb.positions.tolist() == [4, 5, 5, 6, 6, 7]
    assert fb.req_pool_indices.tolist() == [own, lent, own, lent, own, own]
    slots = fb.out_cache_loc.tolist()
    assert len(set(slots)) == 6
    assert slots[0] == table[own, 4] and slots[2] == table[own, 5] and slots[4] == table[own, 6]
    # the spare row: the request's slots up to its last token, then nodes 0 and 2
    assert table[lent, :5].tolist() == table[own, :5].tolist()
    assert table[lent, 5:7].tolist() == [slots[1], slots[3]]
    assert spec.sampling.steps == [1, 2, 2, 3, 3, 4]
    # nodes 0 and 2 accepted: their slots move into the request's row, the main path's two they displace are freed
    spec.settle(mem, [req], [[0, 2]])
    assert table[own, 5:7].tolist() == [slots[1], slots[3]]
    assert mem.req_to_token_pool.available_size() == mem.req_to_token_pool.size - 1
    assert mem.allocator.available_size() + req.kv_allocated_len == total


def test_trees_cut_to_main_path_when_rows_run_out():
    mem = build_memory_pools(KVCacheSpec(1, 1, 8, torch.float32), torch.device("cpu"), 32, 64, 0.5, 1,
                             disable_radix_cache=True)
    assert mem.req_to_token_pool.alloc() is not None  # the one request's row; one spare row is left
    wide = DraftTree([1, 2, 3], [-1, -1, -1])  # three leaves: two spare rows wanted
    narrow = DraftTree([1, 2], [-1, -1])
    cut, kept = fit_trees(mem, [wide, narrow])
    assert cut.tokens == [1] and kept.tokens == [1, 2]


def test_verify_slots_leave_room_for_the_branches():
    """With barely enough free slots, the main path takes only the slots it needs (not a decode run of
    DECODE_SLOT_RUN), so that the nodes off it still find theirs."""
    from sglang.srt.mem_cache.memory_pools import DECODE_SLOT_RUN

    mem = build_memory_pools(KVCacheSpec(1, 1, 8, torch.float32), torch.device("cpu"), 128, 64, 0.5, 4,
                             disable_radix_cache=True)
    req = _req("a", [1, 2, 3, 4], [5])
    req.req_pool_idx = mem.req_to_token_pool.alloc()
    mem.req_to_token_pool.req_to_token[req.req_pool_idx, :5] = mem.alloc_slots(5)
    req.kv_allocated_len = 5
    tree = DraftTree([10, 11, 12, 13, 14], [-1, -1, 0, 1, 3])  # 3 on the main path, 2 off it
    mem.alloc_slots(mem.allocator.available_size() - (DECODE_SLOT_RUN + 1))  # a run fits, a run + 2 does not
    assert verify_slots_needed([req], [tree]) <= mem.allocator.available_size()
    allocate_verify_slots(mem, [req], [tree])
    spec = verify_inputs(mem, [req], [tree], 32, torch.device("cpu"))
    assert req.kv_allocated_len == 8 and len(set(spec.forward_batch.out_cache_loc.tolist())) == 6
