"""LoRA deltas inside the fused CPU decode step (csrc/lora_deltas.h): a decode batch mixing adapters of different
ranks and target modules with base-model rows runs through the step and matches the layer-by-layer path (whose
LoRA is checked against merged / peft models in test_lora.py) up to float32 summation order."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

gguf = pytest.importorskip("gguf")

from sglang.srt.forward_batch import ForwardMode  # noqa: E402
from sglang.srt.layers.quantization.gguf_blocks import kernels_available  # noqa: E402
from sglang.srt.lora.layers import lora_rows  # noqa: E402
from sglang.srt.lora.manager import LoraManager  # noqa: E402
from sglang.srt.model_executor import fused_cpu_decode as fused_decode  # noqa: E402
from tests.test_fused_decode import assert_same_logits, make_fused, quantize_head, quantize_linears  # noqa: E402
from tests.test_lora import write_adapter  # noqa: E402
from tests.test_models import PagedCache, build_models, max_diff, prompt_of, tiny_config  # noqa: E402

pytestmark = pytest.mark.skipif(not (kernels_available() and fused_decode.available()),
                                reason="the compiled CPU kernels are unavailable")

ROWS = ["r6", None, "r16", "r6", "r16", None]


class LoraStep:
    """The fused step as the runner drives it: the batch names each row's adapter, the step gets the LoRA state.
    Records the adapters of every decode batch it ran."""

    def __init__(self, fused, manager: LoraManager) -> None:
        self.fused, self.manager = fused, manager
        self.names: list = []
        self.calls: list = []

    def accepts(self, forward_batch) -> bool:
        forward_batch.lora_ids = self.names if any(n is not None for n in self.names) else None
        return self.fused.accepts(forward_batch, self.manager.state)

    def forward(self, model, forward_batch):
        self.calls.append(forward_batch.lora_ids)
        return self.fused.forward(model, forward_batch, self.manager.state)


def make_model(tmp_path, family: str = "llama", head: bool = False, max_rows: int = 8):
    """A tiny quantized model with a manager holding "r6" (rank 6, every module) and "r16" (rank 16, q/v of the
    fused QKV, up of the fused gate/up, and down: shards missing in both fused linears)."""
    config = tiny_config(family, num_hidden_layers=3)
    _, ours = build_models(tmp_path / "model", config)
    quantize_linears(ours, max_rows=max_rows)
    if head:
        quantize_head(ours, max_rows=max_rows)
    manager = LoraManager(ours, 16, None, 4, torch.float32)
    manager.load("r6", write_adapter(tmp_path / "r6", config, rank=6, seed=51))
    manager.load("r16", write_adapter(tmp_path / "r16", config, modules=("q_proj", "v_proj", "up_proj", "down_proj"),
                                      rank=16, alpha=8.0, seed=52, std=0.2))
    return config, ours, manager


def decode_with_lora(model, config, manager, names, fused: bool, steps: int = 4, max_rows: int = 8,
                     configure=None, decode_threads: int | None = None) -> tuple[list, Any]:
    """Prefill one prompt per entry of `names` (row i under adapter names[i]), then greedy decode steps with the rows
    in reversed order (on `decode_threads` threads where given); returns (each step's logits, the LoraStep or
    None)."""
    prompts = [prompt_of(4 + 3 * i, 30 + i) for i in range(len(names))]
    cache = PagedCache(config, torch.float32, size=1024, rows=max(8, len(names)))
    step = LoraStep(make_fused(model, cache, max_rows), manager) if fused else None
    if step is not None and configure is not None:
        configure(step.fused)
    cache.decode_strategy = step  # type: ignore[assignment]
    order = list(range(len(names)))[::-1]
    with lora_rows(manager.state, names, [len(p) for p in prompts]):
        if step is not None:
            step.names = list(names)
        cache.forward(model, list(enumerate(prompts)))
    next_tokens = {i: p[-1] for i, p in enumerate(prompts)}
    if decode_threads is not None:
        torch.set_num_threads(decode_threads)
    outputs = []
    for _ in range(steps):
        step_names = [names[i] for i in order]
        if step is not None:
            step.names = step_names
        with lora_rows(manager.state, step_names, [1] * len(order)):
            logits = cache.forward(model, [(i, [next_tokens[i]]) for i in order])
        outputs.append(logits)
        for row, i in enumerate(order):
            next_tokens[i] = int(logits[row].argmax())
    return outputs, step


@pytest.mark.parametrize("family,head", [("llama", False), ("llama", True), ("qwen2", True)],
                         ids=["llama-hidden", "llama-tokens-to-logits", "qwen2-bias-tokens-to-logits"])
def test_mixed_adapter_batch_runs_fused_and_matches_layer_by_layer(tmp_path, family, head):
    config, ours, manager = make_model(tmp_path, family, head)
    expected, _ = decode_with_lora(ours, config, manager, ROWS, fused=False)
    actual, step = decode_with_lora(ours, config, manager, ROWS, fused=True)
    # every decode batch ran through the fused step, with its rows' adapters
    assert step.calls == [[ROWS[i] for i in range(len(ROWS))][::-1]] * len(expected)
    assert step.fused.with_head == head and step.fused.stack.lora_adapters() == 2
    assert_same_logits(actual, expected)
    # the adapters change their rows' logits, the base-model rows are those of a step without adapters
    base, _ = decode_with_lora(ours, config, manager, [None] * len(ROWS), fused=True, steps=1)
    for row, name in enumerate(ROWS[::-1]):
        diff = max_diff(actual[0][row], base[0][row])
        assert (diff == 0.0) if name is None else (diff > 1e-2), name


def test_lora_step_bits_do_not_depend_on_threads_or_shared_input(tmp_path):
    """Every LoRA output element is computed by one thread in a fixed order: 1, 2 or 4 threads, and the int8 input
    built once for the team (19 rows on 2 threads) or by every thread, give the same bits. The prefill runs layer by
    layer on torch's GEMMs, whose sums may depend on the thread count: it runs on 2 threads each time."""
    config, ours, manager = make_model(tmp_path, max_rows=32)
    names = [ROWS[i % len(ROWS)] for i in range(19)]
    before = torch.get_num_threads()
    results = []
    try:
        for threads, shared in ((1, False), (2, False), (4, False), (2, True)):
            torch.set_num_threads(2)

            def configure(strategy, shared=shared):
                strategy.stack.set_int8_activations(True)
                strategy.stack.set_shared_input(shared)
                assert strategy.stack.shares_input_for(len(names), 2) == shared

            results.append(decode_with_lora(ours, config, manager, names, fused=True, steps=2, max_rows=32,
                                            configure=configure, decode_threads=threads)[0])
    finally:
        torch.set_num_threads(before)
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)


