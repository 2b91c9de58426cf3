"""GPT-2 language models (``GPT2LMHeadModel``, tied ``wte``/``lm_head``) for the generation tasks: the
causal LM factory (:mod:`dpexp.models.causal_lm`) with GPT-2's defaults, the pretrained GPT-2 small weights
and the hub GPT-2 tokenizer (Li et al. 2022; He et al. 2023); and GPT-2's sequential view
(:class:`GPT2Sequential`), which a pipeline splits into stages (``distributed=pipeline``)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from transformers import GPT2LMHeadModel
from transformers.masking_utils import create_causal_mask
from transformers.modeling_outputs import CausalLMOutputWithCrossAttentions

from dpexp.models.base import SEQUENTIAL_VIEWS, Chain
from dpexp.models.causal_lm import CausalLMFactory, TokenizerSource

HUB_TOKENIZER = "openai-community/gpt2"


class GPT2Factory(CausalLMFactory):
    """GPT-2 LM head model: pretrained from the hub (``pretrained``) or randomly initialised (``config``:
    ``GPT2Config`` fields such as n_layer, n_embd, n_head, n_positions)."""

    default_tokenizer = HUB_TOKENIZER

    def __init__(
        self,
        pretrained: str | None = "openai-community/gpt2",
        config: dict[str, Any] | None = None,
        tokenizer: TokenizerSource = "hub",
        tokenizer_name: str | None = None,
        tokenizer_vocab_size: int = 4096,
        dropout: float | None = None,
        lora: dict[str, Any] | None = None,
        lora_target_modules: Sequence[str] | None = None,
    ) -> None:
        super().__init__(
            "gpt2",
            pretrained=pretrained,
            config=config,
            tokenizer=tokenizer,
            tokenizer_name=tokenizer_name,
            tokenizer_vocab_size=tokenizer_vocab_size,
            dropout=dropout,
            lora=lora,
            lora_target_modules=lora_target_modules,
        )


# ------------------------------------------------------------------------------------- the sequential view
class GPT2Embedding(nn.Module):
    """GPT-2's input: ``drop(wte(input_ids) + wpe(positions))``, positions 0..T-1 (what GPT2Model uses when
    given no ``position_ids`` and no cache; the tasks pad on the right, so every real token keeps its
    position). Takes the attention mask to pass it on; uses none."""

    def __init__(self, wte: nn.Embedding, wpe: nn.Embedding, drop: nn.Dropout) -> None:
        super().__init__()
        self.wte, self.wpe, self.drop = wte, wpe, drop

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        embeds = self.wte(input_ids)
        positions = torch.arange(input_ids.shape[1], device=embeds.device).unsqueeze(0)
        return self.drop(embeds + self.wpe(positions))


class GPT2BlockStage(nn.Module):
    """One ``GPT2Block`` called as ``GPT2Model.forward`` calls it: with no cache, positions 0..T-1 and the
    mask of transformers' own ``create_causal_mask`` from the batch's 2-D padding mask (for sdpa: None for a
    batch without padding, the block then attends with ``is_causal``; a 4-D mask where a row is padded)."""

    def __init__(self, block: nn.Module, config: Any) -> None:
        super().__init__()
        self.block = block
        self.config = config  # a GPT2Config (not a module): the attention implementation the mask is for

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        mask = create_causal_mask(
            config=self.config,
            inputs_embeds=hidden,
            attention_mask=attention_mask,
            past_key_values=None,
            position_ids=positions,
        )
        return self.block(hidden, None, mask, None, use_cache=False, position_ids=positions)


class GPT2Head(nn.Module):
    """GPT-2's output: ``lm_head(ln_f(hidden))``, the logits of every position (its weight is ``wte``'s when
    tied)."""

    def __init__(self, ln_f: nn.LayerNorm, lm_head: nn.Linear) -> None:
        super().__init__()
        self.ln_f, self.lm_head = ln_f, lm_head

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.lm_head(self.ln_f(hidden))


class GPT2Sequential(Chain):
    """A ``GPT2LMHeadModel`` (with or without peft's LoRA layers, which sit inside its blocks) as ``embed``,
    ``h0`` .. ``h{n-1}`` (its blocks) and ``head``, sharing the model's modules: called as
    ``view(input_ids, attention_mask=mask)`` it returns the logits of ``model(input_ids,
    attention_mask=mask).logits``. Every module takes the batch's 2-D attention mask as a side input; a
    pipeline stage builds its blocks' causal mask from it (nothing but the hidden states crosses stages).
    The tasks' call ``model(input_ids=..., attention_mask=..., use_cache=False)`` maps onto it
    (:meth:`pipeline_inputs`) and the logits back to an output with ``.logits`` (:meth:`pipeline_output`);
    other arguments (a cache, positions, labels) are refused. The tied ``wte``/``lm_head`` weight sits in
    ``embed`` and ``head``, the first and last stage of a pipeline, which refuses it unless frozen (LoRA)."""

    @staticmethod
    def pipeline_inputs(*args: Any, **kwargs: Any) -> tuple[Any, dict[str, Any]]:
        if args:
            if "input_ids" in kwargs or len(args) > 1:
                raise TypeError("a GPT-2 pipeline stage takes input_ids and attention_mask by keyword")
            kwargs["input_ids"] = args[0]
        input_ids = kwargs.pop("input_ids", None)
        attention_mask = kwargs.pop("attention_mask", None)
        if kwargs.pop("use_cache", None) or kwargs or not isinstance(input_ids, torch.Tensor):
            raise TypeError(
                "a GPT-2 pipeline stage takes input_ids and attention_mask (use_cache off); this call "
                f"passes {sorted(kwargs) or 'no input_ids'}: generation (a cache) and positions run on the "
                "whole model"
            )
        return input_ids, ({} if attention_mask is None else {"attention_mask": attention_mask})

    @staticmethod
    def pipeline_output(logits: torch.Tensor) -> CausalLMOutputWithCrossAttentions:
        return CausalLMOutputWithCrossAttentions(logits=logits)


def gpt2_sequential(model: GPT2LMHeadModel) -> GPT2Sequential:
    """The sequential view of ``model`` (:class:`GPT2Sequential`); refused for a cross-attention GPT-2."""
    if model.config.add_cross_attention:
        raise ValueError(
            "a GPT-2 with cross-attention has no sequential view (its blocks need the encoder's)"
        )
    gpt = model.transformer
    blocks = [(f"h{i}", GPT2BlockStage(block, model.config)) for i, block in enumerate(gpt.h)]
    return GPT2Sequential(
        OrderedDict(
            [
                ("embed", GPT2Embedding(gpt.wte, gpt.wpe, gpt.drop)),
                *blocks,
                ("head", GPT2Head(gpt.ln_f, model.lm_head)),
            ]
        )
    )


SEQUENTIAL_VIEWS[GPT2LMHeadModel] = gpt2_sequential
