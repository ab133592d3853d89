"""Mixture-of-experts models held as Q8_0 blocks alone (`--large-batch-weights blocks`): one copy of the weights.

A bf16 Qwen2-MoE / Qwen3-MoE / Mixtral checkpoint loads its linear weights and stacked experts in bf16
(model_loader/moe_blocks.keep_experts_in); every attention and dense linear, shared expert, expert projection and
the LM head then gets Q8_0 blocks and its float weight is released (attach_expert_blocks); the routers stay float32.
Each expert's rows run the block kernels up to the plan's row limit and the large-batch method over the same blocks
beyond (layers/moe/expert_blocks.py). The reference is transformers on the same checkpoint with every served
weight replaced by its Q8_0 values from the `gguf` package's reference quantizer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

gguf = pytest.importorskip("gguf")

from sglang.srt.layers.arithmetic import choose_arithmetic  # noqa: E402
from sglang.srt.layers.linear import Linear, LinearMethod  # noqa: E402
from sglang.srt.layers.moe.expert_blocks import ExpertBlocks  # noqa: E402
from sglang.srt.layers.moe.fused_moe import FusedMoE, expert_linear_methods, fused_experts  # noqa: E402
from sglang.srt.layers.moe.topk import TopKConfig, select_experts  # noqa: E402
from sglang.srt.layers.quantization.block_gemm import BlockGEMMLinearMethod  # noqa: E402
from sglang.srt.layers.quantization.gguf_blocks import kernels_available  # noqa: E402
from sglang.srt.layers.quantization.gguf_linear import GGUFLinearMethod  # noqa: E402
from sglang.srt.model_executor.decode_strategy import describe_linear_methods  # noqa: E402
from sglang.srt.model_executor.model_runner import attach_fast_paths, load_for_plan  # noqa: E402
from sglang.srt.model_loader.q8_blocks import quantize_q8_0  # noqa: E402
from sglang.srt.model_loader.weight_report import describe_weights, weight_bytes_by_format  # noqa: E402
from tests.greedy_cases import BF16_MARGIN, assert_same_or_near_tie  # noqa: E402
from tests.test_cpu_arithmetic import BF16_VNNI_FLAGS  # noqa: E402
from tests.test_fused_decode import decode_run  # noqa: E402
from tests.test_models import VOCAB, max_diff, prompt_of, reference_logits  # noqa: E402
from tests.test_moe_engine import PROMPTS  # noqa: E402
from tests.test_moe_models import tiny_moe_config  # noqa: E402

pytestmark = pytest.mark.skipif(not kernels_available(), reason="the compiled GGUF kernels are unavailable")

BLOCKS_PLAN = dict(small_batch_quantization="q8_0", large_batch_weights="blocks")
FAMILIES = ["qwen2_moe-mlp-only", "qwen3_moe", "mixtral"]
MAX_ROWS = 8  # the block kernels' row limit in these tests: a prompt of 60 tokens routes more to most experts


# ---- helpers -----------------------------------------------------------------------------------------------------
def save_bf16_moe(family: str, directory: Path, vocab_size: int = VOCAB, seed: int = 0) -> Any:
    """A random MoE checkpoint saved in bf16 to `directory`; returns transformers' model on its values (float32)."""
    from transformers import AutoModelForCausalLM

    config = tiny_moe_config(family, vocab_size=vocab_size, torch_dtype="bfloat16")
    if family.startswith("qwen2_moe"):
        config.shared_expert_intermediate_size = 64  # the blocks need input widths that are multiples of 32
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(directory)
    # read back in float32: a model built in bf16 keeps its rotary frequencies rounded to bf16
    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


def q8_0_values(weight: torch.Tensor) -> torch.Tensor:
    """`weight` rounded to Q8_0 along its last axis by the reference quantizer (blocks of 32 inputs of one row)."""
    flat = weight.detach().float().reshape(-1, weight.shape[-1]).numpy()
    qtype = gguf.GGMLQuantizationType.Q8_0
    return torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(flat, qtype), qtype)).reshape(weight.shape)


def is_served_from_blocks(name: str, param: torch.Tensor) -> bool:
    """Every matrix but the input embeddings and the routers (the MoE gate and Qwen2-MoE's shared-expert gate)."""
    return param.dim() >= 2 and "embed_tokens" not in name and not name.endswith(
        ("mlp.gate.weight", "shared_expert_gate.weight"))


