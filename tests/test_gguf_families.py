"""GGUF files of Gemma 2, Gemma 3, Mistral, Phi-3, Qwen2-MoE, Qwen3-MoE, GPT-OSS, OLMo 2, Granite, SmolLM3 and
DeepSeek-V2 / V3, written as llama.cpp's converter writes each architecture (tests/gguf_writer.py: Q8_0 weights,
GPT-OSS's experts MXFP4), give the model of their HF checkpoint.

Each tiny random checkpoint has its family's distinctive features on: attention and final soft-capping and windows
shorter than the prompts (Gemma 2), QK-norms, a sliding-layer RoPE base of its own, linear scaling of the global
layers and a final soft-cap (Gemma 3, one global layer in six as llama.cpp lays them out), random norms and
biases, several experts with top-2 routing (the MoE families), a gated shared expert (Qwen2-MoE), sinks, biased
experts, alternating windows and YaRN past its original length (GPT-OSS), QK-norms over all heads and post-norms
(OLMo 2), embedding / residual / attention / logit multipliers other than 1 (Granite), a NoPE layer (SmolLM3), and
multi-head latent attention with a rope part, a leading dense layer, shared experts and grouped routing (DeepSeek-V2:
its queries through `q_lora_rank`, YaRN and routed scaling, and, as V2-Lite has them, straight from `q_proj`;
DeepSeek-V3's layout: the experts' correction bias).

The file converted by the loader gives the config of the checkpoint (what llama.cpp reads from the same file), the
tensors the file holds, prefill logits within float32 tolerance of transformers' on the file's values, and greedy
tokens equal to transformers' `generate` on prompts several windows long. Under the blocks plan the dense
families' linear layers and LM head, and the Qwen MoE families' experts too, run the file's own Q8_0 blocks; GPT-OSS
runs float32 weights (the file's MXFP4 experts dequantized); DeepSeek, whose attention has no fused QKV, runs Q8_0
blocks made at load from the file's values (which are those values again) for its linears and experts.

Mistral files carry no sliding window (llama.cpp writes them as arch `llama` and attends to every position), so the
converted model is a Llama and matches transformers' Mistral with the window off.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

gguf = pytest.importorskip("gguf")

from sglang.srt.layers.arithmetic import choose_arithmetic  # noqa: E402
from sglang.srt.layers.linear import Linear  # noqa: E402
from sglang.srt.layers.quantization.gguf_blocks import kernels_available  # noqa: E402
from sglang.srt.layers.quantization.gguf_linear import GGUFLinearMethod  # noqa: E402
from tests.gguf_writer import VOCAB_SIZES, checkpoint_tensors, write_gguf  # noqa: E402
from tests.test_cpu_arithmetic import BF16_VNNI_FLAGS  # noqa: E402
from tests.test_models import FLOAT32_TOL, PagedCache, assert_logits_close, reference_logits  # noqa: E402

pytestmark = pytest.mark.skipif(not kernels_available(), reason="the compiled GGUF kernels are unavailable")

FAMILIES = ["gemma2", "gemma3", "mistral", "phi3", "qwen2_moe", "qwen3_moe", "gpt_oss", "olmo2", "granite",
            "smollm3", "deepseek_v2", "deepseek_v2_lite", "deepseek_v3"]
DENSE = {"gemma2", "gemma3", "mistral", "phi3", "olmo2", "granite", "smollm3"}
FLOAT_SERVED = {"gpt_oss"}
# Q8_0 blocks made at load, not the file's (gguf_quant attaches the file's to fused QKV layers; MLA has none)
MADE_AT_LOAD = {"deepseek_v2", "deepseek_v2_lite", "deepseek_v3"}
PROMPTS = ["Once upon a time, in a small village near the mountains,", "def fibonacci(n): return n"]
MAX_NEW = 12
MAX_ROWS = 8  # batches of up to this many rows run the block kernels, larger ones the GEMM over the blocks


def tiny_config(family: str):
    from transformers import (
        Gemma2Config,
        Gemma3TextConfig,
        GptOssConfig,
        GraniteConfig,
        MistralConfig,
        Olmo2Config,
        Phi3Config,
        Qwen2MoeConfig,
        Qwen3MoeConfig,
        SmolLM3Config,
    )

    vocab = VOCAB_SIZES["gemma" if family.startswith("gemma") else "other"]
    common: dict[str, Any] = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                  num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2,
                                  rms_norm_eps=1e-6)
    # Gemma's query scale is head_dim ** -0.5 in llama.cpp (no key for it in the file), as in the published models
    gemma = dict(common, head_dim=16, query_pre_attn_scalar=16, sliding_window=6)
    moe = dict(common, intermediate_size=96, num_hidden_layers=3, num_experts=8, num_experts_per_tok=2,
               moe_intermediate_size=32, tie_word_embeddings=False)
    if family == "gemma2":
        return Gemma2Config(**gemma, num_hidden_layers=4, attn_logit_softcapping=4.0, final_logit_softcapping=5.0,
                            attn_implementation="eager")
    if family == "gemma3":
        return Gemma3TextConfig(**gemma, num_hidden_layers=6, final_logit_softcapping=5.0,
                                rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
                                                 "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                    "rope_theta": 1000.0}})
    if family == "mistral":
        return MistralConfig(**common, num_hidden_layers=2, sliding_window=5, tie_word_embeddings=False)
    if family == "phi3":
        # partial rotary (8 of 16 channels), LongRoPE with both prompts past the original length, a window; the
        # factors exact in float32, as the file stores them
        return Phi3Config(**common, num_hidden_layers=2, tie_word_embeddings=False, partial_rotary_factor=0.5,
                          sliding_window=7, original_max_position_embeddings=16, pad_token_id=None,
                          rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                           "short_factor": [1.0, 1.25, 1.875, 2.5],
                                           "long_factor": [1.75, 3.125, 5.25, 11.0]})
    if family == "olmo2":
        return Olmo2Config(**common, num_hidden_layers=2, tie_word_embeddings=False, pad_token_id=None)
    if family == "granite":
        # multipliers other than 1, binary fractions that the file's float32 keys hold exactly
        return GraniteConfig(**common, num_hidden_layers=2, tie_word_embeddings=True, embedding_multiplier=2.5,
                             residual_multiplier=0.375, attention_multiplier=0.1875, logits_scaling=1.25)
    if family == "smollm3":  # layer 3 of 4 without rotary embedding (llama.cpp's fixed interval of 4)
        return SmolLM3Config(**common, num_hidden_layers=4, tie_word_embeddings=True, pad_token_id=None)
    if family.startswith("deepseek"):
        return deepseek_config(family, common)
    if family == "qwen2_moe":
        return Qwen2MoeConfig(**moe, shared_expert_intermediate_size=64)
    if family == "qwen3_moe":
        return Qwen3MoeConfig(**moe, head_dim=32, norm_topk_prob=True)
    # alternating sliding (window 8) and full layers, YaRN past a short original length; llama.cpp fixes the SwiGLU
    # limit at the config class's 7 (no key for it)
    return GptOssConfig(**dict(common, intermediate_size=64, num_hidden_layers=4, head_dim=16, sliding_window=8,
                               num_local_experts=6, num_experts_per_tok=2, max_position_embeddings=128,
                               tie_word_embeddings=False, pad_token_id=None,
                               rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0,
                                                "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                                "original_max_position_embeddings": 16}))


def deepseek_config(family: str, common: dict[str, Any]):
    """DeepSeek's: MLA (a rope part of 16 channels, widths that Q8_0 rows of 32 divide), one leading dense layer,
    8 routed experts in 4 groups (top-3, so that a token's experts often span more groups than the 2 allowed) and
    2 shared ones. V2: queries through q_lora_rank, `group_limited_greedy`, routed scaling, YaRN past a short
    original length; V2-Lite: queries straight from q_proj, one group, plain RoPE; V3: its correction bias
    (`noaux_tc`), renormalized weights, routed scaling."""
    from transformers import DeepseekV2Config, DeepseekV3Config

    options = dict(common, num_key_value_heads=4, num_hidden_layers=3, first_k_dense_replace=1, kv_lora_rank=32,
                   qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32, n_routed_experts=8, n_shared_experts=2,
                   num_experts_per_tok=3, moe_intermediate_size=32, tie_word_embeddings=False, q_lora_rank=32,
                   n_group=4, topk_group=2, routed_scaling_factor=2.5)
    if family == "deepseek_v3":
        return DeepseekV3Config(**options, norm_topk_prob=True)
    if family == "deepseek_v2_lite":
        return DeepseekV2Config(**dict(options, q_lora_rank=None, n_group=1, topk_group=1,
                                       routed_scaling_factor=1.0), topk_method="greedy")
    return DeepseekV2Config(**dict(options, max_position_embeddings=128), topk_method="group_limited_greedy",
                            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0,
                                             "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.707,
                                             "mscale_all_dim": 0.707, "original_max_position_embeddings": 16})


def random_checkpoint(family: str):
    """A transformers model of `family` with random weights, norms (Gemma's about 0, the others' about 1), biases
    (attention, GPT-OSS's router and experts, DeepSeek-V3's expert correction) and sinks."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(6)
    model = AutoModelForCausalLM.from_config(tiny_config(family)).eval()
    with torch.no_grad():
        for name, param in checkpoint_tensors(model):
            if name.endswith("norm.weight"):
                param.copy_(torch.randn_like(param) * 0.2 + (0.0 if family.startswith("gemma") else 1.0))
            elif name.endswith((".bias", "_bias")):
                param.normal_(0, 0.5)
            elif name.endswith(".sinks"):
                param.normal_(0, 1.5)
        if model.config.tie_word_embeddings:  # smaller, so that the tied head does not just repeat the last token
            model.model.embed_tokens.weight.mul_(0.3)
    return model


def blocks_plan():
    """float32 arithmetic over the blocks for every batch (no float weights kept)."""
    return choose_arithmetic("cpu", cpu_gemm="float32", cpu_flags=BF16_VNNI_FLAGS, gguf_activations="float32",
                             small_batch_quantization="q8_0", large_batch_weights="blocks", gguf_checkpoint=True)


def generate_paged(ours, config, prompts: list[list[int]]) -> tuple[list[list[int]], torch.Tensor]:
    """Greedy tokens of every prompt, prefilled in one batch and decoded together through the paged KV cache;
    and the prefill logits of the first prompt. DeepSeek's cache holds the latent (mem_cache/mla_kv_pool.py)."""
    from tests.test_models_deepseek_v2 import latent_cache

    cache = latent_cache(config) if hasattr(config, "kv_lora_rank") else PagedCache(config, torch.float32)
    logits = cache.forward(ours, list(enumerate(prompts)), all_logits=True)
    first = logits[: len(prompts[0])]
    ends = torch.tensor([len(p) for p in prompts]).cumsum(0) - 1
    tokens = [[int(t)] for t in logits[ends].argmax(-1)]
    for _ in range(MAX_NEW - 1):
        logits = cache.forward(ours, [(row, out[-1:]) for row, out in enumerate(tokens)])
        for out, row_logits in zip(tokens, logits):
            out.append(int(row_logits.argmax()))
    return tokens, first


def hf_generate(reference, ids: list[int]) -> list[int]:
    with torch.no_grad():
        out = reference.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
    continuation = out[0, len(ids):].tolist()
    assert len(set(continuation)) > 2  # not a degenerate repetition
    return continuation


def assert_served_from_blocks(ours, reference, family: str) -> None:
    """Every linear layer, expert and the LM head run the file's own Q8_0 blocks with their float weights released.
    GPT-OSS runs on float32 weights (no blocks for it: models/gpt_oss.py), its experts the file's MXFP4 values."""
    from sglang.srt.layers.moe.fused_moe import FusedMoE

    linears = [m for m in ours.modules() if isinstance(m, Linear)]
    if family in FLOAT_SERVED:
        assert linears and not any(isinstance(m.linear_method, GGUFLinearMethod) for m in linears)
        assert all(m.weight.dtype == torch.float32 for m in linears)
        return
    assert linears and all(isinstance(m.linear_method, GGUFLinearMethod) for m in linears)
    assert {m.linear_method.quant_weight.qtype for m in linears} == {"Q8_0"}
    assert all(m.weight.device.type == "meta" for m in linears)
    head = ours.logits_processor.head_method
    assert isinstance(head, GGUFLinearMethod) and head.quant_weight.qtype == "Q8_0"
    experts = [(i, layer.mlp.experts) for i, layer in enumerate(ours.model.layers)
               if isinstance(getattr(layer.mlp, "experts", None), FusedMoE)]  # DeepSeek's first layer is dense
    assert bool(experts) == (family not in DENSE)
    for layer, fused in experts:
        assert fused.expert_blocks is not None
        theirs = reference.model.layers[layer].mlp.experts
        for name in ("gate_up_proj", "down_proj"):
            assert torch.equal(fused.served_values(getattr(fused, name)), getattr(theirs, name)), (layer, name)


@pytest.mark.parametrize("family", FAMILIES)
def test_gguf_file_gives_the_checkpoint_model(tmp_path, cache_dir, family, caplog):
    """The converted file's config and tensors, what serves its layers under the blocks plan, prefill logits and
    greedy tokens of two prompts batched through the paged KV cache, against transformers on the file's values."""
    import json
    import logging
    from pathlib import Path

    from transformers import AutoConfig, AutoTokenizer

    from sglang.srt.model_executor.model_runner import attach_fast_paths, load_for_plan
    from sglang.srt.model_loader.resolve import resolve_model_path
    from sglang.srt.model_loader.weights import iterate_weights

    reference = random_checkpoint(family)
    gguf_path = tmp_path / f"tiny-{family}.gguf"
    types = write_gguf(reference, gguf_path, f"tiny-{family}")  # the reference now holds the file's values
    first = {"phi3": "attn_qkv", "deepseek_v2": "attn_q_a", "deepseek_v2_lite": "attn_q",
             "deepseek_v3": "attn_q_a"}.get(family, "attn_q")
    assert types[f"blk.0.{first}.weight"] == "Q8_0"
    assert types["output_norm.weight"] == "F32"
    assert types.get("blk.0.ffn_gate_exps.weight") == {"gpt_oss": "MXFP4", "qwen2_moe": "Q8_0",
                                                       "qwen3_moe": "Q8_0"}.get(family)
    model_dir = resolve_model_path(str(gguf_path))

    # the converted checkpoint: the config llama.cpp reads from the file, the values the file holds
    converted = json.loads((Path(model_dir) / "config.json").read_text())
    expected = reference.config.to_dict()
    if family == "mistral":
        assert converted["architectures"] == ["LlamaForCausalLM"] and converted.get("sliding_window") is None
        reference = without_sliding_window(reference)
    else:
        assert converted["architectures"] == [type(reference).__name__]
        for key in ("attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar", "sliding_window",
                    "layer_types", "rope_parameters", "moe_intermediate_size", "shared_expert_intermediate_size",
                    "num_experts", "num_local_experts", "num_experts_per_tok", "norm_topk_prob", "head_dim",
                    "intermediate_size", "tie_word_embeddings", "partial_rotary_factor",
                    "original_max_position_embeddings", "embedding_multiplier", "residual_multiplier",
                    "attention_multiplier", "logits_scaling", "no_rope_layers", "no_rope_layer_interval",
                    "q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
                    "n_routed_experts", "n_shared_experts", "first_k_dense_replace", "routed_scaling_factor",
                    "n_group", "topk_group", "topk_method", "attention_bias", "rope_interleave"):
            assert converted.get(key) == expected.get(key), key
    weights = dict(iterate_weights(model_dir))
    state = {k: v for k, v in reference.state_dict().items() if not (k == "lm_head.weight" and
                                                                      reference.config.tie_word_embeddings)}
    assert set(weights) == set(state)
    for name, value in state.items():
        assert torch.equal(weights[name], value), name

    config = AutoConfig.from_pretrained(model_dir)  # as served
    plan = blocks_plan()
    with caplog.at_level(logging.INFO, logger="sglang.srt.model_executor.model_runner"):
        ours = load_for_plan(model_dir, torch.float32, torch.device("cpu"), str(gguf_path), MAX_ROWS, plan)
    # the weights the file's blocks serve are never loaded as floats
    read = {"linear layers": family not in FLOAT_SERVED | MADE_AT_LOAD, "experts": family not in FLOAT_SERVED | DENSE}
    alone = [r.getMessage() for r in caplog.records if "never loaded as floats" in r.getMessage()
             and r.name == "sglang.srt.model_executor.model_runner"]
    assert {what for what, expected in read.items() if expected} == {w for w in read if any(w in m for m in alone)}
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="sglang.srt.model_loader.gguf_quant"):
        attached = attach_fast_paths(ours, str(gguf_path), config, MAX_ROWS, plan)
    assert (attached > 0) == (family not in FLOAT_SERVED)
    from_file = any("Attached" in r.getMessage() and "GGUF blocks" in r.getMessage() for r in caplog.records
                    if r.name == "sglang.srt.model_loader.gguf_quant")  # the linear layers' (not the experts')
    assert from_file == (family not in FLOAT_SERVED | MADE_AT_LOAD), [r.getMessage() for r in caplog.records]
    assert_served_from_blocks(ours, reference, family)

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    assert min(len(p) for p in prompts) > 3 * (getattr(reference.config, "sliding_window", None) or 6)
    tokens, prefill = generate_paged(ours, config, prompts)
    assert_logits_close(prefill, reference_logits(reference, prompts[0]), FLOAT32_TOL, "prefill")
    assert tokens == [hf_generate(reference, ids) for ids in prompts]


