"""The fused CPU decode step on rows that share sequences (speculative verify, ForwardBatch.rows_share_sequences).

Row j + 1 of a sequence attends to the K/V that row j stores in the same step, so the step stores every row's K/V
of a layer before any row attends. Checked against the same positions decoded one step at a time, on 2 threads and
repeatedly, with the rows in position order and reversed: a row that read a K/V row before it was stored would read
NaN (the test fills the new slots with it), and could differ from run to run.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, cast

import pytest
import torch

from sglang.srt.forward_batch import ForwardBatch, ForwardMode
from sglang.srt.layers.quantization.gguf_blocks import kernels_available
from tests.test_fused_decode import MAX_ROWS, fused_decode, make_fused, quantize_head, quantize_linears
from tests.test_models import PagedCache, build_models, max_diff, prompt_of, tiny_config

pytestmark = pytest.mark.skipif(not (kernels_available() and fused_decode.available()),
                                reason="the compiled CPU kernels are unavailable")

TOL = 1e-4
REPEATS = 6
# Tokens fed after each prompt: the first is the prompt's own next input, the others the "draft".
FEED = {0: [11, 12, 13, 14, 15], 1: [21, 22, 23]}


def prefilled(model, config, prompts: dict[int, list[int]]) -> PagedCache:
    """A pool with every prompt prefilled layer by layer and the fused step as its decode strategy (the random
    slot order is the same in every PagedCache, so two of them hold the same positions in the same slots)."""
    cache = PagedCache(config, torch.float32, size=2048, rows=4, context=1024)
    cache.forward(model, list(prompts.items()))
    cache.decode_strategy = make_fused(model, cache, MAX_ROWS)
    return cache


def feed_rows(cache: PagedCache, feed: Iterable[tuple[int, list[int]]]
              ) -> tuple[list[int], list[int], list[int], list[int]]:
    """(token ids, positions, pool rows, slots) of a step that feeds each pool row its `tokens` at the next positions
    of its sequence, one batch row per token: new slots taken from the pool and entered in the row's slot table."""
    table = cache.req_to_token_pool.req_to_token
    ids, positions, rows, slots = [], [], [], []
    for row, tokens in feed:
        start = cache.cached_lens.get(row, 0)
        for j, token in enumerate(tokens):
            slot = cache.free_slots.pop()
            table[row, start + j] = slot
            ids.append(token)
            positions.append(start + j)
            rows.append(row)
            slots.append(slot)
        cache.cached_lens[row] = start + len(tokens)
    return ids, positions, rows, slots


def shared_rows_step(model, cache: PagedCache, feed: dict[int, list[int]], reverse: bool = False) -> torch.Tensor:
    """One fused decode step whose rows are each sequence's next len(tokens) positions (rows_share_sequences), in
    feed order or reversed (later positions first); the logits come back in feed order."""
    ids, positions, rows, slots = feed_rows(cache, feed.items())
    if reverse:
        ids, positions, rows, slots = ids[::-1], positions[::-1], rows[::-1], slots[::-1]
    # Slots not stored yet hold NaN: a row that attended to one before its store would turn NaN.
    for buf in (*cache.pool.k_buffer, *cache.pool.v_buffer):
        buf[torch.tensor(slots)] = float("nan")
    seq_lens = [p + 1 for p in positions]
    batch = ForwardBatch(
        forward_mode=ForwardMode.DECODE, batch_size=len(ids), input_ids=torch.tensor(ids),
        positions=torch.tensor(positions), req_pool_indices=torch.tensor(rows), seq_lens=torch.tensor(seq_lens),
        out_cache_loc=torch.tensor(slots), seq_lens_cpu=seq_lens, extend_prefix_lens_cpu=positions,
        extend_seq_lens_cpu=[1] * len(ids), req_to_token_pool=cast(Any, cache.req_to_token_pool),
        token_to_kv_pool=cache.pool, rows_share_sequences=True,
    )
    strategy = cache.decode_strategy
    assert strategy is not None and strategy.accepts(batch)
    with torch.inference_mode():
        logits = strategy.forward(model, batch)
    return logits.flip(0) if reverse else logits