def with_q8_0_weights(hf_model: Any) -> Any:
    """A copy of transformers' model whose served weights are their reference Q8_0 values."""
    import copy

    served = copy.deepcopy(hf_model)
    with torch.no_grad():
        for name, param in served.named_parameters():
            if is_served_from_blocks(name, param):
                param.copy_(q8_0_values(param))
    return served


def blocks_plan(block_gemm: str = "float32"):
    """The blocks plan of a CPU with native bf16 whose measurement picked `block_gemm` for large batches; the block
    kernels take float32 activations."""
    rates = {"float32": 2.0, "bfloat16": 1.0} if block_gemm == "float32" else {"float32": 0.5, "bfloat16": 1.0}
    plan = choose_arithmetic("cpu", cpu_flags=BF16_VNNI_FLAGS, measurements={**rates, "int8": 0.1},
                             gguf_activations="float32", **BLOCKS_PLAN)
    assert (plan.large_batch_weights, plan.block_gemm) == ("blocks", block_gemm)
    return plan


class RowsSeen(LinearMethod):
    """A large-batch method that records the row counts it multiplies."""

    def __init__(self, inner: LinearMethod) -> None:
        self.inner = inner
        self.rows: list[int] = []

    def apply(self, weight: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        self.rows.append(x.shape[0])
        return self.inner.apply(weight, x, bias)

    def describe(self) -> str:
        return self.inner.describe()


# ---- the experts' computation from blocks --------------------------------------------------------------------------
def test_experts_from_blocks_compute_with_the_blocks_values():
    """Small batches through the block kernels, an expert's many rows through the GEMM over its blocks: both the
    stacked float experts' result on the blocks' values. The stacked parameters are released (meta)."""
    gen = torch.Generator().manual_seed(0)
    experts, hidden, inter, max_rows = 4, 64, 32, 4
    layer = FusedMoE(experts, hidden, inter)
    with torch.no_grad():
        layer.gate_up_proj.copy_(torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.2)
        layer.down_proj.copy_(torch.randn(experts, hidden, inter, generator=gen) * 0.2)
    gate_up = [GGUFLinearMethod(quantize_q8_0(layer.gate_up_proj[e]), max_rows) for e in range(experts)]
    down = [GGUFLinearMethod(quantize_q8_0(layer.down_proj[e]), max_rows) for e in range(experts)]
    for method in gate_up + down:
        method.large = RowsSeen(BlockGEMMLinearMethod(method.quant_weight, torch.float32))
    values = (torch.stack([m.quant_weight.dequantize() for m in gate_up]),
              torch.stack([m.quant_weight.dequantize() for m in down]))
    assert max_diff(values[0], layer.gate_up_proj) < layer.gate_up_proj.abs().max() / 254 + 1e-6  # Q8_0 rounding
    layer.serve_from_blocks(ExpertBlocks(gate_up, down), torch.float32)
    assert layer.gate_up_proj.device.type == "meta" and layer.down_proj.device.type == "meta"
    assert layer.describe() == f"GGUF Q8_0 blocks up to {max_rows} rows, float32 GEMM over the Q8_0 blocks " \
                               f"(slabs of {gate_up[0].large.inner.rows_per_slab} rows) beyond"
    assert len(expert_linear_methods(layer)) == 2 * experts
    config = TopKConfig(experts, 2, renormalize=True, float32_weights=True)
    for tokens in (3, 64):  # 3 tokens: at most 3 rows an expert; 64: about 32
        x = torch.randn(tokens, hidden, generator=gen)
        topk = select_experts(torch.randn(tokens, experts, generator=gen), config)
        for method in gate_up + down:
            method.large.rows.clear()
        with torch.inference_mode():
            out = layer(x, topk)
        expected = fused_experts(x, *values, topk.weights, topk.ids)
        assert out.shape == x.shape and max_diff(out, expected) < 1e-4 * max(1.0, expected.abs().max().item())
        large_rows = [r for m in gate_up + down for r in m.large.rows]
        assert (tokens > max_rows) == bool(large_rows) and all(r > max_rows for r in large_rows)
    with pytest.raises(ValueError, match="blocks of 4 experts of intermediate size 32 for a layer of 5 x 32"):
        FusedMoE(5, hidden, inter).serve_from_blocks(ExpertBlocks(gate_up, down), torch.float32)


# ---- a checkpoint loaded for the blocks plan ----------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_moe_checkpoint_is_held_as_blocks_alone(tmp_path, family):
    """Linear weights and experts load in bf16 and leave only their blocks, which are the reference quantizer's
    Q8_0 of the checkpoint's weights; the weights report counts the experts' blocks and holds no float experts; a
    prefill of 60 tokens (most experts get more rows than the kernels take) and layer-by-layer decode steps give
    the logits of transformers on the blocks' values."""
    hf_model = save_bf16_moe(family, tmp_path)
    config = hf_model.config
    plan = blocks_plan("float32")
    ours: Any = load_for_plan(str(tmp_path), torch.float32, torch.device("cpu"), None, MAX_ROWS, plan)
    layers = ours.model.layers
    sparse = [i for i, layer in enumerate(layers) if hasattr(layer.mlp, "experts")]
    assert sparse and all(layers[i].mlp.experts.gate_up_proj.dtype == torch.bfloat16 for i in sparse)
    assert layers[sparse[0]].self_attn.qkv_proj.weight.dtype == torch.bfloat16  # read as stored
    assert layers[sparse[0]].mlp.gate.weight.dtype == torch.float32  # the router
    attach_fast_paths(ours, None, config, MAX_ROWS, plan)

    expected_names = {"embed_tokens", "norm", "layernorm", "mlp.gate.", "shared_expert_gate", "bias"}
    kept = [name for name, p in ours.named_parameters() if p.device.type != "meta"]
    assert all(any(part in name for part in expected_names) for name in kept), kept
    blocks = [m.quant_weight for m in expert_linear_methods(ours)]
    assert len(blocks) == 2 * len(sparse) * layers[sparse[0]].mlp.experts.num_experts
    hf_state = hf_model.state_dict()
    for i in sparse:
        served = layers[i].mlp.experts.expert_blocks
        for e in (0, len(served.gate_up) - 1):
            gate_up, down = hf_state[f"model.layers.{i}.mlp.experts.gate_up_proj"][e], \
                hf_state[f"model.layers.{i}.mlp.experts.down_proj"][e]
            assert torch.equal(served.gate_up[e].quant_weight.dequantize(), q8_0_values(gate_up)), (i, e)
            assert torch.equal(served.down[e].quant_weight.dequantize(), q8_0_values(down)), (i, e)
    by_format = weight_bytes_by_format(ours)
    assert set(by_format) == {"Q8_0 blocks", "bfloat16", "float32"}  # the embedding table as stored
    linears = [m for m in ours.modules() if isinstance(m, Linear)]
    assert linears and all(isinstance(m.linear_method, GGUFLinearMethod) for m in linears)
    all_blocks = blocks + [m.linear_method.quant_weight for m in linears]
    assert by_format["Q8_0 blocks"] == sum(b.nbytes for b in all_blocks) + \
        ours.logits_processor.head_method.quant_weight.nbytes
    one_layer_of_experts = layers[sparse[0]].mlp.experts.gate_up_proj.numel() * 4
    assert by_format["float32"] < one_layer_of_experts  # routers, norms, biases: no float expert remains
    assert "Q8_0 blocks" in describe_weights(ours)
    assert f"stacked experts, GGUF Q8_0 blocks up to {MAX_ROWS} rows, float32 GEMM over the Q8_0 blocks" in \
        describe_linear_methods(ours)

    reference = with_q8_0_weights(hf_model)
    prompts = [prompt_of(60, 1), prompt_of(5, 2)]
    steps, cache = decode_run(ours, config, False, prompts, steps=3)
    prefill = cache.forward(ours, [(7, prompts[0])], all_logits=True)
    diffs = (prefill - reference_logits(reference, prompts[0])).abs().amax(-1)
    # float32 GEMM over the blocks: the same sums up to rounding (which may flip a router's near-tie)
    assert diffs.median() < 1e-3 and diffs.max() < 0.5, diffs
    # decode_run feeds each prompt's last token again, then its greedy tokens, rows in reverse order
    sequences = {row: [*p, p[-1]] for row, p in enumerate(prompts)}
    for logits in steps:
        for i, row in enumerate([1, 0]):
            expected = reference_logits(reference, sequences[row])[-1]
            assert max_diff(logits[i], expected) < 2e-3, (row, max_diff(logits[i], expected))
            sequences[row].append(int(logits[i].argmax()))


def test_deepseek_v2_experts_and_latent_attention_linears_served_from_blocks(tmp_path):
    """DeepSeek-V2 (multi-head latent attention, grouped routing, shared experts) takes the same path; its
    `kv_b_proj`, which attention reads as the absorbed W_UK / W_UV matrices, stays float32 like the router."""
    from transformers import AutoModelForCausalLM

    from tests.test_models_deepseek_v2 import latent_cache, tiny_deepseek_config

    config = tiny_deepseek_config(32, v_head_dim=16, torch_dtype="bfloat16")  # every input width a multiple of 32
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(tmp_path)
    hf_model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    plan = blocks_plan("float32")
    ours: Any = load_for_plan(str(tmp_path), torch.float32, torch.device("cpu"), None, MAX_ROWS, plan)
    attach_fast_paths(ours, None, config, MAX_ROWS, plan)
    sparse = [layer.mlp.experts for layer in ours.model.layers if hasattr(layer.mlp, "experts")]
    assert len(sparse) == config.num_hidden_layers - 1 and all(e.expert_blocks is not None for e in sparse)
    assert ours.model.layers[1].self_attn.kv_b_proj.weight.dtype == torch.float32
    assert set(weight_bytes_by_format(ours)) == {"Q8_0 blocks", "float32"}
    reference = with_q8_0_weights(hf_model)
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if "kv_b_proj" in name:
                param.copy_(hf_model.get_parameter(name))
    prompt = prompt_of(40, 1)
    logits = latent_cache(config).forward(ours, [(0, prompt)], all_logits=True)
    diffs = (logits - reference_logits(reference, prompt)).abs().amax(-1)
    assert diffs.median() < 1e-3 and diffs.max() < 0.5, diffs


# ---- served end to end ---------------------------------------------------------------------------------------------
LONG_PROMPT = " ".join(["Experts route every token of a long prompt to a few of their number, and each expert then "
                        "multiplies all of its rows at once."] * 4)
GREEDY = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}



