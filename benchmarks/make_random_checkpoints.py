"""Write random-weight checkpoints with real model shapes for benchmarks (no download of real weights needed).

Each shape becomes `OUT/<shape>/`: config.json (LlamaConfig, dtype bfloat16), the SmolLM2 tokenizer files, and bf16
safetensors shards `model-0000K-of-0000N.safetensors` (about --shard-gb each) with `model.safetensors.index.json`.
`--gguf q8_0,q4_0,q4_1` (or `all`) also writes `OUT/<shape>/<shape>.<TYPE>.gguf` from the shards just written.
`--int4 gptq,awq` also writes `OUT/<shape>-gptq-int4/` and `OUT/<shape>-awq-int4/`: a GPTQ (4 bits, group 128,
asymmetric, `qweight` / `qzeros` / `scales` / `g_idx`) and an AWQ (GEMM layout, group 128) checkpoint in the
published layouts, float16 elsewhere, of the same shape, its linear layers random
integers and scales packed by the rules of tests/quant_packers.py (a speed and memory benchmark needs the format, not
these weights' values). An int8 (W8A8) model of the shape is the bf16 checkpoint served with `--quantization
w8a8_int8`.

Shapes (`--shape` is required; repeat it or give a comma-separated list):
  smollm2-360m  SmolLM2-360M's published config (tied embeddings)
  smollm2-1.7b  SmolLM2-1.7B's published config (tied embeddings)
  llama-7b      Llama-2-7B sizes (hidden 4096, ffn 11008, 32 layers, 32 heads) with 8 KV heads (GQA, as in current
                Llama/Qwen 7-8B models), untied lm_head, SmolLM2's 49152-token vocabulary
  gemma-3-1b    Gemma-3-1B's published text config (Gemma3ForCausalLM, model_type gemma3_text: 26 layers, hidden
                1152, ffn 6912, 4 heads, 1 KV head, head_dim 256, five sliding-window layers of 512 for each global
                one, RoPE bases 1e6 global / 1e4 local, query_pre_attn_scalar 256, tied embeddings) with SmolLM2's
                vocabulary instead of Gemma's 262144 tokens; safetensors only (no --gguf / --int4)
  deepseek-v2-lite  DeepSeek-V2-Lite's published config (DeepseekV2ForCausalLM: 27 layers, hidden 2048, 16 heads,
                latent attention with kv_lora_rank 512, rope 64 / nope 128 / v 128, no q LoRA; layer 0 dense (10944),
                the others 64 routed experts of 1408 (6 per token, greedy) and 2 shared) with SmolLM2's vocabulary and
                plain RoPE (no YaRN); safetensors only. 15.7B parameters: `--layers 9` writes its first 9 layers

Weights are seeded (--seed) and deterministic: linear and embedding weights ~ N(0, 0.02), norms 1 + 0.02 * N(0, 1)
(Gemma's norms scale by 1 + weight: their weights are 0.02 * N(0, 1)).
Memory stays bounded for any size: tensors are generated one by one and at most one shard is held at a time; GGUF
files are streamed tensor by tensor. GGUF: every 2-D tensor (token_embd included) gets the file's type, norms F32;
attn_q/attn_k rows are permuted as llama.cpp's convert_hf_to_gguf.py does.

A shape (or GGUF file) whose output is complete is skipped unless --force; rewriting a shape's safetensors also
deletes its old GGUF files (they would no longer match the weights).

  python benchmarks/make_random_checkpoints.py --shape smollm2-360m --gguf all --out /tmp/ckpt
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time

import numpy as np
import torch

COMMON = dict(vocab_size=49152, max_position_embeddings=8192, rms_norm_eps=1e-5, hidden_act="silu")
SHAPES = {
    "smollm2-360m": dict(hidden_size=960, intermediate_size=2560, num_hidden_layers=32, num_attention_heads=15,
                         num_key_value_heads=5, rope_theta=100000.0, tie_word_embeddings=True),
    "smollm2-1.7b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=24, num_attention_heads=32,
                         num_key_value_heads=32, rope_theta=130000.0, tie_word_embeddings=True),
    "llama-7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=8, rope_theta=500000.0, tie_word_embeddings=False),
    # written as Gemma3ForCausalLM (write_config) with Gemma's norms (tensor_specs)
    "gemma-3-1b": dict(gemma3=True, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
                       num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=512,
                       sliding_window_pattern=6, query_pre_attn_scalar=256, rope_theta=1_000_000.0,
                       rope_local_base_freq=10_000.0, rms_norm_eps=1e-6, max_position_embeddings=32768,
                       hidden_act=None, hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True),
    # written as DeepseekV2ForCausalLM (write_config) with its latent attention and experts (deepseek_specs)
    "deepseek-v2-lite": dict(deepseek=True, hidden_size=2048, intermediate_size=10944, num_hidden_layers=27,
                             num_attention_heads=16, num_key_value_heads=16, kv_lora_rank=512, q_lora_rank=None,
                             qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, n_routed_experts=64,
                             n_shared_experts=2, moe_intermediate_size=1408, num_experts_per_tok=6,
                             first_k_dense_replace=1, topk_method="greedy", norm_topk_prob=False,
                             routed_scaling_factor=1.0, rope_theta=10000.0, tie_word_embeddings=False),
}
GGUF_TYPES = ("q8_0", "q4_0", "q4_1")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "added_tokens.json", "chat_template.jinja", "chat_template.json", "generation_config.json")
INDEX = "model.safetensors.index.json"
INIT_STD = 0.02
CHUNK_ELEMS = 1 << 24  # float32 working set per generation / quantization step (64 MiB)


def load_tokenizer(tok_dir: str) -> dict:
    with open(os.path.join(tok_dir, "tokenizer.json"), encoding="utf-8") as f:
        tok = json.load(f)
    cfg_path = os.path.join(tok_dir, "tokenizer_config.json")
    cfg = json.load(open(cfg_path, encoding="utf-8")) if os.path.isfile(cfg_path) else {}
    vocab = dict(tok["model"]["vocab"])
    for added in tok.get("added_tokens", []):
        vocab[added["content"]] = added["id"]
    special = {a["id"] for a in tok.get("added_tokens", []) if a.get("special")}
    added_ids = {a["id"] for a in tok.get("added_tokens", [])}

    def token_id(key: str):
        value = cfg.get(key)
        value = value.get("content") if isinstance(value, dict) else value
        return vocab.get(value) if value is not None else None

    template = cfg.get("chat_template")
    jinja = os.path.join(tok_dir, "chat_template.jinja")
    if template is None and os.path.isfile(jinja):
        template = open(jinja, encoding="utf-8").read()
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"].get("merges", [])]
    ids = {k: token_id(f"{k}_token") for k in ("bos", "eos", "unk", "pad")}
    return dict(vocab=vocab, special=special, added=added_ids, merges=merges, template=template, ids=ids)


def shape_config(shape: str, layers: int = 0) -> dict:
    """The shape's config; `layers` > 0 keeps only its first `layers` layers."""
    c = {k: v for k, v in {**COMMON, **SHAPES[shape]}.items() if v is not None or k == "q_lora_rank"}
    return {**c, "num_hidden_layers": layers} if layers else c


