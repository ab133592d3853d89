"""The fused CPU decode step (csrc/decode_stack.cpp) against the layer-by-layer forward of the same weights.

Tiny random Llama / Qwen2 (QKV bias) / Qwen3 (per-head q/k norm) checkpoints get their linear layers quantized to
Q4_1 and Q8_0; the float weights are replaced by the dequantized values, so both paths compute with the same
weights and may differ only in float32 summation order. The layer-by-layer path is itself checked against
transformers in test_models.py.
"""

from __future__ import annotations

import pytest
import torch

gguf = pytest.importorskip("gguf")

from sglang.srt.layers.quantization.gguf_blocks import GGUFQuantWeight, kernels_available  # noqa: E402
from sglang.srt.layers.quantization.gguf_linear import GGUFLinearMethod  # noqa: E402
from sglang.srt.model_executor import fused_cpu_decode as fused_decode  # noqa: E402
from tests.test_models import PagedCache, build_models, max_diff, prompt_of, tiny_config  # noqa: E402

pytestmark = pytest.mark.skipif(not (kernels_available() and fused_decode.available()),
                                reason="the compiled CPU kernels are unavailable")

TOL = 1e-4
MAX_ROWS = 8


def quantize_linears(model, max_rows: int = MAX_ROWS) -> None:
    """Quantize every decoder linear layer (Q4_1 for QKV and gate/up, Q8_0 for the output and down projections)
    and make its float weight the dequantized one."""
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for module, qtype in ((attn.qkv_proj, "Q4_1"), (attn.o_proj, "Q8_0"), (mlp.gate_up_proj, "Q4_1"),
                              (mlp.down_proj, "Q8_0")):
            n, k = module.weight.shape
            raw = gguf.quants.quantize(module.weight.detach().numpy(), getattr(gguf.GGMLQuantizationType, qtype))
            weight = GGUFQuantWeight(qtype, raw, n, k)
            with torch.no_grad():
                module.weight.copy_(weight.dequantize())
            module.set_linear_method(GGUFLinearMethod(weight, max_rows))


def quantize_head(model, max_rows: int = MAX_ROWS, qtype: str = "Q8_0") -> None:
    """Put the LM head on GGUF blocks (as the loader does for a GGUF checkpoint), its float weight dequantized."""
    head = model.lm_head.weight
    n, k = head.shape
    raw = gguf.quants.quantize(head.detach().numpy(), getattr(gguf.GGMLQuantizationType, qtype))
    weight = GGUFQuantWeight(qtype, raw, n, k)
    with torch.no_grad():
        head.copy_(weight.dequantize())
    model.logits_processor.set_head_method(GGUFLinearMethod(weight, max_rows))


def make_fused(model, cache: PagedCache, max_rows: int = MAX_ROWS):
    fused = fused_decode.build_fused_decode(model, cache.pool.k_buffer, cache.pool.v_buffer, max_rows)
    assert fused is not None
    return fused


def decode_run(model, config, fused: bool, prompts: list[list[int]], steps: int, max_rows: int = MAX_ROWS,
               configure=None, head_major: bool | None = None) -> tuple[list, PagedCache]:
    """Prefill `prompts` (rows 0..n-1), then decode `steps` greedy steps with the rows in a shuffled order.
    `configure(strategy)` sets switches of the fused step (a FusedCpuDecode) before it runs; `head_major` picks the
    K/V pool's layout (None: the pool's default)."""
    cache = PagedCache(config, torch.float32, size=1024, rows=max(8, len(prompts)), head_major=head_major)
    cache.decode_strategy = make_fused(model, cache, max_rows) if fused else None
    if configure is not None:
        configure(cache.decode_strategy)
    cache.forward(model, [(row, prompt) for row, prompt in enumerate(prompts)])
    rows = list(range(len(prompts)))[::-1]
    next_tokens = {row: prompt[-1] for row, prompt in enumerate(prompts)}
    outputs = []
    for _ in range(steps):
        logits = cache.forward(model, [(row, [next_tokens[row]]) for row in rows])
        outputs.append(logits)
        for i, row in enumerate(rows):
            next_tokens[row] = int(logits[i].argmax())
    return outputs, cache


def assert_same_logits(actual: list, expected: list) -> None:
    """Each step's logits within TOL of the reference's, and the same greedy tokens."""
    assert len(actual) == len(expected)
    for step, (a, e) in enumerate(zip(actual, expected)):
        assert max_diff(a, e) < TOL, f"step {step}: {max_diff(a, e)}"
        assert torch.equal(a.argmax(-1), e.argmax(-1))