def test_slots_follow_loads_and_unloads(tmp_path):
    config, ours, manager = make_model(tmp_path)
    fused = make_fused(ours, PagedCache(config, torch.float32))
    slots = fused.lora_slots
    state = manager.state
    assert slots.row_slots(state, ["r16", None, "r6", "r16"]).tolist() == [0, -1, 1, 0]
    assert fused.stack.lora_adapters() == 2
    manager.unload("r16")
    assert slots.row_slots(state, [None, "r6"]).tolist() == [-1, 1]
    assert fused.stack.lora_adapters() == 1  # the unloaded adapter's slot is released
    manager.load("again", write_adapter(tmp_path / "again", config, rank=8, seed=53))
    assert slots.row_slots(state, ["again", "r6"]).tolist() == [0, 1]
    manager.unload("again")
    slots.sync(state)  # a step without adapter rows also releases the slots of adapters gone from memory
    assert fused.stack.lora_adapters() == 1 and "again" not in slots.slots
    # a batch naming an adapter not in memory, or with several rows per sequence, is left to the layer-by-layer path
    decode = SimpleNamespace(forward_mode=ForwardMode.DECODE, batch_size=2, input_ids=torch.tensor([5, 6]),
                             lora_ids=["r6", None])
    assert fused.accepts(decode, state) and not fused.accepts(decode)
    assert not fused.accepts(SimpleNamespace(**{**vars(decode), "lora_ids": ["gone", None]}), state)
    assert not fused.accepts(SimpleNamespace(**{**vars(decode), "batch_size": 1, "lora_ids": ["r6"]}), state)
    with pytest.raises(RuntimeError, match="holds no adapter"):
        fused.stack.forward_tokens(torch.tensor([1]), torch.tensor([0]), torch.tensor([1]),
                                   torch.zeros(1, 4, dtype=torch.long), torch.tensor([0]), torch.tensor([1]),
                                   lora_slots=torch.tensor([7]))