def without_sliding_window(model):
    """The same transformers model with its config's sliding window off."""
    config = copy.deepcopy(model.config)
    config.sliding_window = None
    other = type(model)(config).eval()
    other.load_state_dict(model.state_dict())
    return other


@pytest.mark.parametrize("family", ["gemma3", "qwen2_moe"])
def test_engine_serves_the_file_from_its_blocks(tmp_path, cache_dir, family):
    """Through `sglang.Engine` on the .gguf path (the tokenizer, scheduler and paged cache of a server): greedy
    tokens equal transformers' `generate` on the file's values, and the weights report counts Q8_0 blocks for every
    linear layer, expert, the LM head and the embeddings (read from the file's blocks of them, or from the head's
    where the two are tied: layers/quantization/block_embedding.py), float32 for the norms, biases and routers
    alone."""
    reference, by_format = engine_greedy_on_the_file(tmp_path, family)
    by_format.pop("int8 GEMM copies", None)
    tied = reference.get_output_embeddings().weight is reference.get_input_embeddings().weight
    assert tied == (family == "gemma3")
    state = {k: v for k, v in reference.state_dict().items() if not (tied and k.endswith("embed_tokens.weight"))}
    floats = [k for k, v in state.items()
              if v.dim() == 1 or (k.endswith(FLOAT_KEPT) and not k.endswith("embed_tokens.weight"))]
    assert by_format == {"float32": 4 * sum(state[k].numel() for k in floats),
                         "Q8_0 blocks": sum(q8_0_bytes(v) for k, v in state.items() if k not in floats)}


