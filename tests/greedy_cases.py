"""Prompts and checks shared by the tests that compare greedy generation with transformers on SmolLM2 (the
reference tokens themselves come from the session fixture `reference` in conftest.py)."""

from __future__ import annotations

import torch

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea:",
    "def fibonacci(n):",
    "List three primary colors:",
    "Once upon a time, in a small village near the mountains, there lived an old clockmaker who",
    "Q: What is 12 times 12?\nA:",
]
MAX_NEW = 32
GREEDY = {"temperature": 0, "max_new_tokens": MAX_NEW, "ignore_eos": True}

# bf16 GEMMs (and Q8_0 weights) move SmolLM2's logits by up to ~0.2 (tests/test_cpu_arithmetic.py); a greedy token
# may then differ from float32 transformers' only where transformers' top two logits are closer than this.
BF16_MARGIN = 0.3


def many_prompts(n: int) -> list[str]:
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
    return [f"Story {i}: " + " ".join(words[: (i * 5) % len(words) + 1] * (1 + i % 3)) + ". Then" for i in range(n)]


def transformers_greedy(hf_model, tokenizer, prompt: str) -> list[int]:
    """MAX_NEW greedy tokens of transformers' own generate (float32, one prompt at a time, no padding)."""
    ids = tokenizer.encode(prompt)
    with torch.no_grad():
        out = hf_model.generate(
            torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None, pad_token_id=tokenizer.pad_token_id,
        )
    return out[0, len(ids):].tolist()


def assert_same_or_near_tie(hf_model, tokenizer, prompt: str, ours: list[int], expected: list[int],
                            margin: float) -> None:
    """ours == expected, or they agree up to a position where transformers (teacher-forced on the common prefix)
    rates our token within `margin` of its own choice."""
    if ours == expected:
        return
    first = next(i for i, (a, b) in enumerate(zip(ours, expected)) if a != b)
    ids = tokenizer.encode(prompt) + expected[:first]
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids])).logits[0, -1]
    gap = float(logits.max() - logits[ours[first]])
    assert gap <= margin, f"{prompt!r}: token {first} is {ours[first]}, transformers prefers " \
                          f"{expected[first]} by {gap:.3f} logits"


def generate_ids(engine, prompts: list[str]) -> list[list[int]]:
    return [o["output_ids"] for o in engine.generate(prompt=prompts, sampling_params=GREEDY)]
