"""`--quantization w8a8_int8` and `--quantization fp8` on a float checkpoint: quantized at load
(model_loader/online_quant.py) and served as the checkpoint kind they become.

The reference quantizations are written out here: w8a8_int8 is symmetric int8 per output channel, scale
max|row| / 127 rounded to fp16 (the scale a Q8_0 block keeps), values round(w / scale) in float32; fp8 is float8
e4m3 with one scale per tensor, values (w * 448 / max|w|) rounded to e4m3, times max|w| / 448 (SGLang's online
fp8). On tiny random Llamas and on SmolLM2's weights: the loaded weights (the Q8_0 blocks, or the dequantized float
weights where no blocks are made) equal the reference exactly; the logits equal transformers' on the reference
weights up to summation order and stay within the format's error of transformers' on the float weights; a server
started with `--quantization w8a8_int8` generates transformers' greedy tokens on the reference weights (under the
near-tie rule of tests/test_quantized_blocks.py); each weight is quantized once and each checkpoint tensor read once
(the blocks are made from the first pass's integers; a GPTQ checkpoint's too); a quantized checkpoint or a GGUF file
with an on-the-fly mode is a startup error naming both.
"""

from __future__ import annotations

import logging
import os
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import requests
import torch

from sglang.srt.layers.arithmetic import choose_arithmetic
from sglang.srt.layers.quantization.gguf_linear import GGUFLinearMethod
from sglang.srt.model_loader.quant_config import OnlineScheme, QuantizedCheckpointError, resolve_quantization
from sglang.srt.model_loader.weight_report import describe_weights, weight_bytes_by_format
from tests.quant_packers import gptq_format, write_quantized_checkpoint
from tests.test_cpu_arithmetic import BF16_VNNI_FLAGS
from tests.test_models import PagedCache, max_diff, prompt_of, reference_logits, tiny_config
from tests.test_quantized_blocks import (
    GREEDY,
    PROMPTS,
    SUMMATION_TOL,
    _hf_greedy,
    assert_same_greedy,
    blocks_plan,
    linears_with_parts,
)

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


# ---- the reference quantizations --------------------------------------------------------------------------------
def int8_reference(weight: torch.Tensor) -> torch.Tensor:
    w = weight.to(torch.float32)
    scale = (w.abs().amax(dim=1, keepdim=True) / 127).to(torch.float16).to(torch.float32)
    scale[scale == 0] = 2.0**-24
    return torch.round(w / scale).clamp_(-127, 127).mul_(scale)


def fp8_reference(weight: torch.Tensor) -> torch.Tensor:
    w = weight.to(torch.float32)
    inverse = 448.0 / w.abs().max()
    return (w * inverse).clamp(-448, 448).to(torch.float8_e4m3fn).to(torch.float32) * (1 / inverse)


REFERENCES = {"w8a8_int8": int8_reference, "fp8": fp8_reference}
# The formats' error on the tiny Llamas' logits, as max |logit difference| / max |logit| against the float weights:
# int8 rounds each weight by at most 1/254 of its row's largest, e4m3 by up to 1/16 of itself (3 mantissa bits), and
# two layers of random weights (initializer_range 0.2) compound it; measured 0.036-0.037 (int8) and 0.157 (fp8),
# bounded here with ~1.6x headroom. A wrong axis or scale moves the logits by far more.
FORMAT_ERROR = {"w8a8_int8": 0.06, "fp8": 0.25}


def is_linear(name: str) -> bool:
    module, _, leaf = name.rpartition(".")
    return leaf == "weight" and module.rsplit(".", 1)[-1] in LINEARS


def reference_weights(hf_model: Any, method: str) -> dict[str, torch.Tensor]:
    return {name: REFERENCES[method](p.detach()) for name, p in hf_model.named_parameters() if is_linear(name)}


