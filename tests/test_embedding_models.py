"""Embedding, reward and cross-encoder models through ModelRunner.pool against transformers.

all-MiniLM-L6-v2 (the packaged checkpoint) is compared with sentence-transformers-style mean pooling computed
with transformers; the other architectures are tiny random checkpoints built here. Every sequence is run alone
and in one batch with the others, so padding, masks and the per-sequence reduction are all on the path.
"""

from __future__ import annotations

import types
from typing import Any, Optional

import pytest
import torch
import torch.nn.functional as F

from sglang.srt.forward_batch import ForwardBatch, ForwardMode, build_positions
from sglang.srt.mem_cache.kv_pool import KVPool
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.model_loader.resolve import resolve_model_path

MINILM = "sentence-transformers/all-MiniLM-L6-v2"
SENTENCES = [
    "Hi",
    "The quick brown fox jumps over the lazy dog.",
    "SGLang is a fast serving framework for large language models and vision language models.",
    "Embeddings map text to vectors.",
    "What is the capital of France?",
    "Paris is the capital and most populous city of France, with an estimated population of two million.",
    "ok",
    "A man is eating food.",
    "A man is riding a white horse on an enclosed ground.",
    "Transformers use attention to mix information between all the tokens of a sequence, in every layer.",
    "cats",
    "I love programming in Python because it is readable.",
    "The weather today is sunny with a light breeze from the west.",
    "Quantum computers exploit superposition.",
    "Where is the nearest train station?",
    "Mean pooling averages the token vectors of a sentence, ignoring padding.",
    "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20",
    "Ünïcödé and emoji 🚀 still tokenize.",
    "Short.",
    "Batching many short sentences into one forward pass keeps every CPU core busy instead of idling between calls.",
]


def run_pool(runner: ModelRunner, seqs: list[list[int]], token_types: Optional[list[list[int]]] = None
             ) -> torch.Tensor:
    """One ModelRunner.pool call over `seqs` (whole sequences, nothing cached)."""
    lens = [len(s) for s in seqs]
    total = sum(lens)
    spec = runner.kv_cache_spec()
    pool = KVPool(total + 1, spec.num_layers, spec.num_kv_heads, spec.head_dim, runner.dtype)
    table = torch.zeros(len(seqs), max(lens), dtype=torch.int64)
    slots = torch.arange(1, total + 1)
    offset = 0
    for row, n in enumerate(lens):
        table[row, :n] = slots[offset:offset + n]
        offset += n
    forward_batch = ForwardBatch(
        forward_mode=ForwardMode.EXTEND,
        batch_size=len(seqs),
        input_ids=torch.tensor([t for s in seqs for t in s]),
        positions=build_positions([0] * len(seqs), lens, torch.device("cpu")),
        req_pool_indices=torch.arange(len(seqs)),
        seq_lens=torch.tensor(lens),
        out_cache_loc=slots,
        seq_lens_cpu=lens,
        extend_prefix_lens_cpu=[0] * len(seqs),
        extend_seq_lens_cpu=lens,
        req_to_token_pool=types.SimpleNamespace(req_to_token=table),  # type: ignore[arg-type]
        token_to_kv_pool=pool,
        token_type_ids=torch.tensor([t for s in token_types for t in s]) if token_types else None,
    )
    return runner.pool(forward_batch)


def runner_for(model_dir: str) -> ModelRunner:
    from transformers import AutoConfig

    return ModelRunner(model_dir, AutoConfig.from_pretrained(model_dir), torch.float32, "cpu")


def assert_rows_close(ours: torch.Tensor, ref: torch.Tensor, what: str, min_cos: float = 0.9999,
                      atol: Optional[float] = None) -> None:
    assert ours.shape == ref.shape, (what, ours.shape, ref.shape)
    cos = F.cosine_similarity(ours.double(), ref.double(), dim=-1)
    assert float(cos.min()) > min_cos, f"{what}: min cosine {float(cos.min())}"
    if atol is not None:
        assert float((ours - ref).abs().max()) < atol, f"{what}: max diff {float((ours - ref).abs().max())}"


# ---- all-MiniLM-L6-v2 -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def minilm():
    from transformers import AutoModel, AutoTokenizer

    model_dir = resolve_model_path(MINILM)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    reference = AutoModel.from_pretrained(model_dir).eval()
    return model_dir, tokenizer, reference, runner_for(model_dir)


def st_mean_pooling(reference, tokenizer, sentences: list[str]) -> torch.Tensor:
    """sentence-transformers' Pooling(mean) + Normalize, written with transformers."""
    enc = tokenizer(sentences, padding=True, return_tensors="pt")
    with torch.inference_mode():
        hidden = reference(**enc).last_hidden_state
    mask = enc["attention_mask"].unsqueeze(-1).float()
    mean = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
    return F.normalize(mean, p=2, dim=-1)


def test_minilm_pooling_config_is_mean_normalized(minilm):
    runner = minilm[3]
    assert runner.pooler.config.pooling_type.value == "mean" and runner.pooler.config.normalize


def test_minilm_matches_transformers_alone_and_batched(minilm):
    _, tokenizer, reference, runner = minilm
    expected = st_mean_pooling(reference, tokenizer, SENTENCES)
    ids = [tokenizer.encode(s) for s in SENTENCES]
    assert len({len(i) for i in ids}) > 10  # lengths really differ
    batched = run_pool(runner, ids)
    assert_rows_close(batched, expected, "batched", atol=1e-4)
    alone = torch.cat([run_pool(runner, [i]) for i in ids])
    assert_rows_close(alone, expected, "alone", atol=1e-4)
    assert torch.allclose(batched.norm(dim=-1), torch.ones(len(SENTENCES)), atol=1e-5)


