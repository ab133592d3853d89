"""Hybrid sliding-window memory: the windowed layers' K/V in a smaller window pool (mem_cache/swa_pool.py).

Tiny random Gemma 3 and GPT-OSS checkpoints with windows much shorter than the prompts: paged logits read through
the full -> window slot translation (compiled kernels and the torch path) with out-of-window slots given back;
the pools, the release of out-of-window slots and the radix cache's shortened matches on their own; and greedy
outputs through the Engine, hybrid and with --disable-hybrid-swa-memory, equal transformers.generate on long
generations, chunked prefills and radix hits, with both pools whole again once idle. The window-slot counts the
radix cache keeps: tests/test_swa_window_counts.py.
"""

from __future__ import annotations

import types

import pytest
import torch

from sglang.srt.layers import cpu_ops
from sglang.srt.mem_cache.memory_pools import KVCacheSpec, SWASpec, build_memory_pools
from sglang.srt.mem_cache.swa_pool import SWAKVPool, SWASlotAllocator
from sglang.srt.mem_cache.swa_radix_cache import SWARadixCache, usable_prefix_len
from tests.decoder_variant_checks import hf_greedy
from tests.test_models import FLOAT32_TOL, PagedCache, build_models, max_diff, prompt_of, reference_logits
from tests.test_models_gemma_mistral import tiny_config
from tests.test_models_gpt_oss import random_reference, tiny_gpt_oss_config

GEMMA_WINDOW = 6  # tiny_config("gemma3"): layers 0 and 2 slide over 6 positions, 1 and 3 are global


# ---- attention through the translation ----------------------------------------------------------------------
def hybrid_paged_cache(config) -> PagedCache:
    """PagedCache with its pool swapped for a hybrid one: windowed layers get a window pool the same size, reached
    through a shuffled translation table (so a wrong or missing translation reads the wrong rows)."""
    cache = PagedCache(config, torch.float32)
    plain = cache.pool
    windowed = frozenset(i for i, kind in enumerate(config.layer_types) if kind == "sliding_attention")
    table = torch.zeros(plain.size + 1, dtype=torch.int64)
    table[1:] = torch.randperm(plain.size, generator=torch.Generator().manual_seed(7)) + 1
    cache.pool = SWAKVPool(plain.size, plain.size, windowed, plain.num_layers, plain.num_kv_heads, plain.head_dim,
                           torch.float32, table)
    return cache


@pytest.mark.parametrize("kernels", [True, False], ids=["cpu-kernels", "torch"])
def test_paged_logits_through_window_slots_match_transformers(tmp_path, monkeypatch, kernels):
    """Prefill, an extend after a cached prefix and decode steps; before each step the window slots of tokens out
    of every window are dropped (they read the dummy slot), and logits still equal transformers'."""
    if not kernels:
        monkeypatch.setattr(cpu_ops, "available", lambda: False)
    config = tiny_config("gemma3")
    reference, ours = build_models(tmp_path, config)
    cache = hybrid_paged_cache(config)
    table = cache.req_to_token_pool.req_to_token
    full_to_window = cache.pool.full_to_window
    assert isinstance(cache.pool, SWAKVPool) and cache.pool.window_layers == frozenset({0, 2})

    def drop_out_of_window(row: int) -> None:
        seq_len = cache.cached_lens[row]
        full_to_window[table[row, : max(0, seq_len - GEMMA_WINDOW)]] = 0

    prompts = {0: prompt_of(23, 1), 1: prompt_of(30, 2)}
    cache.forward(ours, [(0, prompts[0]), (1, prompts[1][:17])])
    drop_out_of_window(0)
    drop_out_of_window(1)
    logits = cache.forward(ours, [(1, prompts[1][17:])], all_logits=True)
    assert max_diff(logits, reference_logits(reference, prompts[1])[17:]) < FLOAT32_TOL
    sequences = {row: list(p) for row, p in prompts.items()}
    for step in range(6):
        for row in sequences:
            drop_out_of_window(row)
        tokens = {row: (row * 37 + step * 11) % config.vocab_size for row in sequences}
        step_logits = cache.forward(ours, [(row, [tokens[row]]) for row in sequences])
        for i, row in enumerate(sequences):
            sequences[row].append(tokens[row])
            assert max_diff(step_logits[i], reference_logits(reference, sequences[row])[-1]) < FLOAT32_TOL, step
    assert int((full_to_window[table[1, :30]] == 0).sum()) >= 20  # the early tokens really lost their window K/V


