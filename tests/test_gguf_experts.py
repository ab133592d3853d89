"""A GGUF MoE file's experts served from the file's own blocks, in the mixed types llama-quantize writes.

Tiny random Qwen2-MoE / Qwen3-MoE checkpoints are written as llama.cpp's converter writes them (tests/gguf_writer.py)
with the experts and the shared expert in other block types than Q8_0. Under the blocks plan every expert's gate/up
and down projection must then run blocks read from the file: Q4_0 as the Q4_1 blocks of the same values, Q5_0 as
Q8_0 blocks of the same values, and a gate/up pair stacking Q4_0 with Q5_1 as Q8_0 blocks converted at load within
the bound model_loader/gguf_block_convert.py states; and a K-quant "M" file's Q4_K / Q6_K experts (blocks in ggml's
layouts, tests/kquant_writer.py) as Q4_1 / Q8_0 blocks converted within those bounds. Prefill logits and
greedy tokens through the paged KV cache equal transformers' on the values served.
"""

from __future__ import annotations

import logging

import pytest
import torch

gguf = pytest.importorskip("gguf")

from sglang.srt.layers.moe.fused_moe import FusedMoE  # noqa: E402
from sglang.srt.layers.quantization.gguf_blocks import kernels_available  # noqa: E402
from tests import test_gguf_families  # noqa: E402
from tests.gguf_writer import write_gguf  # noqa: E402
from tests.test_gguf_families import (  # noqa: E402
    MAX_ROWS,
    PROMPTS,
    blocks_plan,
    generate_paged,
    hf_generate,
    random_checkpoint,
)
from tests.test_models import FLOAT32_TOL, assert_logits_close, reference_logits  # noqa: E402

pytestmark = pytest.mark.skipif(not kernels_available(), reason="the compiled GGUF kernels are unavailable")

T = gguf.GGMLQuantizationType
# (family, the type of each expert / shared-expert role, the block type each expert projection is served as)
CASES = {
    "qwen2_moe": ({"ffn_gate_exps": T.Q4_0, "ffn_up_exps": T.Q4_0, "ffn_down_exps": T.Q5_0, "ffn_gate_shexp": T.Q4_1,
                   "ffn_up_shexp": T.Q4_1, "ffn_down_shexp": T.Q5_1}, {"gate_up_proj": "Q4_1", "down_proj": "Q8_0"}),
    "qwen3_moe": ({"ffn_gate_exps": T.Q4_0, "ffn_up_exps": T.Q5_1, "ffn_down_exps": T.Q4_1},
                  {"gate_up_proj": "Q8_0", "down_proj": "Q4_1"}),
    # a K-quant "M" file's experts: Q4_K gate / up, Q6_K down
    "qwen3_moe-k": ({"ffn_gate_exps": T.Q4_K, "ffn_up_exps": T.Q4_K, "ffn_down_exps": T.Q6_K},
                    {"gate_up_proj": "Q4_1", "down_proj": "Q8_0"}),
}
# Projections converted at load (rounded within the bound), by case
CONVERTED = {"qwen2_moe": set(), "qwen3_moe": {"gate_up_proj"}, "qwen3_moe-k": {"gate_up_proj", "down_proj"}}
ROUTES = {"qwen2_moe": "Q4_0 as Q4_1, Q5_0 as Q8_0", "qwen3_moe": "Q4_0+Q5_1 as Q8_0",
          "qwen3_moe-k": "Q4_K as Q4_1, Q6_K as Q8_0"}


def with_k_quants(monkeypatch) -> None:
    """`gguf.quants.quantize` writing K-quants (tests/kquant_writer.py), and the tiny checkpoints as wide as a
    K-quant super-block (256 values) where the experts read."""
    from tests.kquant_writer import writing_k_quants

    narrow = test_gguf_families.tiny_config

    def wide(family: str):
        config = narrow(family)
        config.hidden_size = config.moe_intermediate_size = 256
        return config

    monkeypatch.setattr(test_gguf_families, "tiny_config", wide)
    writing_k_quants(monkeypatch)


def load_served(tmp_path, family: str, role_types: dict, plan):
    """(transformers' model on the file's values, ours loaded under `plan` with its fast paths, the log records)."""
    from transformers import AutoConfig

    from sglang.srt.model_executor.model_runner import attach_fast_paths, load_for_plan
    from sglang.srt.model_loader.resolve import resolve_model_path

    reference = random_checkpoint(family)
    gguf_path = tmp_path / f"mixed-{family}.gguf"
    types = write_gguf(reference, gguf_path, f"mixed-{family}", role_types)
    assert {types[f"blk.0.{role}.weight"] for role in role_types} == {t.name for t in role_types.values()}
    model_dir = resolve_model_path(str(gguf_path))
    config = AutoConfig.from_pretrained(model_dir)
    ours = load_for_plan(model_dir, torch.float32, torch.device("cpu"), str(gguf_path), MAX_ROWS, plan)
    logger = logging.getLogger("sglang.srt.model_loader")
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger.addHandler(handler)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    try:
        attach_fast_paths(ours, str(gguf_path), config, MAX_ROWS, plan)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    return reference, ours, config, [r.getMessage() for r in records]


def block_bound(values: torch.Tensor) -> torch.Tensor:
    """Per value, what a Q8_0 block converted from `values` may differ by: max|w| of its 32-value block / 254, with
    fp16's 2^-10 and float32's division on top (model_loader/gguf_block_convert.py)."""
    blocks = values.reshape(*values.shape[:-1], -1, 32)
    return (blocks.abs().amax(-1, keepdim=True) / 254 * (1 + 2**-10) * (1 + 2**-20)).expand_as(blocks).reshape(
        values.shape)


