"""The EAGLE-3 draft head (--speculative-algorithm EAGLE3, --speculative-draft-model-path): its module and loading.

An EAGLE-3 head for a Llama-family model, in its published checkpoint layout (config.json with architectures
["LlamaForCausalLMEagle3"], `draft_vocab_size` and optionally `target_hidden_size` and
`eagle_config.eagle_aux_hidden_state_layer_ids`; weights `fc.weight` [hidden, 3 * target hidden], one decoder layer
`midlayer.*` whose q/k/v projections read 2 * hidden, `norm.weight`, `lm_head.weight` [draft vocab, hidden], and the
`d2t` / `t2d` tensors of its reduced vocabulary), computes as SGLang's LlamaForCausalLMEagle3 does. The served model
captures the residual stream entering three of its layers (by default layers 2, n // 2 and n - 3 of n; a checkpoint's
layer id i means the input of layer i + 1), concatenated in layer order. For the token at position i+1 and the
served model's captured states at position i:

    h = fc(captured)  (a later draft step reads the head's previous output instead, with no fc)
    x = cat(input_layernorm(embed(token)), hidden_norm(h));  a = attention(x)
    m, r = post_attention_layernorm(a, h) (the sum r = a + h, normed);  out = mlp(m) + r
    logits = lm_head(norm(out)) over the draft vocabulary;  token = draft id + d2t[draft id]

and `out` (before the final norm) is the hidden state the head's next step reads. The embedding is the served
model's (the head's own when its hidden size differs). --speculative-token-map gives the draft->target ids instead of
d2t.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Optional

import torch
from torch import nn

from sglang.srt.forward_batch import ForwardBatch
from sglang.srt.layers.attention.torch_sdpa_backend import TorchSDPABackend
from sglang.srt.layers.layernorm import RMSNorm
from sglang.srt.layers.linear import merged_linear
from sglang.srt.layers.rotary_embedding import get_rope
from sglang.srt.model_loader.weights import iterate_weights, load_checkpoint_weights
from sglang.srt.models.llama import DecoderOptions, LlamaAttention, LlamaForCausalLM, LlamaMLP, LlamaModel, head_dim_of
from sglang.srt.speculative.eagle_head import checkpoint_name, read_head_config
from sglang.srt.speculative.hidden_log import describe_decode_path

logger = logging.getLogger(__name__)

FLAG = "--speculative-draft-model-path"
MAP_FLAG = "--speculative-token-map"
EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3",)
NUM_CAPTURED = 3


class Eagle3MidLayer(nn.Module):
    """The head's decoder layer: attention over [input_layernorm(embeds) ; hidden_norm(hidden)], then the MLP."""

    def __init__(self, config: Any, rotary_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        hidden = config.hidden_size
        bias = bool(getattr(config, "attention_bias", False))
        self.self_attn = LlamaAttention(config, 0, rotary_dim, DecoderOptions(o_proj_bias=bias), dtype, device)
        q_size, kv_size = self.self_attn.q_size, self.self_attn.kv_size
        self.self_attn.qkv_proj = merged_linear(
            2 * hidden, [("q_proj", q_size), ("k_proj", kv_size), ("v_proj", kv_size)], False, dtype, device)
        self.mlp = LlamaMLP(hidden, config.intermediate_size, getattr(config, "hidden_act", "silu"),
                            bool(getattr(config, "mlp_bias", False)), dtype, device)
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(hidden, eps, dtype=dtype, device=device)
        self.hidden_norm = RMSNorm(hidden, eps, dtype=dtype, device=device)
        self.post_attention_layernorm = RMSNorm(hidden, eps, dtype=dtype, device=device)


class Eagle3Head(nn.Module):
    """fc, the mid layer, the final norm and the draft-vocabulary LM head of an EAGLE-3 head."""

    def __init__(self, config: Any, target_hidden: int, fc_bias: bool, draft_vocab: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.hidden_size = hidden
        self.fc = nn.Linear(NUM_CAPTURED * target_hidden, hidden, bias=fc_bias, dtype=dtype, device=device)
        self.rotary_emb = get_rope(config, head_dim_of(config), device=device)
        self.midlayer = Eagle3MidLayer(config, self.rotary_emb.rotary_dim, dtype, device)
        self.norm = RMSNorm(hidden, config.rms_norm_eps, dtype=dtype, device=device)
        self.lm_head = nn.Linear(hidden, draft_vocab, bias=False, dtype=dtype, device=device)

    def forward(self, embeds: torch.Tensor, hidden_in: torch.Tensor, positions: torch.Tensor,
                forward_batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(out, norm(out)) of every row: `out` is what the head's next step reads, norm(out) what the LM head does.
        `hidden_in` rows are the served model's captured states (width fc.in_features) or the head's own `out`."""
        dtype = self.fc.weight.dtype
        if hidden_in.shape[-1] != self.hidden_size:
            hidden = self.fc(hidden_in.to(dtype))
        else:
            hidden = hidden_in.to(dtype).clone()  # the norms below add into it in place
        layer = self.midlayer
        x = torch.cat([layer.input_layernorm(embeds.to(dtype)), layer.hidden_norm(hidden)], dim=-1)
        cos_sin = self.rotary_emb.lookup(positions, dtype)
        attn = layer.self_attn(cos_sin, x, forward_batch).to(dtype)
        mlp_in, residual = layer.post_attention_layernorm(attn, hidden)
        normed, out = self.norm(layer.mlp(mlp_in).to(dtype), residual)
        return out, normed


class Eagle3Runner:
    """Runs the head over a forward batch of its own memory and maps its greedy draft ids to the served model's.
    The served model is read through its runner at each call (a weight update replaces it)."""

    def __init__(self, head: Eagle3Head, target_runner: Any, embed: Optional[nn.Module], hot_ids: torch.Tensor,
                 device: torch.device) -> None:
        self.head = head
        self.target_runner = target_runner
        self.own_embed = embed
        self.own_lm_head = head.lm_head.weight
        self.hot_ids = hot_ids  # [draft vocab]: the served model's id of each draft id
        self.device = device
        self.attn_backend = TorchSDPABackend()

    def forward(self, forward_batch: ForwardBatch, hidden_in: torch.Tensor, last: torch.Tensor
                ) -> tuple[torch.Tensor, list[int]]:
        """The head's output hidden state and greedy token (a served-model id) at the `last` rows."""
        out, logits = self.forward_logits(forward_batch, hidden_in, last)
        return out, self.hot_ids[logits.argmax(dim=-1).cpu()].tolist()

    @torch.inference_mode()
    def forward_logits(self, forward_batch: ForwardBatch, hidden_in: torch.Tensor, last: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """The head's output hidden state and logits over the draft vocabulary (token_ids maps them to the served
        model's ids) at the `last` rows."""
        forward_batch.attn_backend = self.attn_backend
        self.attn_backend.init_forward_metadata(forward_batch)
        embed = self.own_embed if self.own_embed is not None else self.target_runner.model.model.embed_tokens
        tokens = embed(forward_batch.input_ids).to(hidden_in.dtype)  # the table may be bf16 (q8_blocks.py)
        out, normed = self.head(tokens, hidden_in, forward_batch.positions, forward_batch)
        rows = last.to(out.device)
        return out[rows], self.head.lm_head(normed[rows]).float()

    @property
    def token_ids(self) -> Optional[torch.Tensor]:
        return self.hot_ids


class TargetCapture:
    """The served model's hidden-state sink with EAGLE3: has its backbone capture the chosen layers' inputs in every
    forward and hands those (not the final states) to `record`. The fused CPU decode step captures them too (it reads
    the backbone's `layers_to_capture` and leaves `aux_hidden_states` as LlamaModel.forward does), so decode and
    verify batches keep it."""

    def __init__(self, target_runner: Any, layers: tuple[int, ...],
                 record: Callable[[ForwardBatch, torch.Tensor], None]) -> None:
        self.target_runner = target_runner
        self.layers = layers
        self.record = record

    def arm(self) -> None:
        """Set the capture on the served model and say in its decode path line how it is served (both again after a
        weight update, which builds a new model and plans its decode path again)."""
        runner = self.target_runner
        runner.model.model.layers_to_capture = self.layers
        describe_decode_path(runner, "EAGLE3", f"the inputs of layers {list(self.layers)}")

    def __call__(self, forward_batch: ForwardBatch, hidden: torch.Tensor) -> None:
        backbone = self.target_runner.model.model
        captured, backbone.aux_hidden_states = backbone.aux_hidden_states, None
        if captured is None or captured.shape[0] != hidden.shape[0]:
            self.arm()  # a forward that captured nothing (a new model): those positions are not drafted from
            return
        self.record(forward_batch, captured)


def capture_layers(config: Any, num_layers: int, path: str) -> tuple[int, ...]:
    """The served model's layers whose inputs the head reads: eagle_config.eagle_aux_hidden_state_layer_ids + 1, or
    SGLang's default (2, n // 2, n - 3); three distinct layers of the served model."""
    ids = (getattr(config, "eagle_config", None) or {}).get("eagle_aux_hidden_state_layer_ids")
    if ids is not None:
        if len(ids) != NUM_CAPTURED or any(not isinstance(i, int) or not 0 <= i <= num_layers - 2 for i in ids):
            raise ValueError(f"{FLAG} {path}: eagle_config.eagle_aux_hidden_state_layer_ids {ids} must be "
                             f"{NUM_CAPTURED} layer ids of the served model's {num_layers} layers, each at most "
                             f"{num_layers - 2} (layer i's output is read)")
        layers = sorted({i + 1 for i in ids})
    else:
        layers = sorted({i for i in (2, num_layers // 2, num_layers - 3) if 0 < i < num_layers})
    if len(layers) != NUM_CAPTURED:
        raise ValueError(f"{FLAG} {path}: the served model's {num_layers} layers give no {NUM_CAPTURED} distinct "
                         f"layers to capture (got {layers}); set eagle_config.eagle_aux_hidden_state_layer_ids")
    return tuple(layers)


def load_token_map(path: str, draft_vocab: int, target_vocab: int) -> torch.Tensor:
    """The served model's id of each draft id from a .pt file (a list or 1-D integer tensor), or ValueError naming
    the flag."""
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any failure to read the map is the flag's error
        raise ValueError(f"{MAP_FLAG} {path}: cannot read it: {type(e).__name__}: {e}") from e
    try:
        ids = torch.as_tensor(data)
    except Exception as e:  # noqa: BLE001
        raise ValueError(f"{MAP_FLAG} {path}: expected a list or 1-D tensor of token ids, got "
                         f"{type(data).__name__}") from e
    if ids.dim() != 1 or ids.dtype.is_floating_point or ids.dtype == torch.bool or ids.is_complex():
        raise ValueError(f"{MAP_FLAG} {path}: expected a 1-D list of integer token ids, got shape "
                         f"{list(ids.shape)} of {ids.dtype}")
    if ids.shape[0] != draft_vocab:
        raise ValueError(f"{MAP_FLAG} {path}: {ids.shape[0]} token ids, the head's draft vocabulary has "
                         f"{draft_vocab}")
    return _checked_ids(ids.to(torch.int64), target_vocab, f"{MAP_FLAG} {path}")


def _checked_ids(ids: torch.Tensor, target_vocab: int, what: str) -> torch.Tensor:
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= target_vocab):
        raise ValueError(f"{what}: maps draft ids to token ids outside the served model's vocabulary "
                         f"[0, {target_vocab})")
    return ids


def _hot_ids(path: str, weights: dict[str, torch.Tensor], draft_vocab: int, target_vocab: int,
             token_map: Optional[str]) -> torch.Tensor:
    """The served model's id of each draft id: the token map, else arange + d2t, else the identity (a head over the
    whole vocabulary)."""
    d2t, t2d = weights.pop("d2t", None), weights.pop("t2d", None)
    if t2d is not None and tuple(t2d.shape) != (target_vocab,):
        raise ValueError(f"{FLAG} {path}: the head's t2d has shape {list(t2d.shape)}, the served model needs "
                         f"[{target_vocab}]")
    if token_map is not None:
        if d2t is not None:
            logger.info("EAGLE3: %s %s replaces the head's d2t", MAP_FLAG, token_map)
        return load_token_map(token_map, draft_vocab, target_vocab)
    if d2t is None:
        if draft_vocab != target_vocab:
            raise ValueError(f"{FLAG} {path}: the head has no d2t tensor for its {draft_vocab}-token draft "
                             f"vocabulary; pass {MAP_FLAG}")
        return torch.arange(target_vocab)
    if tuple(d2t.shape) != (draft_vocab,) or d2t.dtype.is_floating_point:
        raise ValueError(f"{FLAG} {path}: the head's d2t has shape {list(d2t.shape)} of {d2t.dtype}, expected "
                         f"[{draft_vocab}] integers (draft_vocab_size)")
    ids = _checked_ids(torch.arange(draft_vocab) + d2t.to(torch.int64), target_vocab, f"{FLAG} {path}: d2t")
    if t2d is not None and (int(t2d.bool().sum()) != draft_vocab or not bool(t2d.bool()[ids].all())):
        raise ValueError(f"{FLAG} {path}: the head's d2t and t2d disagree on the draft vocabulary")
    return ids


def _check_target(path: str, target: Any) -> None:
    # The runner hands the sink the states of compute_logits(forward_hidden(...)); the capture is LlamaModel's.
    if not (isinstance(target, LlamaForCausalLM) and type(target).forward_hidden is LlamaForCausalLM.forward_hidden
            and isinstance(target.model, LlamaModel) and type(target.model).forward is LlamaModel.forward):
        raise ValueError(f"{FLAG} {path}: EAGLE3 heads draft for Llama-family served models built on its decoder, "
                         f"not {type(target).__name__}")


def load_eagle3_runner(path: str, target_runner: Any, token_map: Optional[str]
                       ) -> tuple[Eagle3Runner, Any, tuple[int, ...]]:
    """Build the head of `path` for the served model of `target_runner` and load its weights; the head, its config
    and the served model's layers to capture. ValueError naming the flag (or the tensor) when it does not fit."""
    config = read_head_config(path, "EAGLE3", EAGLE3_ARCHITECTURES)
    target, dtype, device = target_runner.model, target_runner.dtype, target_runner.device
    _check_target(path, target)
    text_config = target_runner.hf_config.get_text_config()
    target_hidden = getattr(config, "target_hidden_size", None) or config.hidden_size
    if target_hidden != text_config.hidden_size:
        raise ValueError(f"{FLAG} {path}: the head reads hidden states of size {target_hidden} (target_hidden_size "
                         f"or hidden_size), the served model's are {text_config.hidden_size}")
    if config.num_hidden_layers != 1:
        raise ValueError(f"{FLAG} {path}: num_hidden_layers {config.num_hidden_layers}: an EAGLE3 head has one "
                         "decoder layer (midlayer)")
    if NUM_CAPTURED * target_hidden == config.hidden_size:
        raise ValueError(f"{FLAG} {path}: hidden_size {config.hidden_size} equals fc's input width")
    layers = capture_layers(config, text_config.num_hidden_layers, path)
    vocab = text_config.vocab_size
    draft_vocab = getattr(config, "draft_vocab_size", None) or vocab
    try:
        weights = {checkpoint_name(name): tensor for name, tensor in iterate_weights(path)}
    except Exception as e:  # noqa: BLE001 - any failure to read the head is the flag's error
        raise ValueError(f"{FLAG} {path}: cannot read the head's weights: {type(e).__name__}: {e}") from e
    hot_ids = _hot_ids(path, weights, draft_vocab, vocab, token_map)
    embed_weight = weights.pop("embed_tokens.weight", None)
    embed: Optional[nn.Module] = None
    if config.hidden_size != text_config.hidden_size:  # the served model's embedding cannot be shared (as SGLang)
        if embed_weight is None or tuple(embed_weight.shape) != (vocab, config.hidden_size):
            shape = None if embed_weight is None else list(embed_weight.shape)
            raise ValueError(f"{FLAG} {path}: the head's hidden size differs from the served model's, so it needs "
                             f"its own embed_tokens.weight [{vocab}, {config.hidden_size}] (got {shape})")
        embed = nn.Embedding.from_pretrained(embed_weight.to(dtype=dtype, device=device), freeze=True)
    for name, rows, cols in (("fc.weight", config.hidden_size, NUM_CAPTURED * target_hidden),
                             ("lm_head.weight", draft_vocab, config.hidden_size)):
        tensor = weights.get(name)
        if tensor is None or tuple(tensor.shape) != (rows, cols):
            got = "missing" if tensor is None else f"shape {list(tensor.shape)}"
            raise ValueError(f"{FLAG} {path}: the head's {name} is {got}, expected [{rows}, {cols}]")
    head = Eagle3Head(config, target_hidden, "fc.bias" in weights, draft_vocab, dtype, device)
    try:
        load_checkpoint_weights(head, weights.items())
    except ValueError as e:
        raise ValueError(f"{FLAG} {path}: the head does not fit the served model: {e}") from e
    head.eval()
    return Eagle3Runner(head, target_runner, embed, hot_ids, device), config, layers