@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from sglang.srt.model_loader.resolve import resolve_model_path
    from sglang.test.test_utils import DEFAULT_SMALL_MODEL_NAME_FOR_TEST

    return AutoTokenizer.from_pretrained(resolve_model_path(DEFAULT_SMALL_MODEL_NAME_FOR_TEST))


def hf_greedy(model: Any, tokenizer: Any, prompt: str) -> list[int]:
    ids = tokenizer.encode(prompt)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=GREEDY["max_new_tokens"], do_sample=False, eos_token_id=None,
                             pad_token_id=tokenizer.pad_token_id)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("family", FAMILIES)
def test_engine_serves_moe_from_blocks_with_transformers_greedy_tokens(tmp_path, tokenizer, family):
    """Through the Engine, its plan serving every batch from blocks: two short prompts and one long one in one
    batch (the long prefill gives most experts more rows than the kernels take: the GEMM over the blocks) give
    transformers' greedy tokens on the blocks' values (or a near tie), and the server reports Q8_0 blocks and no
    float32 experts. A weight update loads the checkpoint the same way."""
    from sglang import Engine

    hf_model = save_bf16_moe(family, tmp_path, vocab_size=len(tokenizer), seed=3)
    tokenizer.save_pretrained(tmp_path)
    reference = with_q8_0_weights(hf_model)
    prompts = [*PROMPTS, LONG_PROMPT]
    experts = hf_model.config.num_experts if hasattr(hf_model.config, "num_experts") else \
        hf_model.config.num_local_experts
    assert len(tokenizer.encode(LONG_PROMPT)) * hf_model.config.num_experts_per_tok > 2 * MAX_ROWS * experts
    expected = [hf_greedy(reference, tokenizer, p) for p in prompts]
    assert all(len(set(ids)) > 2 for ids in expected)
    with Engine(model_path=str(tmp_path), gguf_kernel_max_rows=MAX_ROWS, max_total_tokens=2048,
                **BLOCKS_PLAN) as engine:
        info = engine.get_server_info()
        outputs = [o["output_ids"] for o in engine.generate(prompt=prompts, sampling_params=GREEDY)]
        if family == FAMILIES[0]:
            # a released expert reads back as its blocks' values
            name = "model.layers.0.mlp.experts.down_proj"
            served = torch.tensor(engine.get_weights_by_name(name, truncate_size=2))
            assert torch.equal(served, reference.get_parameter(name).detach()[:2])
            ok, message = engine.update_weights_from_disk(str(tmp_path))
            assert ok, message
            assert engine.get_server_info()["weights"] == info["weights"]
            again = [o["output_ids"] for o in engine.generate(prompt=prompts, sampling_params=GREEDY)]
            assert again == outputs
    assert info["arithmetic"]["large_batch_weights"] == "blocks"
    by_format = info["weights"]["by_format"]
    assert "Q8_0 blocks" in by_format and info["weights"]["bytes"] == sum(by_format.values())
    expert_params = sum(p.numel() for n, p in hf_model.named_parameters() if ".experts." in n)
    assert by_format["Q8_0 blocks"] > expert_params * 34 / 32  # the experts' blocks are counted
    assert by_format.get("float32", 0) < expert_params * 4 / hf_model.config.num_hidden_layers  # no float experts
    for prompt, ours, theirs in zip(prompts, outputs, expected):
        assert_same_or_near_tie(reference, tokenizer, prompt, ours, theirs, BF16_MARGIN)


