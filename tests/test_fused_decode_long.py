"""The fused CPU decode step on long sequences, whose attention is split into chunks of the token range and merged
(csrc/attention_split.h), against the layer-by-layer forward of the same weights and K/V cache.

A tiny random Llama is prefilled layer by layer (its K/V land in scattered slots of the paged pool); then a few
decode steps run once through the fused step and once layer by layer from the same cache. The chunks of one
sequence are merged by whichever thread finishes last, so the result is also checked to be identical for any
thread count.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("gguf")

from sglang.srt.layers.quantization.gguf_blocks import kernels_available  # noqa: E402
from sglang.srt.model_executor import fused_cpu_decode as fused_decode  # noqa: E402
from tests.test_fused_decode import make_fused, quantize_linears  # noqa: E402
from tests.test_models import PagedCache, build_models, max_diff, prompt_of, tiny_config  # noqa: E402

pytestmark = pytest.mark.skipif(not (kernels_available() and fused_decode.available()),
                                reason="the compiled CPU kernels are unavailable")

CONTEXT = 2048
STEPS = 3
# Sequences above 512 tokens are split into equal chunks (multiples of 64): 1,500 tokens into three (512, 512 and
# the rest), 700 into 384 + the rest, 513 into 320 + the rest; 40 runs one item per KV head. At most four rows:
# the test model's LM head is a dense float32 matmul, whose results vary with the thread count from five rows up.
BATCHES = {"batch1": [1500], "mixed": [1500, 40, 513, 700]}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    config = tiny_config("llama", num_hidden_layers=2, max_position_embeddings=CONTEXT,
                         hidden_size=96, num_attention_heads=6, num_key_value_heads=2)
    _, ours = build_models(tmp_path_factory.mktemp("llama"), config)
    quantize_linears(ours)
    return config, ours


def prefilled(config, ours, kv_dtype: torch.dtype, lengths: list[int]) -> PagedCache:
    cache = PagedCache(config, kv_dtype, size=sum(lengths) + 64, rows=len(lengths), context=CONTEXT)
    for row, length in enumerate(lengths):
        cache.forward(ours, [(row, prompt_of(length, 10 + row))])
    return cache


def decode(cache: PagedCache, ours, fused: bool, lengths: list[int]) -> list[torch.Tensor]:
    """STEPS greedy decode steps of every row (in reverse row order), fused or layer by layer."""
    cache.decode_strategy = make_fused(ours, cache) if fused else None
    rows = list(range(len(lengths)))[::-1]
    tokens = {row: 7 + row for row in rows}
    logits = []
    for _ in range(STEPS):
        out = cache.forward(ours, [(row, [tokens[row]]) for row in rows])
        logits.append(out)
        for i, row in enumerate(rows):
            tokens[row] = int(out[i].argmax())
    return logits


def snapshot(cache: PagedCache) -> dict:
    return {"k": [t.clone() for t in cache.pool.k_buffer], "v": [t.clone() for t in cache.pool.v_buffer],
            "table": cache.req_to_token_pool.req_to_token.clone(), "free": list(cache.free_slots),
            "lens": dict(cache.cached_lens)}


def restore(cache: PagedCache, state: dict) -> None:
    for dst, src in zip([*cache.pool.k_buffer, *cache.pool.v_buffer], [*state["k"], *state["v"]]):
        dst.copy_(src)
    cache.req_to_token_pool.req_to_token.copy_(state["table"])
    cache.free_slots = list(state["free"])
    cache.cached_lens = dict(state["lens"])


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16], ids=["float32", "bf16"])
@pytest.mark.parametrize("batch", list(BATCHES))
def test_split_attention_matches_layer_by_layer(model, kv_dtype, batch):
    config, ours = model
    lengths = BATCHES[batch]
    cache = prefilled(config, ours, kv_dtype, lengths)
    state = snapshot(cache)
    fused = decode(cache, ours, True, lengths)
    fused_k = [t.clone() for t in cache.pool.k_buffer]
    restore(cache, state)
    plain = decode(cache, ours, False, lengths)
    for step, (a, e) in enumerate(zip(fused, plain)):
        assert max_diff(a, e) < 1e-3, f"step {step}: {max_diff(a, e)}"
        assert torch.equal(a.argmax(-1), e.argmax(-1))
    # The chunk over the last tokens stored the new tokens' keys, as the layer-by-layer path did.
    table = cache.req_to_token_pool.req_to_token
    new = torch.cat([table[row, length:length + STEPS] for row, length in enumerate(lengths)])
    # (bf16: a key may round to the neighbouring value, from float32 noise in the layers below)
    rtol = 1e-4 if kv_dtype == torch.float32 else 2**-7
    for layer, plain_k in enumerate(cache.pool.k_buffer):
        torch.testing.assert_close(fused_k[layer][new].float(), plain_k[new].float(), rtol=rtol, atol=1e-4)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16], ids=["float32", "bf16"])
def test_split_attention_same_result_with_any_thread_count(model, kv_dtype):
    config, ours = model
    lengths = BATCHES["mixed"]
    cache = prefilled(config, ours, kv_dtype, lengths)
    state = snapshot(cache)
    before = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            restore(cache, state)
            results.append(decode(cache, ours, True, lengths))
    finally:
        torch.set_num_threads(before)
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)
