"""Tiny random Llama / Qwen2 / Qwen3 checkpoints: our paged-KV forward against transformers' logits.

Every checkpoint is written with save_pretrained (safetensors) and read back through load_model, so the
loader, the fused q/k/v and gate/up weight mapping, the attention backend and the model code are all on the
path. KV slots are handed out in a shuffled order, so a sequence's cache is scattered over the pool and only
the req_to_token indirection holds it together.
"""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from sglang.srt.forward_batch import ForwardBatch, ForwardMode, build_positions
from sglang.srt.layers.attention.torch_sdpa_backend import TorchSDPABackend
from sglang.srt.layers.rotary_embedding import RotaryEmbedding, get_rope, rope_parameters_from_config
from sglang.srt.mem_cache.kv_pool import KVPool
from sglang.srt.model_loader.loader import load_model
from sglang.srt.models.registry import get_model_class

FLOAT32_TOL = 1e-4
# bf16 keeps 8 mantissa bits: one rounding step of a logit of magnitude 4..8 is 0.03, and the kernels
# (fused vs separate projections, SDPA variants) round in different places, so logits of size ~7 differ
# by up to ~0.1 in max and ~0.01 on average, the same as transformers' bf16 differs from its own float32.
# A wrong weight, mask or position gives differences of whole units.
BF16_TOL = 0.25
BF16_MEAN_TOL = 0.03
VOCAB = 512
DECODE_STEPS = 10


# ---- helpers -------------------------------------------------------------------------------------------
def tiny_config(family: str, **overrides: Any):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        # Larger than the default 0.02 so logits spread over several units and a wrong mapping shows.
        initializer_range=0.2,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    if family == "qwen3":
        common["head_dim"] = 32  # explicit and != hidden / heads, as in real Qwen3 checkpoints
    common.update(overrides)
    config_class = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}[family]
    return config_class(**common)