@pytest.mark.parametrize("family", ["smollm3", "deepseek_v2"])
def test_engine_greedy_equals_transformers_on_files_without_a_transformers_reader(tmp_path, cache_dir, family):
    """Families whose config is built from the file's keys (NoPE layers; latent attention with grouped routing),
    through `sglang.Engine` on the .gguf path: greedy tokens equal transformers' `generate` on the file's values,
    served from blocks (DeepSeek's experts the file's own, its latent projections made at load)."""
    _, by_format = engine_greedy_on_the_file(tmp_path, family)
    assert by_format.get("Q8_0 blocks", 0) > by_format["float32"] / 4


def engine_greedy_on_the_file(tmp_path, family: str) -> tuple[Any, dict[str, int]]:
    """A file of `family` served by `sglang.Engine` on the .gguf path under the blocks plan: its greedy tokens must
    equal transformers' `generate` on the file's values. Returns (transformers' model on those values, the weights
    report's bytes by format)."""
    from transformers import AutoTokenizer

    from sglang import Engine
    from sglang.srt.model_loader.resolve import resolve_model_path

    reference = random_checkpoint(family)
    gguf_path = tmp_path / f"tiny-{family}.gguf"
    write_gguf(reference, gguf_path, f"tiny-{family}")
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(str(gguf_path)))
    expected = [hf_generate(reference, tokenizer.encode(p)) for p in PROMPTS]
    with Engine(model_path=str(gguf_path), dtype="float32", cpu_gemm="float32", gguf_activations="float32",
                small_batch_quantization="q8_0", large_batch_weights="blocks", gguf_kernel_max_rows=MAX_ROWS,
                max_total_tokens=2048) as engine:
        outputs = engine.generate(prompt=PROMPTS, sampling_params={"temperature": 0, "max_new_tokens": MAX_NEW,
                                                                   "ignore_eos": True})
        by_format = dict(engine.get_server_info()["weights"]["by_format"])
    assert [o["output_ids"] for o in outputs] == expected
    return reference, by_format


# Parameters kept float32: the embeddings (read by row) and the routers; the norms and biases too (one dimension).
FLOAT_KEPT = ("embed_tokens.weight", "mlp.gate.weight", "shared_expert_gate.weight")


def q8_0_bytes(weight: torch.Tensor) -> int:
    """Bytes of the Q8_0 blocks of a [n, k] weight (or of each of a stack of experts) as the kernels pack them:
    34 bytes per 32 values, rows in groups of 16."""
    *stack, n, k = weight.shape
    return int(torch.tensor(stack).prod()) * -(-n // 16) * 16 * k // 32 * 34
