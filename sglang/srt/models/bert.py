"""BERT-family encoders (BERT, XLM-RoBERTa): sentence embeddings and cross-encoder classification.

Encoders attend bidirectionally and keep nothing between forwards, so they run without the KV cache: the
projections work on the flat tokens of the whole batch and attention on a padded view of it
(layers/attention/bidirectional.py). Parameter names mirror the Hugging Face checkpoints except that
query/key/value are fused into `attention.self.qkv_proj`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from sglang.srt.forward_batch import ForwardBatch
from sglang.srt.layers.attention.bidirectional import PaddedLayout, bidirectional_attention
from sglang.srt.layers.linear import Linear, MergedLinear
from sglang.srt.layers.pooler import first_token_indices
from sglang.srt.model_loader.weights import load_checkpoint_weights

Device = Optional[torch.device | str]


def _activation(name: str):
    if name == "gelu":
        return F.gelu
    if name in ("gelu_new", "gelu_pytorch_tanh"):
        return lambda x: F.gelu(x, approximate="tanh")
    if name == "relu":
        return F.relu
    raise ValueError(f"Unsupported hidden_act {name!r} for an encoder model")


class BertEmbeddings(nn.Module):
    def __init__(self, config: Any, position_offset: int, dtype: Optional[torch.dtype], device: Device) -> None:
        super().__init__()
        h = config.hidden_size
        self.word_embeddings = nn.Embedding(config.vocab_size, h, dtype=dtype, device=device)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, h, dtype=dtype, device=device)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, h, dtype=dtype, device=device)
        self.LayerNorm = nn.LayerNorm(h, eps=config.layer_norm_eps, dtype=dtype, device=device)
        # RoBERTa numbers positions from padding_idx + 1.
        self.position_offset = position_offset

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, token_type_ids: Optional[torch.Tensor]
                ) -> torch.Tensor:
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions + self.position_offset)
        if token_type_ids is None:
            x = x + self.token_type_embeddings.weight[0]
        else:
            x = x + self.token_type_embeddings(token_type_ids)
        return self.LayerNorm(x)


class BertSelfAttention(nn.Module):
    def __init__(self, config: Any, dtype: Optional[torch.dtype], device: Device) -> None:
        super().__init__()
        h = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = h // self.num_heads
        self.qkv_proj = MergedLinear(h, [("query", h), ("key", h), ("value", h)], True, dtype, device)

    def forward(self, x: torch.Tensor, layout: PaddedLayout) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).view(x.shape[0], 3, self.num_heads, self.head_dim).unbind(1)
        return bidirectional_attention(q, k, v, layout, self.head_dim**-0.5)


class BertAddNorm(nn.Module):
    """dense -> residual add -> LayerNorm (BERT's `attention.output` and `output` blocks)."""

    def __init__(self, in_features: int, config: Any, dtype: Optional[torch.dtype], device: Device) -> None:
        super().__init__()
        self.dense = Linear(in_features, config.hidden_size, True, dtype=dtype, device=device)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class BertAttention(nn.Module):
    def __init__(self, config: Any, dtype: Optional[torch.dtype], device: Device) -> None:
        super().__init__()
        self.self = BertSelfAttention(config, dtype, device)
        self.output = BertAddNorm(config.hidden_size, config, dtype, device)

    def forward(self, x: torch.Tensor, layout: PaddedLayout) -> torch.Tensor:
        return self.output(self.self(x, layout), x)


class BertIntermediate(nn.Module):
    def __init__(self, config: Any, dtype: Optional[torch.dtype], device: Device) -> None:
        super().__init__()
        self.dense = Linear(config.hidden_size, config.intermediate_size, True, dtype=dtype, device=device)
        self.act = _activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.dense(x))


class BertLayer(nn.Module):
    def __init__(self, config: Any, dtype: Optional[torch.dtype], device: Device) -> None:
        super().__init__()
        self.attention = BertAttention(config, dtype, device)
        self.intermediate = BertIntermediate(config, dtype, device)
        self.output = BertAddNorm(config.intermediate_size, config, dtype, device)

    def forward(self, x: torch.Tensor, layout: PaddedLayout) -> torch.Tensor:
        x = self.attention(x, layout)
        return self.output(self.intermediate(x), x)


class BertEncoder(nn.Module):
    def __init__(self, config: Any, dtype: Optional[torch.dtype], device: Device) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(config, dtype, device) for _ in range(config.num_hidden_layers))

    def forward(self, x: torch.Tensor, layout: PaddedLayout) -> torch.Tensor:
        for layer in self.layer:
            x = layer(x, layout)
        return x


class BertPooler(nn.Module):
    """BERT's pooled output: dense + tanh on the first ([CLS]) token."""

    def __init__(self, config: Any, dtype: Optional[torch.dtype], device: Device) -> None:
        super().__init__()
        self.dense = Linear(config.hidden_size, config.hidden_size, True, dtype=dtype, device=device)

    def forward(self, cls_hidden: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(cls_hidden))