# ---- tiny random checkpoints ----------------------------------------------------------------------------
def _random_biases(model: torch.nn.Module, seed: int) -> None:
    """HF initialises biases and LayerNorms to 0/1; random values prove they are loaded and applied."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "LayerNorm" in name or "norm" in name:
                p.add_(torch.randn(p.shape, generator=generator) * 0.2)


def _save(reference, tmp_path) -> str:
    reference.eval()
    reference.save_pretrained(tmp_path)
    return str(tmp_path)


def random_seqs(vocab: int, lengths: list[int], seed: int, low: int = 5) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(low, vocab, (n,), generator=g).tolist() for n in lengths]


LENGTHS = [7, 1, 19, 3, 12, 30, 2]


def _decoder_common(**overrides: Any) -> dict[str, Any]:
    common = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  initializer_range=0.2, rms_norm_eps=1e-6, tie_word_embeddings=False, pad_token_id=0)
    common.update(overrides)
    return common


def _reference_last_hidden(reference_backbone, seqs: list[list[int]]) -> torch.Tensor:
    with torch.inference_mode():
        return torch.stack([reference_backbone(torch.tensor([s])).last_hidden_state[0, -1] for s in seqs])


def test_qwen2_decoder_as_embedder_last_token(tmp_path):
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(Qwen2Config(**_decoder_common()))
    _random_biases(reference, 1)
    runner = runner_for(_save(reference, tmp_path))
    seqs = random_seqs(256, LENGTHS, 2)
    expected = F.normalize(_reference_last_hidden(reference.model, seqs), dim=-1)
    assert_rows_close(run_pool(runner, seqs), expected, "batched", atol=1e-4)
    assert_rows_close(torch.cat([run_pool(runner, [s]) for s in seqs]), expected, "alone", atol=1e-4)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_sequence_classification_reward_models(tmp_path, family):
    from transformers import AutoModelForSequenceClassification, LlamaConfig, Qwen2Config

    config_class = {"llama": LlamaConfig, "qwen2": Qwen2Config}[family]
    config = config_class(**_decoder_common(num_labels=1))
    config.architectures = [f"{'Llama' if family == 'llama' else 'Qwen2'}ForSequenceClassification"]
    torch.manual_seed(0)
    reference = AutoModelForSequenceClassification.from_config(config)
    _random_biases(reference, 3)
    runner = runner_for(_save(reference, tmp_path))
    seqs = random_seqs(256, LENGTHS, 4)
    with torch.inference_mode():
        expected = torch.cat([reference(torch.tensor([s])).logits for s in seqs]).float()
    assert_rows_close(run_pool(runner, seqs), expected, "batched", min_cos=0.99999, atol=1e-4)


def test_qwen2_reward_model_head(tmp_path):
    """Qwen2ForRewardModel (Qwen2.5-Math-RM): score = Linear -> ReLU -> Linear on the last token."""
    from transformers import Qwen2Config, Qwen2Model

    config = Qwen2Config(**_decoder_common(num_labels=1))
    config.architectures = ["Qwen2ForRewardModel"]
    torch.manual_seed(0)

    class Reference(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = Qwen2Model(config)
            self.score = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))

    reference = Reference().eval()
    _random_biases(reference, 5)
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in reference.state_dict().items()}, str(tmp_path / "model.safetensors"))
    config.save_pretrained(tmp_path)
    runner = runner_for(str(tmp_path))
    seqs = random_seqs(256, LENGTHS, 6)
    with torch.inference_mode():
        expected = reference.score(_reference_last_hidden(reference.model, seqs))
    assert_rows_close(run_pool(runner, seqs), expected, "batched", min_cos=0.99999, atol=1e-4)


def _encoder_config(kind: str):
    from transformers import BertConfig, XLMRobertaConfig

    common = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=80, initializer_range=0.2, num_labels=1)
    if kind == "bert":
        config = BertConfig(type_vocab_size=2, **common)
        config.architectures = ["BertForSequenceClassification"]
    else:
        config = XLMRobertaConfig(type_vocab_size=1, pad_token_id=1, **common)
        config.architectures = ["XLMRobertaForSequenceClassification"]
    return config


@pytest.mark.parametrize("kind", ["bert", "xlm-roberta"])
def test_cross_encoders_match_transformers(tmp_path, kind):
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(0)
    reference = AutoModelForSequenceClassification.from_config(_encoder_config(kind))
    _random_biases(reference, 7)
    runner = runner_for(_save(reference, tmp_path))
    seqs = random_seqs(300, LENGTHS, 8)
    # sentence pairs: the second segment (after the first third) has token type 1 where the model has two types
    types_ = [[0] * (len(s) // 3) + [1 if kind == "bert" else 0] * (len(s) - len(s) // 3) for s in seqs]
    with torch.inference_mode():
        expected = torch.cat([
            reference(torch.tensor([s]), token_type_ids=torch.tensor([t])).logits for s, t in zip(seqs, types_)
        ]).float()
    assert_rows_close(run_pool(runner, seqs, types_), expected, "batched", min_cos=0.99999, atol=1e-4)
    alone = torch.cat([run_pool(runner, [s], [t]) for s, t in zip(seqs, types_)])
    assert_rows_close(alone, expected, "alone", min_cos=0.99999, atol=1e-4)
