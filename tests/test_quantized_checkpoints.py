"""Checkpoints with a `quantization_config` (GPTQ, AWQ, FP8, compressed-tensors) load and serve.

Tiny random Llamas are written in each format by the packers of tests/quant_packers.py (the published rules,
written out independently of the loader). The loaded model's weights must equal the reference dequantized values
exactly (a float checkpoint of those values loads to the same parameters), its logits must match transformers on
the dequantized float model, a GPTQ model served through `Engine` must generate transformers' greedy tokens, and a
malformed checkpoint or a wrong `--quantization` must stop startup with an error naming the tensor or both methods.
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
from sglang.srt.model_loader.quant_config import OnlineScheme, QuantizedCheckpointError, resolve_quantization
from sglang.srt.server_args import ServerArgs
from tests.quant_packers import (
    awq_format,
    ct_config,
    ct_int4_format,
    ct_int8_layer,
    fp8_layer,
    gptq_format,
    write_quantized_checkpoint,
)
from tests.test_models import FLOAT32_TOL, PagedCache, assert_logits_close, prompt_of, reference_logits, tiny_config

BF16 = torch.bfloat16

# name -> (quantization_config, layer packer, checkpoint dtype). Input widths are 128 (q/k/v/gate/up) and 320
# (down_proj): a GPTQ group of 128 and FP8's 128 x 128 blocks leave a partial last group / block there.
FORMATS = {
    "gptq-4bit-g32-sym": gptq_format(4, 32, True, False),
    "gptq-4bit-g128-asym-desc_act": gptq_format(4, 128, False, True),
    "gptq-8bit-g64-asym-v2": gptq_format(8, 64, False, False, fmt="gptq_v2"),
    "gptq-8bit-per-column-desc_act": gptq_format(8, -1, True, True),
    "gptq-2bit-g32-asym": gptq_format(2, 32, False, False),
    "awq-4bit-g32": awq_format(32),
    "awq-4bit-g64": awq_format(64),
    "fp8-block128": ({"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                      "weight_block_size": [128, 128]}, fp8_layer("block"), BF16),
    "fp8-per-tensor-static": ({"quant_method": "fp8", "activation_scheme": "static"},
                              fp8_layer("tensor", static_input=True), BF16),
    "fp8-per-channel": ({"quant_method": "fp8", "activation_scheme": "dynamic"}, fp8_layer("channel"), BF16),
    "ct-int4-group32-sym": ct_int4_format("group", 32, True),
    "ct-int4-group64-asym": ct_int4_format("group", 64, False),
    "ct-int4-channel-asym": ct_int4_format("channel", 0, False),
    "ct-int8-channel-w8a8": (ct_config("int-quantized", {
        "num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}, {
        "num_bits": 8, "type": "int", "symmetric": True, "strategy": "tensor", "dynamic": False}),
        ct_int8_layer(), BF16),
}


def tiny_llama(**overrides: Any):
    return tiny_config("llama", hidden_size=128, intermediate_size=320, **overrides)


def build_quantized(tmp_path: Path, fmt: str, config=None, seed: int = 0):
    """(transformers model on the dequantized weights, quantized checkpoint dir, float checkpoint dir, references)"""
    from transformers import AutoModelForCausalLM

    quant_config, make_layer, dtype = FORMATS[fmt]
    torch.manual_seed(seed)
    hf_model = AutoModelForCausalLM.from_config(config or tiny_llama()).float().eval()
    quant_dir, float_dir = tmp_path / "quantized", tmp_path / "float"
    quant_dir.mkdir()
    references = write_quantized_checkpoint(quant_dir, hf_model, quant_config, make_layer, dtype, seed)
    hf_model.save_pretrained(float_dir)
    return hf_model, quant_dir, float_dir, references


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_dequantized_weights_and_logits_match_the_reference(tmp_path, fmt, caplog):
    hf_model, quant_dir, float_dir, references = build_quantized(tmp_path, fmt)
    with caplog.at_level(logging.INFO, logger="sglang.srt.model_loader.quantized_weights"):
        ours = load_model(str(quant_dir), torch.float32, "cpu")
    dense = load_model(str(float_dir), torch.float32, "cpu")
    # Every parameter (fused q/k/v and gate/up included) equals the float checkpoint of the reference values.
    mine, theirs = dict(ours.named_parameters()), dict(dense.named_parameters())
    assert mine.keys() == theirs.keys()
    for name, param in mine.items():
        assert torch.equal(param, theirs[name]), name
    # and the q_proj rows of the fused projection are the reference dequantization itself, not two equal mistakes
    q_rows = references["model.layers.0.self_attn.q_proj.weight"]
    assert torch.equal(ours.model.layers[0].self_attn.qkv_proj.weight[: q_rows.shape[0]], q_rows.float())
    assert any("Dequantized 14" in r.getMessage() for r in caplog.records)
    if "static" in fmt or "w8a8" in fmt:
        assert any("14 input_scale" in r.getMessage() for r in caplog.records)
    prompt = prompt_of(9, 3)
    logits = PagedCache(hf_model.config, torch.float32).forward(ours, [(0, prompt)], all_logits=True)
    assert_logits_close(logits, reference_logits(hf_model, prompt), FLOAT32_TOL, fmt)


def test_weights_are_dequantized_one_tensor_at_a_time_in_the_checkpoint_dtype(tmp_path):
    from sglang.srt.model_loader.weights import iterate_weights

    _, quant_dir, _, references = build_quantized(tmp_path, "gptq-4bit-g128-asym-desc_act")
    seen = dict(iterate_weights(str(quant_dir)))
    assert not any(name.endswith(("qweight", "qzeros", "scales", "g_idx")) for name in seen)
    for name, reference in references.items():
        assert seen[name].dtype == torch.float16 and torch.equal(seen[name], reference), name


def test_gptq_served_by_engine_equals_transformers_greedy(tmp_path, smollm2_tokenizer):
    from sglang import Engine

    config = tiny_llama(vocab_size=len(smollm2_tokenizer), num_hidden_layers=2)
    hf_model, quant_dir, _, _ = build_quantized(tmp_path, "gptq-4bit-g32-sym", config=config, seed=5)
    smollm2_tokenizer.save_pretrained(quant_dir)
    prompts = ["The capital of France is", "Quantized weights, read back:"]
    greedy = {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True}
    expected = []
    with torch.no_grad():
        for prompt in prompts:
            ids = smollm2_tokenizer.encode(prompt)
            out = hf_model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                    max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0)
            expected.append(out[0, len(ids):].tolist())
    assert all(len(set(ids)) > 2 for ids in expected)
    with Engine(model_path=str(quant_dir), dtype="float32", max_total_tokens=1024, quantization="gptq_marlin") as eng:
        outputs = eng.generate(prompt=prompts, sampling_params=greedy)
        info = eng.get_server_info()
    assert [o["output_ids"] for o in outputs] == expected
    assert info["quantization"] == "gptq"


def test_blocks_plan_loads_the_dequantized_weights_in_the_checkpoint_dtype_and_logs_it(tmp_path):
    from sglang.srt.layers.arithmetic import choose_arithmetic
    from sglang.srt.layers.linear import Linear
    from sglang.srt.layers.quantization.gguf_blocks import kernels_available
    from sglang.srt.layers.quantization.gguf_linear import GGUFLinearMethod
    from sglang.srt.model_executor.model_runner import attach_fast_paths, load_for_plan
    from sglang.srt.model_loader.weight_report import describe_weights
    from tests.test_cpu_arithmetic import BF16_VNNI_FLAGS

    if not kernels_available():
        pytest.skip("the compiled GGUF kernels are unavailable")
    # act-order group indices: no blocks of its own (tests/test_quantized_blocks.py), Q8_0 blocks made at load
    _, quant_dir, _, _ = build_quantized(tmp_path, "gptq-4bit-g128-asym-desc_act")
    plan = choose_arithmetic("cpu", cpu_flags=BF16_VNNI_FLAGS, measurements={"float32": 0.5, "bfloat16": 1.0,
                                                                              "int8": 0.1},
                             small_batch_quantization="q8_0", large_batch_weights="blocks")
    model = load_for_plan(str(quant_dir), torch.float32, torch.device("cpu"), None, 8, plan)
    assert {m.weight.dtype for m in model.modules() if isinstance(m, Linear)} == {torch.float16}
    attach_fast_paths(model, None, model.config, 8, plan)
    assert all(isinstance(m.linear_method, GGUFLinearMethod) for m in model.modules() if isinstance(m, Linear))
    line = describe_weights(model)
    assert line.startswith("Weights: GPTQ 4-bit, group 128, desc_act, asymmetric, dequantized to float16 at load, "
                           "then served as "), line
    assert "Q8_0 blocks" in line


# ---- errors ---------------------------------------------------------------------------------------------------
def _edit_shard(quant_dir: Path, edit) -> None:
    path = quant_dir / "model-00002-of-00002.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path))
    index_path = quant_dir / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != path.name}
    index["weight_map"].update(dict.fromkeys(tensors, path.name))
    index_path.write_text(json.dumps(index))


def _set_quantization_config(quant_dir: Path, **changes: Any) -> None:
    path = quant_dir / "config.json"
    config = json.loads(path.read_text())
    config["quantization_config"].update(changes)
    path.write_text(json.dumps(config))


@pytest.fixture(scope="module")
def gptq_dir(tmp_path_factory) -> Path:
    return build_quantized(tmp_path_factory.mktemp("gptq"), "gptq-4bit-g32-sym")[1]


def _copy(src: Path, tmp_path: Path) -> Path:
    import shutil

    return Path(shutil.copytree(src, tmp_path / "copy"))


def test_missing_scales_is_an_error_naming_the_tensor(gptq_dir, tmp_path):
    quant_dir = _copy(gptq_dir, tmp_path)
    _edit_shard(quant_dir, lambda t: t.pop("model.layers.1.mlp.up_proj.scales"))
    with pytest.raises(QuantizedCheckpointError, match=r"model\.layers\.1\.mlp\.up_proj\.scales is missing"):
        load_model(str(quant_dir), torch.float32, "cpu")


def test_scales_of_the_wrong_shape_are_an_error_naming_the_tensor(gptq_dir, tmp_path):
    quant_dir = _copy(gptq_dir, tmp_path)

    def shrink(tensors: dict) -> None:
        tensors["model.layers.0.self_attn.o_proj.scales"] = tensors["model.layers.0.self_attn.o_proj.scales"][:2]

    _edit_shard(quant_dir, shrink)
    with pytest.raises(QuantizedCheckpointError, match=r"model\.layers\.0\.self_attn\.o_proj\.scales has shape "
                                                       r"\[2, 128\]; expected \[4, 128\]"):
        load_model(str(quant_dir), torch.float32, "cpu")


def test_a_scale_without_its_weight_is_an_error(tmp_path):
    _, quant_dir, _, _ = build_quantized(tmp_path, "fp8-block128")

    def orphan(tensors: dict) -> None:
        tensors["model.layers.0.mlp.extra_proj.weight_scale_inv"] = torch.ones(1, 1)

    _edit_shard(quant_dir, orphan)
    with pytest.raises(QuantizedCheckpointError, match=r"extra_proj\.weight_scale_inv has no "
                                                       r"model\.layers\.0\.mlp\.extra_proj\.weight beside it"):
        load_model(str(quant_dir), torch.float32, "cpu")


@pytest.mark.parametrize("changes, message", [
    ({"bits": 3}, "GPTQ checkpoints with 3 bits are not supported"),
    ({"group_size": 0}, "GPTQ group_size 0"),
    ({"quant_method": "bitsandbytes"}, "quantized with 'bitsandbytes'"),
])
def test_unsupported_settings_are_startup_errors(gptq_dir, tmp_path, changes, message):
    quant_dir = _copy(gptq_dir, tmp_path)
    _set_quantization_config(quant_dir, **changes)
    with pytest.raises(QuantizedCheckpointError, match=message):
        resolve_quantization(str(quant_dir), None)


def test_quantization_flag_is_checked_against_the_checkpoint(gptq_dir, tmp_path):
    from sglang import Engine

    assert resolve_quantization(str(gptq_dir), "gptq") == resolve_quantization(str(gptq_dir), None)
    with pytest.raises(QuantizedCheckpointError, match=r"--quantization awq does not match the checkpoint: its "
                                                       r"quantization_config .* says 'gptq'"):
        Engine(model_path=str(gptq_dir), quantization="awq")
    float_dir = tmp_path / "float"
    build_quantized(tmp_path, "awq-4bit-g32")
    with pytest.raises(QuantizedCheckpointError, match="--quantization gptq does not match the checkpoint: it has "
                                                       "no quantization_config"):
        resolve_quantization(str(float_dir), "gptq")
    # fp8 and w8a8_int8 quantize a float checkpoint at load (tests/test_quantize_on_the_fly.py)
    assert resolve_quantization(str(float_dir), "fp8") == OnlineScheme("fp8")
    with pytest.raises(ValueError, match="--quantization bitsandbytes is not supported by this engine"):
        ServerArgs(model_path=str(gptq_dir), quantization="bitsandbytes").validate()
    with pytest.raises(ValueError, match="'int3' is not a known quantization method"):
        ServerArgs(model_path=str(gptq_dir), quantization="int3").validate()
    assert "quantization" not in ServerArgs(model_path=str(gptq_dir), quantization="gptq").not_applicable_settings()


def test_malformed_checkpoint_stops_engine_startup_naming_the_tensor(gptq_dir, tmp_path):
    from sglang import Engine

    quant_dir = _copy(gptq_dir, tmp_path)
    _edit_shard(quant_dir, lambda t: t.pop("model.layers.0.self_attn.k_proj.qzeros"))
    with pytest.raises(QuantizedCheckpointError, match=r"model\.layers\.0\.self_attn\.k_proj\.qzeros is missing"):
        Engine(model_path=str(quant_dir))