def build_models(tmp_path, config, dtype: torch.dtype = torch.float32, seed: int = 0):
    """(transformers model, our model) sharing one random checkpoint saved to tmp_path."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    reference = AutoModelForCausalLM.from_config(config).to(dtype).eval()
    if config.model_type == "qwen2":
        with torch.no_grad():  # HF initialises biases to zero; random ones prove they are loaded and added
            for layer in reference.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    reference.save_pretrained(tmp_path)
    ours = load_model(str(tmp_path), dtype, "cpu")
    return reference, ours


def reference_logits(reference, token_ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return reference(torch.tensor([token_ids])).logits[0].float()


class PagedCache:
    """A minimal stand-in for the scheduler: owns the KV pool and the request->token table and builds batches."""

    def __init__(self, config, dtype: torch.dtype, size: int = 512, rows: int = 8, context: int = 256,
                 head_major: bool | None = None) -> None:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.pool = KVPool(size, config.num_hidden_layers, config.num_key_value_heads, head_dim, dtype,
                           head_major=head_major)
        self.req_to_token_pool = types.SimpleNamespace(req_to_token=torch.zeros(rows, context, dtype=torch.int64))
        generator = torch.Generator().manual_seed(1234)
        self.free_slots: list[int] = (torch.randperm(size, generator=generator) + 1).tolist()
        self.cached_lens: dict[int, int] = {}
        self.backend = TorchSDPABackend()
        # A decode strategy (the fused CPU step) the runner would use for the batches it accepts.
        self.decode_strategy = None

    def forward(
        self, model, batch: list[tuple[int, list[int]]], all_logits: bool = False, hidden: bool = False
    ) -> torch.Tensor:
        """Run the new tokens of each (row, tokens) entry; logits of the last (or every) token."""
        prefix_lens = [self.cached_lens.get(row, 0) for row, _ in batch]
        extend_lens = [len(tokens) for _, tokens in batch]
        table = self.req_to_token_pool.req_to_token
        out_cache_loc = []
        for (row, tokens), prefix in zip(batch, prefix_lens):
            slots = [self.free_slots.pop() for _ in tokens]
            table[row, prefix : prefix + len(tokens)] = torch.tensor(slots)
            out_cache_loc += slots
        seq_lens = [p + n for p, n in zip(prefix_lens, extend_lens)]
        is_decode = all(n == 1 for n in extend_lens)
        input_ids = torch.tensor([t for _, tokens in batch for t in tokens])
        forward_batch = ForwardBatch(
            forward_mode=ForwardMode.DECODE if is_decode else ForwardMode.EXTEND,
            batch_size=len(batch),
            input_ids=input_ids,
            positions=build_positions(prefix_lens, extend_lens, torch.device("cpu")),
            req_pool_indices=torch.tensor([row for row, _ in batch]),
            seq_lens=torch.tensor(seq_lens),
            out_cache_loc=torch.tensor(out_cache_loc),
            seq_lens_cpu=seq_lens,
            extend_prefix_lens_cpu=prefix_lens,
            extend_seq_lens_cpu=extend_lens,
            req_to_token_pool=self.req_to_token_pool,
            token_to_kv_pool=self.pool,
            attn_backend=self.backend,
            logits_indices=torch.arange(len(input_ids)) if all_logits else None,
        )
        with torch.inference_mode():
            if self.decode_strategy is not None and self.decode_strategy.accepts(forward_batch):
                out = self.decode_strategy.forward(model, forward_batch)
            elif hidden:
                self.backend.init_forward_metadata(forward_batch)
                out = model.forward_hidden(forward_batch.input_ids, forward_batch.positions, forward_batch)
            else:
                self.backend.init_forward_metadata(forward_batch)
                out = model(forward_batch.input_ids, forward_batch.positions, forward_batch)
        for (row, _), seq_len in zip(batch, seq_lens):
            self.cached_lens[row] = seq_len
        return out


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def assert_logits_close(actual: torch.Tensor, expected: torch.Tensor, tol: float, what: str) -> None:
    assert actual.shape == expected.shape, what
    assert max_diff(actual, expected) < tol, f"{what}: max abs diff {max_diff(actual, expected)}"
    if tol >= BF16_TOL:
        mean = (actual.float() - expected.float()).abs().mean().item()
        assert mean < BF16_MEAN_TOL, f"{what}: mean abs diff {mean}"


def check_prefill_then_greedy_decode(
    reference, ours, config, dtype: torch.dtype, tol: float, prompt: list[int], steps: int = DECODE_STEPS
) -> None:
    cache = PagedCache(config, dtype)
    logits = cache.forward(ours, [(0, prompt)], all_logits=True)
    assert logits.dtype == torch.float32 and logits.shape == (len(prompt), config.vocab_size)
    assert_logits_close(logits, reference_logits(reference, prompt), tol, "prefill")

    tokens = list(prompt)
    next_token = int(logits[-1].argmax())
    for step in range(steps):
        tokens.append(next_token)
        step_logits = cache.forward(ours, [(0, [next_token])])
        assert step_logits.shape == (1, config.vocab_size)
        assert_logits_close(step_logits[0], reference_logits(reference, tokens)[-1], tol, f"decode step {step}")
        next_token = int(step_logits[0].argmax())


def prompt_of(length: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


# ---- float32 equivalence -----------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_prefill_and_paged_greedy_decode_match_transformers(tmp_path, family, tied):
    config = tiny_config(family, tie_word_embeddings=tied)
    reference, ours = build_models(tmp_path, config)
    if tied:
        assert ours.lm_head.weight is ours.model.embed_tokens.weight
    else:
        assert ours.lm_head.weight.data_ptr() != ours.model.embed_tokens.weight.data_ptr()
    check_prefill_then_greedy_decode(reference, ours, config, torch.float32, FLOAT32_TOL, prompt_of(13, 1))


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_batched_extend_with_cached_prefix_and_batched_decode(tmp_path, family):
    config = tiny_config(family)
    reference, ours = build_models(tmp_path, config)
    cache = PagedCache(config, torch.float32)
    fresh_a, fresh_b = prompt_of(7, 2), prompt_of(16, 3)
    prefixed_c, prefixed_d = prompt_of(15, 4), prompt_of(9, 5)
    c_prefix, d_prefix = 6, 8

    # The prefixes are cached by earlier forwards (as a radix-cache hit or an earlier chunk would be).
    cache.forward(ours, [(2, prefixed_c[:c_prefix]), (3, prefixed_d[:d_prefix])])
    logits = cache.forward(
        ours,
        [(0, fresh_a), (1, fresh_b), (2, prefixed_c[c_prefix:]), (3, prefixed_d[d_prefix:])],
        all_logits=True,
    )
    expected = torch.cat(
        [
            reference_logits(reference, fresh_a),
            reference_logits(reference, fresh_b),
            reference_logits(reference, prefixed_c)[c_prefix:],
            reference_logits(reference, prefixed_d)[d_prefix:],  # a single new token after a prefix
        ]
    )
    assert logits.shape == expected.shape
    assert max_diff(logits, expected) < FLOAT32_TOL

    sequences = {0: list(fresh_a), 1: list(fresh_b), 2: list(prefixed_c), 3: list(prefixed_d)}
    for step in range(4):
        next_tokens = {row: (row * 31 + step * 7) % VOCAB for row in sequences}
        for row, token in next_tokens.items():
            sequences[row].append(token)
        # Rows in a shuffled order: the batch order must not have to follow the table order.
        rows = [2, 0, 3, 1]
        step_logits = cache.forward(ours, [(row, [next_tokens[row]]) for row in rows])
        for i, row in enumerate(rows):
            expected_row = reference_logits(reference, sequences[row])[-1]
            assert max_diff(step_logits[i], expected_row) < FLOAT32_TOL, f"step {step} row {row}"


def test_last_token_logits_and_hidden_states(tmp_path):
    config = tiny_config("llama")
    reference, ours = build_models(tmp_path, config)
    prompts = [prompt_of(5, 6), prompt_of(11, 7)]
    cache = PagedCache(config, torch.float32)
    last = cache.forward(ours, [(0, prompts[0]), (1, prompts[1])])
    assert last.shape == (2, VOCAB)
    for i, prompt in enumerate(prompts):
        assert max_diff(last[i], reference_logits(reference, prompt)[-1]) < FLOAT32_TOL

    hidden = PagedCache(config, torch.float32).forward(ours, [(0, prompts[1])], hidden=True)
    with torch.inference_mode():
        expected = reference.model(torch.tensor([prompts[1]])).last_hidden_state[0]
    assert hidden.shape == (len(prompts[1]), config.hidden_size)
    assert max_diff(hidden, expected) < FLOAT32_TOL


# ---- RoPE scaling ------------------------------------------------------------------------------------------
ROPE_VARIANTS = {
    "llama-llama3": (
        "llama",
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 32, "rope_theta": 10000.0},
    ),
    "llama-linear": ("llama", {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}),
    "qwen2-yarn": (
        "qwen2",
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 1000000.0},
    ),
    "qwen3-linear": ("qwen3", {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0}),
}


@pytest.mark.parametrize("variant", sorted(ROPE_VARIANTS))
def test_rope_scaling_matches_transformers(tmp_path, variant):
    family, rope_parameters = ROPE_VARIANTS[variant]
    config = tiny_config(family, rope_parameters=rope_parameters)
    reference, ours = build_models(tmp_path, config)
    assert ours.model.rotary_emb.rope_type == rope_parameters["rope_type"]
    # A long prompt so that positions reach the range the scaling changes.
    check_prefill_then_greedy_decode(reference, ours, config, torch.float32, FLOAT32_TOL, prompt_of(70, 8), steps=4)


def test_dynamic_ntk_matches_transformers_cached_decode_past_trained_length(tmp_path):
    max_positions = 16
    config = tiny_config(
        "llama", max_position_embeddings=max_positions, rope_parameters={"rope_type": "dynamic", "factor": 2.0}
    )
    reference, ours = build_models(tmp_path, config)
    prompt = prompt_of(10, 9)
    cache = PagedCache(config, torch.float32)
    logits = cache.forward(ours, [(0, prompt)])
    with torch.inference_mode():
        out = reference(torch.tensor([prompt]), use_cache=True)
    past = out.past_key_values
    assert max_diff(logits[0], out.logits[0, -1]) < FLOAT32_TOL
    # transformers grows the NTK base with the sequence as it decodes; each new token must see the same base.
    for step in range(2 * max_positions - len(prompt)):
        token = (step * 37 + 5) % VOCAB
        step_logits = cache.forward(ours, [(0, [token])])
        with torch.inference_mode():
            out = reference(torch.tensor([[token]]), past_key_values=past, use_cache=True)
        past = out.past_key_values
        assert max_diff(step_logits[0], out.logits[0, -1]) < FLOAT32_TOL, f"step {step}"


def test_rope_reads_legacy_and_current_config_styles():
    current = types.SimpleNamespace(
        max_position_embeddings=128,
        rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 5000.0},
    )
    legacy = types.SimpleNamespace(
        max_position_embeddings=128, rope_theta=5000.0, rope_scaling={"type": "linear", "factor": 2.0}
    )
    plain_legacy = types.SimpleNamespace(max_position_embeddings=128, rope_theta=5000.0, rope_scaling=None)
    assert rope_parameters_from_config(legacy)["rope_type"] == "linear"
    assert rope_parameters_from_config(plain_legacy) == {
        "rope_type": "default", "rope_theta": 5000.0, "partial_rotary_factor": 1.0
    }
    a, b = get_rope(current, 16), get_rope(legacy, 16)
    assert a.cache_len == b.cache_len == 256
    assert torch.equal(a.cos_cache, b.cos_cache) and torch.equal(a.sin_cache, b.sin_cache)
    assert not torch.equal(a.cos_cache[:128], get_rope(plain_legacy, 16).cos_cache)
    with pytest.raises(ValueError, match="longrope"):
        RotaryEmbedding(16, 128, {"rope_type": "longrope", "rope_theta": 1e4})


# ---- bfloat16 --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_bfloat16_matches_transformers(tmp_path, family):
    config = tiny_config(family, tie_word_embeddings=family == "qwen2")
    reference, ours = build_models(tmp_path, config, dtype=torch.bfloat16)
    assert ours.model.embed_tokens.weight.dtype == torch.bfloat16
    assert ours.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.bfloat16
    check_prefill_then_greedy_decode(reference, ours, config, torch.bfloat16, BF16_TOL, prompt_of(12, 10), steps=4)


# ---- loader errors -----------------------------------------------------------------------------------------------
def test_loader_reports_missing_and_unexpected_weights(tmp_path):
    config = tiny_config("llama")
    build_models(tmp_path, config)
    weights = load_file(str(tmp_path / "model.safetensors"))

    missing = dict(weights)
    del missing["model.layers.1.self_attn.k_proj.weight"]
    save_file(missing, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing 1 weight.*model\.layers\.1\.self_attn\.k_proj\.weight"):
        load_model(str(tmp_path), torch.float32, "cpu")

    extra = dict(weights)
    extra["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(64)
    save_file(extra, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"does not use: model\.layers\.0\.self_attn\.q_proj\.bias"):
        load_model(str(tmp_path), torch.float32, "cpu")

    wrong_shape = dict(weights)
    wrong_shape["model.layers.0.mlp.up_proj.weight"] = torch.zeros(64, 64)
    save_file(wrong_shape, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"up_proj\.weight has shape \(64, 64\)"):
        load_model(str(tmp_path), torch.float32, "cpu")


def test_tied_checkpoint_may_carry_lm_head_or_only_lm_head(tmp_path):
    config = tiny_config("qwen3", tie_word_embeddings=True)
    reference, _ = build_models(tmp_path, config)
    weights = load_file(str(tmp_path / "model.safetensors"))
    embedding = weights.pop("model.embed_tokens.weight")
    weights["lm_head.weight"] = embedding
    save_file(weights, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    ours = load_model(str(tmp_path), torch.float32, "cpu")
    assert torch.equal(ours.model.embed_tokens.weight, embedding)
    logits = PagedCache(config, torch.float32).forward(ours, [(0, prompt_of(6, 11))])
    assert max_diff(logits[0], reference_logits(reference, prompt_of(6, 11))[-1]) < FLOAT32_TOL


def test_registry_names_unsupported_architectures():
    assert get_model_class(["Qwen3ForCausalLM"]).__name__ == "Qwen3ForCausalLM"
    assert get_model_class(["SomethingElse", "LlamaForCausalLM"]).__name__ == "LlamaForCausalLM"
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*supported: .*LlamaForCausalLM"):
        get_model_class(["GPT2LMHeadModel"])