# ---- the pools on their own ---------------------------------------------------------------------------------
SPEC = KVCacheSpec(num_layers=4, num_kv_heads=2, head_dim=16, dtype=torch.float32)


def hybrid_pools(window: int = 8, ratio: float = 0.5, radix: bool = True):
    return build_memory_pools(SPEC, torch.device("cpu"), 256, 512, 0.3, 4, not radix,
                              SWASpec(frozenset({0, 2}), window, ratio))


def fake_req(mem, committed: int, allocated: int, prefix=None):
    """A request holding a row of `allocated` slots (the first of them `prefix`), `committed` of them computed."""
    row = mem.req_to_token_pool.alloc()
    held = 0 if prefix is None else len(prefix)
    if prefix is not None:
        mem.req_to_token_pool.req_to_token[row, :held] = prefix
    mem.req_to_token_pool.req_to_token[row, held:allocated] = mem.alloc_slots(allocated - held)
    return types.SimpleNamespace(req_pool_idx=row, kv_committed_len=committed, kv_allocated_len=allocated,
                                 window_released_len=0)


def test_pool_sizes_bytes_and_saving():
    mem = hybrid_pools(ratio=0.5)
    report = mem.pool_report()
    per_layer = 2 * 2 * 16 * 4  # K and V, 2 heads of 16 float32 per layer and token
    assert report == {"full_tokens": 512, "full_bytes": 2 * per_layer * 512, "window_tokens": 256,
                      "window_bytes": 2 * per_layer * 256, "sliding_window": 8,
                      "single_pool_bytes": 4 * per_layer * 512, "saved_bytes": 2 * per_layer * 256}
    assert mem.kv_bytes == report["full_bytes"] + report["window_bytes"]
    assert [b.shape[0] for b in mem.kv_pool.k_buffer] == [257, 513, 257, 513]
    assert mem.max_total_num_tokens == 512 and mem.max_request_tokens == 256
    # a model whose every layer slides, or none, keeps one pool
    every = build_memory_pools(SPEC, torch.device("cpu"), 256, 512, 0.3, 4, False,
                               SWASpec(frozenset(range(4)), 8, 0.5))
    assert not isinstance(every.allocator, SWASlotAllocator) and every.pool_report() == {
        "full_tokens": 512, "full_bytes": 4 * per_layer * 512}


def test_allocation_takes_both_slot_kinds_and_frees_both():
    mem = hybrid_pools(ratio=0.5)
    alloc = mem.window_allocator
    assert alloc is not None
    slots = mem.alloc_slots(200)
    assert bool(alloc.has_window(slots).all()) and alloc.full_available_size() == 312
    assert alloc.window_available_size() == 56 and mem.available_tokens() == 56
    assert alloc.alloc(57) is None and alloc.full_available_size() == 312  # refused whole, nothing taken
    alloc.free_window(slots[:50])
    assert alloc.window_available_size() == 106 and not bool(alloc.has_window(slots[:50]).any())
    alloc.free(slots)  # full slots, and the window slots the other 150 still hold
    assert alloc.full_available_size() == 512 and alloc.window_available_size() == 256


def test_release_out_of_window_spares_slots_another_request_still_reaches():
    mem = hybrid_pools(window=8, ratio=0.5)
    alloc = mem.window_allocator
    assert alloc is not None
    long_req = fake_req(mem, committed=150, allocated=160)
    # a second request shares the first 60 tokens' slots and has computed 70 tokens: tokens 30..69 are in its reach
    shared = mem.req_to_token_pool.req_to_token[long_req.req_pool_idx, :60].clone()
    short_req = fake_req(mem, committed=70, allocated=80, prefix=shared)
    before = alloc.window_available_size()
    mem.release_out_of_window([long_req, short_req])
    row = mem.req_to_token_pool.req_to_token[long_req.req_pool_idx]
    reach = 8 + 32
    assert long_req.window_released_len == 150 - reach and short_req.window_released_len == 0  # 70 - 40 < 32
    kept = alloc.has_window(row[:150 - reach])
    assert not bool(kept[:70 - reach].any())  # out of both windows: given back
    assert bool(kept[70 - reach:60].all())  # still within the short request's reach
    assert not bool(kept[60:].any())
    assert alloc.window_available_size() == before + (150 - reach) - (60 - (70 - reach))
    assert bool(alloc.has_window(row[150 - reach:160]).all())
    mem.release_out_of_window([long_req, short_req])  # nothing new is due: no change
    assert long_req.window_released_len == 150 - reach