# The reference runs layer by layer on a slot-major pool; the fused step on either layout (head-major is the pool's
# default on CPU) computes the same logits and writes the same K/V.
@pytest.mark.parametrize("head_major", [True, False])
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_fused_decode_matches_layer_by_layer(tmp_path, family, head_major):
    config = tiny_config(family, num_hidden_layers=3)
    _, ours = build_models(tmp_path, config)
    quantize_linears(ours)
    prompts = [prompt_of(5, 1), prompt_of(17, 2), prompt_of(33, 3)]
    expected, plain_cache = decode_run(ours, config, False, prompts, steps=6, head_major=False)
    actual, fused_cache = decode_run(ours, config, True, prompts, steps=6, head_major=head_major)
    assert fused_cache.pool.k_buffer[0].is_contiguous() != head_major
    assert_same_logits(actual, expected)
    # The fused step wrote the same K/V into the same slots.
    for layer in range(config.num_hidden_layers):
        for fused_buf, plain_buf in ((fused_cache.pool.k_buffer[layer], plain_cache.pool.k_buffer[layer]),
                                     (fused_cache.pool.v_buffer[layer], plain_cache.pool.v_buffer[layer])):
            used = plain_cache.req_to_token_pool.req_to_token[:3, :40].flatten()
            used = used[used > 0]
            assert max_diff(fused_buf[used], plain_buf[used]) < TOL


@pytest.mark.parametrize("family,head_qtype", [("llama", "Q8_0"), ("qwen3", "Q4_1")])
def test_one_call_from_token_ids_to_logits_matches_layer_by_layer(tmp_path, family, head_qtype):
    """With the LM head on GGUF blocks the step runs from token ids to logits in one call (embedding and RoPE rows
    looked up in C++, the head as its last phase). It matches the layer-by-layer path, and gives exactly the bits
    of the same stack fed from Python (model.embed, then compute_logits with the same head kernel)."""
    config = tiny_config(family, num_hidden_layers=3)
    _, ours = build_models(tmp_path, config)
    quantize_linears(ours)
    quantize_head(ours, qtype=head_qtype)
    fused = make_fused(ours, PagedCache(config, torch.float32))
    assert fused.from_tokens and fused.with_head and fused.stack.has_head()
    assert fused.name == "fused CPU decode step (token ids to logits)"
    prompts = [prompt_of(5, 1), prompt_of(17, 2), prompt_of(33, 3)]
    expected, _ = decode_run(ours, config, False, prompts, steps=5)
    actual, _ = decode_run(ours, config, True, prompts, steps=5)
    assert_same_logits(actual, expected)

    def from_python(strategy):
        strategy.from_tokens = strategy.with_head = False

    python_fed, _ = decode_run(ours, config, True, prompts, steps=5, configure=from_python)
    for a, b in zip(actual, python_fed):
        assert torch.equal(a, b)