def deepseek_specs(c: dict) -> list[tuple[str, tuple[int, ...], str]]:
    """tensor_specs of a DeepSeek-V2 shape: latent attention without a q LoRA (V2-Lite), the first
    `first_k_dense_replace` layers dense, the others a router, per-expert MLPs and the shared experts."""
    h, v, heads, r = c["hidden_size"], c["vocab_size"], c["num_attention_heads"], c["kv_lora_rank"]
    nope, rope, vd = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]

    def mlp(prefix: str, f: int) -> list[tuple[str, tuple[int, ...], str]]:
        return [(prefix + "gate_proj.weight", (f, h), "linear"), (prefix + "up_proj.weight", (f, h), "linear"),
                (prefix + "down_proj.weight", (h, f), "linear")]

    specs = [("model.embed_tokens.weight", (v, h), "embed")]
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        specs += [(p + "input_layernorm.weight", (h,), "norm"),
                  (p + "self_attn.q_proj.weight", (heads * (nope + rope), h), "linear"),
                  (p + "self_attn.kv_a_proj_with_mqa.weight", (r + rope, h), "linear"),
                  (p + "self_attn.kv_a_layernorm.weight", (r,), "norm"),
                  (p + "self_attn.kv_b_proj.weight", (heads * (nope + vd), r), "linear"),
                  (p + "self_attn.o_proj.weight", (h, heads * vd), "linear"),
                  (p + "post_attention_layernorm.weight", (h,), "norm")]
        if i < c["first_k_dense_replace"]:
            specs += mlp(p + "mlp.", c["intermediate_size"])
            continue
        specs.append((p + "mlp.gate.weight", (c["n_routed_experts"], h), "linear"))
        for e in range(c["n_routed_experts"]):
            specs += mlp(f"{p}mlp.experts.{e}.", c["moe_intermediate_size"])
        specs += mlp(p + "mlp.shared_experts.", c["moe_intermediate_size"] * c["n_shared_experts"])
    return specs + [("model.norm.weight", (h,), "norm"), ("lm_head.weight", (v, h), "linear")]


