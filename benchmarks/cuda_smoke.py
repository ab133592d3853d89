"""The CUDA path end to end: a tiny random Llama through `sglang.Engine` on the GPU against transformers' greedy
`generate` on the same GPU and weights.

    python benchmarks/cuda_smoke.py [TOKENIZER_DIR]

TOKENIZER_DIR is a folder with a tokenizer (SmolLM2's by default, from the installed model package). The engine
picks the device itself (`cuda` wherever torch sees one); on a machine without one this runs on the CPU. Prints, per
prompt, whether the 16 greedy tokens are the same, and exits non-zero when any differs.
"""

from __future__ import annotations

import sys
import tempfile
import time

import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

PROMPTS = ["The capital of France is", "Once upon a time there", "1, 2, 3, 4,"]
NEW_TOKENS = 16


def reference_tokens(model: LlamaForCausalLM, tok, device: str) -> list[list[int]]:
    model = model.to(device)
    out = []
    for prompt in PROMPTS:
        ids = tok(prompt, return_tensors="pt").input_ids.to(device)
        gen = model.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
        out.append(gen[0, ids.shape[1]:].tolist())
    return out


def main() -> int:
    if len(sys.argv) > 1:
        tok_dir = sys.argv[1]
    else:
        from sglang.srt.model_loader.resolve import resolve_model_path

        tok_dir = resolve_model_path("HuggingFaceTB/SmolLM2-135M-Instruct")
    from sglang import Engine

    tok = AutoTokenizer.from_pretrained(tok_dir)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, dtype="float32")
    model = LlamaForCausalLM(config).eval()
    folder = tempfile.mkdtemp()
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    expected = reference_tokens(model, tok, device)
    started = time.time()
    engine = Engine(model_path=folder, dtype="float32")
    print(f"engine ready in {time.time() - started:.1f} s on {engine.get_server_info().get('device')}", flush=True)
    try:
        outs = engine.generate(PROMPTS, {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True})
    finally:
        engine.shutdown()
    same = 0
    for prompt, out, ref in zip(PROMPTS, outs, expected):
        got = out["output_ids"][:NEW_TOKENS]
        same += got == ref
        print(repr(prompt), "same" if got == ref else f"DIFF ours={got} transformers={ref}", flush=True)
    print(f"greedy tokens equal to transformers on {device}: {same}/{len(PROMPTS)}")
    return 0 if same == len(PROMPTS) else 1


if __name__ == "__main__":
    sys.exit(main())
