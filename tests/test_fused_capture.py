"""What the fused CPU decode step hands EAGLE drafting: the final normed hidden states beside the logits, and the
inputs of chosen layers (EAGLE3's `layers_to_capture`), in plain decode batches and in verify batches (several rows of
one sequence). They must equal what the layer-by-layer forward records on the same batch, up to float32 summation
order, and asking for them must not change a bit of the logits.

A tiny random Llama with Q4_1 / Q8_0 blocks (tests/test_fused_decode.py) runs the same prompts and steps through both
paths, each on its own KV pool with the same slots.
"""

from __future__ import annotations

import pytest
import torch

gguf = pytest.importorskip("gguf")

from sglang.srt.forward_batch import ForwardBatch, ForwardMode  # noqa: E402
from sglang.srt.layers.quantization.gguf_blocks import kernels_available  # noqa: E402
from sglang.srt.model_executor import fused_cpu_decode as fused_decode  # noqa: E402
from tests.test_fused_decode import make_fused, quantize_head, quantize_linears  # noqa: E402
from tests.test_fused_shared_rows import feed_rows  # noqa: E402
from tests.test_models import PagedCache, build_models, prompt_of, tiny_config  # noqa: E402

pytestmark = pytest.mark.skipif(not (kernels_available() and fused_decode.available()),
                                reason="the compiled CPU kernels are unavailable")

LAYERS = 4
CAPTURE = (0, 2, 3)  # layer 0's input is the embedding rows; the others the residual stream after a layer
PROMPTS = [prompt_of(5, 11), prompt_of(19, 12), prompt_of(33, 13)]


def decode_batch(cache: PagedCache, rows: list[tuple[int, list[int]]]) -> ForwardBatch:
    """A decode forward of `rows` (pool row, new tokens): each token one row at the next position of its sequence, so
    a row with several tokens is a verify step's (rows_share_sequences)."""
    ids, positions, pool_rows, locs = feed_rows(cache, rows)
    seq_lens = [p + 1 for p in positions]
    return ForwardBatch(
        forward_mode=ForwardMode.DECODE, batch_size=len(ids), input_ids=torch.tensor(ids),
        positions=torch.tensor(positions), req_pool_indices=torch.tensor(pool_rows), seq_lens=torch.tensor(seq_lens),
        out_cache_loc=torch.tensor(locs), seq_lens_cpu=seq_lens, extend_prefix_lens_cpu=positions,
        extend_seq_lens_cpu=[1] * len(ids), req_to_token_pool=cache.req_to_token_pool, token_to_kv_pool=cache.pool,
        attn_backend=cache.backend, rows_share_sequences=any(len(tokens) > 1 for _, tokens in rows),
    )


@torch.inference_mode()
def layer_by_layer(model, cache: PagedCache, forward_batch: ForwardBatch):
    """(logits, final hidden states, captured layer inputs or None) of the model's own forward."""
    cache.backend.init_forward_metadata(forward_batch)
    backbone = model.model
    backbone.aux_hidden_states = None
    hidden = backbone(forward_batch.input_ids, forward_batch.positions, forward_batch)
    return model.compute_logits(hidden, forward_batch), hidden, backbone.aux_hidden_states


@torch.inference_mode()
def fused_step(model, strategy, forward_batch: ForwardBatch):
    model.model.aux_hidden_states = None
    assert strategy.accepts(forward_batch)
    logits, hidden = strategy.forward_with_hidden(model, forward_batch)
    return logits, hidden, model.model.aux_hidden_states


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Within the float32 step's rounding: 1e-4 relative to the tensor's scale."""
    assert actual.shape == expected.shape, what
    scale = expected.abs().max().item()
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4 * scale, msg=what)


def run_both(model, config, capture: tuple[int, ...], configure=None) -> None:
    """Prefill PROMPTS on two pools, then the same decode and verify batches layer by layer on one and through the
    fused step on the other; every batch's logits, hidden states and captured inputs agree."""
    plain, fused = PagedCache(config, torch.float32), PagedCache(config, torch.float32)
    strategy = make_fused(model, fused)
    if configure is not None:
        configure(strategy)
    model.model.layers_to_capture = capture
    try:
        for cache in (plain, fused):
            cache.forward(model, [(row, prompt) for row, prompt in enumerate(PROMPTS)])
        batches = [[(2, [7]), (0, [8]), (1, [9])],                   # plain decode rows, shuffled
                   [(1, [3, 4, 5, 6]), (0, [10]), (2, [11, 12])],    # verify rows: 4, 1 and 2 per sequence
                   [(0, [13, 14, 15])]]                              # one sequence's verify rows alone
        for step, rows in enumerate(batches):
            want = layer_by_layer(model, plain, decode_batch(plain, rows))
            got = fused_step(model, strategy, decode_batch(fused, rows))
            for name, g, w in zip(("logits", "hidden", "aux"), got, want):
                if w is None:
                    assert g is None, f"step {step}: {name} captured without layers_to_capture"
                else:
                    assert_close(g, w, f"step {step}: {name}")
            assert torch.equal(got[0].argmax(-1), want[0].argmax(-1))
    finally:
        model.model.layers_to_capture = ()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    config = tiny_config("llama", num_hidden_layers=LAYERS)
    _, ours = build_models(tmp_path_factory.mktemp("capture"), config)
    quantize_linears(ours)
    quantize_head(ours)
    return ours, config