def tensor_specs(c: dict) -> list[tuple[str, tuple[int, ...], str]]:
    """(HF name, shape, kind) for every weight, in file order."""
    if c.get("deepseek"):
        return deepseek_specs(c)
    h, f, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    hd = c.get("head_dim") or h // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    gemma = c.get("gemma3", False)
    norm = "gemma_norm" if gemma else "norm"
    specs = [("model.embed_tokens.weight", (v, h), "embed")]
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        specs += [(p + "input_layernorm.weight", (h,), norm),
                  (p + "self_attn.q_proj.weight", (q, h), "linear"), (p + "self_attn.k_proj.weight", (kv, h), "linear"),
                  (p + "self_attn.v_proj.weight", (kv, h), "linear"), (p + "self_attn.o_proj.weight", (h, q), "linear"),
                  (p + "post_attention_layernorm.weight", (h,), norm)]
        if gemma:
            specs += [(p + "self_attn.q_norm.weight", (hd,), norm), (p + "self_attn.k_norm.weight", (hd,), norm),
                      (p + "pre_feedforward_layernorm.weight", (h,), norm),
                      (p + "post_feedforward_layernorm.weight", (h,), norm)]
        specs += [(p + "mlp.gate_proj.weight", (f, h), "linear"), (p + "mlp.up_proj.weight", (f, h), "linear"),
                  (p + "mlp.down_proj.weight", (h, f), "linear")]
    specs.append(("model.norm.weight", (h,), norm))
    if not c["tie_word_embeddings"]:
        specs.append(("lm_head.weight", (v, h), "linear"))
    return specs


def random_tensor(shape: tuple[int, ...], kind: str, gen: torch.Generator) -> torch.Tensor:
    out = torch.empty(shape, dtype=torch.bfloat16)
    flat = out.view(-1)
    for start in range(0, flat.numel(), CHUNK_ELEMS):
        n = min(CHUNK_ELEMS, flat.numel() - start)
        chunk = torch.randn(n, generator=gen, dtype=torch.float32).mul_(INIT_STD)
        flat[start:start + n] = chunk.add_(1.0) if kind == "norm" else chunk  # gemma_norm: 1 + weight applied
    return out


def plan_shards(specs, max_bytes: int) -> list[list]:
    shards: list[list] = [[]]
    size = 0
    for spec in specs:
        nbytes = 2 * int(np.prod(spec[1]))
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += nbytes
    return shards


def shard_name(k: int, n: int) -> str:
    return f"model-{k:05d}-of-{n:05d}.safetensors"


def safetensors_complete(d: str) -> bool:
    path = os.path.join(d, INDEX)
    if not os.path.isfile(path):
        return False
    files = set(json.load(open(path))["weight_map"].values())
    return all(os.path.isfile(os.path.join(d, f)) for f in files) and os.path.isfile(os.path.join(d, "config.json"))


