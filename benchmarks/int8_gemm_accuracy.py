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

`--alternatives` prints a third table, on the prompt positions, of ways around the skinny float GEMM of the columns
kept apart, and the LM head alone under each arithmetic: SmoothQuant (per-channel factors max|x|^a / max|w|^(1-a)
moved from the activations into the weights, with activation maxima from a separate calibration text), 64 columns
chosen once from that calibration instead of per batch, and the columns kept apart but multiplied in int8 with
their own per-token scale.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Optional

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

from sglang.srt.layers.int8_linear import Int8LinearMethod, outlier_columns, split_quantize
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


CALIBRATION = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
               "movable metal type, oil-based ink and a wooden press. Books became cheaper, literacy spread, and ideas "
               "moved faster across Europe. Today, engineers write software in Python and C++, scientists measure "
               "3.14159 and 2.71828, and people ask questions such as: What is the weather like in Paris? How do I "
               "cook rice? def main():\n    print('hello world')\n1. apples 2. oranges 3. pears. Once upon a time "
               "there was a king who had three sons.")


def input_maxima(model: torch.nn.Module, layers: dict[str, torch.nn.Linear]) -> dict[str, torch.Tensor]:
    """Each linear layer's largest absolute input per column over the calibration text."""
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("HuggingFaceTB/SmolLM2-135M-Instruct"))
    amax: dict[str, torch.Tensor] = {}

    def hook(name: str) -> Callable:
        def record(module: torch.nn.Module, inputs: tuple) -> None:
            a = inputs[0].detach().abs().reshape(-1, inputs[0].shape[-1]).amax(0)
            amax[name] = torch.maximum(amax[name], a) if name in amax else a

        return record

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in layers.items()]
    with torch.no_grad():
        model(torch.tensor([tokenizer.encode(CALIBRATION)]))
    for h in handles:
        h.remove()
    return amax


def smoothquant(amax: torch.Tensor, alpha: float) -> Callable[[torch.nn.Linear], Callable]:
    def make(layer: torch.nn.Linear) -> Callable[[torch.Tensor], torch.Tensor]:
        w = layer.weight.float()
        s = (amax.clamp_min(1e-5) ** alpha / w.abs().amax(0).clamp_min(1e-5) ** (1 - alpha)).clamp_min(1e-5)
        wq, ws = quantize_rows(w * s)

        def forward(x: torch.Tensor) -> torch.Tensor:
            xq, xs = quantize_rows(x.float() / s)
            return ((xq @ wq.t()) * xs * ws.view(1, -1)).to(x.dtype)

        return forward

    return make


def calibrated_columns_apart(amax: torch.Tensor, k: int = 64) -> Callable[[torch.nn.Linear], Callable]:
    cols = amax.topk(min(k, amax.numel() // 8)).indices.sort().values

    def make(layer: torch.nn.Linear) -> Callable[[torch.Tensor], torch.Tensor]:
        w = layer.weight.float()
        keep = torch.ones(w.shape[1])
        keep[cols] = 0
        wq, ws = quantize_rows(w * keep)
        w_cols = w[:, cols]

        def forward(x: torch.Tensor) -> torch.Tensor:
            xq, xs = quantize_rows(x.float() * keep)
            return ((xq @ wq.t()) * xs * ws.view(1, -1) + x.float()[..., cols] @ w_cols.t()).to(x.dtype)

        return forward

    return make


def columns_apart_on_int8_weights(int8_columns: bool) -> Callable[[torch.nn.Linear], Callable]:
    """The columns kept apart as Int8LinearMethod picks them, multiplied by the int8 copy's weights of those columns
    (rows of its [K, N] layout: no gather from the float weight or the blocks): in int8 with their own per-token
    scale (`int8_columns`), or with their float activations."""

    def make(layer: torch.nn.Linear) -> Callable[[torch.Tensor], torch.Tensor]:
        w = layer.weight.float()
        wq, ws = quantize_rows(w)
        k = outlier_columns(w.shape[1])

        def forward(x: torch.Tensor) -> torch.Tensor:
            x2 = x.reshape(-1, x.shape[-1]).float().contiguous()
            xq, xs, cols, xo = split_quantize(x2, k)
            if int8_columns:
                oq, os_ = quantize_rows(xo)
                xo = oq * os_
            out = ((xq.float() @ wq.t()) * xs + xo @ wq[:, cols].t()) * ws.view(1, -1)
            return out.reshape(*x.shape[:-1], -1).to(x.dtype)

        return forward

    return make


def alternatives(model: torch.nn.Module, sequences: list[tuple[int, torch.Tensor]], base: list[torch.Tensor],
                 layers: dict[str, torch.nn.Linear]) -> None:
    original = {n: m.forward for n, m in layers.items()}
    amax = input_maxima(model, layers)
    dynamic = int8_kept_apart(torch.float32)
    variants: dict[str, Callable[[str], Callable]] = {
        "64 columns apart per batch (the method)": lambda n: dynamic,
        "SmoothQuant a=0.5": lambda n: smoothquant(amax[n], 0.5),
        "SmoothQuant a=0.65": lambda n: smoothquant(amax[n], 0.65),
        "SmoothQuant a=0.5, down_proj per batch": lambda n: dynamic if "down" in n else smoothquant(amax[n], 0.5),
        "64 calibrated columns apart": lambda n: calibrated_columns_apart(amax[n]),
        "same, down_proj per batch": lambda n: dynamic if "down" in n else calibrated_columns_apart(amax[n]),
        "64 columns apart per batch, in int8": lambda n: columns_apart_on_int8_weights(True),
        "64 columns apart per batch, int8 weights": lambda n: columns_apart_on_int8_weights(False),
    }
    mask: dict = {}
    print("alternatives, prompt positions only", flush=True)
    for name, make_for in variants.items():
        for n, m in layers.items():
            m.forward = on_prompt_only(original[n], make_for(n)(m), mask)
        print(f"  {name:42s} {compare(base, teacher_forced_logprobs(model, sequences, mask))}", flush=True)
    for n, m in layers.items():
        m.forward = original[n]
    head = model.get_output_embeddings()
    print("the LM head alone, every position", flush=True)
    for name, make in [("bf16", bf16), ("int8, per-token activations", int8), ("int8, 64 columns apart", dynamic)]:
        head.forward = make(head)
        print(f"  {name:42s} {compare(base, teacher_forced_logprobs(model, sequences))}", flush=True)
    del head.forward


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--alternatives", action="store_true", help="only the table of alternatives and the LM head")
    args = parser.parse_args()
    model, sequences = reference_model()
    base = teacher_forced_logprobs(model, sequences)
    layers = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and "lm_head" not in n}
    if args.alternatives:
        alternatives(model, sequences, base, layers)
        return
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