def test_experts_keep_no_int8_copy_where_the_plan_picks_the_int8_gemm(tmp_path):
    """Where the startup measurement picks the int8 GEMM for large batches, the dense linears get their int8 copies
    beside the blocks but the experts multiply their own blocks (the plan's float GEMM over them): an int8 copy of
    every expert would double most of such a model's bytes."""
    from sglang.srt.layers.int8_linear import Int8LinearMethod

    hf_model = save_bf16_moe("qwen3_moe", tmp_path)
    plan = choose_arithmetic("cpu", cpu_flags=BF16_VNNI_FLAGS, measurements={"float32": 2.0, "bfloat16": 1.0,
                                                                              "int8": 3.0}, **BLOCKS_PLAN)
    assert plan.large_batch_gemm == "int8" and plan.block_gemm == "float32"
    ours: Any = load_for_plan(str(tmp_path), torch.float32, torch.device("cpu"), None, MAX_ROWS, plan)
    attach_fast_paths(ours, None, hf_model.config, MAX_ROWS, plan)
    experts = expert_linear_methods(ours)
    assert experts and {type(m.large) for m in experts} == {BlockGEMMLinearMethod}
    linears = [m for m in ours.modules() if isinstance(m, Linear)]
    assert {type(m.linear_method.large) for m in linears} == {Int8LinearMethod}
    copies = weight_bytes_by_format(ours)["int8 GEMM copies"]
    assert copies == sum(m.linear_method.large.nbytes for m in linears) + \
        ours.logits_processor.head_method.large.nbytes


def test_the_plan_counts_every_expert_in_the_model_size():
    """The size that decides whether blocks serve every batch (`linear_float_bytes`, float32 bytes of the linears)
    counts every expert: Mixtral-8x7B's and Qwen1.5-MoE's published shapes are their parameter counts, not those
    of one expert's dense model."""
    from transformers import MixtralConfig, Qwen2MoeConfig

    from sglang.srt.model_loader.gemm_measurement import linear_float_bytes

    mixtral = MixtralConfig()  # 32 layers, hidden 4096, 8 experts of 14336: ~46.7B parameters
    assert 46e9 < linear_float_bytes(mixtral) / 4 < 47e9
    qwen = Qwen2MoeConfig()  # 60 experts of 1408 and a shared expert of 5632 per layer: ~14.3B parameters
    assert 13.9e9 < linear_float_bytes(qwen) / 4 < 14.4e9
    dense = linear_float_bytes(MixtralConfig(num_local_experts=1)) / 4
    assert dense < linear_float_bytes(mixtral) / 4 / 6