class EncoderBackbone(nn.Module):
    """Embeddings + encoder layers, optionally BERT's pooler (the module under `bert.` / `roberta.`)."""

    def __init__(self, config: Any, position_offset: int, with_pooler: bool, dtype: Optional[torch.dtype],
                 device: Device) -> None:
        super().__init__()
        self.embeddings = BertEmbeddings(config, position_offset, dtype, device)
        self.encoder = BertEncoder(config, dtype, device)
        self.pooler = BertPooler(config, dtype, device) if with_pooler else None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch
                ) -> torch.Tensor:
        """Last hidden states [num_tokens, hidden] of every token of the batch."""
        if any(p != 0 for p in forward_batch.extend_prefix_lens_cpu):
            raise ValueError("Encoder models run whole sequences; a cached prefix cannot be reused")
        layout = PaddedLayout.build(forward_batch.extend_seq_lens_cpu, input_ids.device)
        x = self.embeddings(input_ids, positions, forward_batch.token_type_ids)
        return self.encoder(x, layout)


def _encoder_weights(weights: Iterable[tuple[str, torch.Tensor]], drop_prefixes: tuple[str, ...]
                     ) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in weights:
        # position_ids is a derived buffer; heads the model does not use (pretraining heads, an unused pooler)
        # are skipped by prefix.
        if name.endswith("position_ids") or name.startswith(drop_prefixes):
            continue
        yield name, tensor


def _position_offset(config: Any) -> int:
    return config.pad_token_id + 1 if getattr(config, "model_type", "") in ("roberta", "xlm-roberta") else 0


class BertModel(EncoderBackbone):
    """Sentence embeddings: last hidden states, reduced by the runner's pooler (mean / CLS, normalized)."""

    is_encoder = True
    # What the runner does with it: reduce hidden states with the configured pooler.
    pooling_output = "hidden"

    def __init__(self, config: Any, dtype: Optional[torch.dtype] = None, device: Device = None) -> None:
        super().__init__(config, _position_offset(config), False, dtype, device)
        self.config = config

    def forward_hidden(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch
                       ) -> torch.Tensor:
        return self(input_ids, positions, forward_batch)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        drop = ("pooler.", "cls.", "lm_head.")
        stripped = ((_strip_model_prefix(n), t) for n, t in weights)
        load_checkpoint_weights(self, _encoder_weights(stripped, drop))


def _strip_model_prefix(name: str) -> str:
    # Some embedding checkpoints are saved from the task model, under `bert.` / `roberta.`.
    for prefix in ("bert.", "roberta."):
        if name.startswith(prefix):
            return name[len(prefix):]
    return name


class XLMRobertaModel(BertModel):
    pass


class BertForSequenceClassification(nn.Module):
    """Cross-encoder: BERT's pooled [CLS] output -> linear classifier; one row of logits per sequence."""

    is_encoder = True
    pooling_output = "scores"

    def __init__(self, config: Any, dtype: Optional[torch.dtype] = None, device: Device = None) -> None:
        super().__init__()
        self.config = config
        self.bert = EncoderBackbone(config, 0, True, dtype, device)
        self.classifier = Linear(config.hidden_size, config.num_labels, True, dtype=dtype, device=device)

    def forward_scores(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch
                       ) -> torch.Tensor:
        hidden = self.bert(input_ids, positions, forward_batch)
        cls = hidden.index_select(0, first_token_indices(forward_batch.extend_seq_lens_cpu, hidden.device))
        assert self.bert.pooler is not None
        return self.classifier(self.bert.pooler(cls)).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_checkpoint_weights(self, _encoder_weights(weights, ("cls.",)))


class RobertaClassificationHead(nn.Module):
    def __init__(self, config: Any, dtype: Optional[torch.dtype], device: Device) -> None:
        super().__init__()
        self.dense = Linear(config.hidden_size, config.hidden_size, True, dtype=dtype, device=device)
        self.out_proj = Linear(config.hidden_size, config.num_labels, True, dtype=dtype, device=device)

    def forward(self, cls_hidden: torch.Tensor) -> torch.Tensor:
        return self.out_proj(torch.tanh(self.dense(cls_hidden)))


class XLMRobertaForSequenceClassification(nn.Module):
    """Cross-encoder (e.g. bge-reranker): the <s> token's hidden state -> dense + tanh -> out_proj."""

    is_encoder = True
    pooling_output = "scores"

    def __init__(self, config: Any, dtype: Optional[torch.dtype] = None, device: Device = None) -> None:
        super().__init__()
        self.config = config
        self.roberta = EncoderBackbone(config, _position_offset(config), False, dtype, device)
        self.classifier = RobertaClassificationHead(config, dtype, device)

    def forward_scores(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch
                       ) -> torch.Tensor:
        hidden = self.roberta(input_ids, positions, forward_batch)
        cls = hidden.index_select(0, first_token_indices(forward_batch.extend_seq_lens_cpu, hidden.device))
        return self.classifier(cls).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_checkpoint_weights(self, _encoder_weights(weights, ("roberta.pooler.", "lm_head.")))