def test_head_and_token_inputs_only_where_they_compute_the_same(tmp_path):
    """The step ends with the head only when the head's blocks serve every batch it runs and compute like the
    layers (same int8 switch); it builds its own input only from a plain embedding and RoPE table."""
    from sglang.srt.layers.mrope import MRotaryEmbedding

    config = tiny_config("llama")
    _, ours = build_models(tmp_path, config)
    quantize_linears(ours)
    cache = PagedCache(config, torch.float32)
    plain_head = make_fused(ours, cache)
    assert plain_head.from_tokens and not plain_head.with_head and not plain_head.stack.has_head()
    quantize_head(ours, max_rows=MAX_ROWS // 2)  # the head's blocks stop below the step's batches
    assert not make_fused(ours, cache).with_head
    quantize_head(ours)
    ours.logits_processor.head_method.int8_activations = True  # the layers compute with float32 activations
    assert not make_fused(ours, cache).with_head
    ours.logits_processor.head_method.int8_activations = False
    assert make_fused(ours, cache).with_head
    rotary = ours.model.rotary_emb  # M-RoPE rows are not plain table rows: the model's lookup builds them
    ours.model.rotary_emb = MRotaryEmbedding(rotary.head_dim, 256, {"rope_theta": 10000.0},
                                             [rotary.rotary_dim // 4, rotary.rotary_dim // 8, rotary.rotary_dim // 8])
    try:
        mrope = make_fused(ours, cache)
        assert not mrope.from_tokens and not mrope.with_head and not mrope.stack.has_token_tables()
    finally:
        ours.model.rotary_emb = rotary


def test_fused_decode_is_used_only_for_small_decode_batches(tmp_path):
    config = tiny_config("llama")
    _, ours = build_models(tmp_path, config)
    quantize_linears(ours)
    cache = PagedCache(config, torch.float32)
    fused = make_fused(ours, cache, max_rows=2)
    calls = []

    class Counting:
        def forward(self, *args):
            calls.append(args[0].shape[0])
            return fused.stack.forward(*args)

    cache.decode_strategy = fused_decode.FusedCpuDecode(Counting(), max_rows=2)
    cache.forward(ours, [(0, prompt_of(6, 1)), (1, prompt_of(4, 2)), (2, prompt_of(1, 3))])
    assert calls == []  # extend batches, even one with a single-token sequence, run layer by layer
    cache.forward(ours, [(0, [5]), (1, [6])])
    assert calls == [2]
    cache.forward(ours, [(0, [5]), (1, [6]), (2, [7])])
    assert calls == [2]  # three rows > max_rows


def test_fused_decode_same_result_with_any_thread_count(tmp_path):
    """Every output element is computed by one thread in a fixed order, so the result does not depend on how the
    work items were shared out (4 threads on this 2-core machine also exercises threads that arrive late)."""
    config = tiny_config("qwen2")
    _, ours = build_models(tmp_path, config)
    quantize_linears(ours)
    prompts = [prompt_of(9, 4), prompt_of(3, 5)]
    before = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2, 4):
            torch.set_num_threads(threads)
            results.append(decode_run(ours, config, True, prompts, steps=3)[0])
    finally:
        torch.set_num_threads(before)
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)


@pytest.mark.parametrize("rows,convert_from", [(12, 10), (12, 0), (70, 10)],
                         ids=["12-groups-converted-once", "12-tile-kernels", "70-groups-converted-once"])
def test_many_rows_match_layer_by_layer_with_either_float_kernel(tmp_path, rows, convert_from):
    """A step of 12 or 70 rows (AVX2 CPUs run the fused step up to 512), with the LM head in it: the float32
    matmuls convert each row group once for all rows (the AVX2 default from 10 rows) or per tile of 8 rows (switch
    at 0); either way it matches the layer-by-layer path."""
    config = tiny_config("llama")
    _, ours = build_models(tmp_path, config)
    quantize_linears(ours, max_rows=128)
    quantize_head(ours, max_rows=128)
    prompts = [prompt_of(3 + i % 11, 20 + i) for i in range(rows)]
    expected, _ = decode_run(ours, config, False, prompts, steps=3, max_rows=128)
    previous = fused_decode.set_dequant_min_rows(convert_from)
    try:
        actual, _ = decode_run(ours, config, True, prompts, steps=3, max_rows=128)
    finally:
        fused_decode.set_dequant_min_rows(previous)
    assert_same_logits(actual, expected)


def test_fused_decode_same_result_with_any_matmul_split(tmp_path):
    """How many row-group chunks each thread's share of a matmul is cut into changes who computes what, never the
    bits: one contiguous run per thread (the layers' default) and 3 or 4 smaller ones, and 4, 2 or 1 for the LM
    head, on 2 threads."""
    config = tiny_config("llama")
    _, ours = build_models(tmp_path, config)
    quantize_linears(ours)
    quantize_head(ours)
    prompts = [prompt_of(7, 6), prompt_of(12, 7), prompt_of(2, 8)]
    before = torch.get_num_threads()
    results = []
    try:
        torch.set_num_threads(2)
        for items in (1, 3, 4):
            def configure(strategy, items=items):
                assert strategy.with_head
                assert strategy.stack.matmul_items_per_thread() == 1  # the defaults
                assert strategy.stack.head_items_per_thread() == 4
                strategy.stack.set_matmul_items_per_thread(items)
                strategy.stack.set_head_items_per_thread(5 - items)

            results.append(decode_run(ours, config, True, prompts, steps=3, configure=configure)[0])
    finally:
        torch.set_num_threads(before)
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)
    with pytest.raises(RuntimeError, match="items per thread"):
        make_fused(ours, PagedCache(config, torch.float32)).stack.set_matmul_items_per_thread(0)
    with pytest.raises(RuntimeError, match="items per thread"):
        make_fused(ours, PagedCache(config, torch.float32)).stack.set_head_items_per_thread(0)