def write_config(c: dict, d: str, ids: dict) -> None:
    from transformers import DeepseekV2Config, Gemma3TextConfig, LlamaConfig

    common = dict(dtype="bfloat16", initializer_range=INIT_STD, bos_token_id=ids["bos"], eos_token_id=ids["eos"],
                  pad_token_id=ids["pad"])
    fields = {k: v for k, v in c.items() if k not in ("gemma3", "deepseek")}
    if c.get("deepseek"):
        DeepseekV2Config(**fields, architectures=["DeepseekV2ForCausalLM"], **common).save_pretrained(d)
        return
    if not c.get("gemma3"):
        LlamaConfig(**fields, architectures=["LlamaForCausalLM"], **common).save_pretrained(d)
        return
    pattern, theta, local_theta = (fields.pop(k) for k in ("sliding_window_pattern", "rope_theta",
                                                            "rope_local_base_freq"))
    layer_types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                   for i in range(c["num_hidden_layers"])]
    rope = {"full_attention": {"rope_type": "default", "rope_theta": theta},
            "sliding_attention": {"rope_type": "default", "rope_theta": local_theta}}
    Gemma3TextConfig(**fields, layer_types=layer_types, rope_parameters=rope, architectures=["Gemma3ForCausalLM"],
                     **common).save_pretrained(d)


def write_safetensors(shape: str, d: str, tok_dir: str, tok: dict, seed: int, shard_gb: float,
                      layers: int = 0) -> None:
    from safetensors.torch import save_file

    c = shape_config(shape, layers)
    os.makedirs(d, exist_ok=True)
    for stale in os.listdir(d):  # the index goes first, so an interrupted run never looks complete
        if stale == INDEX or ".gguf" in stale or (stale.startswith("model-") and ".safetensors" in stale):
            os.remove(os.path.join(d, stale))
    for name in TOKENIZER_FILES:
        if os.path.isfile(os.path.join(tok_dir, name)):
            shutil.copyfile(os.path.join(tok_dir, name), os.path.join(d, name))
    write_config(c, d, tok["ids"])
    gen = torch.Generator().manual_seed(seed)
    shards = plan_shards(tensor_specs(c), int(shard_gb * (1 << 30)))
    weight_map, total = {}, 0
    for k, shard in enumerate(shards, 1):
        fname = shard_name(k, len(shards))
        tensors = {name: random_tensor(shp, kind, gen) for name, shp, kind in shard}
        save_file(tensors, os.path.join(d, fname + ".tmp"), metadata={"format": "pt"})
        os.replace(os.path.join(d, fname + ".tmp"), os.path.join(d, fname))
        os.chmod(os.path.join(d, fname), 0o644)  # safetensors creates the file 0600
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map.update({name: fname for name in tensors})
        del tensors
        print(f"  {fname}: {len(shard)} tensors", flush=True)
    with open(os.path.join(d, INDEX + ".tmp"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    os.replace(os.path.join(d, INDEX + ".tmp"), os.path.join(d, INDEX))


INT4_GROUP = 128
INT4_FORMATS = ("gptq", "awq")


def write_int4(fmt: str, d: str, out_dir: str, seed: int, shard_gb: float) -> None:
    """The GPTQ or AWQ 4-bit checkpoint of the shape in `d` (module docstring), streamed shard by shard."""
    import sys
    from pathlib import Path

    from safetensors import safe_open

    from sglang.srt.model_loader.gguf_convert import ShardWriter

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from tests.quant_packers import LINEAR_NAMES, awq_format, gptq_format

    quant_config, make_layer, dtype = (gptq_format(4, INT4_GROUP, sym=False) if fmt == "gptq"
                                       else awq_format(INT4_GROUP))
    os.makedirs(out_dir, exist_ok=True)
    for name in (*TOKENIZER_FILES, "config.json"):
        if os.path.isfile(os.path.join(d, name)):
            shutil.copyfile(os.path.join(d, name), os.path.join(out_dir, name))
    config = json.load(open(os.path.join(out_dir, "config.json")))
    config.update(dtype="float16", torch_dtype="float16", quantization_config=quant_config)
    json.dump(config, open(os.path.join(out_dir, "config.json"), "w"), indent=2)
    gen = torch.Generator().manual_seed(seed)
    weight_map = json.load(open(os.path.join(d, INDEX)))["weight_map"]
    writer = ShardWriter(Path(out_dir), int(shard_gb * (1 << 30)), dtype=None)
    for shard in sorted(set(weight_map.values())):
        with safe_open(os.path.join(d, shard), framework="pt") as f:
            for name in f.keys():
                module, _, leaf = name.rpartition(".")
                if module.rsplit(".", 1)[-1] in LINEAR_NAMES and leaf == "weight":
                    out_f, in_f = f.get_slice(name).get_shape()
                    tensors, _ = make_layer(out_f, in_f, gen)
                    for key, t in tensors.items():
                        writer.add(f"{module}.{key}", t)
                else:
                    writer.add(name, f.get_tensor(name).to(dtype))
    writer.finish()


def gguf_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    # llama.cpp convert_hf_to_gguf.py LlamaModel.permute
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape).contiguous()


def gguf_name(hf: str) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    parts = hf.split(".")  # model.layers.{i}.{module}.{proj}.weight
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "q_proj": "attn_q",
             "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output", "gate_proj": "ffn_gate",
             "up_proj": "ffn_up", "down_proj": "ffn_down"}
    return f"blk.{parts[2]}.{names[parts[-2]]}.weight"


