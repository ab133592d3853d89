"""How far each large-batch GEMM arithmetic moves SmolLM2's next-token choices, teacher-forced.

`python benchmarks/int8_gemm_accuracy.py` generates 32 greedy tokens per prompt with float32 transformers
(the greedy tests' prompts), then recomputes the logits of every generated position with the decoder's linear
layers replaced by: bf16 weights and inputs; int8 weights alone (per output channel, dequantized); int8 weights
and per-token int8 activations (`torch._int_mm` arithmetic, as Int8LinearMethod); the same except some layers;
int8 with two activation terms (value + rounding remainder); and int8 with the input columns of largest magnitude
kept out of the int8 product (layers/int8_linear.py, `--cpu-gemm int8`). It prints how many top-1 choices change,
the largest change of the float32 choice's log-probability and, for each changed choice, how far float32 had
preferred its own token (a near-tie is a small gap). The second table applies each arithmetic to the prompt's
positions only, as the engine does (prefill on the large-batch GEMM, decode steps on the quantized blocks).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

from sglang.srt.layers.int8_linear import Int8LinearMethod
from sglang.srt.model_loader.resolve import resolve_model_path

PROMPTS = ["The capital of France is", "Write a haiku about the sea:", "def fibonacci(n):",
           "List three primary colors:",
           "Once upon a time, in a small village near the mountains, there lived an old clockmaker who",
           "Q: What is 12 times 12?\nA:"]
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
PROMPTS += [f"Story {i}: " + " ".join(WORDS[: (i * 5) % len(WORDS) + 1] * (1 + i % 3)) + ". Then" for i in range(10)]


def quantize_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = t.abs().amax(-1, keepdim=True).clamp_min(1e-8) / 127
    return torch.round(t / scale).clamp(-127, 127), scale


def int8(layer: torch.nn.Linear, terms: int = 1) -> Callable[[torch.Tensor], torch.Tensor]:
    wq, ws = quantize_rows(layer.weight.float())

    def forward(x: torch.Tensor) -> torch.Tensor:
        out, rest = 0, x.float()
        for _ in range(terms):
            xq, xs = quantize_rows(rest)
            out = out + (xq @ wq.t()) * xs * ws.view(1, -1)
            rest = rest - xq * xs
        return out.to(x.dtype)

    return forward


def bf16(layer: torch.nn.Linear) -> Callable[[torch.Tensor], torch.Tensor]:
    wb = layer.weight.bfloat16()
    return lambda x: F.linear(x.bfloat16(), wb).float()


def int8_weights_only(layer: torch.nn.Linear) -> Callable[[torch.Tensor], torch.Tensor]:
    wq, ws = quantize_rows(layer.weight.float())
    w = wq * ws
    return lambda x: F.linear(x, w)


def int8_kept_apart(outlier_dtype: torch.dtype) -> Callable[[torch.nn.Linear], Callable]:
    def make(layer: torch.nn.Linear) -> Callable[[torch.Tensor], torch.Tensor]:
        method = Int8LinearMethod(layer.weight.detach(), outlier_dtype)
        return lambda x: method.apply(layer.weight, x, None)

    return make


def reference_model() -> tuple[torch.nn.Module, list[tuple[int, torch.Tensor]]]:
    """float32 SmolLM2 and, per prompt, (prompt length, prompt + 32 greedy tokens)."""
    model_dir = resolve_model_path("HuggingFaceTB/SmolLM2-135M-Instruct")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    sequences = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = tokenizer.encode(prompt)
            out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=32, do_sample=False, pad_token_id=tokenizer.pad_token_id)
            sequences.append((len(ids), out[0]))
    return model, sequences


def teacher_forced_logprobs(model: torch.nn.Module, sequences: list[tuple[int, torch.Tensor]],
                            prompt_mask: Optional[dict] = None) -> list[torch.Tensor]:
    """Next-token log-probabilities at every generated position of each sequence. With `prompt_mask` (a dict the
    replaced layers read), only the prompt's positions take the replaced arithmetic."""
    out = []
    with torch.no_grad():
        for n, s in sequences:
            if prompt_mask is not None:
                prompt_mask["mask"] = torch.arange(len(s)) < n
            out.append(model(s[None]).logits[0, n - 1 : -1].float().log_softmax(-1))
    return out


def compare(base: list[torch.Tensor], other: list[torch.Tensor]) -> str:
    """How many top-1 choices of `base` changed in `other`, the largest change of the chosen log-probability, and
    float32's own margin at each changed choice."""
    changed = total = 0
    worst = 0.0
    gaps = []
    for b, g in zip(base, other):
        total += b.shape[0]
        top, ours = b.argmax(-1), g.argmax(-1)
        for i in (top != ours).nonzero().flatten().tolist():
            gaps.append(float(b[i, top[i]] - b[i, ours[i]]))
        changed += int((top != ours).sum())
        worst = max(worst, float((b - g).gather(-1, top[:, None]).abs().max()))
    margins = ", ".join(f"{m:.3f}" for m in sorted(gaps))
    return f"top-1 changed {changed}/{total}, max |d logp(float32 choice)| {worst:.3f}; float32 margins [{margins}]"


def on_prompt_only(original: Callable, replaced: Callable, prompt_mask: dict) -> Callable:
    def forward(x: torch.Tensor) -> torch.Tensor:
        exact = original(x)
        return torch.where(prompt_mask["mask"].view(1, -1, 1), replaced(x).to(exact.dtype), exact)

    return forward


def main() -> None:
    model, sequences = reference_model()
    base = teacher_forced_logprobs(model, sequences)
    layers = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and "lm_head" not in n}
    original = {n: m.forward for n, m in layers.items()}
    variants: dict[str, Callable[[str], Callable | None]] = {
        "bf16 everywhere": lambda n: bf16,
        "int8 weights only (dequantized)": lambda n: int8_weights_only,
        "int8 weights + per-token activations": lambda n: int8,
        "same, down_proj in bf16": lambda n: bf16 if "down" in n else int8,
        "same, o_proj and down_proj in bf16": lambda n: bf16 if ("down" in n or "o_proj" in n) else int8,
        "int8, two activation terms": lambda n: (lambda layer: int8(layer, terms=2)),
        "int8, 64 largest columns apart (float32)": lambda n: int8_kept_apart(torch.float32),
        "int8, 64 largest columns apart (bf16)": lambda n: int8_kept_apart(torch.bfloat16),
    }
    prompt_only = ["bf16 everywhere", "int8 weights + per-token activations", "int8, 64 largest columns apart (float32)",
                   "int8, 64 largest columns apart (bf16)"]
    mask: dict = {}
    for only_prompt, names in ((False, list(variants)), (True, prompt_only)):
        print("prompt positions only (as a prefill)" if only_prompt else "every position", flush=True)
        for name in names:
            for n, m in layers.items():
                make = variants[name](n)
                replaced = make(m) if make else original[n]
                m.forward = on_prompt_only(original[n], replaced, mask) if only_prompt else replaced
            result = compare(base, teacher_forced_logprobs(model, sequences, mask if only_prompt else None))
            print(f"  {name:42s} {result}", flush=True)


if __name__ == "__main__":
    main()