def test_shared_input_only_for_int8_with_a_tile_for_every_thread(tmp_path):
    config = tiny_config("llama")
    _, ours = build_models(tmp_path, config)
    quantize_linears(ours)
    stack = make_fused(ours, PagedCache(config, torch.float32)).stack
    stack.set_int8_activations(True)
    assert stack.shared_input()
    assert stack.shares_input_for(16, 2) and stack.shares_input_for(19, 2) and stack.shares_input_for(64, 8)
    assert not stack.shares_input_for(8, 2) and not stack.shares_input_for(19, 4) and not stack.shares_input_for(64, 1)
    stack.set_int8_activations(False)  # float panels are a copy: each thread builds its own
    assert not stack.shares_input_for(64, 2)
    stack.set_int8_activations(True)
    stack.set_shared_input(False)
    assert not stack.shared_input() and not stack.shares_input_for(64, 2)


def test_shared_int8_input_gives_the_same_bits(tmp_path):
    """With int8 activations and a tile of 8 rows for every thread the team builds each matmul's input once, a tile
    per work item (norm, residual update, SiLU, int8 quantization); that must give exactly what every thread building
    the whole input gives. 19 sequences on 2 threads: three tiles, the last one partial."""
    config = tiny_config("qwen2")
    _, ours = build_models(tmp_path, config)
    quantize_linears(ours, max_rows=32)
    prompts = [prompt_of(3 + i, 10 + i) for i in range(19)]
    before = torch.get_num_threads()
    results = []
    try:
        torch.set_num_threads(2)
        for shared in (True, False):
            def configure(strategy, shared=shared):
                strategy.stack.set_int8_activations(True)
                strategy.stack.set_shared_input(shared)
                assert strategy.stack.shares_input_for(len(prompts), 2) == shared

            results.append(decode_run(ours, config, True, prompts, steps=3, max_rows=32, configure=configure)[0])
    finally:
        torch.set_num_threads(before)
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_fused_decode_rejects_bad_arguments(tmp_path):
    config = tiny_config("llama")
    _, ours = build_models(tmp_path, config)
    quantize_linears(ours)
    cache = PagedCache(config, torch.float32)
    stack = make_fused(ours, cache).stack
    hidden = config.hidden_size
    x = torch.randn(1, hidden)
    rd = ours.model.rotary_emb.rotary_dim
    cos, sin = torch.ones(1, rd), torch.zeros(1, rd)
    table = torch.zeros(4, 16, dtype=torch.int64)
    one = torch.ones(1, dtype=torch.int64)
    zero = torch.zeros(1, dtype=torch.int64)
    out = stack.forward(x, cos, sin, one, table, zero, one)
    assert out.shape == (1, hidden) and torch.isfinite(out).all()
    with pytest.raises(RuntimeError, match="slot out of range"):
        stack.forward(x, cos, sin, one * 10**9, table, zero, one)
    with pytest.raises(RuntimeError, match="request pool index"):
        stack.forward(x, cos, sin, one, table, one * 7, one)
    with pytest.raises(RuntimeError, match="sequence length"):
        stack.forward(x, cos, sin, one, table, zero, one * 99)
    with pytest.raises(RuntimeError, match="x must be"):
        stack.forward(torch.randn(1, hidden + 1), cos, sin, one, table, zero, one)
    with pytest.raises(RuntimeError, match="cos/sin"):
        stack.forward(x, cos[:, :2], sin, one, table, zero, one)
    logits = stack.forward_tokens(one, zero, one, table, zero, one)
    assert logits.shape == (1, hidden) and torch.isfinite(logits).all()  # no head: the normed hidden states
    with pytest.raises(RuntimeError, match="token id out of range"):
        stack.forward_tokens(one * config.vocab_size, zero, one, table, zero, one)
    with pytest.raises(RuntimeError, match="position out of range"):
        stack.forward_tokens(one, one * 10**6, one, table, zero, one)
    with pytest.raises(RuntimeError, match="differ in length"):
        stack.forward_tokens(one, torch.zeros(2, dtype=torch.int64), one, table, zero, one)
    with pytest.raises(RuntimeError, match="cos_half/sin_half"):
        stack.set_token_tables(ours.model.embed_tokens.weight.detach(), cos, sin)
    bare = fused_decode.FusedCpuDecode(stack, MAX_ROWS)
    assert not bare.from_tokens
    tableless = type(stack)(hidden_size=hidden, num_heads=4, num_kv_heads=2, head_dim=16, rotary_dim=rd,
                            intermediate_size=128, eps=1e-6, scale=0.25, final_norm=torch.ones(hidden))
    with pytest.raises(RuntimeError, match="no token tables"):
        tableless.forward_tokens(one, zero, one, table, zero, one)


