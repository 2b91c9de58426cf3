"""Sequential views of Hugging Face causal LMs, which a pipeline splits into stages (``distributed=
pipeline``): GPT-2 (``GPT2LMHeadModel``) and Llama-style decoders (``LlamaForCausalLM``, which also serves
SmolLM2, and ``Qwen2ForCausalLM``, with its per-layer full or sliding-window attention).

A view is ``embed``, ``h0`` .. ``h{n-1}`` (the decoder blocks) and ``head`` (final norm and LM head), sharing
the model's modules (and so its parameters, peft's LoRA layers inside the blocks included). Called as
``view(input_ids, attention_mask=mask)`` it returns ``model(input_ids, attention_mask=mask).logits``: every
block is called as the model's own forward calls it, with no cache, positions 0..T-1 and the mask of
transformers' own mask functions built from the batch's 2-D padding mask, which every module takes as a side
input. Nothing but the hidden states crosses stages. Importing this module registers the views
(:data:`dpexp.models.base.SEQUENTIAL_VIEWS`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from transformers import GPT2LMHeadModel, LlamaForCausalLM, Qwen2ForCausalLM
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
from transformers.modeling_outputs import CausalLMOutputWithPast

from dpexp.models.base import SEQUENTIAL_VIEWS, Chain

MaskFunction = Callable[..., Any]  # transformers.masking_utils' create_*_mask
MASKS: dict[str, MaskFunction] = {  # a decoder layer's type (config.layer_types) -> its mask
    "full_attention": create_causal_mask,
    "sliding_attention": create_sliding_window_causal_mask,
}


class CausalLMSequential(Chain):
    """A causal LM's sequential view. The tasks' call ``model(input_ids=..., attention_mask=...,
    use_cache=False)`` maps onto it (:meth:`pipeline_inputs`) and the logits back to an output with
    ``.logits`` (:meth:`pipeline_output`); other arguments (a cache, positions, labels) are refused. A tied
    input embedding / LM head weight sits in ``embed`` and ``head``, the first and the last stage of a
    pipeline, which refuses it unless frozen (LoRA)."""

    @staticmethod
    def pipeline_inputs(*args: Any, **kwargs: Any) -> tuple[Any, dict[str, Any]]:
        if args:
            if "input_ids" in kwargs or len(args) > 1:
                raise TypeError("a language model's stage takes input_ids and attention_mask by keyword")
            kwargs["input_ids"] = args[0]
        input_ids = kwargs.pop("input_ids", None)
        attention_mask = kwargs.pop("attention_mask", None)
        if kwargs.pop("use_cache", None) or kwargs or not isinstance(input_ids, torch.Tensor):
            raise TypeError(
                "a language model's pipeline stage takes input_ids and attention_mask (use_cache off); this "
                f"call passes {sorted(kwargs) or 'no input_ids'}: generation (a cache) and positions run on "
                "the whole model"
            )
        return input_ids, ({} if attention_mask is None else {"attention_mask": attention_mask})

    @staticmethod
    def pipeline_output(logits: torch.Tensor) -> CausalLMOutputWithPast:
        return CausalLMOutputWithPast(logits=logits)


def _positions(hidden: torch.Tensor) -> torch.Tensor:
    """Positions 0..T-1, (1, T): what the models use given no ``position_ids`` and no cache (the tasks pad
    on the right, so every real token keeps its position)."""
    return torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)


def _mask(make: MaskFunction, config: Any, hidden: torch.Tensor, attention_mask: torch.Tensor | None) -> Any:
    """The block's attention mask from the batch's 2-D padding mask, as the model's forward builds it (for
    sdpa: None for a batch without padding, the block then attends with ``is_causal``)."""
    return make(
        config=config,
        inputs_embeds=hidden,
        attention_mask=attention_mask,
        past_key_values=None,
        position_ids=_positions(hidden),
    )


class Head(nn.Module):
    """The model's output: ``lm_head(norm(hidden))``, the logits of every position (the head's weight is the
    input embedding's when tied)."""

    def __init__(self, norm: nn.Module, lm_head: nn.Linear) -> None:
        super().__init__()
        self.norm, self.lm_head = norm, lm_head

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))


