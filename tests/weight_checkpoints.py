"""Checkpoints for weight-update tests: SmolLM2 with perturbed weights, and a tiny Llama of other shapes."""

from __future__ import annotations

from pathlib import Path

import torch

PERTURBED_PARAM = "model.layers.0.self_attn.q_proj.weight"


def build_perturbed_smollm2(smollm2_dir: str, out_dir: Path):
    """Save SmolLM2 with noise added to every layer's q_proj and down_proj (enough to change greedy output);
    returns the perturbed transformers model (float32, eval) for reference outputs."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for layer in model.model.layers:
            for weight in (layer.self_attn.q_proj.weight, layer.mlp.down_proj.weight):
                weight.add_(torch.randn(weight.shape, generator=gen) * weight.std() * 0.5)
    model.eval()
    model.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(smollm2_dir).save_pretrained(out_dir)
    return model


def build_tiny_llama(smollm2_dir: str, out_dir: Path) -> None:
    """A random Llama whose every weight has a different shape from SmolLM2's."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(smollm2_dir).save_pretrained(out_dir)


def hf_greedy(model, prompts_ids: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt, one at a time (no padding effects)."""
    outs = []
    with torch.no_grad():
        for ids in prompts_ids:
            # eos_token_id=None: generation runs on past the end token, as with ignore_eos.
            out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
            outs.append(out[0, len(ids):].tolist())
            assert len(outs[-1]) == max_new_tokens
    return outs