def set_weights(hf_model: Any, weights: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            if name in weights:
                param.copy_(weights[name])


def tiny_float_checkpoint(directory: Path, dtype: torch.dtype, config: Any = None) -> Any:
    """A tiny random Llama saved in `dtype`; returns the transformers model on exactly the saved values (float32)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config or tiny_config("llama", hidden_size=128, intermediate_size=320)).to(
        dtype).save_pretrained(directory)
    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


def online_config(model_dir: Path, method: str) -> Any:
    """The served config as the server builds it (model_loader/model_info.py): the on-the-fly mode in it."""
    from transformers import AutoConfig

    from sglang.srt.model_loader.quant_config import quantization_settings

    scheme = resolve_quantization(str(model_dir), method)
    assert scheme == OnlineScheme(method)
    config = AutoConfig.from_pretrained(model_dir)
    config.quantization_config = quantization_settings(str(model_dir), scheme)
    return config


def load_online(model_dir: Path, method: str, plan: Any) -> Any:
    from sglang.srt.model_executor.model_runner import attach_fast_paths, load_for_plan

    config = online_config(model_dir, method)
    model = load_for_plan(str(model_dir), torch.float32, torch.device("cpu"), None, 8, plan, config=config)
    attach_fast_paths(model, None, config, 8, plan)
    return model


def assert_logits(model: Any, hf_model: Any, references: dict[str, torch.Tensor], method: str) -> None:
    """Our logits: transformers' on the reference weights up to summation order, and within the format's error of
    transformers' on the float weights (and not equal to them: the weights were quantized)."""
    prompt = prompt_of(9, 3)
    logits = PagedCache(hf_model.config, torch.float32).forward(model, [(0, prompt)], all_logits=True)
    float_logits = reference_logits(hf_model, prompt)
    saved = {name: p.detach().clone() for name, p in hf_model.named_parameters() if name in references}
    set_weights(hf_model, references)
    try:
        assert max_diff(logits, reference_logits(hf_model, prompt)) < SUMMATION_TOL, method
    finally:
        set_weights(hf_model, saved)
    relative = max_diff(logits, float_logits) / float(float_logits.abs().max())
    assert 1e-5 < relative < FORMAT_ERROR[method], (method, relative)


# ---- tiny Llamas, in process ------------------------------------------------------------------------------------
def test_w8a8_int8_blocks_are_the_reference_int8(tmp_path, caplog):
    """bf16 checkpoint, blocks for every batch: each decoder linear is served from Q8_0 blocks made from its int8
    values and fp16 scales, exactly the reference; no float copy of them is kept; the LM head, embeddings and norms
    are not quantized by the mode (the head gets the plan's own Q8_0 blocks, as it does for a checkpoint)."""
    hf_model = tiny_float_checkpoint(tmp_path, torch.bfloat16)
    references = reference_weights(hf_model, "w8a8_int8")
    with caplog.at_level(logging.INFO, logger="sglang.srt.model_loader"):
        model = load_online(tmp_path, "w8a8_int8", blocks_plan())
    source = model.quantized_checkpoint
    for module, parts in linears_with_parts(model):
        method = module.linear_method
        assert isinstance(method, GGUFLinearMethod) and method.quant_weight.qtype == "Q8_0", parts
        assert id(method.quant_weight.packed) in source.served, parts  # made from the int8 values, not requantized
        assert module.weight.device.type == "meta", parts
        assert torch.equal(method.quant_weight.dequantize(), torch.cat([references[p] for p in parts])), parts
    head = model.logits_processor.head_method.quant_weight
    assert id(head.packed) not in source.served
    assert torch.equal(model.model.embed_tokens.weight, hf_model.model.embed_tokens.weight)
    assert torch.equal(model.model.layers[0].input_layernorm.weight, hf_model.model.layers[0].input_layernorm.weight)
    by_format = weight_bytes_by_format(model)
    # the bf16 checkpoint's embedding table stays bf16 (model_loader/q8_blocks.table_kept_as_stored)
    assert set(by_format) == {"Q8_0 blocks from the w8a8_int8 checkpoint", "float32", "bfloat16", "Q8_0 blocks"}, \
        by_format
    assert describe_weights(model).startswith(
        "Weights: w8a8_int8 (int8 weights per output channel (fp16 scales), quantized at load), served from its own "
        "Q8_0 blocks")
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Quantized at load")]
    assert len(lines) == 1 and "w8a8_int8, int8 weights per output channel (fp16 scales), 14 linears" in lines[0]
    with torch.no_grad():  # transformers with the LM head the plan serves (its Q8_0 values)
        hf_model.lm_head.weight.copy_(head.dequantize())
    assert_logits(model, hf_model, references, "w8a8_int8")


@pytest.mark.parametrize("method", ["w8a8_int8", "fp8"])
def test_dequantize_path_loads_the_reference_values(tmp_path, method, caplog):
    """float32 checkpoint, no blocks (float32 arithmetic): the model's linear weights are the reference
    quantization's values themselves (exact in float32), everything else as stored."""
    hf_model = tiny_float_checkpoint(tmp_path, torch.float32)
    references = reference_weights(hf_model, method)
    plan = choose_arithmetic("cpu", cpu_gemm="float32", cpu_flags=BF16_VNNI_FLAGS, small_batch_quantization="none")
    with caplog.at_level(logging.INFO, logger="sglang.srt.model_loader"):
        model = load_online(tmp_path, method, plan)
    for module, parts in linears_with_parts(model):
        assert torch.equal(module.weight, torch.cat([references[p] for p in parts])), parts
    assert torch.equal(model.lm_head.weight, hf_model.lm_head.weight)
    assert not model.quantized_checkpoint.served
    weights = OnlineScheme(method).weights
    assert describe_weights(model).startswith(f"Weights: {method} ({weights}, quantized at load), dequantized to "
                                              "float32 at load, then served as float32")
    assert any(r.getMessage().startswith(f"Quantized at load: {method}, {weights}, 14 linears")
               for r in caplog.records)
    assert_logits(model, hf_model, references, method)


def test_fp8_has_no_integer_blocks_and_says_so(tmp_path, caplog):
    """fp8 is served as an FP8 checkpoint is: dequantized, with the plan's Q8_0 blocks quantized from that."""
    tiny_float_checkpoint(tmp_path, torch.bfloat16)
    with caplog.at_level(logging.INFO, logger="sglang.srt.model_loader.checkpoint_blocks"):
        model = load_online(tmp_path, "fp8", blocks_plan())
    assert not model.quantized_checkpoint.served
    assert any("FP8 weights have no integer block layout here" in r.getMessage() for r in caplog.records)


def test_on_the_fly_mode_on_a_quantized_checkpoint_or_gguf_file_is_a_startup_error(tmp_path):
    from transformers import AutoModelForCausalLM

    from sglang import Engine

    torch.manual_seed(0)
    hf_model = AutoModelForCausalLM.from_config(tiny_config("llama", hidden_size=128, intermediate_size=320))
    quant_config, make_layer, dtype = gptq_format(4, 32, True)
    write_quantized_checkpoint(tmp_path, hf_model, quant_config, make_layer, dtype)
    for method in ("w8a8_int8", "fp8"):
        with pytest.raises(QuantizedCheckpointError, match=rf"--quantization {method} does not match the checkpoint: "
                                                           r"its quantization_config .* says 'gptq'"):
            Engine(model_path=str(tmp_path), quantization=method)
    with pytest.raises(QuantizedCheckpointError, match="--quantization w8a8_int8 does not match the checkpoint: it "
                                                       "is a GGUF file"):
        Engine(model_path="HuggingFaceTB/SmolLM2-135M-Instruct", quantization="w8a8_int8")


# ---- one quantization per weight, one read per tensor --------------------------------------------------------------
def count_reads(monkeypatch) -> dict[str, int]:
    """Checkpoint tensor name -> how many times the loader has read it (quantized_weights.TensorStore)."""
    from sglang.srt.model_loader.quantized_weights import TensorStore

    reads: dict[str, int] = {}
    read = TensorStore.get

    def counted(store: TensorStore, name: str) -> torch.Tensor:
        reads[name] = reads.get(name, 0) + 1
        return read(store, name)

    monkeypatch.setattr(TensorStore, "get", counted)
    return reads


def stored_names(directory: Path) -> set[str]:
    from safetensors import safe_open

    names: set[str] = set()
    for path in directory.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as f:
            names |= set(f.keys())
    return names


def test_w8a8_int8_quantizes_each_weight_once(tmp_path, monkeypatch):
    """The int8 values and fp16 scales made as each linear weight is first read are what its Q8_0 blocks are made
    of: `int8_per_channel` runs once per weight and every tensor of the checkpoint is read once, whether the blocks
    serve every batch (a bf16 checkpoint) or small batches beside the float32 weights (a float32 checkpoint, whose
    float weights are the same values); the blocks made at load are not kept once attached, nor where the model gets
    none (--gguf-kernel-max-rows 0)."""
    from sglang.srt.model_executor.model_runner import attach_fast_paths, load_for_plan
    from sglang.srt.model_loader import online_quant

    quantized: list[tuple[int, ...]] = []
    quantize = online_quant.int8_per_channel

    def counted(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        quantized.append(tuple(weight.shape))
        return quantize(weight)

    monkeypatch.setattr(online_quant, "int8_per_channel", counted)
    reads = count_reads(monkeypatch)
    small_blocks = choose_arithmetic("cpu", cpu_gemm="float32", cpu_flags=BF16_VNNI_FLAGS,
                                     small_batch_quantization="q8_0", large_batch_weights="dense")
    for dtype, plan in ((torch.bfloat16, blocks_plan()), (torch.float32, small_blocks)):
        directory = tmp_path / str(dtype).removeprefix("torch.")
        references = reference_weights(tiny_float_checkpoint(directory, dtype), "w8a8_int8")
        quantized.clear()
        reads.clear()
        model = load_online(directory, "w8a8_int8", plan)
        assert sorted(quantized) == sorted(tuple(r.shape) for r in references.values()), dtype  # 14, once each
        assert reads == dict.fromkeys(stored_names(directory), 1), dtype
        source = model.quantized_checkpoint
        assert source.made is None, dtype
        for module, parts in linears_with_parts(model):
            method = module.linear_method
            assert isinstance(method, GGUFLinearMethod) and id(method.quant_weight.packed) in source.served, parts
            reference = torch.cat([references[p] for p in parts])
            assert torch.equal(method.quant_weight.dequantize(), reference), parts
            if module.weight.device.type != "meta":
                assert torch.equal(module.weight, reference), parts
    config = online_config(directory, "w8a8_int8")
    model = load_for_plan(str(directory), torch.float32, torch.device("cpu"), None, 0, small_blocks, config=config)
    assert model.quantized_checkpoint.made is not None and len(model.quantized_checkpoint.made) == 14
    attach_fast_paths(model, None, config, 0, small_blocks)
    assert model.quantized_checkpoint.made is None and not model.quantized_checkpoint.served
    no_blocks = choose_arithmetic("cpu", cpu_gemm="float32", cpu_flags=BF16_VNNI_FLAGS, small_batch_quantization="none")
    model = load_for_plan(str(directory), torch.float32, torch.device("cpu"), None, 8, no_blocks, config=config)
    assert model.quantized_checkpoint.made is not None
    attach_fast_paths(model, None, config, 8, no_blocks)  # no layer takes blocks: those made while reading go
    assert model.quantized_checkpoint.made is None and not model.quantized_checkpoint.served


def test_a_quantized_checkpoint_is_read_once(tmp_path, monkeypatch):
    """A GPTQ checkpoint served from Q4_1 blocks of its own integers: every tensor of it is read once (the blocks
    made as each weight is read and dequantized), and the served blocks are byte for byte those a second reading of
    its integers makes."""
    from transformers import AutoModelForCausalLM

    from sglang.srt.model_loader.int_blocks import blocks_of
    from sglang.srt.model_loader.quantized_weights import iterate_quantized
    from tests.test_quantized_blocks import load_served

    torch.manual_seed(0)
    hf_model = AutoModelForCausalLM.from_config(tiny_config("llama", hidden_size=128, intermediate_size=320))
    quant_config, make_layer, dtype = gptq_format(4, 32, False)
    write_quantized_checkpoint(tmp_path, hf_model, quant_config, make_layer, dtype)
    reads = count_reads(monkeypatch)
    model = load_served(tmp_path, blocks_plan())
    assert reads == dict.fromkeys(stored_names(tmp_path), 1)
    source = model.quantized_checkpoint
    assert source.made is None
    again = {module: blocks_of(stored, module) for module, stored in iterate_quantized(source.files, source.scheme)}
    for module, parts in linears_with_parts(model):
        method = module.linear_method
        assert isinstance(method, GGUFLinearMethod) and id(method.quant_weight.packed) in source.served, parts
        raw = [again[p.removesuffix(".weight")] for p in parts]
        assert all(isinstance(r, tuple) and r[0] == "Q4_1" for r in raw), parts
        assert torch.equal(method.quant_weight.raw(), torch.cat([r[1] for r in raw])), parts


def test_what_is_quantized_and_what_cannot_be(tmp_path):
    """The decoder's linear weights and nothing else; a checkpoint without them, or a tensor that is not a 2-d float
    weight, is an error naming it."""
    from sglang.srt.model_loader.online_quant import plan_online, quantize_at_load

    names = ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.gate.weight",
             "model.layers.0.mlp.experts.1.down_proj.weight", "model.layers.0.input_layernorm.weight",
             "model.layers.0.self_attn.kv_a_proj_with_mqa.weight", "model.norm.weight", "lm_head.weight",
             "visual.blocks.0.attn.proj.weight", "model.layers.0.self_attn.q_proj.bias"]
    assert plan_online(names, OnlineScheme("w8a8_int8")) == dict.fromkeys([
        "model.layers.0.self_attn.q_proj", "model.layers.0.mlp.experts.1.down_proj",
        "model.layers.0.self_attn.kv_a_proj_with_mqa"], "weight")
    with pytest.raises(QuantizedCheckpointError, match="--quantization fp8 quantizes the decoder's linear weights"):
        plan_online(["model.embed_tokens.weight", "lm_head.weight"], OnlineScheme("fp8"))
    with pytest.raises(QuantizedCheckpointError, match=r"Checkpoint tensor x\.q_proj\.weight is torch\.int8"):
        quantize_at_load(OnlineScheme("w8a8_int8"), torch.zeros(4, 32, dtype=torch.int8), "x.q_proj.weight")
    zero_row = torch.zeros(2, 32)
    zero_row[1] = torch.linspace(-1, 1, 32)
    ours = quantize_at_load(OnlineScheme("w8a8_int8"), zero_row, "w").dequantize()
    assert torch.equal(ours, int8_reference(zero_row)) and not bool(ours[0].any())


# ---- SmolLM2 through the server -----------------------------------------------------------------------------------
def q8_0_values(weight: torch.Tensor) -> torch.Tensor:
    """llama.cpp's reference Q8_0 rounding of a float weight (the LM head's blocks for small batches)."""
    import gguf

    raw = gguf.quants.quantize(weight.detach().float().numpy(), gguf.GGMLQuantizationType.Q8_0)
    return torch.from_numpy(np.asarray(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q8_0))).float()


