"""The EAGLE draft head (--speculative-algorithm EAGLE, --speculative-draft-model-path): its module and loading.

An EAGLE-1 head for a Llama-family model, in its published checkpoint layout (config.json with architectures
["LlamaForCausalLMEagle"] or ["EagleLlamaForCausalLM"]; weights `fc.weight` [hidden, 2*hidden], optional `fc.bias`,
one decoder layer `layers.0.*`, optional `embed_tokens.weight` and `lm_head.weight`), computes as SGLang's
LlamaForCausalLMEagle does: for the token at position i+1 and the served model's final hidden state at position i,

    h = fc(cat(embed(token), hidden));  h, residual = layer(h) (no input norm in layer 0);  out = h + residual

and the LM head reads `out` (no final norm); `out` is also the hidden state the head's next step reads. The
embedding and LM head are the served model's unless the checkpoint has its own. The pair (token i+1, hidden i) runs
at the served model's position i, as SGLang's draft extend runs it, with the head's own KV cache.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any, Optional

import torch
from torch import nn

from sglang.srt.forward_batch import ForwardBatch
from sglang.srt.layers.attention.torch_sdpa_backend import TorchSDPABackend
from sglang.srt.layers.logits_processor import LogitsProcessor
from sglang.srt.layers.rotary_embedding import get_rope
from sglang.srt.model_loader.weights import iterate_weights, load_checkpoint_weights
from sglang.srt.models.llama import DecoderOptions, LlamaDecoderLayer, LlamaForCausalLM, head_dim_of

logger = logging.getLogger(__name__)

FLAG = "--speculative-draft-model-path"
EAGLE_ARCHITECTURES = ("LlamaForCausalLMEagle", "EagleLlamaForCausalLM")
# Checkpoint weights the head does not use: layer 0's input norm is the identity in EAGLE (its trained value, where a
# checkpoint keeps one, is never applied).
_UNUSED = ("layers.0.input_layernorm.weight",)


class _NoNorm(nn.Module):
    """Layer 0's input norm in an EAGLE head: the identity (in the dtype the projection after it asks for)."""

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None,
                out_dtype: Optional[torch.dtype] = None) -> Any:
        assert residual is None
        return x if out_dtype is None else x.to(out_dtype)


class EagleHead(nn.Module):
    """fc + decoder layer(s) of an EAGLE-1 head; the embedding and LM head are given (the served model's or its own)."""

    def __init__(self, config: Any, fc_bias: bool, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.fc = nn.Linear(2 * hidden, hidden, bias=fc_bias, dtype=dtype, device=device)
        self.rotary_emb = get_rope(config, head_dim_of(config), device=device)
        options = DecoderOptions(qkv_bias=bool(getattr(config, "attention_bias", False)),
                                 o_proj_bias=bool(getattr(config, "attention_bias", False)),
                                 mlp_bias=bool(getattr(config, "mlp_bias", False)))
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, self.rotary_emb.rotary_dim, options, dtype, device)
            for i in range(config.num_hidden_layers)
        )
        self.layers[0].input_layernorm = _NoNorm()

    def forward(self, embeds: torch.Tensor, hidden_in: torch.Tensor, positions: torch.Tensor,
                forward_batch: ForwardBatch) -> torch.Tensor:
        """The head's output hidden state of every row (what the LM head and the next draft step read)."""
        hidden_states = self.fc(torch.cat([embeds.to(self.fc.weight.dtype), hidden_in.to(self.fc.weight.dtype)], -1))
        cos_sin = self.rotary_emb.lookup(positions, hidden_states.dtype)
        residual: Optional[torch.Tensor] = None
        for layer in self.layers:
            hidden_states, residual = layer(cos_sin, hidden_states, forward_batch, residual)
        assert residual is not None
        return hidden_states.to(residual.dtype) + residual