def test_without_radix_cache_a_finished_request_frees_both_kinds():
    mem = hybrid_pools(window=8, ratio=0.5, radix=False)
    alloc = mem.window_allocator
    assert alloc is not None
    req = fake_req(mem, committed=100, allocated=110)
    mem.release_out_of_window([req])
    assert alloc.window_available_size() == 256 - 110 + (100 - 40)
    mem.tree_cache.cache_finished_req(req)
    assert alloc.full_available_size() == 512 and alloc.window_available_size() == 256
    assert mem.idle_window_error() is None


def test_ratio_flag_is_checked():
    from sglang.srt.server_args import ServerArgs

    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match="--swa-full-tokens-ratio"):
            ServerArgs(model_path="m", swa_full_tokens_ratio=bad).validate()


def test_radix_match_stops_where_window_kv_is_gone():
    assert usable_prefix_len(torch.tensor([True] * 10), 4) == 10
    assert usable_prefix_len(torch.tensor([False] * 5 + [True] * 5), 4) == 10
    assert usable_prefix_len(torch.tensor([True] * 3 + [False] * 5 + [True] * 3), 4) == 3
    assert usable_prefix_len(torch.tensor([False] * 10), 4) == 0
    mem = hybrid_pools(window=4, ratio=0.5)
    cache, alloc = mem.tree_cache, mem.window_allocator
    assert isinstance(cache, SWARadixCache) and alloc is not None
    key = list(range(100, 120))
    slots = mem.alloc_slots(20)
    cache.insert(key, slots)
    assert len(cache.match_prefix(key + [7]).indices) == 20
    alloc.free_window(slots[6:12])
    match = cache.match_prefix(key + [7])
    assert len(match.indices) == 20  # the last four tokens still hold theirs
    alloc.free_window(slots[17:18])
    assert torch.equal(cache.match_prefix(key).indices, slots[:17])
    alloc.free_window(slots[14:15])
    match = cache.match_prefix(key)
    assert torch.equal(match.indices, slots[:6]) and len(match.last_node.key) <= 6
    cache.inc_lock_ref(match.last_node)
    cache.check_integrity()
    cache.dec_lock_ref(match.last_node)
    # another copy of the same tokens with window slots: the tree takes them over, so the long match comes back
    copy = mem.alloc_slots(20)
    assert cache.insert(key, copy) == 20
    moved = torch.zeros(20, dtype=torch.bool)
    moved[[6, 7, 8, 9, 10, 11, 14, 17]] = True
    assert bool(alloc.has_window(slots).all()) and torch.equal(alloc.has_window(copy), ~moved)
    alloc.free(copy)
    assert len(cache.match_prefix(key).indices) == 20
    assert cache.window_evictable_size() == 20 and cache.window_slots_held() == 20
    cache.evict(100)  # evicting frees both kinds
    assert alloc.full_available_size() == 512 and alloc.window_available_size() == 256


# ---- through the Engine -------------------------------------------------------------------------------------
MAX_NEW = 90  # long enough that decoding gives out-of-window slots back (MemoryPools.release_out_of_window)
TOTAL_TOKENS = 1024


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory, smollm2_tokenizer):
    from transformers import AutoModelForCausalLM

    directory = tmp_path_factory.mktemp("gemma3-swa")
    torch.manual_seed(5)
    config = tiny_config("gemma3", vocab_size=len(smollm2_tokenizer), tie_word_embeddings=False,
                         max_position_embeddings=512)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(directory)
    smollm2_tokenizer.save_pretrained(directory)
    return directory, model


def engine_prompts(tokenizer) -> dict[str, list[int]]:
    first = tokenizer.encode("The capital of France is a city that many people visit every single year because of "
                             "its museums, its food and the river that runs through it")
    # shares 24 tokens (four windows) with `first`, then goes its own way
    shared = first[:24] + tokenizer.encode(" Count: one, two, three, four, five, six")
    return {"first": first, "shared": shared}