def one_step_at_a_time(model, cache: PagedCache, feed: dict[int, list[int]]) -> torch.Tensor:
    """The same positions as shared_rows_step, one fused decode step per position (all sequences together)."""
    logits: dict[tuple[int, int], torch.Tensor] = {}
    for j in range(max(len(tokens) for tokens in feed.values())):
        step = [(row, [tokens[j]]) for row, tokens in feed.items() if j < len(tokens)]
        out = cache.forward(model, step)
        for i, (row, _) in enumerate(step):
            logits[row, j] = out[i]
    return torch.stack([logits[row, j] for row, tokens in feed.items() for j in range(len(tokens))])


def kv_of(cache: PagedCache, row: int) -> list[torch.Tensor]:
    """Every layer's K and V of sequence `row`, in position order."""
    slots = cache.req_to_token_pool.req_to_token[row, : cache.cached_lens[row]]
    return [buf[slots].clone() for buf in (*cache.pool.k_buffer, *cache.pool.v_buffer)]


# llama: the step builds its input from the token ids and ends with the LM head; qwen3: per-head q/k norms; a
# 600-token prompt: the step splits its attention over chunks of the token range (attention_split.h).
@pytest.mark.parametrize("family,long_prompt", [("llama", False), ("qwen3", False), ("llama", True)],
                         ids=["llama", "qwen3-qk-norm", "llama-split-attention"])
def test_rows_sharing_a_sequence_match_one_step_at_a_time(tmp_path, family, long_prompt):
    config = tiny_config(family, max_position_embeddings=1024)
    _, ours = build_models(tmp_path, config)
    quantize_linears(ours)
    if family == "llama":
        quantize_head(ours)
    prompts = {0: prompt_of(600 if long_prompt else 9, 1), 1: prompt_of(5, 2)}
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        reference = prefilled(ours, config, prompts)
        assert reference.decode_strategy.with_head == (family == "llama")
        expected = one_step_at_a_time(ours, reference, FEED)
        expected_kv = {row: kv_of(reference, row) for row in prompts}
        first: dict[bool, torch.Tensor] = {}
        for repeat in range(REPEATS):
            reverse = repeat % 2 == 1
            cache = prefilled(ours, config, prompts)
            logits = shared_rows_step(ours, cache, FEED, reverse)
            assert torch.isfinite(logits).all()
            assert max_diff(logits, expected) < TOL
            assert torch.equal(logits.argmax(-1), expected.argmax(-1))
            for row in prompts:
                for got, want in zip(kv_of(cache, row), expected_kv[row]):
                    assert max_diff(got, want) < TOL
            # The same bits on every run of one row order, whichever thread took which item.
            assert torch.equal(logits, first.setdefault(reverse, logits))
    finally:
        torch.set_num_threads(before)


def test_rows_of_distinct_sequences_give_the_same_bits_either_way(tmp_path):
    """The flag only reorders the stores: on rows of distinct sequences the step computes the same bits with it as
    without it."""
    config = tiny_config("qwen2")
    _, ours = build_models(tmp_path, config)
    quantize_linears(ours)
    prompts = {0: prompt_of(9, 3), 1: prompt_of(4, 4), 2: prompt_of(13, 5)}
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        results = []
        for shared in (False, True):
            cache = prefilled(ours, config, prompts)
            feed = {row: [30 + row] for row in prompts}
            if shared:
                results.append((shared_rows_step(ours, cache, feed), [kv_of(cache, row) for row in prompts]))
            else:
                results.append((cache.forward(ours, [(row, tokens) for row, tokens in feed.items()]),
                                [kv_of(cache, row) for row in prompts]))
    finally:
        torch.set_num_threads(before)
    (plain, plain_kv), (shared_logits, shared_kv) = results
    assert torch.equal(plain, shared_logits)
    for a, b in zip(plain_kv, shared_kv):
        for x, y in zip(a, b):
            assert torch.equal(x, y)