class TokenEmbedding(nn.Module):
    """A Llama-style input: ``embed_tokens(input_ids)`` (positions enter through the rotary embedding of every
    block). Takes the attention mask to pass it on; uses none."""

    def __init__(self, embed_tokens: nn.Embedding) -> None:
        super().__init__()
        self.embed_tokens = embed_tokens

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.embed_tokens(input_ids)


# -------------------------------------------------------------------------------------------------- GPT-2
class GPT2Embedding(nn.Module):
    """GPT-2's input: ``drop(wte(input_ids) + wpe(positions))``, positions 0..T-1."""

    def __init__(self, wte: nn.Embedding, wpe: nn.Embedding, drop: nn.Dropout) -> None:
        super().__init__()
        self.wte, self.wpe, self.drop = wte, wpe, drop

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        embeds = self.wte(input_ids)
        return self.drop(embeds + self.wpe(_positions(embeds)))


class GPT2BlockStage(nn.Module):
    """One ``GPT2Block`` called as ``GPT2Model.forward`` calls it."""

    def __init__(self, block: nn.Module, config: Any) -> None:
        super().__init__()
        self.block = block
        self.config = config  # a GPT2Config (not a module): the attention implementation the mask is for

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        mask = _mask(create_causal_mask, self.config, hidden, attention_mask)
        return self.block(hidden, None, mask, None, use_cache=False, position_ids=_positions(hidden))


def gpt2_sequential(model: GPT2LMHeadModel) -> CausalLMSequential:
    """The sequential view of a ``GPT2LMHeadModel``; refused for a cross-attention GPT-2."""
    if model.config.add_cross_attention:
        raise ValueError(
            "a GPT-2 with cross-attention has no sequential view (its blocks need the encoder's)"
        )
    gpt = model.transformer
    blocks = [(f"h{i}", GPT2BlockStage(block, model.config)) for i, block in enumerate(gpt.h)]
    return CausalLMSequential(
        OrderedDict(
            [
                ("embed", GPT2Embedding(gpt.wte, gpt.wpe, gpt.drop)),
                *blocks,
                ("head", Head(gpt.ln_f, model.lm_head)),
            ]
        )
    )


# ----------------------------------------------------------------------------------- Llama-style decoders
class DecoderLayerStage(nn.Module):
    """One Llama-style decoder layer called as ``LlamaModel.forward`` (``Qwen2Model.forward``) calls it: the
    rotary ``(cos, sin)`` of positions 0..T-1 from the model's rotary embedding (no parameters, so every
    stage computes its own) and the mask of the layer's type (``config.layer_types``: full or sliding-window
    causal attention, Qwen2's per-layer choice)."""

    def __init__(self, layer: nn.Module, rotary: nn.Module, config: Any, layer_type: str) -> None:
        super().__init__()
        if layer_type not in MASKS:
            raise ValueError(f"decoder layer type {layer_type!r} has no view (not in {list(MASKS)})")
        self.layer, self.rotary = layer, rotary
        self.config = config  # not a module: the attention implementation (and window) the mask is for
        self.make_mask = MASKS[layer_type]

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        positions = _positions(hidden)
        return self.layer(
            hidden,
            attention_mask=_mask(self.make_mask, self.config, hidden, attention_mask),
            position_ids=positions,
            past_key_values=None,
            use_cache=False,
            position_embeddings=self.rotary(hidden, positions),
        )


def decoder_sequential(model: LlamaForCausalLM | Qwen2ForCausalLM) -> CausalLMSequential:
    """The sequential view of a Llama-style causal LM (``model.model``: ``embed_tokens``, ``layers``,
    ``norm``, ``rotary_emb``; ``model.lm_head``)."""
    decoder, config = model.model, model.config
    types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    layers = decoder.layers[: config.num_hidden_layers]
    blocks = [
        (f"h{i}", DecoderLayerStage(layer, decoder.rotary_emb, config, types[i]))
        for i, layer in enumerate(layers)
    ]
    return CausalLMSequential(
        OrderedDict(
            [
                ("embed", TokenEmbedding(decoder.embed_tokens)),
                *blocks,
                ("head", Head(decoder.norm, model.lm_head)),
            ]
        )
    )


SEQUENTIAL_VIEWS[GPT2LMHeadModel] = gpt2_sequential
SEQUENTIAL_VIEWS[LlamaForCausalLM] = decoder_sequential
SEQUENTIAL_VIEWS[Qwen2ForCausalLM] = decoder_sequential
