"""The input embeddings of a GGUF model read from blocks (layers/quantization/block_embedding.py): where the file's
blocks serve every batch, a table tied to the LM head is read from the head's blocks and an untied one from the
file's own `token_embd` blocks (a K-quant table, tied or not, from the file's rows as stored), with no float32 copy
held, and every lookup (the layer-by-layer path and the fused decode step's) returns the float table's row bit for
bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

gguf = pytest.importorskip("gguf")

from sglang.srt.layers import cpu_ops  # noqa: E402
from sglang.srt.layers.quantization import block_embedding  # noqa: E402
from sglang.srt.layers.quantization.block_embedding import BlockEmbedding, KQuantTable  # noqa: E402
from sglang.srt.layers.quantization.gguf_blocks import KQUANT_TYPES, kernels_available  # noqa: E402
from sglang.srt.model_executor import fused_cpu_decode, model_runner  # noqa: E402
from sglang.srt.model_executor.model_runner import attach_fast_paths, load_for_plan  # noqa: E402
from sglang.srt.model_executor.weight_update import weights_by_name  # noqa: E402
from sglang.srt.model_loader import gguf_quant  # noqa: E402
from sglang.srt.model_loader.q8_blocks import quantize_blocks  # noqa: E402
from sglang.srt.model_loader.weight_report import weight_bytes_by_format  # noqa: E402
from tests.test_gguf_one_copy import TINY_BLOCKS, plan_for  # noqa: E402

# (the checks run prefill and the fused decode step)
pytestmark = pytest.mark.skipif(not (kernels_available() and fused_cpu_decode.available() and cpu_ops.available()),
                                reason="the compiled CPU kernels are unavailable")


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1"])
def test_rows_of_blocks_are_the_dequantized_rows(qtype):
    table = torch.randn(53, 96)  # 53 rows: the last row group is partial
    table[7] = 0.0  # an all-zero row (d = 0)
    blocks = quantize_blocks(table, qtype)
    values = blocks.dequantize()
    ids = torch.tensor([0, 52, 17, 16, 15, 17, 7, 48])
    assert torch.equal(blocks.rows(ids), values[ids])
    embed = BlockEmbedding(blocks)
    assert embed.weight.is_meta and tuple(embed.weight.shape) == (53, 96)
    assert torch.equal(embed(ids.view(2, 4)), values[ids].view(2, 4, 96))
    assert embed(ids[:0]).shape == (0, 96)
    with pytest.raises(RuntimeError, match=r"row 53 is outside \[0, 53\)"):
        blocks.rows(torch.tensor([53]))
    with pytest.raises(RuntimeError, match=r"column -1 is outside \[0, 96\)"):  # the same checks
        blocks.columns(torch.tensor([-1]))


def _tiny_file(tmp_path, name: str, embed_qtype: str, tied: bool):
    from sglang.srt.model_loader.resolve import resolve_model_path
    from tests.test_model_loader import _tiny_llama_tensors, _write_tiny_gguf

    tensors = {n: (np.ones_like(v) if v.ndim == 1 else v * 0.05)
               for n, v in _tiny_llama_tensors(seed=5, t=TINY_BLOCKS).items()}
    if tied:
        del tensors["lm_head.weight"]
    path = tmp_path / f"{name}.gguf"
    _write_tiny_gguf(path, tensors, TINY_BLOCKS, linear_qtype="Q8_0", embed_qtype=embed_qtype)
    return resolve_model_path(str(path)), str(path)


def _load(model_dir: str, gguf_path: str, plan, never_loaded: tuple[str, ...] = ()):
    """The model loaded and given its fast paths; `never_loaded`: the names of its parameters that must be meta
    tensors once loaded (released before the checkpoint is read: model_loader/gguf_tables.py), and only those of
    them besides the decoder's linear weights."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    model = load_for_plan(model_dir, torch.float32, torch.device("cpu"), gguf_path, 8, plan)
    meta = {name for name, p in model.named_parameters() if p.is_meta and not name.startswith("model.layers.")}
    assert meta == set(never_loaded)
    assert attach_fast_paths(model, gguf_path, config, 8, plan) > 0
    return model, config


def _keeping_the_float_table(monkeypatch) -> None:
    """Later loads read the float table and keep it (neither released at load nor served from blocks)."""
    monkeypatch.setattr(model_runner, "tables_read_from_file", lambda *args: (None, []))
    monkeypatch.setattr(gguf_quant, "_embeddings_from_blocks", lambda *args: 0)


def _same_outputs(ours, kept, config) -> None:
    """The model reading its table from blocks gives the logits of the one holding the float table, bit for bit,
    layer by layer and through the fused decode step (which gathers the rows itself)."""
    from tests.test_fused_decode import decode_run

    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, config.vocab_size, (n,), generator=generator).tolist() for n in (23, 4)]
    for fused in (False, True):
        actual, cache = decode_run(ours, config, fused, prompts, steps=4, max_rows=8)
        expected, _ = decode_run(kept, config, fused, prompts, steps=4, max_rows=8)
        assert not fused or cache.decode_strategy.from_tokens  # the step reads the blocks' rows
        assert all(torch.equal(a, e) for a, e in zip(actual, expected)), fused


