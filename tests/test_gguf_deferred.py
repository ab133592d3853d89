"""A GGUF file's block tensors left in the file by its conversion (model_loader/gguf_deferred.py), as files of 256 MiB
or more are converted (`SGLANG_GGUF_BLOCKS_IN_FILE=1` forces it for the tiny files here).

The converted directory then holds the small float tensors alone (norms, routers), and reading it gives the same
tensors as the whole conversion: the Llama path's Q / K rows put back in the checkpoint's order (Mistral, written
as arch `llama`), the Qwen2-MoE experts gathered (gate rows, then up rows) with the shared expert, Phi-3's fused
tensors, Gemma 3's tied embeddings. Under the blocks plan the linear layers and experts are neither read nor
dequantized (the file's blocks serve them); without it every tensor is dequantized from the file as it loads, and
both give transformers' greedy tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

gguf = pytest.importorskip("gguf")

from sglang.srt.layers.quantization.gguf_blocks import kernels_available  # noqa: E402
from tests import test_gguf_families as families  # noqa: E402
from tests.gguf_writer import write_gguf  # noqa: E402

pytestmark = pytest.mark.skipif(not kernels_available(), reason="the compiled GGUF kernels are unavailable")
FAMILIES = ["mistral", "qwen2_moe", "phi3", "gemma3"]


def convert(tmp_path, family: str, monkeypatch, blocks_in_file: bool):
    """(transformers' model on the file's values, the converted directory, the file) for a file of `family`."""
    from sglang.srt.model_loader.resolve import resolve_model_path

    reference = families.random_checkpoint(family)
    gguf_path = tmp_path / f"tiny-{family}.gguf"
    write_gguf(reference, gguf_path, f"tiny-{family}")
    monkeypatch.setenv("SGLANG_GGUF_BLOCKS_IN_FILE", "1" if blocks_in_file else "0")
    return reference, resolve_model_path(str(gguf_path)), gguf_path


@pytest.mark.parametrize("family", FAMILIES)
def test_converted_directory_reads_the_same_tensors(tmp_path, cache_dir, monkeypatch, family):
    from sglang.srt.model_loader.gguf_reader import GGML_BLOCK_TYPES
    from sglang.srt.model_loader.weights import iterate_weights, weight_files

    real, dequantized = gguf.dequantize, []

    def recording(data, qtype):
        dequantized.append(int(qtype))
        return real(data, qtype)

    monkeypatch.setattr(gguf, "dequantize", recording)
    reference, model_dir, gguf_path = convert(tmp_path, family, monkeypatch, True)
    monkeypatch.setattr(gguf, "dequantize", real)
    # the conversion learns each left tensor's row order without dequantizing it (transformers' processors run on
    # a column of row numbers): no block tensor is dequantized, only the float ones (norms) pass through
    assert dequantized and not [t for t in dequantized if t in GGML_BLOCK_TYPES], dequantized
    deferred = json.loads((Path(model_dir) / "gguf_deferred.json").read_text())
    state = {k: v for k, v in reference.state_dict().items() if not (k == "lm_head.weight" and
                                                                      reference.config.tie_word_embeddings)}
    # every Q8_0 matrix of the file stays there: what the directory stores is the float tensors
    stored = {name for path in weight_files(model_dir) for name in _names(path)}
    assert stored.isdisjoint(deferred) and set(deferred) | stored == set(state)
    assert all(state[name].dim() == 1 or name.endswith(families.FLOAT_KEPT) for name in stored), stored
    if family == "mistral":  # Q / K rows in llama.cpp's order in the file
        assert deferred["model.layers.0.self_attn.q_proj.weight"]["heads"] == reference.config.num_attention_heads
        assert deferred["model.layers.0.self_attn.k_proj.weight"]["heads"] == reference.config.num_key_value_heads
    if family == "qwen2_moe":
        assert deferred["model.layers.0.mlp.experts.gate_up_proj"]["parts"] == [
            "blk.0.ffn_gate_exps.weight", "blk.0.ffn_up_exps.weight"]
    read = dict(iterate_weights(model_dir))  # the whole conversion's tensors: tests/test_gguf_families.py
    assert set(read) == set(state)
    for name, value in state.items():
        assert torch.equal(read[name], value), name
    # skipped tensors are not read
    assert set(dict(iterate_weights(model_dir, skip=set(deferred)))) == stored


def _names(path) -> list[str]:
    from sglang.srt.model_loader.weights import safetensors_names

    return safetensors_names(path)


@pytest.mark.parametrize("family", ["mistral", "qwen2_moe"])
def test_models_load_from_the_file_with_and_without_the_blocks_plan(tmp_path, cache_dir, monkeypatch, family):
    from transformers import AutoConfig, AutoTokenizer

    import sglang.srt.model_loader.loader as loader
    from sglang.srt.model_executor.model_runner import attach_fast_paths, load_for_plan

    reference, model_dir, gguf_path = convert(tmp_path, family, monkeypatch, True)
    if family == "mistral":  # llama.cpp writes Mistral with no window (tests/test_gguf_families.py)
        reference = families.without_sliding_window(reference)
    config = AutoConfig.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = [tokenizer.encode(p) for p in families.PROMPTS]
    expected = [families.hf_generate(reference, ids) for ids in prompts]
    deferred = set(json.loads((Path(model_dir) / "gguf_deferred.json").read_text()))
    plain = loader.iterate_weights
    for plan in (families.blocks_plan(), None):
        read: list[str] = []

        def spy(model_dir, skip=(), read=read):
            for name, tensor in plain(model_dir, skip):
                read.append(name)
                yield name, tensor

        monkeypatch.setattr(loader, "iterate_weights", spy)
        ours = load_for_plan(model_dir, torch.float32, torch.device("cpu"), str(gguf_path) if plan else None,
                             families.MAX_ROWS, plan)
        if plan is not None:
            attach_fast_paths(ours, str(gguf_path), config, families.MAX_ROWS, plan)
            # the linear layers and experts come from the file's blocks: only the embeddings (and an own head) are
            # dequantized from it
            assert {n for n in read if n in deferred} <= {"model.embed_tokens.weight", "lm_head.weight"}, read
        else:
            assert deferred <= set(read)
        tokens, _ = families.generate_paged(ours, config, prompts)
        assert tokens == expected, plan


def test_the_conversion_parses_the_file_once(tmp_path, cache_dir, monkeypatch):
    """transformers' GGUF config and tokenizer readers are handed the conversion's own parse of the file (a large
    vocabulary's parse takes seconds), and gguf's reader and name map are gguf's own again afterwards."""
    from gguf import gguf_reader

    real_init, parses = gguf_reader.GGUFReader.__init__, []

    def counting(self, path, *args, **kwargs):
        parses.append(str(path))
        real_init(self, path, *args, **kwargs)

    monkeypatch.setattr(gguf_reader.GGUFReader, "__init__", counting)
    reader_class, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    _, model_dir, gguf_path = convert(tmp_path, "mistral", monkeypatch, True)
    assert parses == [str(gguf_path)]
    assert (Path(model_dir) / "tokenizer.json").is_file() and (Path(model_dir) / "config.json").is_file()
    assert gguf.GGUFReader is reader_class and gguf.get_tensor_name_map is name_map