def expected_outputs(model, tokenizer, prompts: dict[str, list[int]]) -> dict[str, list[int]]:
    return {name: hf_greedy(model, tokenizer, ids, MAX_NEW) for name, ids in prompts.items()}


def assert_idle_pools_whole(engine, hybrid: bool) -> None:
    """Idle: no leak (the scheduler's invariant check), and after a flush both pools are entirely free."""
    state = engine.get_internal_state()
    assert state["invariant_error"] is None
    assert engine.flush_cache()
    state = engine.get_internal_state()
    pools = state["kv_pools"]
    assert state["invariant_error"] is None
    assert state["free_kv_tokens"] == min(pools["full_tokens"], pools.get("window_tokens", TOTAL_TOKENS))
    if hybrid:
        assert state["free_window_kv_tokens"] == pools["window_tokens"]


@pytest.fixture(scope="module")
def gemma3_hybrid(gemma3_dir):
    from sglang import Engine

    directory, _ = gemma3_dir
    engine = Engine(model_path=str(directory), dtype="float32", max_total_tokens=TOTAL_TOKENS,
                    chunked_prefill_size=16, max_prefill_tokens=16)
    yield engine
    engine.shutdown()


GREEDY = {"temperature": 0, "max_new_tokens": MAX_NEW, "ignore_eos": True}


def test_hybrid_engine_long_generation_equals_transformers_and_gives_window_slots_back(
        gemma3_dir, gemma3_hybrid, smollm2_tokenizer):
    """Prompts of about 30 and 130 tokens prefilled in chunks of 16 (the long one gives window slots back between
    its chunks), 90 new tokens each; idle afterwards, the window pool holds fewer of the cached tokens than the full
    pool: the out-of-window ones went back."""
    _, model = gemma3_dir
    prompts = engine_prompts(smollm2_tokenizer)
    prompts["long"] = smollm2_tokenizer.encode(" ".join(f"item {i} costs {i * 7 % 23} coins," for i in range(20)))
    assert len(prompts["long"]) >= 120
    expected = expected_outputs(model, smollm2_tokenizer, prompts)
    engine = gemma3_hybrid
    engine.flush_cache()
    info = engine.get_server_info()
    assert info["kv_pools"]["window_tokens"] == int(TOTAL_TOKENS * 0.8) and info["kv_pools"]["saved_bytes"] > 0
    assert info["max_total_num_tokens"] == TOTAL_TOKENS
    outs = engine.generate(input_ids=list(prompts.values()), sampling_params=GREEDY)
    assert [o["output_ids"] for o in outs] == list(expected.values())
    state = engine.get_internal_state()
    cached = state["evictable_size"]  # idle: every cached token is evictable
    window_held = state["kv_pools"]["window_tokens"] - state["free_window_kv_tokens"]
    # three requests of 120 to 220 tokens went 70 past their start (window 6 + release margin and batch 32 each)
    assert cached >= 3 * MAX_NEW and window_held <= cached - 3 * 32, (cached, window_held)
    assert_idle_pools_whole(engine, hybrid=True)


def test_hybrid_engine_radix_hits_equal_cold_runs(gemma3_dir, gemma3_hybrid, smollm2_tokenizer):
    """Short generations keep every window slot: a repeated prompt and a prompt sharing four windows of it hit the
    cache past the window. After a long generation the prompt's window slots are gone: the same prompt matches only
    what is still usable, and the conversation so far (prompt + output, whose tail kept its window) hits long; every
    output equals transformers' (a cold run)."""
    _, model = gemma3_dir
    prompts = engine_prompts(smollm2_tokenizer)
    short = {**GREEDY, "max_new_tokens": 10}
    expected_short = {name: hf_greedy(model, smollm2_tokenizer, ids, 10) for name, ids in prompts.items()}
    expected = expected_outputs(model, smollm2_tokenizer, {"first": prompts["first"]})["first"]
    engine = gemma3_hybrid
    engine.flush_cache()
    cold = engine.generate(input_ids=prompts["first"], sampling_params=short)
    warm = engine.generate(input_ids=prompts["first"], sampling_params=short)
    shared = engine.generate(input_ids=prompts["shared"], sampling_params=short)
    assert cold["output_ids"] == warm["output_ids"] == expected_short["first"]
    assert shared["output_ids"] == expected_short["shared"]
    assert cold["meta_info"]["cached_tokens"] == 0
    assert warm["meta_info"]["cached_tokens"] == len(prompts["first"]) - 1
    assert shared["meta_info"]["cached_tokens"] == 24

    engine.flush_cache()
    long_cold = engine.generate(input_ids=prompts["first"], sampling_params=GREEDY)
    long_warm = engine.generate(input_ids=prompts["first"], sampling_params=GREEDY)
    assert long_cold["output_ids"] == long_warm["output_ids"] == expected
    assert long_warm["meta_info"]["cached_tokens"] < len(prompts["first"]) - GEMMA_WINDOW  # a shortened match
    conversation = prompts["first"] + expected[:60]
    again = engine.generate(input_ids=conversation, sampling_params=GREEDY)
    assert again["meta_info"]["cached_tokens"] == len(conversation) - 1
    assert again["output_ids"] == hf_greedy(model, smollm2_tokenizer, conversation, MAX_NEW)
    assert_idle_pools_whole(engine, hybrid=True)


