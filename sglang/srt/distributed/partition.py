"""How a tensor-parallel rank's share of a dimension (heads, MLP columns, vocabulary rows) is chosen.

Every split is "as even as possible": n items over tp ranks give the first n % tp ranks one item more, so sizes
that divide split evenly and the others (SmolLM2's 3 K/V heads over 2 ranks) differ by one item at most.
Attention heads are split by K/V head, each with its whole group of query heads; with more ranks than K/V heads
each K/V head is replicated on tp / num_kv_heads ranks, which split that head's query group between them.
"""

from __future__ import annotations

from dataclasses import dataclass


def partition(n: int, tp_size: int, rank: int) -> tuple[int, int]:
    """(start, size) of rank `rank`'s share of `n` items split as evenly as possible over `tp_size` ranks."""
    if tp_size < 1 or not 0 <= rank < tp_size:
        raise ValueError(f"rank {rank} is not in a tensor-parallel group of {tp_size}")
    base, extra = divmod(n, tp_size)
    return rank * base + min(rank, extra), base + (rank < extra)


@dataclass(frozen=True)
class HeadPartition:
    """The attention heads one rank holds: query heads [q_start, q_start + num_heads) and K/V heads
    [kv_start, kv_start + num_kv_heads) of the checkpoint (a replicated K/V head is held by several ranks)."""

    q_start: int
    num_heads: int
    kv_start: int
    num_kv_heads: int

    def row_slices(self, head_dim: int) -> list[tuple[int, int]]:
        """(first row, rows) of this rank in the checkpoint's q_proj, k_proj and v_proj output rows."""
        kv = (self.kv_start * head_dim, self.num_kv_heads * head_dim)
        return [(self.q_start * head_dim, self.num_heads * head_dim), kv, kv]


def head_partition(num_heads: int, num_kv_heads: int, tp_size: int, rank: int) -> HeadPartition:
    """Rank `rank`'s attention heads; ValueError naming --tp-size for a split that cannot work."""
    if tp_size == 1:  # every head, whatever the model's grouping
        return HeadPartition(0, num_heads, 0, num_kv_heads)
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"The model's {num_heads} attention heads are not groups of its {num_kv_heads} "
                         "key/value heads")
    group = num_heads // num_kv_heads
    if tp_size <= num_kv_heads:
        kv_start, kv_count = partition(num_kv_heads, tp_size, rank)
        return HeadPartition(kv_start * group, kv_count * group, kv_start, kv_count)
    # More ranks than K/V heads: each K/V head is copied on `replicas` ranks that share its query heads.
    if tp_size % num_kv_heads:
        raise ValueError(f"--tp-size {tp_size} is larger than the model's {num_kv_heads} key/value heads and not "
                         "a multiple of them; choose a tensor-parallel size up to the number of key/value heads "
                         "or a multiple of it")
    replicas = tp_size // num_kv_heads
    if group < replicas:
        raise ValueError(f"--tp-size {tp_size} leaves ranks without attention heads (the model has {num_heads} "
                         f"attention heads); choose a tensor-parallel size of at most {num_heads}")
    kv_head = rank // replicas
    q_offset, q_count = partition(group, replicas, rank % replicas)
    return HeadPartition(kv_head * group + q_offset, q_count, kv_head, 1)


def check_partition_fits(n: int, tp_size: int, what: str) -> None:
    """Refuse a dimension with fewer items than ranks: a rank would hold none of it."""
    if n < tp_size:
        raise ValueError(f"--tp-size {tp_size} is larger than the model's {what} ({n}); every rank needs a share")