@pytest.mark.parametrize("embed_qtype", ["Q8_0", "Q4_0"])
def test_tied_table_is_read_from_the_heads_blocks(monkeypatch, tmp_path, cache_dir, embed_qtype):
    model_dir, path = _tiny_file(tmp_path, f"tied-{embed_qtype}", embed_qtype, tied=True)
    plan = plan_for("float32")
    ours, config = _load(model_dir, path, plan, never_loaded=("model.embed_tokens.weight",))
    table = ours.model.embed_tokens
    assert isinstance(table, BlockEmbedding) and ours.lm_head is table
    head_blocks = ours.logits_processor.head_method.quant_weight
    assert table.quant_weight is head_blocks  # one copy: the head's blocks
    assert head_blocks.qtype == ("Q4_1" if embed_qtype == "Q4_0" else "Q8_0")
    by_format = weight_bytes_by_format(ours)
    norms = (2 * config.num_hidden_layers + 1) * config.hidden_size * 4
    assert by_format.pop("float32") == norms  # no float32 table
    linears = [m.linear_method.quant_weight for layer in ours.model.layers
               for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)]
    assert sum(by_format.values()) == sum(w.nbytes for w in linears) + head_blocks.nbytes
    # the float table as loaded equals the blocks' values, and reading it back by name gives them
    _keeping_the_float_table(monkeypatch)
    kept, _ = _load(model_dir, path, plan)
    assert type(kept.model.embed_tokens) is nn.Embedding
    assert torch.equal(kept.model.embed_tokens.weight, head_blocks.dequantize())
    assert weights_by_name(ours, "model.embed_tokens.weight", 3) == weights_by_name(kept, "model.embed_tokens.weight",
                                                                                       3)
    _same_outputs(ours, kept, config)


def test_tied_table_stays_where_it_serves_the_heads_large_batches(tmp_path, cache_dir):
    """Under the dense plan the float table is the head's weight for large batches: it stays."""
    from sglang.srt.layers.arithmetic import choose_arithmetic
    from tests.test_cpu_arithmetic import BF16_VNNI_FLAGS

    model_dir, path = _tiny_file(tmp_path, "tied-dense", "Q8_0", tied=True)
    plan = choose_arithmetic("cpu", cpu_flags=BF16_VNNI_FLAGS, small_batch_quantization="q8_0",
                             large_batch_weights="dense")
    ours, _ = _load(model_dir, path, plan)
    assert type(ours.model.embed_tokens) is nn.Embedding and not ours.model.embed_tokens.weight.is_meta


def test_untied_table_is_read_from_the_files_blocks(monkeypatch, tmp_path, cache_dir):
    model_dir, path = _tiny_file(tmp_path, "untied-q4_0", "Q4_0", tied=False)
    plan = plan_for("float32")
    ours, config = _load(model_dir, path, plan, never_loaded=("model.embed_tokens.weight", "lm_head.weight"))
    table = ours.model.embed_tokens
    assert isinstance(table, BlockEmbedding) and ours.lm_head is not table
    assert table.quant_weight.qtype == "Q4_1"  # Q4_0 as the Q4_1 blocks of the same values
    by_format = weight_bytes_by_format(ours)
    assert by_format["Q4_1 blocks from GGUF Q4_0"] == table.quant_weight.nbytes
    assert by_format.pop("float32") == (2 * config.num_hidden_layers + 1) * config.hidden_size * 4
    _keeping_the_float_table(monkeypatch)
    kept, _ = _load(model_dir, path, plan)
    assert torch.equal(kept.model.embed_tokens.weight, table.quant_weight.dequantize())
    assert weights_by_name(ours, "model.embed_tokens.weight", 5) == weights_by_name(kept, "model.embed_tokens.weight",
                                                                                       5)
    _same_outputs(ours, kept, config)


@pytest.mark.parametrize("embed_qtype", ["Q5_1", "F16"])
def test_a_table_the_files_blocks_hold_only_converted_is_loaded_as_floats(tmp_path, cache_dir, embed_qtype):
    """token_embd in a type whose served blocks would round its values (Q5_1 as Q8_0) or in no block type: the table
    is read as floats (and, untied, kept as them); the LM head, Q8_0 in the file, is still never loaded."""
    model_dir, path = _tiny_file(tmp_path, f"untied-{embed_qtype}", embed_qtype, tied=False)
    ours, _ = _load(model_dir, path, plan_for("float32"), never_loaded=("lm_head.weight",))
    assert type(ours.model.embed_tokens) is nn.Embedding and not ours.model.embed_tokens.weight.is_meta


