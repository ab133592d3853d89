"""Sharded layers in a 2-process gloo group where the sizes do not divide by 2: 3 K/V heads (9 query heads) split
2 + 1 with their query groups, one K/V head replicated on both ranks, and an MLP of 7 columns split 4 + 3.

Run every tensor-parallel test with `pytest -m tensor_parallel`.
"""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as tmp

from sglang.srt.distributed.parallel_state import destroy_tp_group, get_tp_group, init_tp_group
from sglang.srt.distributed.partition import head_partition
from sglang.srt.layers.linear import merged_linear, row_parallel_linear
from sglang.srt.model_loader.weights import load_checkpoint_weights
from sglang.srt.models.llama import LlamaMLP
from sglang.test.test_utils import find_free_port

pytestmark = pytest.mark.tensor_parallel

TP = 2
HIDDEN, HEAD_DIM, OUT, MLP = 12, 2, 10, 7
# (query heads, K/V heads): SmolLM2's 9 / 3 (K/V heads 0-1 on rank 0, 2 on rank 1) and one replicated K/V head
SHAPES = {"gqa": (9, 3), "mqa": (4, 1)}


def _checkpoint() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    weights = {
        "mlp.gate_proj.weight": torch.randn(MLP, HIDDEN, generator=g),
        "mlp.up_proj.weight": torch.randn(MLP, HIDDEN, generator=g),
        "mlp.down_proj.weight": torch.randn(HIDDEN, MLP, generator=g),
    }
    for name, (heads, kv_heads) in SHAPES.items():
        for proj, rows in (("q_proj", heads * HEAD_DIM), ("k_proj", kv_heads * HEAD_DIM),
                           ("v_proj", kv_heads * HEAD_DIM)):
            weights[f"{name}.{proj}.weight"] = torch.randn(rows, HIDDEN, generator=g)
            weights[f"{name}.{proj}.bias"] = torch.randn(rows, generator=g)
        weights[f"{name}.o_proj.weight"] = torch.randn(OUT, heads * HEAD_DIM, generator=g)
        weights[f"{name}.o_proj.bias"] = torch.randn(OUT, generator=g)
    return weights


class _Attention(torch.nn.Module):
    """The projections of an attention layer, sliced by this rank's heads as LlamaAttention slices them."""

    def __init__(self, heads: int, kv_heads: int) -> None:
        super().__init__()
        tp = get_tp_group()
        self.part = head_partition(heads, kv_heads, tp.size, tp.rank)
        self.qkv_proj = merged_linear(
            HIDDEN, [("q_proj", heads * HEAD_DIM), ("k_proj", kv_heads * HEAD_DIM), ("v_proj", kv_heads * HEAD_DIM)],
            True, None, None, slices=self.part.row_slices(HEAD_DIM))
        self.o_proj = row_parallel_linear(heads * HEAD_DIM, OUT, True, None, None,
                                          cols=(self.part.q_start * HEAD_DIM, self.part.num_heads * HEAD_DIM))


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gqa = _Attention(*SHAPES["gqa"])
        self.mqa = _Attention(*SHAPES["mqa"])
        self.mlp = LlamaMLP(HIDDEN, MLP, "silu", False, None, None)


def _inputs() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(5, HIDDEN, generator=g), {name: torch.randn(5, h * HEAD_DIM, generator=g)
                                                 for name, (h, _) in SHAPES.items()}


def _outputs(block: _Block) -> dict[str, torch.Tensor]:
    x, attn_out = _inputs()
    out = {"mlp": block.mlp(x)}
    for name in SHAPES:
        attention: _Attention = getattr(block, name)
        q_cols = attention.part.q_start * HEAD_DIM, attention.part.num_heads * HEAD_DIM
        out[f"{name}.qkv"] = attention.qkv_proj(x)
        # o_proj reads the attention output of this rank's query heads only
        out[f"{name}.o"] = attention.o_proj(attn_out[name].narrow(1, *q_cols))
    return out


def _rank_main(rank: int, port: int, queue) -> None:
    init_tp_group(rank, TP, f"127.0.0.1:{port}", "cpu", timeout_s=60)
    try:
        block = _Block()
        load_checkpoint_weights(block, _checkpoint().items())
        shapes = {name: tuple(p.shape) for name, p in block.named_parameters()}
        queue.put((rank, {k: v.tolist() for k, v in _outputs(block).items()}, shapes))
    finally:
        destroy_tp_group()


@pytest.fixture(scope="module")
def sharded() -> dict[int, tuple[dict[str, torch.Tensor], dict[str, tuple]]]:
    queue = tmp.get_context("spawn").Queue()
    tmp.spawn(_rank_main, args=(find_free_port(), queue), nprocs=TP, join=True)
    results = [queue.get(timeout=10) for _ in range(TP)]
    return {rank: ({k: torch.tensor(v) for k, v in out.items()}, shapes) for rank, out, shapes in results}


@pytest.fixture(scope="module")
def reference() -> dict[str, torch.Tensor]:
    block = _Block()  # no group: the unsharded layers
    load_checkpoint_weights(block, _checkpoint().items())
    return _outputs(block)


def test_each_rank_holds_only_its_uneven_share(sharded):
    rows = {0: (6 + 2 + 2) * HEAD_DIM, 1: (3 + 1 + 1) * HEAD_DIM}  # q, k, v heads of each rank
    for rank in range(TP):
        shapes = sharded[rank][1]
        assert shapes["gqa.qkv_proj.weight"] == (rows[rank], HIDDEN)
        assert shapes["gqa.o_proj.weight"] == (OUT, {0: 6, 1: 3}[rank] * HEAD_DIM)
        assert shapes["mqa.qkv_proj.weight"] == ((2 + 1 + 1) * HEAD_DIM, HIDDEN)  # the K/V head on both ranks
        assert shapes["mlp.gate_up_proj.weight"] == (2 * {0: 4, 1: 3}[rank], HIDDEN)
        assert shapes["mlp.down_proj.weight"] == (HIDDEN, {0: 4, 1: 3}[rank])


@pytest.mark.parametrize("name", SHAPES)
def test_column_parallel_ranks_compute_the_rows_of_their_heads(sharded, reference, name):
    heads, kv_heads = SHAPES[name]
    full = reference[f"{name}.qkv"]
    q, k, v = full.split([heads * HEAD_DIM, kv_heads * HEAD_DIM, kv_heads * HEAD_DIM], dim=1)
    for rank in range(TP):
        part = head_partition(heads, kv_heads, TP, rank)
        (q0, qn), (k0, kn), _ = part.row_slices(HEAD_DIM)
        expected = torch.cat([q.narrow(1, q0, qn), k.narrow(1, k0, kn), v.narrow(1, k0, kn)], dim=1)
        torch.testing.assert_close(sharded[rank][0][f"{name}.qkv"], expected)


@pytest.mark.parametrize("name", ["gqa.o", "mqa.o", "mlp"])
def test_row_parallel_sums_equal_the_unsharded_layer(sharded, reference, name):
    for rank in range(TP):
        torch.testing.assert_close(sharded[rank][0][name], reference[name], rtol=1e-5, atol=1e-5)
