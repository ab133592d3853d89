"""The CPU default of --chunked-prefill-size: 4,096 tokens a prefill batch, 2,048 for models of 1B parameters or
more (their prefill per token is faster in smaller batches); a flag given, and the GPU default, stay as they are."""

from __future__ import annotations

import json

from transformers import LlamaConfig

from sglang.srt.model_loader.gemm_measurement import linear_float_bytes
from sglang.srt.model_loader.model_info import default_chunked_prefill_size, load_model_info
from sglang.srt.server_args import ServerArgs

# SmolLM2-1.7B's published shape (no weights needed: the default is read from the config)
LARGE = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=24, num_attention_heads=32,
             num_key_value_heads=32, vocab_size=49152, tie_word_embeddings=True)
SMALL = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
             num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True)


def test_default_by_the_models_linear_bytes():
    assert linear_float_bytes(LlamaConfig(**LARGE)) >= 4 << 30 > linear_float_bytes(LlamaConfig(**SMALL))
    assert default_chunked_prefill_size(linear_float_bytes(LlamaConfig(**LARGE))) == 2048
    assert default_chunked_prefill_size(linear_float_bytes(LlamaConfig(**SMALL))) == 4096
    assert default_chunked_prefill_size(None) == 4096
    assert ServerArgs(model_path="m", device="cpu").chunked_prefill_size is None  # decided with the model
    assert ServerArgs(model_path="m", device="cuda").chunked_prefill_size == 8192
    assert ServerArgs(model_path="m", device="cpu", chunked_prefill_size=512).chunked_prefill_size == 512


def test_load_model_info_sets_the_cpu_default_and_keeps_a_given_size(tmp_path, cache_dir):
    for name, shape, want in (("large", LARGE, 2048), ("small", SMALL, 4096)):
        folder = tmp_path / name
        folder.mkdir()
        config = LlamaConfig(**shape).to_dict()
        (folder / "config.json").write_text(json.dumps({**config, "architectures": ["LlamaForCausalLM"]}))
        args = ServerArgs(model_path=str(folder), device="cpu", cpu_gemm="float32")
        load_model_info(args)
        assert args.chunked_prefill_size == want, name
        given = ServerArgs(model_path=str(folder), device="cpu", cpu_gemm="float32", chunked_prefill_size=300)
        load_model_info(given)
        assert given.chunked_prefill_size == 300