@pytest.mark.parametrize("case", sorted(CASES))
def test_experts_run_the_files_own_blocks(monkeypatch, tmp_path, cache_dir, case):
    role_types, served_as = CASES[case]
    family = case.removesuffix("-k")
    if case.endswith("-k"):
        with_k_quants(monkeypatch)
    reference, ours, config, log = load_served(tmp_path, family, role_types, blocks_plan())
    # read from the file alone: the stacked experts were never loaded as floats
    assert any("GGUF blocks for 3 x 8 experts" in line and "never loaded as floats" in line for line in log), log
    experts = [m for m in ours.modules() if isinstance(m, FusedMoE)]
    assert len(experts) == 3
    for layer, fused in enumerate(experts):
        assert fused.expert_blocks is not None and fused.gate_up_proj.device.type == "meta"
        theirs = reference.model.layers[layer].mlp.experts
        for name, qtype in served_as.items():
            methods = fused.expert_blocks.gate_up if name == "gate_up_proj" else fused.expert_blocks.down
            assert {m.quant_weight.qtype for m in methods} == {qtype}, (layer, name)
            served, stored = fused.served_values(getattr(fused, name)), getattr(theirs, name)
            if name in CONVERTED[case]:  # converted at load: rounded
                difference = (served - stored).abs()
                assert bool((difference <= block_bound(stored)).all()) and difference.max() > 0, (layer, name)
                with torch.no_grad():  # transformers computes with what is served
                    stored.copy_(served)
            else:  # the file's values exactly
                assert torch.equal(served, stored), (layer, name)
        shared = ours.model.layers[layer].mlp.shared_expert
        if shared is not None:  # Q4_1 gate / up (as stored), Q5_1 down (converted)
            assert shared.gate_up_proj.linear_method.quant_weight.qtype == "Q4_1"
            assert shared.down_proj.linear_method.quant_weight.qtype == "Q8_0"
            with torch.no_grad():
                down = reference.model.layers[layer].mlp.shared_expert.down_proj.weight
                down.copy_(shared.down_proj.linear_method.quant_weight.dequantize())
    assert any(f"experts (converted at load: {ROUTES[case]})" in line for line in log), log

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(ours.config._name_or_path)
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    tokens, prefill = generate_paged(ours, config, prompts)
    # float32 sums in the kernels' order against transformers' (logits up to ~10: 1.05e-4 was seen on an AVX2 CPU)
    assert_logits_close(prefill, reference_logits(reference, prompts[0]), 2 * FLOAT32_TOL, "prefill")
    assert tokens == [hf_generate(reference, ids) for ids in prompts]


def test_report_names_the_files_expert_blocks(tmp_path, cache_dir):
    from sglang.srt.model_loader.weight_report import weight_bytes_by_format

    role_types, _ = CASES["qwen2_moe"]
    _, ours, _, _ = load_served(tmp_path, "qwen2_moe", role_types, blocks_plan())
    formats = weight_bytes_by_format(ours)
    # 3 layers x 8 experts: gate/up 64 x 64 values as Q4_1 (20 bytes per 32), down 64 x 32 as Q8_0 (34 per 32)
    assert formats["Q4_1 blocks from GGUF Q4_0"] >= 3 * 8 * 64 * 64 // 32 * 20
    assert formats["Q8_0 blocks from GGUF Q5_0"] >= 3 * 8 * 64 * 32 // 32 * 34


def test_experts_in_a_float_type_load_as_floats_and_get_blocks_made_at_load(tmp_path, cache_dir):
    """A file whose down experts are F16 (no blocks): the experts load as floats (the file's values) and every
    expert gets Q8_0 blocks made at load from them; the other layers keep the file's own blocks."""
    reference, ours, config, log = load_served(tmp_path, "qwen3_moe", {"ffn_down_exps": T.F16}, blocks_plan())
    assert any("GGUF expert blocks of layer 0 are not blocks" in line for line in log), log
    assert any("quantized at load) for the matmuls the file's blocks do not serve" in line
               and "for the experts of 3 layers" in line for line in log), log
    for layer, fused in enumerate(m for m in ours.modules() if isinstance(m, FusedMoE)):
        assert fused.expert_blocks is not None
        theirs = reference.model.layers[layer].mlp.experts
        for name in ("gate_up_proj", "down_proj"):
            served, stored = fused.served_values(getattr(fused, name)), getattr(theirs, name)
            # Q8_0 blocks of the file's values as llama.cpp's quantizer makes them (q = round(w / d), d = max|w| / 127
            # stored fp16: d / 2 plus 127 times d's fp16 rounding): the Q8_0 gate / up exactly, the F16 down within
            bound = block_bound(stored) * (1 + 127 * 2**-10)
            assert (served - stored).abs().le(bound).all(), (layer, name)
            if name == "gate_up_proj":
                assert torch.equal(served, stored)


def test_the_files_expert_pages_leave_the_process_once_read(monkeypatch, tmp_path, cache_dir):
    """Each stacked expert tensor's range of the mapped file is handed to the page dropper once its layer's experts
    are copied into served blocks (the dense layers' ranges are, tests/test_gguf_pack.py), so a MoE file's load does
    not hold the file's pages beside its blocks; the values served are read before that (the test above)."""
    from tests.page_drops import recording_page_drops

    ranges, dropped = recording_page_drops(monkeypatch)
    role_types, _ = CASES["qwen2_moe"]
    _, ours, _, log = load_served(tmp_path, "qwen2_moe", role_types, blocks_plan())
    assert any("never loaded as floats" in line for line in log), log
    experts = {name: span for name, span in ranges.items() if "_exps" in name}
    assert len(experts) == 3 * 3  # gate, up and down of 3 layers
    assert set(experts.values()) <= dropped