def test_disabled_hybrid_memory_gives_the_same_tokens(gemma3_dir, smollm2_tokenizer):
    from sglang import Engine

    directory, model = gemma3_dir
    prompts = engine_prompts(smollm2_tokenizer)
    expected = expected_outputs(model, smollm2_tokenizer, prompts)
    with Engine(model_path=str(directory), dtype="float32", max_total_tokens=TOTAL_TOKENS,
                disable_hybrid_swa_memory=True) as engine:
        assert engine.get_server_info()["kv_pools"] == {"full_tokens": TOTAL_TOKENS,
                                                         "full_bytes": engine.get_internal_state()["kv_bytes"]}
        outs = engine.generate(input_ids=list(prompts.values()), sampling_params=GREEDY)
        again = engine.generate(input_ids=prompts["first"], sampling_params=GREEDY)
        assert_idle_pools_whole(engine, hybrid=False)
    assert [o["output_ids"] for o in outs] == list(expected.values())
    assert again["output_ids"] == expected["first"]


def test_gpt_oss_hybrid_engine_equals_transformers(tmp_path, smollm2_tokenizer):
    """Sinks and alternating windows of 8: a long generation, chunked, then the conversation so far hits the cache
    (its tail kept its window slots)."""
    from sglang import Engine

    tokenizer = smollm2_tokenizer
    config = tiny_gpt_oss_config(vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id,
                                 bos_token_id=tokenizer.bos_token_id, max_position_embeddings=512)
    model = random_reference(config, seed=7)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    ids = engine_prompts(tokenizer)["first"]
    expected = hf_greedy(model, tokenizer, ids, MAX_NEW)
    with Engine(model_path=str(tmp_path), dtype="float32", max_total_tokens=TOTAL_TOKENS,
                chunked_prefill_size=16) as engine:
        assert engine.get_server_info()["kv_pools"]["sliding_window"] == 8
        cold = engine.generate(input_ids=ids, sampling_params=GREEDY)
        conversation = ids + expected[:60]
        warm = engine.generate(input_ids=conversation, sampling_params=GREEDY)
        assert_idle_pools_whole(engine, hybrid=True)
    assert cold["output_ids"] == expected
    assert warm["output_ids"] == hf_greedy(model, tokenizer, conversation, MAX_NEW)
    assert warm["meta_info"]["cached_tokens"] == len(conversation) - 1


@pytest.mark.tensor_parallel
def test_tp2_hybrid_engine_equals_transformers(gemma3_dir, smollm2_tokenizer):
    """Two ranks: the other rank takes rank 0's window slots with each step and reads its window layers through
    them, through a long generation that gives window slots back."""
    from sglang import Engine

    directory, model = gemma3_dir
    prompts = engine_prompts(smollm2_tokenizer)
    expected = expected_outputs(model, smollm2_tokenizer, prompts)
    with Engine(model_path=str(directory), dtype="float32", cpu_gemm="float32", max_total_tokens=TOTAL_TOKENS,
                tp_size=2, chunked_prefill_size=16) as engine:
        assert engine.get_server_info()["kv_pools"]["window_tokens"] == int(TOTAL_TOKENS * 0.8)
        outs = engine.generate(input_ids=list(prompts.values()), sampling_params=GREEDY)
        assert_idle_pools_whole(engine, hybrid=True)
    assert [o["output_ids"] for o in outs] == list(expected.values())
