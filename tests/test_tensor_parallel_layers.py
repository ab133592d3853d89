"""Sharded linears, embedding and LM head in a 2-process gloo group against the unsharded layers.

Run every tensor-parallel test with `pytest -m tensor_parallel`.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.multiprocessing as tmp

from sglang.srt.distributed.parallel_state import destroy_tp_group, init_tp_group
from sglang.srt.forward_batch import ForwardBatch, ForwardMode
from sglang.srt.layers.linear import (
    ColumnParallelLinear,
    MergedLinear,
    RowParallelLinear,
    divide,
    merged_linear,
    row_parallel_linear,
)
from sglang.srt.layers.logits_processor import LogitsProcessor
from sglang.srt.layers.vocab_parallel_embedding import VocabParallelEmbedding, vocab_embedding
from sglang.srt.model_loader.weights import load_checkpoint_weights
from sglang.test.test_utils import find_free_port

pytestmark = pytest.mark.tensor_parallel

TP = 2
HIDDEN, Q, KV, OUT = 16, 8, 4, 12
VOCAB = 37  # not a multiple of TP: the last rank's rows are padding


def _checkpoint() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "q_proj.weight": torch.randn(Q, HIDDEN, generator=g), "q_proj.bias": torch.randn(Q, generator=g),
        "k_proj.weight": torch.randn(KV, HIDDEN, generator=g), "k_proj.bias": torch.randn(KV, generator=g),
        "v_proj.weight": torch.randn(KV, HIDDEN, generator=g), "v_proj.bias": torch.randn(KV, generator=g),
        "o_proj.weight": torch.randn(OUT, HIDDEN, generator=g), "o_proj.bias": torch.randn(OUT, generator=g),
        "embed.weight": torch.randn(VOCAB, HIDDEN, generator=g),
    }


class _Block(torch.nn.Module):
    """qkv (column-parallel), o (row-parallel) and an embedding table, named as a checkpoint names them."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv_proj = merged_linear(HIDDEN, [("q_proj", Q), ("k_proj", KV), ("v_proj", KV)], True, None, None)
        self.o_proj = row_parallel_linear(HIDDEN, OUT, True, None, None)
        self.embed = vocab_embedding(VOCAB, HIDDEN, None, None)


def _forward_batch(n: int) -> ForwardBatch:
    zeros = torch.zeros(n, dtype=torch.int64)
    return ForwardBatch(ForwardMode.DECODE, n, zeros, zeros, zeros, zeros, zeros, [1] * n, [0] * n, [1] * n,
                        None, None)  # type: ignore[arg-type]


def _outputs(block: _Block, rank: int = 0, tp: int = 1) -> dict[str, torch.Tensor]:
    x = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(1))
    cols = HIDDEN // tp  # a row-parallel layer reads its rank's slice of the input features
    ids = torch.tensor([0, 5, 18, 19, 36, 20])
    head = LogitsProcessor(SimpleNamespace(vocab_size=VOCAB))
    return {
        "qkv": block.qkv_proj(x), "o": block.o_proj(x[:, rank * cols : (rank + 1) * cols]), "embed": block.embed(ids),
        "logits": head(x, block.embed.weight, _forward_batch(5)),
    }


def _rank_main(rank: int, port: int, queue) -> None:
    init_tp_group(rank, TP, f"127.0.0.1:{port}", "cpu", timeout_s=60)
    try:
        block = _Block()
        assert isinstance(block.qkv_proj, ColumnParallelLinear) and isinstance(block.o_proj, RowParallelLinear)
        assert isinstance(block.embed, VocabParallelEmbedding)
        # each rank holds its slice only: half the heads' rows, half o_proj's columns, ceil(vocab / 2) rows
        assert tuple(block.qkv_proj.weight.shape) == ((Q + 2 * KV) // TP, HIDDEN)
        assert tuple(block.o_proj.weight.shape) == (OUT, HIDDEN // TP)
        assert tuple(block.embed.weight.shape) == ((VOCAB + 1) // TP, HIDDEN)
        load_checkpoint_weights(block, _checkpoint().items())
        # plain lists: shared tensor storage would vanish with the process
        queue.put((rank, {k: v.tolist() for k, v in _outputs(block, rank, TP).items()}))
    finally:
        destroy_tp_group()


@pytest.fixture(scope="module")
def sharded_outputs() -> dict[int, dict[str, torch.Tensor]]:
    queue = tmp.get_context("spawn").Queue()
    # join=True re-raises a rank's exception here; the outputs are small enough to sit in the queue meanwhile
    tmp.spawn(_rank_main, args=(find_free_port(), queue), nprocs=TP, join=True)
    results = dict(queue.get(timeout=10) for _ in range(TP))
    return {rank: {k: torch.tensor(v) for k, v in out.items()} for rank, out in results.items()}


@pytest.fixture(scope="module")
def reference_outputs() -> dict[str, torch.Tensor]:
    block = _Block()  # no group: the unsharded layers
    assert type(block.qkv_proj) is MergedLinear
    load_checkpoint_weights(block, _checkpoint().items())
    return _outputs(block)


def test_column_parallel_ranks_hold_their_heads(sharded_outputs, reference_outputs):
    ref = reference_outputs["qkv"]
    # rank r holds rows r of q, then of k, then of v: concatenating per shard rebuilds the full output
    parts = [sharded_outputs[r]["qkv"] for r in range(TP)]
    q = torch.cat([p[:, : Q // TP] for p in parts], dim=1)
    k = torch.cat([p[:, Q // TP : (Q + KV) // TP] for p in parts], dim=1)
    v = torch.cat([p[:, (Q + KV) // TP :] for p in parts], dim=1)
    torch.testing.assert_close(torch.cat([q, k, v], dim=1), ref)


@pytest.mark.parametrize("name", ["o", "embed", "logits"])
def test_reduced_and_gathered_outputs_equal_the_unsharded_layer(sharded_outputs, reference_outputs, name):
    for rank in range(TP):
        torch.testing.assert_close(sharded_outputs[rank][name], reference_outputs[name], rtol=1e-5, atol=1e-5)
    assert reference_outputs["logits"].shape == (5, VOCAB)


def test_a_size_that_does_not_divide_is_refused_by_name():
    with pytest.raises(ValueError, match=r"--tp-size 2 does not divide the model's key/value heads \(3\)"):
        divide(3, 2, "key/value heads")