def test_engine_greedy_with_peft_adapters_through_the_fused_step(tmp_path, smollm2_tokenizer):
    """Through sglang.Engine with Q8_0 blocks made at load, so that the fused step serves the decode batches (without
    the adapters' deltas in it these tokens differ from peft's), on a checkpoint whose weights are already the
    blocks' values: greedy tokens of a batch mixing two peft adapters (ranks 6 and 16, different modules) and the
    base model, and of one adapter alone, equal peft's PeftModel."""
    peft = pytest.importorskip("peft")
    import copy

    from transformers import AutoModelForCausalLM, LlamaConfig

    from sglang import Engine
    from sglang.srt.model_loader.q8_blocks import quantize_q8_0
    from tests.test_lora import hf_greedy

    tokenizer = smollm2_tokenizer
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         initializer_range=0.2, tie_word_embeddings=False, eos_token_id=tokenizer.eos_token_id,
                         bos_token_id=tokenizer.bos_token_id)
    torch.manual_seed(61)
    base = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # weights the Q8_0 blocks hold exactly: the fused step computes with the same values
        for name, param in base.named_parameters():
            if param.dim() == 2 and "embed_tokens" not in name:
                param.copy_(quantize_q8_0(param.detach()).dequantize().reshape(param.shape))
    model_dir = tmp_path / "model"
    base.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    specs = {"r6": (6, "all-linear"), "r16": (16, ["q_proj", "v_proj", "up_proj", "down_proj"])}
    adapters = {}
    for i, (name, (rank, targets)) in enumerate(specs.items()):
        torch.manual_seed(70 + i)
        cfg = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False,
                              task_type="CAUSAL_LM")
        adapters[name] = peft.get_peft_model(copy.deepcopy(base), cfg).eval()
        adapters[name].save_pretrained(str(tmp_path / name))
    prompts = [[5, 17, 300, 42, 9, 77], [8, 1000, 3, 3, 12], [400, 401, 402, 17, 5000]]
    names = ["r16", None, "r6"]
    expected = [hf_greedy(base if n is None else adapters[n], ids) for ids, n in zip(prompts, names)]
    assert len({tuple(e) for e in expected}) == 3
    greedy = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
    with Engine(model_path=str(model_dir), dtype="float32", small_batch_quantization="q8_0",
                gguf_activations="float32", kv_cache_dtype="float32", max_lora_rank=16, max_total_tokens=2048,
                lora_paths=[f"{n}={tmp_path / n}" for n in specs]) as engine:
        assert engine.get_server_info()["arithmetic"]["small_batch_quantization"] == "q8_0"
        batch = engine.generate(input_ids=prompts, sampling_params=greedy, lora_path=names)
        alone = engine.generate(input_ids=prompts[0], sampling_params=greedy, lora_path="r16")
    assert [o["output_ids"] for o in batch] == expected
    assert alone["output_ids"] == expected[0]