def _tiny_k_file(tmp_path, embed_qtype: str, tied: bool):
    """A tiny Llama 256 wide (a K-quant super-block), its linears (and an untied head) Q8_0 and its table
    `embed_qtype`, as tests/kquant_writer.py writes K-quants."""
    from sglang.srt.model_loader.resolve import resolve_model_path
    from tests.kquant_writer import writing_k_quants
    from tests.test_model_loader import _tiny_llama_tensors, _write_tiny_gguf

    dims = {**TINY_BLOCKS, "hidden": 256, "inter": 256}
    tensors = {n: (np.ones_like(v) if v.ndim == 1 else v * 0.05) for n, v in _tiny_llama_tensors(5, dims).items()}
    if tied:
        del tensors["lm_head.weight"]
    path = tmp_path / f"{'tied' if tied else 'untied'}-{embed_qtype}.gguf"
    with pytest.MonkeyPatch.context() as mp:
        writing_k_quants(mp)
        _write_tiny_gguf(path, tensors, dims, linear_qtype="Q8_0", embed_qtype=embed_qtype)
    return resolve_model_path(str(path)), str(path)


@pytest.mark.parametrize("qtype", list(KQUANT_TYPES))
def test_k_quant_rows_are_the_reference_rows(qtype, monkeypatch):
    """A K-quant table's looked-up rows equal gguf's reference dequantization bit for bit, compiled or not."""
    from tests.kquant_writer import quantize_k

    rng = np.random.default_rng(4)
    values = (rng.standard_normal((37, 512)) * 0.03).astype(np.float32)
    values[2] = 0
    raw = quantize_k(values, qtype)
    reference = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype]))
    table = KQuantTable(qtype, torch.from_numpy(raw), 37, 512)
    assert table.nbytes == raw.nbytes and table.shape == (37, 512)
    ids = torch.tensor([36, 0, 2, 5, 5])
    assert torch.equal(table.rows(ids), reference[ids]) and torch.equal(table.dequantize(), reference)
    embed = BlockEmbedding(table)
    assert torch.equal(embed(ids.view(1, 5)), reference[ids].view(1, 5, 512)) and embed(ids[:0]).shape == (0, 512)
    with pytest.raises(RuntimeError, match=r"row 37 is outside \[0, 37\)"):
        table.rows(torch.tensor([37]))
    monkeypatch.setattr(block_embedding, "kernel_module", lambda: None)  # without the compiled kernels
    assert torch.equal(table.rows(ids), reference[ids])


@pytest.mark.parametrize("embed_qtype,tied", [("Q6_K", True), ("Q4_K", False)])
def test_a_k_quant_table_is_read_from_the_files_rows(monkeypatch, tmp_path, cache_dir, embed_qtype, tied):
    """A K-quant table (tied and Q6_K, or untied and Q4_K, as llama.cpp's K-quant files store them) is never loaded
    as floats: the lookups dequantize the file's own rows (which Q4_1 / Q8_0 blocks would round), in the fused decode
    step too, while a tied head computes with Q8_0 blocks converted from the table (within the conversion's bound)
    at every batch size, instead of a float32 matmul over it. Outputs equal those of the model holding the float
    table, bit for bit."""
    from sglang.srt.layers.quantization.gguf_linear import GGUFLinearMethod
    from tests.test_fused_decode import decode_run

    model_dir, path = _tiny_k_file(tmp_path, embed_qtype, tied)
    plan = plan_for("float32")
    never_loaded = ("model.embed_tokens.weight",) if tied else ("model.embed_tokens.weight", "lm_head.weight")
    ours, config = _load(model_dir, path, plan, never_loaded=never_loaded)
    table = ours.model.embed_tokens
    assert isinstance(table, BlockEmbedding) and isinstance(table.quant_weight, KQuantTable)
    assert table.quant_weight.qtype == embed_qtype and (ours.lm_head is table) == tied
    method = ours.logits_processor.head_method
    assert isinstance(method, GGUFLinearMethod) and method.quant_weight.qtype == "Q8_0"
    by_format = weight_bytes_by_format(ours)
    assert by_format[f"{embed_qtype} blocks"] == table.quant_weight.nbytes
    assert by_format.pop("float32") == (2 * config.num_hidden_layers + 1) * config.hidden_size * 4  # the norms
    _keeping_the_float_table(monkeypatch)
    kept, _ = _load(model_dir, path, plan)
    assert type(kept.model.embed_tokens) is nn.Embedding
    assert torch.equal(kept.model.embed_tokens.weight, table.quant_weight.dequantize())
    assert weights_by_name(ours, "model.embed_tokens.weight", 4) == weights_by_name(kept, "model.embed_tokens.weight",
                                                                                       4)
    if tied:
        assert by_format["Q8_0 blocks from GGUF Q6_K"] == method.quant_weight.nbytes
        float_table = kept.model.embed_tokens.weight
        blocks = float_table.reshape(config.vocab_size, -1, 32)
        bound = (blocks.abs().amax(-1, keepdim=True) / 254 * (1 + 2**-10) * (1 + 2**-20)).expand_as(blocks)
        difference = (method.quant_weight.dequantize() - float_table).abs().reshape(blocks.shape)
        assert bool((difference <= bound).all()) and difference.max() > 0  # rounded within the conversion's bound
    _same_outputs(ours, kept, config)
    _, cache = decode_run(ours, config, True, [[1, 2, 3]], steps=1, max_rows=8)
    assert cache.decode_strategy.with_head  # the step ends with the head's blocks