@pytest.mark.parametrize("capture", [(), CAPTURE], ids=["final-states", "final-and-layer-inputs"])
def test_one_call_with_head_hands_back_what_layer_by_layer_records(model, capture):
    """The step from token ids to logits (the LM head its last phase) returns the head's input too, and the captured
    layers' inputs, matching the layer-by-layer forward in decode and verify batches."""
    ours, config = model
    assert make_fused(ours, PagedCache(config, torch.float32)).with_head
    run_both(ours, config, capture)


def test_python_fed_stack_without_head_captures_the_same(model):
    """Fed from Python (model.embed; no head in the step: compute_logits after it) the capture is the same."""
    ours, config = model

    def from_python(strategy):
        strategy.from_tokens = strategy.with_head = False

    run_both(ours, config, CAPTURE, configure=from_python)


def test_capture_changes_no_bit_of_the_output(model):
    """The plain call and the capturing one give the same logits bit for bit; the hidden states are the head's
    input (compute_logits over them gives the head's logits) and the captured block of a layer is its input."""
    ours, config = model
    caches = [PagedCache(config, torch.float32) for _ in range(3)]
    strategies = [make_fused(ours, cache) for cache in caches]
    outputs = []
    for n, (cache, strategy) in enumerate(zip(caches, strategies)):
        cache.forward(ours, [(row, prompt) for row, prompt in enumerate(PROMPTS)])
        forward_batch = decode_batch(cache, [(0, [5]), (1, [6, 7]), (2, [8])])
        ours.model.layers_to_capture = CAPTURE if n == 2 else ()
        try:
            with torch.inference_mode():
                outputs.append(strategy.forward(ours, forward_batch) if n == 0
                               else strategy.forward_with_hidden(ours, forward_batch))
        finally:
            ours.model.layers_to_capture = ()
    plain, (logits, hidden), (logits_aux, hidden_aux) = outputs
    assert torch.equal(plain, logits) and torch.equal(plain, logits_aux) and torch.equal(hidden, hidden_aux)
    aux = ours.model.aux_hidden_states
    assert aux is not None and aux.shape == (4, len(CAPTURE) * config.hidden_size)
    # Layer 0's input is the embedding rows of the tokens.
    assert torch.equal(aux[:, : config.hidden_size], ours.model.embed_tokens.weight[torch.tensor([5, 6, 7, 8])])