def smollm2_reference(smollm2_dir: str, tokenizer: Any) -> tuple[Any, list[list[int]]]:
    """(transformers SmolLM2 on the reference int8 linears and the served LM head's Q8_0 values, its greedy tokens)."""
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    embed = hf_model.model.embed_tokens.weight
    hf_model.lm_head.weight = torch.nn.Parameter(q8_0_values(embed), requires_grad=False)  # untied: the served head
    set_weights(hf_model, reference_weights(hf_model, "w8a8_int8"))
    return hf_model, _hf_greedy(hf_model, tokenizer)


def test_smollm2_server_with_w8a8_int8(smollm2_dir, smollm2_tokenizer):
    """SmolLM2's HF weights (its converted directory, a float checkpoint) served with --quantization w8a8_int8:
    /generate answers with transformers' greedy tokens on the reference int8 weights (float32 arithmetic, and the
    LM head at its Q8_0 values, as the plan serves small batches), and the log and /get_server_info say what was
    quantized and how it is served. `--large-batch-weights blocks`: the plan keeps a dense float32 copy for the
    large batches of a model this small (layers/arithmetic.py), quantized checkpoints alike; here the blocks alone
    serve. The reference is computed while the server starts."""
    from sglang.test.test_utils import find_free_port, popen_launch_server
    from sglang.utils import terminate_process

    base_url = f"http://127.0.0.1:{find_free_port()}"
    log = tempfile.NamedTemporaryFile(prefix="sglang-otf-", suffix=".log", delete=False)
    log.close()
    with ThreadPoolExecutor(1) as pool:
        starting = pool.submit(popen_launch_server, smollm2_dir, base_url, log_path=log.name, other_args=[
            "--quantization", "w8a8_int8", "--cpu-gemm", "float32", "--large-batch-weights", "blocks",
            "--max-total-tokens", "2048"])
        try:
            hf_model, expected = smollm2_reference(smollm2_dir, smollm2_tokenizer)
        except BaseException:
            terminate_process(starting.result())
            raise
        proc = starting.result()
    try:
        served = []
        for prompt in PROMPTS:
            response = requests.post(f"{base_url}/generate", json={"text": prompt, "sampling_params": GREEDY},
                                     timeout=120)
            assert response.status_code == 200, response.text
            served.append(response.json()["output_ids"])
        info = requests.get(f"{base_url}/get_server_info", timeout=30).json()
    finally:
        terminate_process(proc)
        with open(log.name) as f:
            server_log = f.read()
        os.unlink(log.name)
    assert info["quantization"] == "w8a8_int8"
    assert "Quantized at load: w8a8_int8, int8 weights per output channel (fp16 scales), 210 linears" in server_log
    # One copy of the linear weights, the int8 blocks: float32 only for the embeddings (the tied head) and norms.
    by_format = info["weights"]["by_format"]
    assert set(by_format) == {"Q8_0 blocks from the w8a8_int8 checkpoint", "Q8_0 blocks", "float32"}, by_format
    params = {name: p for name, p in hf_model.named_parameters() if name != "lm_head.weight"}  # tied when served
    linears = sum(p.numel() for name, p in params.items() if is_linear(name))
    assert by_format["Q8_0 blocks from the w8a8_int8 checkpoint"] == linears // 32 * 34
    assert by_format["float32"] == sum(p.numel() * 4 for name, p in params.items() if not is_linear(name))
    assert all(len(set(ids)) > 2 for ids in expected)
    assert_same_greedy(served, expected, hf_model, smollm2_tokenizer, "w8a8_int8 server")