class EagleRunner:
    """Runs the head over a forward batch of its own memory: embedding, head, LM head. The served model is read
    through its runner at each call (a weight update replaces it)."""

    def __init__(self, head: EagleHead, target_runner: Any, embed: Optional[nn.Module],
                 lm_head: Optional[torch.Tensor], config: Any, device: torch.device) -> None:
        self.head = head
        self.target_runner = target_runner
        self.own_embed = embed
        self.own_lm_head = lm_head
        self.own_logits = LogitsProcessor(config) if lm_head is not None else None
        self.device = device
        self.attn_backend = TorchSDPABackend()

    # The logits index the served model's vocabulary.
    token_ids: Optional[torch.Tensor] = None

    def forward(self, forward_batch: ForwardBatch, hidden_in: torch.Tensor, last: torch.Tensor
                ) -> tuple[torch.Tensor, list[int]]:
        """The head's output hidden state and greedy token at the `last` rows."""
        out, logits = self.forward_logits(forward_batch, hidden_in, last)
        return out, logits.argmax(dim=-1).tolist()

    @torch.inference_mode()
    def forward_logits(self, forward_batch: ForwardBatch, hidden_in: torch.Tensor, last: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """The head's output hidden state and logits at the `last` rows."""
        target = self.target_runner.model
        forward_batch.attn_backend = self.attn_backend
        self.attn_backend.init_forward_metadata(forward_batch)
        embed = self.own_embed if self.own_embed is not None else target.model.embed_tokens
        tokens = embed(forward_batch.input_ids).to(hidden_in.dtype)  # the table may be bf16 (q8_blocks.py)
        out = self.head(tokens, hidden_in, forward_batch.positions, forward_batch)
        selected = out[last.to(out.device)]
        # One row per part: the logits processor takes the rows as they are (decode mode or one row per sequence).
        if self.own_logits is not None:
            assert self.own_lm_head is not None
            logits = self.own_logits(selected, self.own_lm_head, forward_batch)
        else:
            logits = target.compute_logits(selected, forward_batch)
        return selected, logits


def read_head_config(path: str, algorithm: str = "EAGLE", architectures_expected: tuple[str, ...] = EAGLE_ARCHITECTURES
                     ) -> Any:
    """The head's config (a Llama config with its architectures and extra fields), or ValueError naming the
    flag."""
    from transformers import LlamaConfig

    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        raise ValueError(f"{FLAG} {path}: no config.json (an {algorithm} head is a directory with config.json and "
                         "weights)")
    with open(config_file) as f:
        raw = json.load(f)
    architectures = raw.get("architectures") or []
    if not any(a in architectures_expected for a in architectures):
        raise ValueError(f"{FLAG} {path}: architectures {architectures} is not an {algorithm} head for "
                         f"--speculative-algorithm {algorithm} (expected one of {', '.join(architectures_expected)})")
    raw.pop("model_type", None)
    return LlamaConfig(**raw)


def load_eagle_runner(path: str, target_runner: Any) -> tuple[EagleRunner, Any]:
    """Build the head of `path` for the served model of `target_runner` and load its weights; ValueError naming the
    flag when its shapes do not fit the served model."""
    config = read_head_config(path)
    target, dtype, device = target_runner.model, target_runner.dtype, target_runner.device
    text_config = target_runner.hf_config.get_text_config()
    if config.hidden_size != text_config.hidden_size:
        raise ValueError(f"{FLAG} {path}: the head's hidden size ({config.hidden_size}) differs from the served "
                         f"model's ({text_config.hidden_size})")
    # The served model's forward must be compute_logits(forward_hidden(...)), as the Llama family's is: with a head,
    # the runner calls the two halves to hand the hidden states on.
    if not isinstance(target, LlamaForCausalLM):
        raise ValueError(f"{FLAG} {path}: EAGLE heads draft for Llama-family served models, not "
                         f"{type(target).__name__}")
    try:
        weights = {checkpoint_name(name): tensor for name, tensor in iterate_weights(path)}
    except Exception as e:  # noqa: BLE001 - any failure to read the head is the flag's error
        raise ValueError(f"{FLAG} {path}: cannot read the head's weights: {type(e).__name__}: {e}") from e
    vocab = text_config.vocab_size
    embed = lm_head = None
    embed_weight = weights.pop("embed_tokens.weight", None)
    head_weight = weights.pop("lm_head.weight", None)
    for name, tensor in (("embed_tokens.weight", embed_weight), ("lm_head.weight", head_weight)):
        if tensor is not None and tuple(tensor.shape) != (vocab, config.hidden_size):
            raise ValueError(f"{FLAG} {path}: the head's {name} has shape {list(tensor.shape)}, the served model "
                             f"needs [{vocab}, {config.hidden_size}]")
    if embed_weight is not None:
        embed = nn.Embedding.from_pretrained(embed_weight.to(dtype=dtype, device=device), freeze=True)
    if head_weight is not None:
        lm_head = head_weight.to(dtype=dtype, device=device)
    head = EagleHead(config, "fc.bias" in weights, dtype, device)
    try:
        load_checkpoint_weights(head, [item for item in weights.items() if item[0] not in _UNUSED])
    except ValueError as e:
        raise ValueError(f"{FLAG} {path}: the head does not fit the served model: {e}") from e
    head.eval()
    return EagleRunner(head, target_runner, embed, lm_head, config, device), config


def checkpoint_name(name: str) -> str:
    return name[len("model."):] if name.startswith("model.") else name