def test_capture_same_bits_with_shared_or_per_thread_input(tmp_path):
    """With int8 activations and a tile of rows for every thread, the team builds each matmul input (residual update
    included) once, tile by tile, and each tile's item copies its rows' layer inputs; otherwise one item of the phase
    does. 19 verify-like rows on 2 threads: both give the same bits."""
    config = tiny_config("llama", num_hidden_layers=LAYERS)
    _, ours = build_models(tmp_path, config)
    quantize_linears(ours, max_rows=32)
    prompts = [prompt_of(3 + i, 40 + i) for i in range(7)]
    before = torch.get_num_threads()
    results = []
    try:
        torch.set_num_threads(2)
        ours.model.layers_to_capture = CAPTURE
        for shared in (True, False):
            cache = PagedCache(config, torch.float32, rows=8)
            strategy = make_fused(ours, cache, max_rows=32)
            strategy.stack.set_int8_activations(True)
            strategy.stack.set_shared_input(shared)
            cache.forward(ours, [(row, prompt) for row, prompt in enumerate(prompts)])
            rows = [(row, [row + 1, row + 2, row + 3]) for row in range(6)] + [(6, [9])]
            forward_batch = decode_batch(cache, rows)
            assert strategy.stack.shares_input_for(forward_batch.batch_size, 2) == shared
            results.append(fused_step(ours, strategy, forward_batch))
    finally:
        torch.set_num_threads(before)
        ours.model.layers_to_capture = ()
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_bad_capture_layers_are_refused(model):
    ours, config = model
    cache = PagedCache(config, torch.float32)
    stack = make_fused(ours, cache).stack
    one, zero = torch.ones(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
    table = torch.zeros(4, 16, dtype=torch.int64)
    logits, hidden, aux = stack.forward_tokens_capture(one, zero, one, table, zero, one, False, None, [])
    assert logits.shape == (1, config.vocab_size) and hidden.shape == (1, config.hidden_size) and aux.shape == (1, 0)
    for layers, message in (([LAYERS], "out of range"), ([-1], "out of range"), ([2, 1], "ascending"),
                            ([1, 1], "ascending")):
        with pytest.raises(RuntimeError, match=message):
            stack.forward_tokens_capture(one, zero, one, table, zero, one, False, None, layers)


# ---- the served model's runner and the Engine with EAGLE / EAGLE3 ------------------------------------------------
SPEC_LAYERS = 8  # EAGLE3 reads the inputs of layers 2, 4 and 5 (SGLang's default for 8 layers)
STATES = {"EAGLE": "the final hidden states", "EAGLE3": "the inputs of layers [2, 4, 5]"}


@pytest.fixture(scope="module")
def spec_models(tmp_path_factory, smollm2_tokenizer):
    """An eight-layer tiny random Llama (its projections scaled up so that greedy outputs change token now and then;
    much more and its outputs hang on near ties that the rounding of other batch shapes breaks either way) and a
    random EAGLE-1 and EAGLE-3 head for it, in their published layouts."""
    from tests.test_speculative_eagle import save_eagle_head
    from tests.test_speculative_eagle3 import DRAFT_VOCAB, head_weights, save_eagle3_head, scaled_tiny_target

    target, hf = scaled_tiny_target(tmp_path_factory.mktemp("capture-target"), smollm2_tokenizer, SPEC_LAYERS, 3)
    config = hf.config
    hidden = config.hidden_size
    gen = torch.Generator().manual_seed(21)
    layer = {name: torch.randn(t.shape, generator=gen) * (0.2 if t.dim() > 1 else 1.0)
             for name, t in hf.model.layers[0].state_dict().items()}
    eagle = save_eagle_head(tmp_path_factory.mktemp("capture-eagle"), config,
                            torch.randn(hidden, 2 * hidden, generator=gen) * 0.2,
                            torch.randn(hidden, generator=gen) * 0.1, layer)
    hot = torch.randperm(config.vocab_size, generator=gen)[:DRAFT_VOCAB].sort().values
    eagle3 = save_eagle3_head(tmp_path_factory.mktemp("capture-eagle3"), config,
                              head_weights(hidden, config.intermediate_size, DRAFT_VOCAB, gen), hot)
    return {"target": target, "config": config, "EAGLE": eagle, "EAGLE3": eagle3, "hf": hf}


@pytest.mark.parametrize("algorithm", ["EAGLE", "EAGLE3"])
def test_runner_keeps_the_fused_step_and_records_its_states(spec_models, algorithm):
    """With an EAGLE / EAGLE3 head the served model's runner keeps the fused step (its `Decode path:` line says what
    the step hands the head), and the states the head's log records from a prompt, a decode row and verify rows are
    those the layer-by-layer forward records."""
    from sglang.srt.layers.arithmetic import ArithmeticPlan
    from sglang.srt.mem_cache.memory_pools import build_memory_pools
    from sglang.srt.model_executor.decode_strategy import DecodePlan
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.speculative.draft_model import DraftModel
    from sglang.srt.speculative.eagle_draft import EagleDraft

    target, config = spec_models["target"], spec_models["config"]
    plan = ArithmeticPlan("cpu", "test", torch.float32, "float32", "test", small_batch_quantization="q8_0",
                          small_batch_max_rows=8)
    runner = ModelRunner(target, config, torch.float32, "cpu", gguf_kernel_max_rows=8, arithmetic=plan)
    mem = build_memory_pools(runner.kv_cache_spec(), runner.device, 512, 256, 0.5, 2, True)
    runner.bind_kv_pool(mem.kv_pool)
    fused = runner.decode_plan.fused
    assert fused is not None and fused.with_head  # the tied head on Q8_0 blocks ends the step
    args = ServerArgs(model_path=target, dtype="float32", speculative_algorithm=algorithm,
                      speculative_draft_model_path=spec_models[algorithm], speculative_num_steps=3)
    args.validate()
    draft = EagleDraft.load_eagle(args, runner, context_len=512, target_tokens=256, max_requests=2)
    described = runner.decode_plan
    assert described.fused is fused
    assert described.description.startswith("Decode path: batches of 1-8 sequences run the fused CPU decode step")
    assert described.description.endswith(f"; with {algorithm} the fused step also returns {STATES[algorithm]} "
                                          "from its one call")
    ids = list(range(300, 330))
    row = mem.req_to_token_pool.alloc()
    mem.req_to_token_pool.req_to_token[row, : len(ids)] = mem.alloc_slots(len(ids))
    feeder = DraftModel(runner, mem, 512, 4096, "served model")
    calls = []
    stack_call = fused.stack

    class Counting:  # the fused step's stack, counting the calls that hand states back
        def __getattr__(self, name):
            if name.endswith("_capture"):
                calls.append(name)
            return getattr(stack_call, name)

    recorded = {}
    for use_fused in (True, False):
        runner.decode_plan = DecodePlan(fused, described.description) if use_fused else DecodePlan(None, "plain")
        fused.stack = Counting()
        draft.hidden.drop(row)
        # a prompt (extend), one decode row, then verify rows of 4 and 3 positions
        for start, end in ((0, 22), (22, 23), (23, 27), (27, 30)):
            forward_batch, _ = feeder._forward_batch([(row, start, ids[start:end])])
            runner.forward(forward_batch, None)
        recorded[use_fused] = draft.hidden.get(row, 0, len(ids)).clone()
        fused.stack = stack_call
    assert calls == ["forward_tokens_capture"] * 3  # the decode and verify forwards, with the fused step only
    width = config.hidden_size * (3 if algorithm == "EAGLE3" else 1)
    assert recorded[True].shape == (len(ids), width)
    assert_close(recorded[True], recorded[False], "recorded states")
    # The prompt ran layer by layer both times: its rows are the same bits.
    assert torch.equal(recorded[True][:22], recorded[False][:22])


def test_engine_with_eagle_heads_keeps_the_fused_step(spec_models, smollm2_tokenizer):
    """In-process engines on Q8_0 blocks (the fused step up to 64 rows: every verify step here): with an EAGLE and an
    EAGLE3 head the decode path (the startup log's line, in get_server_info) says the fused step hands the head its
    states, requests are verified, and greedy outputs, in a batch and alone, are plain decoding's up to a near-tie
    of the served model (a token transformers rates within BF16_MARGIN of the other: this random model repeats a
    token, then switches at a position where two tokens nearly tie)."""
    from sglang import Engine
    from tests.greedy_cases import BF16_MARGIN, assert_same_or_near_tie
    from tests.test_speculative_standalone import PROMPTS, STEPS, assert_engine_idle

    prompts = [*PROMPTS[:5], " ".join(PROMPTS)]
    params = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
    # float32 prefill GEMM: the int8 GEMM picks its outlier columns per batch, so prefills batched otherwise (as the
    # speculative engine's may be) could round differently and flip this random model's near-ties
    common = dict(model_path=spec_models["target"], dtype="float32", max_total_tokens=4096, log_level="info",
                  small_batch_quantization="q8_0", cpu_gemm="float32")
    plain = Engine(**common)
    try:
        want = [g["output_ids"] for g in plain.generate(prompt=prompts, sampling_params=params)]
        assert "run the fused CPU decode step" in plain.get_server_info()["decode_path"]
    finally:
        plain.shutdown()
    for algorithm in ("EAGLE", "EAGLE3"):
        engine = Engine(**common, speculative_algorithm=algorithm,
                        speculative_draft_model_path=spec_models[algorithm], speculative_num_steps=STEPS)
        try:
            got = engine.generate(prompt=prompts, sampling_params=params)
            one = engine.generate(prompt=prompts[0], sampling_params=params)  # batch 1
            for prompt, ours, expected in zip([*prompts, prompts[0]], [*got, one], [*want, want[0]]):
                assert_same_or_near_tie(spec_models["hf"], smollm2_tokenizer, prompt, ours["output_ids"], expected,
                                        BF16_MARGIN)
            assert all(g["meta_info"]["spec_verify_ct"] > 0 for g in [*got, one])
            assert_engine_idle(engine)
            path = engine.get_server_info()["decode_path"]
        finally:
            engine.shutdown()
        assert f"with {algorithm} the fused step also returns {STATES[algorithm]} from its one call" in path, path
        assert "every batch runs layer by layer" not in path
