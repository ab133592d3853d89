"""Quantized mixture-of-experts checkpoints in the published layouts load and serve.

Tiny random Qwen2-MoE (with its gated shared expert), Mixtral and Qwen3-MoE models are written by
tests/quant_packers.py with each expert's projections quantized under its own name (`mlp.experts.E.gate_proj.qweight`,
Mixtral's `block_sparse_moe.experts.E.w1.qweight`, FP8's `weight` / `weight_scale_inv`), routers and the
shared-expert gate unquantized. The stacked expert parameters must equal the reference dequantized values exactly,
the routers and the shared expert transformers' parameters, the logits transformers' on those weights, and `Engine`
must generate transformers' greedy tokens (or a near tie). Experts quantized fused in one tensor are refused.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from sglang.srt.model_loader.loader import load_model
from sglang.srt.model_loader.quant_config import QuantizedCheckpointError
from tests.quant_packers import (
    EXPERT_LAYOUTS,
    HF_EXPERT_LAYOUT,
    Format,
    awq_format,
    ct_int4_format,
    fp8_layer,
    gptq_format,
    write_quantized_checkpoint,
)
from tests.test_models import BF16_TOL, FLOAT32_TOL, PagedCache, assert_logits_close, prompt_of, reference_logits
from tests.test_moe_models import tiny_moe_config
from tests.test_quantized_blocks import GREEDY, PROMPTS, _hf_greedy, assert_same_greedy

# name -> (model family, checkpoint format). Expert widths: Qwen2-MoE and Qwen3-MoE 32 (64 for Qwen2-MoE's shared
# expert), Mixtral 96.
MOE_FORMATS: dict[str, tuple[str, Format]] = {
    "qwen2_moe-gptq-4bit-g32-sym": ("qwen2_moe-mlp-only", gptq_format(4, 32, True)),
    "qwen2_moe-awq-4bit-g32": ("qwen2_moe-mlp-only", awq_format(32)),
    "qwen2_moe-ct-int4-group32-asym": ("qwen2_moe-mlp-only", ct_int4_format("group", 32, False)),
    "mixtral-gptq-4bit-g32-asym-desc_act": ("mixtral", gptq_format(4, 32, False, True)),
    "mixtral-awq-4bit-g32": ("mixtral", awq_format(32)),
    "qwen3_moe-fp8-block128": ("qwen3_moe", ({"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                              "weight_block_size": [128, 128]}, fp8_layer("block"), torch.bfloat16)),
}


def moe_config(family: str, **overrides: Any) -> Any:
    config = tiny_moe_config(family, **overrides)
    if family.startswith("qwen2_moe"):
        config.shared_expert_intermediate_size = 64  # AWQ and compressed-tensors groups of 32 input columns
    return config


def build_quantized_moe(tmp_path: Path, name: str, vocab_size: int = 512, seed: int = 0):
    """(transformers model on the dequantized weights, quantized checkpoint dir, references by published name)"""
    from transformers import AutoModelForCausalLM

    family, (quant_config, make_layer, dtype) = MOE_FORMATS[name]
    torch.manual_seed(seed)
    hf_model = AutoModelForCausalLM.from_config(moe_config(family, vocab_size=vocab_size)).float().eval()
    quant_dir = tmp_path / "quantized"
    quant_dir.mkdir()
    references = write_quantized_checkpoint(quant_dir, hf_model, quant_config, make_layer, dtype, seed)
    return hf_model, quant_dir, references


def _expert_layout(hf_model: Any) -> tuple[tuple[str, str, str], str]:
    return EXPERT_LAYOUTS.get(hf_model.config.model_type, HF_EXPERT_LAYOUT)


@pytest.mark.parametrize("name", list(MOE_FORMATS))
def test_experts_dequantize_exactly_and_logits_match_transformers(tmp_path, name, caplog):
    hf_model, quant_dir, references = build_quantized_moe(tmp_path, name)
    (gate, up, down), block = _expert_layout(hf_model)
    with caplog.at_level(logging.INFO, logger="sglang.srt.model_loader.quantized_weights"):
        ours = load_model(str(quant_dir), torch.float32, "cpu")
    # the routers and the shared-expert gate are stored unquantized, as published checkpoints keep them
    stored = json.loads((quant_dir / "model.safetensors.index.json").read_text())["weight_map"]
    assert f"model.layers.0.{block}.gate.weight" in stored and f"model.layers.0.{block}.gate.qweight" not in stored
    sparse = [i for i, layer in enumerate(ours.model.layers) if hasattr(layer.mlp, "experts")]
    num_experts = ours.model.layers[sparse[0]].mlp.experts.num_experts
    assert len(sparse) >= 3
    for i in sparse:
        experts = ours.model.layers[i].mlp.experts
        size = experts.intermediate_size
        for e in range(num_experts):
            prefix = f"model.layers.{i}.{block}.experts.{e}"
            assert torch.equal(experts.gate_up_proj[e, :size], references[f"{prefix}.{gate}.weight"].float())
            assert torch.equal(experts.gate_up_proj[e, size:], references[f"{prefix}.{up}.weight"].float())
            assert torch.equal(experts.down_proj[e], references[f"{prefix}.{down}.weight"].float())
    # every parameter (attention, shared expert, routers, norms) equals transformers' on the reference weights
    theirs = hf_model.state_dict()
    for i in sparse:
        mine, ref = ours.model.layers[i].mlp, f"model.layers.{i}.mlp"
        assert torch.equal(mine.gate.weight, theirs[f"{ref}.gate.weight"])
        if mine.shared_expert is not None:
            assert torch.equal(mine.shared_expert_gate.weight, theirs[f"{ref}.shared_expert_gate.weight"])
            shared = mine.shared_expert.gate_up_proj.weight
            assert torch.equal(shared, torch.cat([theirs[f"{ref}.shared_expert.gate_proj.weight"],
                                                  theirs[f"{ref}.shared_expert.up_proj.weight"]]))
    messages = [r.getMessage() for r in caplog.records]
    assert any(f"Of these, {len(sparse) * num_experts * 3} are MoE expert projections" in m for m in messages), messages
    prompt = prompt_of(11, 4)
    logits = PagedCache(hf_model.config, torch.float32).forward(ours, [(0, prompt)], all_logits=True)
    assert_logits_close(logits, reference_logits(hf_model, prompt), FLOAT32_TOL, name)


@pytest.mark.parametrize("name", ["qwen2_moe-gptq-4bit-g32-sym", "mixtral-awq-4bit-g32"])
def test_engine_greedy_equals_transformers(tmp_path, smollm2_tokenizer, name):
    from sglang import Engine

    hf_model, quant_dir, _ = build_quantized_moe(tmp_path, name, vocab_size=len(smollm2_tokenizer), seed=3)
    smollm2_tokenizer.save_pretrained(quant_dir)
    expected = _hf_greedy(hf_model, smollm2_tokenizer)
    assert all(len(set(ids)) > 2 for ids in expected)
    with Engine(model_path=str(quant_dir), dtype="float32", cpu_gemm="float32", max_total_tokens=1024) as engine:
        outputs = engine.generate(prompt=PROMPTS, sampling_params=GREEDY)
        info = engine.get_server_info()
    assert_same_greedy([o["output_ids"] for o in outputs], expected, hf_model, smollm2_tokenizer, name)
    assert info["quantization"] == MOE_FORMATS[name][1][0]["quant_method"]


def test_experts_quantized_fused_in_one_tensor_are_refused_naming_it(tmp_path):
    _, quant_dir, _ = build_quantized_moe(tmp_path, "qwen2_moe-gptq-4bit-g32-sym")
    index_path = quant_dir / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    for file_name in sorted(set(index["weight_map"].values())):
        path = quant_dir / file_name
        tensors = load_file(str(path))
        for leaf in ("qweight", "qzeros", "scales", "g_idx"):
            per_expert = sorted(k for k in tensors if k.startswith("model.layers.0.mlp.experts.")
                                and k.endswith(f".down_proj.{leaf}"))
            if per_expert:
                tensors["model.layers.0.mlp.experts.down_proj." + leaf] = torch.stack([tensors.pop(k)
                                                                                       for k in per_expert])
        save_file(tensors, str(path))
        index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != file_name}
        index["weight_map"].update(dict.fromkeys(tensors, file_name))
    index_path.write_text(json.dumps(index))
    with pytest.raises(QuantizedCheckpointError, match=r"model\.layers\.0\.mlp\.experts\.down_proj\.qweight holds "
                                                       r"the quantized experts of an MoE layer fused in one tensor"):
        load_model(str(quant_dir), torch.float32, "cpu")


@pytest.mark.parametrize("name", ["qwen2_moe-gptq-4bit-g32-sym", "mixtral-awq-4bit-g32",
                                  "qwen2_moe-ct-int4-group32-asym"])
def test_experts_served_from_the_checkpoints_own_blocks(tmp_path, name, caplog):
    """Where blocks serve every batch, every expert (and linear layer) of a GPTQ / AWQ / compressed-tensors MoE
    checkpoint runs Q4_1 blocks made from its integers, its float weights released: the integers' values exactly for
    a symmetric checkpoint (the references are their rounding to the checkpoint's fp16), within 1/128 of a
    quantization step where the zero points make the offsets (model_loader/int_blocks.py); prefill logits then
    match transformers' with the served experts."""
    from sglang.srt.layers.moe.fused_moe import FusedMoE

    hf_model, quant_dir, _ = build_quantized_moe(tmp_path, name)
    (gate, up, down), block = _expert_layout(hf_model)
    exact = reference_experts(quant_dir)  # the integers' values, in float32
    ours, messages = load_under_blocks_plan(quant_dir, caplog)
    assert any("experts of" in m and "not loaded as floats" in m for m in messages), messages
    assert any("linear layers are not loaded as floats" in m for m in messages), messages
    assert any("only made into blocks" in m for m in messages), messages  # released: never dequantized
    assert any("from its own Q4_1 blocks" in m and "every matmul and expert" in m for m in messages), messages
    for i, layer in enumerate(ours.model.layers):
        fused = getattr(layer.mlp, "experts", None)
        if not isinstance(fused, FusedMoE):
            continue
        assert fused.expert_blocks is not None and fused.gate_up_proj.is_meta
        prefix = f"model.layers.{i}.{block}.experts"
        for e in range(fused.num_experts):
            pairs = ((fused.expert_blocks.gate_up[e], [f"{prefix}.{e}.{gate}", f"{prefix}.{e}.{up}"]),
                     (fused.expert_blocks.down[e], [f"{prefix}.{e}.{down}"]))
            for method, parts in pairs:
                weight = method.quant_weight
                assert weight.qtype == "Q4_1" and id(weight.packed) in ours.quantized_checkpoint.served, parts
                served, expected = weight.dequantize(), torch.cat([exact[f"{p}.weight"] for p in parts])
                if "-sym" in name:
                    assert torch.equal(served, expected), parts
                else:  # m = -scale * zero rounded once to fp16: under 1/128 of a quantization step (d)
                    d = weight.raw().view(weight.n, -1, 20)[..., 0:2].contiguous().view(torch.float16).float()
                    assert bool(((served - expected).abs() <= d.squeeze(-1).repeat_interleave(32, 1) / 128).all())
        with torch.no_grad():  # transformers computes with the served experts
            for param in ("gate_up_proj", "down_proj"):
                getattr(hf_model.model.layers[i].mlp.experts, param).copy_(fused.served_values(getattr(fused,
                                                                                                       param)))
    with torch.no_grad():  # the LM head, unquantized in the checkpoint, runs Q8_0 blocks made at load
        hf_model.lm_head.weight.copy_(ours.logits_processor.head_method.quant_weight.dequantize())
    prompt = prompt_of(11, 4)
    logits = PagedCache(hf_model.config, torch.float32).forward(ours, [(0, prompt)], all_logits=True)
    # the other linear layers' exact blocks against transformers' references rounded to the checkpoint's dtype
    tol = FP16_REFERENCE_TOL if MOE_FORMATS[name][1][2] == torch.float16 else BF16_TOL
    assert_logits_close(logits, reference_logits(hf_model, prompt), tol, name)


# logits of the exact weights against weights rounded to fp16 (11 significant bits)
FP16_REFERENCE_TOL = 0.02


def load_under_blocks_plan(quant_dir: Path, caplog) -> tuple[Any, list[str]]:
    """The checkpoint loaded as the server loads it where blocks serve every batch, and the loader's log."""
    from sglang.srt.model_executor.model_runner import attach_fast_paths, load_for_plan
    from tests.test_gguf_families import MAX_ROWS, blocks_plan

    plan = blocks_plan()
    with caplog.at_level(logging.INFO, logger="sglang.srt.model_loader"):
        ours = load_for_plan(str(quant_dir), torch.float32, torch.device("cpu"), None, MAX_ROWS, plan)
        attach_fast_paths(ours, None, ours.config, MAX_ROWS, plan)
    return ours, [r.getMessage() for r in caplog.records]


def reference_experts(quant_dir: Path) -> dict[str, torch.Tensor]:
    """Every expert projection of the checkpoint as model_loader/dequantize.py computes it, in float32 (exact)."""
    from sglang.srt.model_loader.quant_config import resolve_quantization
    from sglang.srt.model_loader.quantized_weights import iterate_dequantized
    from sglang.srt.model_loader.weights import weight_files

    scheme = resolve_quantization(str(quant_dir), None)
    assert scheme is not None
    return {name: w for name, w in iterate_dequantized(weight_files(str(quant_dir)), scheme, torch.float32)
            if ".experts." in name}


def test_experts_without_blocks_are_read_again_dequantized(tmp_path, monkeypatch, caplog):
    """Experts released before loading whose integers make no blocks after all (here every expert's scales refused)
    are read again dequantized: the model is the one loaded without blocks."""
    from sglang.srt.model_loader import quantized_weights

    name = "qwen2_moe-gptq-4bit-g32-sym"
    hf_model, quant_dir, references = build_quantized_moe(tmp_path, name)
    plain = quantized_weights.blocks_of
    monkeypatch.setattr(quantized_weights, "blocks_of", lambda stored, module: (
        f"{module}: refused here" if ".experts." in module else plain(stored, module)))
    ours, messages = load_under_blocks_plan(quant_dir, caplog)
    assert any("keeps the dequantize path" in m and "refused here" in m for m in messages), messages
    assert any("were read again, dequantized" in m for m in messages), messages
    (gate, up, down), block = _expert_layout(hf_model)
    for i, layer in enumerate(ours.model.layers):
        experts = getattr(layer.mlp, "experts", None)
        if experts is None:
            continue
        assert experts.expert_blocks is None and not experts.gate_up_proj.is_meta
        size, prefix = experts.intermediate_size, f"model.layers.{i}.{block}.experts"
        for e in range(experts.num_experts):
            assert torch.equal(experts.gate_up_proj[e, :size], references[f"{prefix}.{e}.{gate}.weight"].float())
            assert torch.equal(experts.gate_up_proj[e, size:], references[f"{prefix}.{e}.{up}.weight"].float())
            assert torch.equal(experts.down_proj[e], references[f"{prefix}.{e}.{down}.weight"].float())
    prompt = prompt_of(11, 4)
    logits = PagedCache(hf_model.config, torch.float32).forward(ours, [(0, prompt)], all_logits=True)
    assert_logits_close(logits, reference_logits(hf_model, prompt), FLOAT32_TOL, name)
