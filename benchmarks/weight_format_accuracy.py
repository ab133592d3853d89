"""How far each weight format the engine serves moves SmolLM2's next-token choices, teacher-forced.

`PYTHONPATH=. python benchmarks/weight_format_accuracy.py` generates 32 greedy tokens per prompt with float32
transformers (the prompts of benchmarks/int8_gemm_accuracy.py), then recomputes the log-probabilities of every
generated position with the weights of every decoder linear layer and the LM head replaced by the values of their
blocks: Q8_0 (`--small-batch-quantization q8_0`, the blocks made at load for a plain checkpoint), Q4_1 with the LM
head in Q8_0 (`--small-batch-quantization q4_1`) and Q4_1 everywhere, with float32 arithmetic, so the figures are
the weight format's own cost.

SmolLM2's only offline copy is its Q4_1 GGUF: most of its weights already are Q4_1 values, and quantizing them
to Q4_1 again is nearly lossless. The second table therefore uses an equivalent model whose weights are not block
aligned: the RMSNorm gains folded into the linear layers that read them and the residual stream rotated by a
random orthogonal matrix (embeddings E Q, input sides W Q, output sides Q^T W): the same function (its greedy
tokens are checked to be the same), weights as a checkpoint trained in float would have them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from int8_gemm_accuracy import compare, reference_model, teacher_forced_logprobs  # noqa: E402

from sglang.srt.model_loader.q8_blocks import quantize_blocks  # noqa: E402


def linears(model: torch.nn.Module) -> list[torch.nn.Linear]:
    out = [m for name, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in name]
    return out + [model.lm_head]


def untie_head(model: torch.nn.Module) -> None:
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone(), requires_grad=False)
    model.config.tie_word_embeddings = False


@torch.no_grad()
def rotate(model: torch.nn.Module, seed: int) -> None:
    """Fold the RMSNorm gains into the linear layers after them, then rotate the residual stream by a random
    orthogonal Q: an equivalent model (RMSNorm with unit gains commutes with Q)."""
    untie_head(model)
    hidden = model.config.hidden_size
    q, _ = torch.linalg.qr(torch.randn(hidden, hidden, generator=torch.Generator().manual_seed(seed),
                                       dtype=torch.float64))

    def scale_inputs(layer: torch.nn.Linear, norm: torch.nn.Module) -> None:
        layer.weight.copy_((layer.weight.double() * norm.weight.double()).float())

    for block in model.model.layers:
        attn, mlp = block.self_attn, block.mlp
        for layer in (attn.q_proj, attn.k_proj, attn.v_proj):
            scale_inputs(layer, block.input_layernorm)
        for layer in (mlp.gate_proj, mlp.up_proj):
            scale_inputs(layer, block.post_attention_layernorm)
        block.input_layernorm.weight.fill_(1.0)
        block.post_attention_layernorm.weight.fill_(1.0)
        for layer in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj):
            layer.weight.copy_((layer.weight.double() @ q).float())
        for layer in (attn.o_proj, mlp.down_proj):
            layer.weight.copy_((q.T @ layer.weight.double()).float())
    scale_inputs(model.lm_head, model.model.norm)
    model.model.norm.weight.fill_(1.0)
    model.lm_head.weight.copy_((model.lm_head.weight.double() @ q).float())
    embed = model.model.embed_tokens.weight
    embed.copy_((embed.double() @ q).float())


@torch.no_grad()
def with_blocks(model: torch.nn.Module, qtype: str, head_qtype: str) -> dict[torch.nn.Linear, torch.Tensor]:
    """Replace every decoder linear weight by its `qtype` blocks' values and the LM head's by its `head_qtype`
    blocks' values; returns the originals."""
    saved = {}
    for layer in linears(model):
        saved[layer] = layer.weight.detach().clone()
        kind = head_qtype if layer is model.lm_head else qtype
        layer.weight.copy_(quantize_blocks(layer.weight, kind).dequantize())
    return saved


@torch.no_grad()
def restore(saved: dict[torch.nn.Linear, torch.Tensor]) -> None:
    for layer, weight in saved.items():
        layer.weight.copy_(weight)


def mean_error(base: list[torch.Tensor], other: list[torch.Tensor]) -> float:
    """Mean |change| of the float32 choice's log-probability over all positions."""
    diffs = [(b - o).gather(-1, b.argmax(-1, keepdim=True)).abs().flatten() for b, o in zip(base, other)]
    return float(torch.cat(diffs).mean())


def table(model: torch.nn.Module, sequences, title: str) -> None:
    base = teacher_forced_logprobs(model, sequences)
    print(f"\n{title}")
    for qtype, head in (("Q8_0", "Q8_0"), ("Q4_1", "Q8_0"), ("Q4_1", "Q4_1")):
        saved = with_blocks(model, qtype, head)
        other = teacher_forced_logprobs(model, sequences)
        restore(saved)
        print(f"  {qtype} blocks, LM head {head}: {compare(base, other)}; mean |d logp| {mean_error(base, other):.4f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=0, help="seed of the rotation")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    model, sequences = reference_model()
    untie_head(model)  # the LM head gets its own blocks, as the engine quantizes it
    table(model, sequences, "SmolLM2-135M as loaded (its GGUF's Q4_1 / Q8_0 values), float32 arithmetic:")
    before = teacher_forced_logprobs(model, sequences)
    rotate(model, args.seed)
    after = teacher_forced_logprobs(model, sequences)
    same = all(torch.equal(b.argmax(-1), a.argmax(-1)) for b, a in zip(before, after))
    print(f"\nrotated model: same greedy choices {same}, max |d logp| "
          f"{max(float((b - a).abs().max()) for b, a in zip(before, after)):.2e}")
    table(model, sequences, "SmolLM2-135M rotated (an equivalent model whose weights are not block aligned):")


if __name__ == "__main__":
    main()
