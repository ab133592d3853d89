"""The tensor-parallel partition of heads, columns and vocabulary rows (distributed/partition.py), and the model
check that refuses only the splits that cannot work."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from sglang.srt.distributed.args import check_model_supports_tp
from sglang.srt.distributed.partition import HeadPartition, check_partition_fits, head_partition, partition
from sglang.srt.layers.vocab_parallel_embedding import unpad_gathered_logits

pytestmark = pytest.mark.tensor_parallel


@pytest.mark.parametrize("n", [0, 1, 3, 7, 9, 1536, 49152, 49155])
@pytest.mark.parametrize("tp", [1, 2, 3, 4, 8])
def test_partition_covers_every_item_once_and_sizes_differ_by_at_most_one(n, tp):
    parts = [partition(n, tp, rank) for rank in range(tp)]
    assert [start for start, _ in parts] == [sum(size for _, size in parts[:r]) for r in range(tp)]
    assert sum(size for _, size in parts) == n
    sizes = [size for _, size in parts]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)  # the first ranks hold more


def test_partition_is_even_where_the_size_divides():
    assert [partition(1536, 2, r) for r in range(2)] == [(0, 768), (768, 768)]
    assert [partition(49152, 2, r) for r in range(2)] == [(0, 24576), (24576, 24576)]
    assert [partition(3, 2, r) for r in range(2)] == [(0, 2), (2, 1)]
    with pytest.raises(ValueError, match="rank 2 is not in a tensor-parallel group of 2"):
        partition(3, 2, 2)


def test_smollm2_heads_over_two_ranks_keep_each_kv_head_with_its_query_group():
    # 9 query heads in 3 groups of 3: rank 0 holds K/V heads 0-1 (query heads 0-5), rank 1 K/V head 2 (6-8)
    assert head_partition(9, 3, 2, 0) == HeadPartition(q_start=0, num_heads=6, kv_start=0, num_kv_heads=2)
    assert head_partition(9, 3, 2, 1) == HeadPartition(q_start=6, num_heads=3, kv_start=2, num_kv_heads=1)
    assert head_partition(9, 3, 2, 1).row_slices(64) == [(384, 192), (128, 64), (128, 64)]
    assert head_partition(9, 3, 1, 0) == HeadPartition(0, 9, 0, 3)
    assert [head_partition(9, 3, 3, r) for r in range(3)] == [HeadPartition(3 * r, 3, r, 1) for r in range(3)]


def test_more_ranks_than_kv_heads_replicate_each_kv_head():
    # 8 query heads, 2 K/V heads, 4 ranks: each K/V head on 2 ranks, which split its 4 query heads
    parts = [head_partition(8, 2, 4, r) for r in range(4)]
    assert [(p.kv_start, p.num_kv_heads) for p in parts] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    assert [(p.q_start, p.num_heads) for p in parts] == [(0, 2), (2, 2), (4, 2), (6, 2)]
    # an uneven query group: 9 heads, 3 K/V heads, 6 ranks -> each group of 3 split 2 + 1
    assert [(p.q_start, p.num_heads) for p in (head_partition(9, 3, 6, r) for r in range(6))] == [
        (0, 2), (2, 1), (3, 2), (5, 1), (6, 2), (8, 1)]


@pytest.mark.parametrize("heads, kv, tp, message", [
    (9, 3, 4, r"--tp-size 4 is larger than the model's 3 key/value heads and not a multiple of them"),
    (4, 2, 8, r"--tp-size 8 leaves ranks without attention heads \(the model has 4 attention heads\)"),
    (9, 2, 2, r"9 attention heads are not groups of its 2 key/value heads"),
])
def test_splits_that_cannot_work_are_refused_by_name(heads, kv, tp, message):
    with pytest.raises(ValueError, match=message):
        head_partition(heads, kv, tp, 0)


def test_a_dimension_smaller_than_the_group_is_refused():
    check_partition_fits(3, 3, "MLP intermediate size")
    with pytest.raises(ValueError, match=r"--tp-size 4 is larger than the model's MLP intermediate size \(3\)"):
        check_partition_fits(3, 4, "MLP intermediate size")


def _config(**overrides) -> LlamaConfig:
    sizes = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=1,
                 num_attention_heads=9, num_key_value_heads=3)
    return LlamaConfig(**{**sizes, **overrides})


def test_the_model_check_accepts_smollm2_at_tp2_and_refuses_impossible_shapes():
    check_model_supports_tp(_config(), 2)
    check_model_supports_tp(_config(), 3)
    check_model_supports_tp(_config(intermediate_size=1537), 2)
    with pytest.raises(ValueError, match="--tp-size 4 is larger than the model's 3 key/value heads"):
        check_model_supports_tp(_config(), 4)
    with pytest.raises(ValueError, match="--tp-size 9 leaves ranks without attention heads"):
        check_model_supports_tp(_config(num_attention_heads=8, num_key_value_heads=1, hidden_size=512), 9)


@pytest.mark.parametrize("vocab, tp", [(37, 2), (37, 4), (10, 3), (16, 4), (5, 8)])
def test_gathered_logits_lose_each_ranks_padding(vocab, tp):
    per_rank = -(-vocab // tp)
    # what every rank's padded table of per_rank rows gathers into: column ids, -1 for padding
    gathered = torch.full((2, per_rank * tp), -1.0)
    for rank in range(tp):
        start, size = partition(vocab, tp, rank)
        gathered[:, rank * per_rank : rank * per_rank + size] = torch.arange(start, start + size, dtype=torch.float)
    assert unpad_gathered_logits(gathered, vocab, tp).tolist() == [list(map(float, range(vocab)))] * 2
    # an unsharded head: only trailing columns past the vocabulary go
    assert unpad_gathered_logits(torch.zeros(1, vocab + 3), vocab, 1).shape == (1, vocab)