def gguf_tensor(d: str, weight_map: dict, hf: str, c: dict, qtype) -> np.ndarray:
    from gguf.quants import quantize
    from safetensors import safe_open

    with safe_open(os.path.join(d, weight_map[hf]), framework="pt") as f:  # reopened per tensor: no lingering mmap
        w = f.get_tensor(hf)
    if ".q_proj." in hf:
        w = gguf_permute(w, c["num_attention_heads"])
    elif ".k_proj." in hf:
        w = gguf_permute(w, c["num_key_value_heads"])
    if w.dim() == 1:
        return w.float().numpy()
    rows = max(1, CHUNK_ELEMS // w.shape[1])
    out = None
    for r in range(0, w.shape[0], rows):
        part = quantize(w[r:r + rows].float().numpy(), qtype)
        if out is None:
            out = np.empty((w.shape[0], part.shape[1]), dtype=np.uint8)
        out[r:r + rows] = part
    return out


def write_gguf(shape: str, d: str, path: str, tok: dict, qname: str) -> None:
    import gguf
    from gguf.quants import quant_shape_to_byte_shape

    qtype = gguf.GGMLQuantizationType[qname.upper()]
    c = shape_config(shape)
    weight_map = json.load(open(os.path.join(d, INDEX)))["weight_map"]
    w = gguf.GGUFWriter(path + ".tmp", "llama")
    for add, value in ((w.add_type, "model"), (w.add_name, f"random-{shape}"),
                       (w.add_context_length, c["max_position_embeddings"]), (w.add_embedding_length, c["hidden_size"]),
                       (w.add_block_count, c["num_hidden_layers"]), (w.add_feed_forward_length, c["intermediate_size"]),
                       (w.add_head_count, c["num_attention_heads"]), (w.add_head_count_kv, c["num_key_value_heads"]),
                       (w.add_rope_freq_base, c["rope_theta"]), (w.add_layer_norm_rms_eps, c["rms_norm_eps"]),
                       (w.add_rope_dimension_count, c["hidden_size"] // c["num_attention_heads"]),
                       (w.add_vocab_size, c["vocab_size"]),
                       (w.add_file_type, getattr(gguf.LlamaFileType, f"MOSTLY_{qname.upper()}")),
                       (w.add_quantization_version, gguf.GGML_QUANT_VERSION)):
        add(value)
    by_id = {i: t for t, i in tok["vocab"].items()}
    tokens, types = [], []
    for i in range(c["vocab_size"]):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        else:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.CONTROL if i in tok["special"] else
                         gguf.TokenType.USER_DEFINED if i in tok["added"] else gguf.TokenType.NORMAL)
    for add, value in ((w.add_tokenizer_model, "gpt2"), (w.add_tokenizer_pre, "smollm"), (w.add_token_list, tokens),
                       (w.add_token_types, types), (w.add_token_merges, tok["merges"])):
        add(value)
    for key, add in (("bos", w.add_bos_token_id), ("eos", w.add_eos_token_id), ("unk", w.add_unk_token_id),
                     ("pad", w.add_pad_token_id)):
        if tok["ids"][key] is not None:
            add(tok["ids"][key])
    w.add_add_bos_token(False)
    w.add_add_space_prefix(False)
    if tok["template"]:
        w.add_chat_template(tok["template"])
    specs = tensor_specs(c)
    for hf, shp, _ in specs:
        if len(shp) == 1:
            w.add_tensor_info(gguf_name(hf), shp, np.dtype(np.float32), 4 * shp[0])
        else:
            byte_shape = quant_shape_to_byte_shape(shp, qtype)
            w.add_tensor_info(gguf_name(hf), byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for hf, _, _ in specs:
        w.write_tensor_data(gguf_tensor(d, weight_map, hf, c, qtype))
    w.close()
    os.replace(path + ".tmp", path)


def timed(label: str, path: str, fn) -> None:
    start = time.perf_counter()
    fn()
    secs = time.perf_counter() - start
    size = (sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))
            if os.path.isdir(path) else os.path.getsize(path))
    print(f"wrote {label}: {path} ({size / 1e9:.3f} GB, {size} bytes) in {secs:.1f} s", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", action="append", required=True, help=f"one of {', '.join(SHAPES)} (repeatable)")
    ap.add_argument("--out", default="~/.cache/sglang-lite/bench-models")
    ap.add_argument("--gguf", default="", help=f"comma-separated subset of {','.join(GGUF_TYPES)}, or 'all'")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shard-gb", type=float, default=2.0, help="maximum safetensors shard size in GiB")
    ap.add_argument("--force", action="store_true", help="rewrite outputs that already exist")
    ap.add_argument("--int4", default="", help=f"comma-separated subset of {','.join(INT4_FORMATS)}: also write "
                    "OUT/<shape>-<format>-int4 (module docstring)")
    ap.add_argument("--layers", type=int, default=0, help="keep only the first N layers of each shape (written to "
                    "OUT/<shape>-<N>l; safetensors only): a deep shape's per-layer figures on a smaller machine")
    ap.add_argument("--tokenizer-dir", default=None,
                    help="a folder with SmolLM2's tokenizer files (default: those of the installed SmolLM2 package)")
    args = ap.parse_args()
    shapes = [s for item in args.shape for s in item.split(",") if s]
    gguf_types = list(GGUF_TYPES) if args.gguf == "all" else [t.lower() for t in args.gguf.split(",") if t]
    for bad in [s for s in shapes if s not in SHAPES] + [t for t in gguf_types if t not in GGUF_TYPES]:
        ap.error(f"unknown shape or GGUF type {bad!r}: shapes {', '.join(SHAPES)}; GGUF {', '.join(GGUF_TYPES)}, all")
    if (gguf_types or args.int4) and (args.layers or any(SHAPES[s].get("gemma3") or SHAPES[s].get("deepseek")
                                                         for s in shapes)):
        ap.error("--gguf and --int4 write Llama layouts of whole shapes: not for the Gemma 3 / DeepSeek shapes or "
                 "with --layers")
    out = os.path.expanduser(args.out)
    if args.tokenizer_dir:
        tok_dir = os.path.expanduser(args.tokenizer_dir)
    else:
        from sglang.srt.model_loader.resolve import resolve_model_path

        tok_dir = resolve_model_path("HuggingFaceTB/SmolLM2-135M-Instruct")  # its tokenizer files, not its weights
    tok = load_tokenizer(tok_dir)
    for shape in shapes:
        d = os.path.join(out, f"{shape}-{args.layers}l" if args.layers else shape)
        if args.force or not safetensors_complete(d):
            timed(f"{shape} bf16 safetensors", d,
                  lambda: write_safetensors(shape, d, tok_dir, tok, args.seed, args.shard_gb, args.layers))
        else:
            print(f"skip {shape} safetensors: {d} is complete (--force to rewrite)")
        for t in gguf_types:
            path = os.path.join(d, f"{shape}.{t.upper()}.gguf")
            if args.force or not os.path.isfile(path):
                timed(f"{shape} {t.upper()} gguf", path, lambda: write_gguf(shape, d, path, tok, t))
            else:
                print(f"skip {path}: exists (--force to rewrite)")
        for fmt in [f for f in args.int4.split(",") if f]:
            if fmt not in INT4_FORMATS:
                ap.error(f"unknown int4 format {fmt!r}: {', '.join(INT4_FORMATS)}")
            target = os.path.join(out, f"{shape}-{fmt}-int4")
            if args.force or not safetensors_complete(target):
                timed(f"{shape} {fmt.upper()} int4", target,
                      lambda: write_int4(fmt, d, target, args.seed, args.shard_gb))  # noqa: B023 - called at once


if __name__ == "__main__":
    main()