def test_not_built_without_quantized_weights(tmp_path):
    config = tiny_config("llama")
    _, ours = build_models(tmp_path, config)
    cache = PagedCache(config, torch.float32)
    assert fused_decode.build_fused_decode(ours, cache.pool.k_buffer, cache.pool.v_buffer, MAX_ROWS) is None
    reason = fused_decode.why_not_fused(ours, cache.pool.k_buffer, cache.pool.v_buffer, MAX_ROWS)
    assert reason == "not every linear layer runs on GGUF Q4_1/Q8_0 blocks"


def test_model_runner_uses_fused_decode_on_the_packaged_model(smollm2_dir):
    """On the packaged Q4_1 SmolLM2 the runner builds the fused step, and greedy decoding with it produces the same
    logits (up to summation order) and tokens as the layer-by-layer path."""
    from sglang.bench_one_batch import build_runner, make_reqs, run_step
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.model_executor.decode_strategy import DecodePlan
    from sglang.srt.model_loader.model_info import load_model_info
    from sglang.srt.server_args import ServerArgs

    info = load_model_info(ServerArgs(model_path="HuggingFaceTB/SmolLM2-135M-Instruct", dtype="float32"))
    runner, mem = build_runner(info, "cpu", 512, 4, gguf_kernel_max_rows=64)
    plan = runner.decode_plan
    assert plan is not None and plan.fused is not None
    assert "batches of 1-64 sequences run the fused CPU decode step" in plan.description
    results = {}
    for fused in (True, False):
        runner.decode_plan = plan if fused else DecodePlan(None, "layer by layer")
        reqs = make_reqs(3, 20, 6, runner.vocab_size)
        batch = ScheduleBatch(reqs, is_decode=False)
        batch.prepare_for_extend(mem)
        out = run_step(runner, mem, batch)
        for req, tok in zip(reqs, out.sample.next_token_ids.tolist()):
            req.output_ids.append(tok)
            req.kv_committed_len = len(req.fill_ids)
        steps = []
        for _ in range(5):
            batch = ScheduleBatch(reqs, is_decode=True)
            batch.prepare_for_decode(mem)
            out = run_step(runner, mem, batch)
            steps.append(out.logits)
            for req, tok in zip(reqs, out.sample.next_token_ids.tolist()):
                req.output_ids.append(tok)
        results[fused] = (steps, [list(r.output_ids) for r in reqs])
        for req in reqs:
            mem.tree_cache.cache_finished_req(req)
        mem.clear()
    for a, b in zip(results[True][0], results[False][0]):
        torch.testing.assert_close(a, b, atol=2e-3, rtol=1e-4)
    assert results[True][1] == results[False][1]


def test_decode_plan_names_the_path_and_the_reason(tmp_path):
    """The one `Decode path:` log line says which code runs a decode batch of 8 sequences, and why."""
    from sglang.srt.layers.attention.torch_sdpa_backend import TorchSDPABackend
    from sglang.srt.model_executor.decode_strategy import plan_decode

    config = tiny_config("llama")
    _, ours = build_models(tmp_path, config)
    cache = PagedCache(config, torch.float32)
    cpu = torch.device("cpu")
    plain = plan_decode(ours, cache.pool, TorchSDPABackend(), MAX_ROWS, cpu)
    assert plain.fused is None
    assert plain.description.startswith("Decode path: every batch layer by layer (linears: ")
    assert "dense" in plain.description and "not every linear layer runs on GGUF Q4_1/Q8_0 blocks" in plain.description
    quantize_linears(ours)
    fused = plan_decode(ours, cache.pool, TorchSDPABackend(), MAX_ROWS, cpu)
    assert fused.fused is not None and fused.fused.max_rows == MAX_ROWS
    assert f"batches of 1-{MAX_ROWS} sequences run the fused CPU decode step" in fused.description
    assert "GGUF Q4_1 blocks up to 8 rows, dense beyond" in fused.description
    off = plan_decode(ours, cache.pool, TorchSDPABackend(), 0, cpu)
    assert off.fused is None and "--gguf-kernel-max-rows is 0" in off.description
