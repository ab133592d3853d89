"""Tiny random Qwen2-MoE / Mixtral / Qwen3-MoE checkpoints: our paged-KV forward against transformers' logits,
the routing decisions the expert-distribution hook receives, the batched expert dispatch against a per-token
reference, both checkpoint layouts, and how the model runner treats an MoE model."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from sglang.srt.eplb.expert_distribution import get_global_expert_distribution_recorder
from sglang.srt.layers.arithmetic import ArithmeticPlan
from sglang.srt.layers.linear import Linear
from sglang.srt.layers.moe.fused_moe import fused_experts
from sglang.srt.layers.moe.moe_block import SparseMoeBlock
from sglang.srt.layers.moe.topk import TopKConfig, select_experts
from sglang.srt.mem_cache.kv_pool import KVPool
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.model_loader.gguf_quant import attach_gguf_quant_weights
from sglang.srt.model_loader.loader import load_model
from sglang.srt.models.registry import architectures_of, get_model_class
from tests.test_models import (
    BF16_TOL,
    FLOAT32_TOL,
    VOCAB,
    PagedCache,
    build_models,
    check_prefill_then_greedy_decode,
    max_diff,
    prompt_of,
    reference_logits,
)

NUM_EXPERTS = 8


def tiny_moe_config(family: str, vocab_size: int = VOCAB, **overrides: Any):
    """A 4-layer MoE config. qwen2_moe-step2 has experts in layers 1 and 3 only (decoder_sparse_step=2);
    qwen2_moe-mlp-only has a dense layer 1 among sparse ones (mlp_only_layers); both have the shared expert."""
    from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

    common: dict[str, Any] = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2, rms_norm_eps=1e-6,
        num_experts_per_tok=2, tie_word_embeddings=False,
    )
    if family == "mixtral":
        config = MixtralConfig(num_local_experts=NUM_EXPERTS, **{**common, **overrides})
    elif family == "qwen3_moe":
        config = Qwen3MoeConfig(num_experts=NUM_EXPERTS, moe_intermediate_size=32, head_dim=32, norm_topk_prob=True,
                                **{**common, **overrides})
    else:
        sparsity = {"qwen2_moe-step2": dict(decoder_sparse_step=2), "qwen2_moe-mlp-only": dict(mlp_only_layers=[1])}
        config = Qwen2MoeConfig(num_experts=NUM_EXPERTS, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                                **{**common, **sparsity[family], **overrides})
    return config


FAMILIES = ["qwen2_moe-step2", "qwen2_moe-mlp-only", "mixtral", "qwen3_moe"]


def sparse_layer_ids(model) -> list[int]:
    return [i for i, layer in enumerate(model.model.layers) if isinstance(layer.mlp, SparseMoeBlock)]


# ---- logits against transformers ----------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_and_paged_greedy_decode_match_transformers(tmp_path, family):
    config = tiny_moe_config(family)
    reference, ours = build_models(tmp_path, config)
    expected_sparse = {"qwen2_moe-step2": [1, 3], "qwen2_moe-mlp-only": [0, 2, 3]}.get(family, [0, 1, 2, 3])
    assert sparse_layer_ids(ours) == expected_sparse
    has_shared = family.startswith("qwen2_moe")
    assert all((ours.model.layers[i].mlp.shared_expert is not None) == has_shared for i in expected_sparse)
    check_prefill_then_greedy_decode(reference, ours, config, torch.float32, FLOAT32_TOL, prompt_of(13, 1), steps=3)


def test_batched_extend_and_decode_route_tokens_of_several_sequences_together(tmp_path):
    config = tiny_moe_config("qwen2_moe-mlp-only")
    reference, ours = build_models(tmp_path, config)
    cache = PagedCache(config, torch.float32)
    prompts = {0: prompt_of(9, 2), 1: prompt_of(17, 3), 2: prompt_of(1, 4)}
    logits = cache.forward(ours, list(prompts.items()), all_logits=True)
    expected = torch.cat([reference_logits(reference, p) for p in prompts.values()])
    assert max_diff(logits, expected) < FLOAT32_TOL
    for step in range(3):
        rows = [2, 0, 1]
        for row in rows:
            prompts[row].append((row * 37 + step * 11) % VOCAB)
        step_logits = cache.forward(ours, [(row, [prompts[row][-1]]) for row in rows])
        for i, row in enumerate(rows):
            assert max_diff(step_logits[i], reference_logits(reference, prompts[row])[-1]) < FLOAT32_TOL


@pytest.mark.parametrize("family", ["qwen2_moe-step2", "mixtral", "qwen3_moe"])
def test_bfloat16_matches_transformers(tmp_path, family):
    # Two layers: bf16 rounding differences of the attention kernels grow with depth (see tests/test_models.py).
    config = tiny_moe_config(family, num_hidden_layers=2)
    reference, ours = build_models(tmp_path, config, dtype=torch.bfloat16)
    block = ours.model.layers[1].mlp
    assert isinstance(block, SparseMoeBlock)
    assert block.experts.gate_up_proj.dtype == block.gate.weight.dtype == torch.bfloat16
    check_prefill_then_greedy_decode(reference, ours, config, torch.bfloat16, BF16_TOL, prompt_of(12, 10), steps=3)


@pytest.mark.parametrize("family", ["qwen2_moe-step2", "mixtral", "qwen3_moe"])
def test_bfloat16_expert_blocks_equal_transformers_eager_experts_bit_for_bit(tmp_path, family):
    """Same routing weights dtype, same expert order, same rounding: the block output is identical."""
    config = tiny_moe_config(family)
    reference, ours = build_models(tmp_path, config, dtype=torch.bfloat16)
    reference.set_experts_implementation("eager")  # the per-expert loop; grouped_mm rounds differently
    io: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for i in sparse_layer_ids(ours):
        reference.model.layers[i].mlp.register_forward_hook(
            lambda mod, args, out, i=i: io.__setitem__(i, (args[0][0], out[0])))
    reference_logits(reference, prompt_of(19, 14))
    assert sorted(io) == sparse_layer_ids(ours)
    with torch.inference_mode():
        for i, (x, expected) in io.items():
            assert torch.equal(ours.model.layers[i].mlp(x), expected), f"layer {i}"


# ---- the expert-distribution hook ----------------------------------------------------------------------------
@pytest.fixture
def recorded():
    """(layer_id, topk_ids) of every on_select_experts call while the fixture is active."""
    calls: list[tuple[int, torch.Tensor]] = []
    recorder = get_global_expert_distribution_recorder()
    recorder.attach(lambda layer_id, ids: calls.append((layer_id, ids.clone())))
    recorder.recording = True
    yield calls
    recorder.recording = False
    recorder.attach(None)


@pytest.mark.parametrize("family", ["qwen2_moe-step2", "mixtral", "qwen3_moe"])
def test_hook_receives_the_experts_transformers_routes_to(tmp_path, family, recorded):
    config = tiny_moe_config(family)
    reference, ours = build_models(tmp_path, config)
    hf_choices: dict[int, torch.Tensor] = {}
    for i, layer in enumerate(reference.model.layers):
        router = getattr(layer.mlp, "gate", None)
        if router is not None:  # transformers' routers return (logits, weights, top-k indices)
            router.register_forward_hook(lambda mod, args, out, i=i: hf_choices.__setitem__(i, out[2].clone()))
    prompt = prompt_of(21, 5)
    reference_logits(reference, prompt)
    PagedCache(config, torch.float32).forward(ours, [(0, prompt)])

    assert [layer_id for layer_id, _ in recorded] == sorted(hf_choices) == sparse_layer_ids(ours)
    for layer_id, ids in recorded:
        assert ids.shape == (len(prompt), config.num_experts_per_tok)
        assert not ids.is_floating_point()
        assert torch.equal(ids, hf_choices[layer_id]), f"layer {layer_id}"
    # Routing is not degenerate: the prompt's tokens spread over several experts.
    assert len(torch.unique(torch.cat([ids for _, ids in recorded]))) > config.num_experts_per_tok


def test_hook_is_silent_unless_recording(tmp_path, recorded):
    config = tiny_moe_config("qwen3_moe")
    _, ours = build_models(tmp_path, config)
    get_global_expert_distribution_recorder().recording = False
    PagedCache(config, torch.float32).forward(ours, [(0, prompt_of(5, 6))])
    assert recorded == []


# ---- dispatch against a per-token reference ------------------------------------------------------------------
def naive_experts(x, gate_up, down, weights, ids):
    """One token and one chosen expert at a time, accumulated in float32."""
    inter = down.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            h = gate_up[e].float() @ x[t].float()
            out[t] += float(weights[t, k]) * (down[e].float() @ (torch.nn.functional.silu(h[:inter]) * h[inter:]))
    return out


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 0.05)])
@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_dispatch_matches_per_token_reference(dtype, tol, top_k):
    gen = torch.Generator().manual_seed(top_k)
    tokens, hidden, inter, experts = 37, 24, 16, 6
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.3).to(dtype)
    down = (torch.randn(experts, hidden, inter, generator=gen) * 0.3).to(dtype)
    logits = torch.randn(tokens, experts, generator=gen)
    logits[:, 4] -= 100  # expert 4 is never chosen: it must be skipped, not crash an empty group
    topk = select_experts(logits.to(dtype), TopKConfig(experts, top_k, renormalize=True, float32_weights=False))
    assert not (topk.ids == 4).any()
    out = fused_experts(x, gate_up, down, topk.weights, topk.ids)
    expected = naive_experts(x, gate_up, down, topk.weights, topk.ids)
    assert out.dtype == dtype and out.shape == x.shape
    scale = expected.abs().max().item()
    assert max_diff(out, expected) < tol * max(scale, 1.0), max_diff(out, expected)
    empty = fused_experts(x[:0], gate_up, down, topk.weights[:0], topk.ids[:0])
    assert empty.shape == (0, hidden)


def test_topk_renormalization_and_weight_dtype():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]], dtype=torch.bfloat16)
    probs = torch.softmax(logits.float(), -1)
    plain = select_experts(logits, TopKConfig(4, 2, renormalize=False, float32_weights=False))
    assert plain.ids.tolist() == [[0, 1]] and plain.weights.dtype == torch.bfloat16
    assert torch.allclose(plain.weights.float(), probs[:, :2].to(torch.bfloat16).float())
    renorm = select_experts(logits, TopKConfig(4, 2, renormalize=True, float32_weights=True))
    assert renorm.weights.dtype == torch.float32
    assert torch.allclose(renorm.weights.sum(-1), torch.ones(1))
    with pytest.raises(ValueError, match="num_experts_per_tok=5"):
        TopKConfig(4, 5, renormalize=True, float32_weights=True)


# ---- checkpoint layouts ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["qwen2_moe-step2", "mixtral"])
def test_fused_transformers_layout_loads_and_missing_or_unexpected_experts_raise(tmp_path, family):
    config = tiny_moe_config(family)
    reference, _ = build_models(tmp_path, config)
    hub = load_file(str(tmp_path / "model.safetensors"))
    block = "block_sparse_moe" if family == "mixtral" else "mlp"
    gate_name = "w1" if family == "mixtral" else "gate_proj"
    assert f"model.layers.1.{block}.experts.7.{gate_name}.weight" in hub  # what save_pretrained writes

    # transformers' in-memory layout: experts stacked per layer ([E, 2I, H] gate_up, [E, H, I] down)
    fused = {k: v.detach().clone() for k, v in reference.state_dict().items()}
    assert "model.layers.1.mlp.experts.gate_up_proj" in fused
    save_file(fused, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    ours = load_model(str(tmp_path), torch.float32, "cpu")
    prompt = prompt_of(8, 12)
    logits = PagedCache(config, torch.float32).forward(ours, [(0, prompt)])
    assert max_diff(logits[0], reference_logits(reference, prompt)[-1]) < FLOAT32_TOL

    missing = dict(hub)
    del missing[f"model.layers.1.{block}.experts.3.{gate_name}.weight"]
    save_file(missing, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    hub_expert = rf"model\.layers\.1\.{block}\.experts"  # reported under the checkpoint's own names
    with pytest.raises(ValueError, match=rf"missing 1 weight\(s\): {hub_expert}\.3\.{gate_name}\.weight$"):
        load_model(str(tmp_path), torch.float32, "cpu")

    no_router = {k: v for k, v in hub.items() if k != f"model.layers.1.{block}.gate.weight"}
    save_file(no_router, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing 1 weight\(s\): model\.layers\.1\.mlp\.gate\.weight$"):
        load_model(str(tmp_path), torch.float32, "cpu")

    extra = dict(hub)
    extra[f"model.layers.1.{block}.experts.{NUM_EXPERTS}.{gate_name}.weight"] = hub[
        f"model.layers.1.{block}.experts.0.{gate_name}.weight"].clone()
    save_file(extra, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"does not use: {hub_expert}\.{NUM_EXPERTS}\.{gate_name}\.weight$"):
        load_model(str(tmp_path), torch.float32, "cpu")

    wrong = dict(hub)
    wrong[f"model.layers.1.{block}.experts.2.{gate_name}.weight"] = torch.zeros(3, 64)
    save_file(wrong, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"experts\.2\..*has shape \(3, 64\)"):
        load_model(str(tmp_path), torch.float32, "cpu")


def test_registry_and_model_type_fallback():
    for family, name in [("qwen2_moe-step2", "Qwen2MoeForCausalLM"), ("mixtral", "MixtralForCausalLM"),
                         ("qwen3_moe", "Qwen3MoeForCausalLM")]:
        config = tiny_moe_config(family)
        assert not getattr(config, "architectures", None)  # only model_type says what it is
        assert get_model_class(architectures_of(config)).__name__ == name
    with pytest.raises(ValueError, match="Sliding-window"):
        get_model_class(["MixtralForCausalLM"])(tiny_moe_config("mixtral", sliding_window=64), device="meta")


# ---- the model runner ----------------------------------------------------------------------------------------
def test_model_runner_excludes_fused_decode_and_keeps_router_and_experts_dense(tmp_path, caplog):
    config = tiny_moe_config("qwen2_moe-mlp-only")
    reference, _ = build_models(tmp_path, config)
    plan = ArithmeticPlan("cpu", "avx2", torch.float32, "bfloat16", "test")
    runner = ModelRunner(str(tmp_path), config, torch.float32, "cpu", gguf_kernel_max_rows=8, arithmetic=plan)
    spec = runner.kv_cache_spec()
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim) == (4, 2, 16)
    with caplog.at_level("INFO", logger="sglang.srt.model_executor.model_runner"):
        runner.bind_kv_pool(KVPool(64, spec.num_layers, spec.num_kv_heads, spec.head_dim, torch.float32))
    assert runner.decode_plan is not None and runner.decode_plan.fused is None
    assert "mixture-of-experts" in runner.decode_plan.description
    assert "3 x 8 stacked experts, dense float32" in runner.decode_plan.description
    assert any(r.getMessage().startswith("Decode path: every batch layer by layer") for r in caplog.records)
    # The attention and dense linears took the large-batch bf16 GEMM; routers and experts are not Linear layers
    # and so keep float32 weights and dense math.
    model: Any = runner.model
    block = model.model.layers[0].mlp
    assert isinstance(model.model.layers[0].self_attn.qkv_proj, Linear)
    assert not isinstance(block.gate, Linear) and not isinstance(block.shared_expert_gate, Linear)
    assert block.experts.gate_up_proj.dtype == torch.float32
    # GGUF blocks are for dense Llama-family layers: an MoE model is skipped before any file is read.
    assert attach_gguf_quant_weights(model, str(tmp_path / "absent.gguf"), config) == 0
    prompt = prompt_of(6, 13)
    with torch.inference_mode():
        expected = torch.softmax(reference.model.layers[0].mlp.gate.weight @ torch.ones(64), -1)
        ours = torch.softmax(block.gate(torch.ones(64)), -1)
    assert torch.equal(ours, expected)
    assert PagedCache(config, torch.float32).forward(model, [(0, prompt)]).shape == (1, VOCAB)
