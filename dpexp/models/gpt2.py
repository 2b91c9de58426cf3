"""GPT-2 language models (``GPT2LMHeadModel``, tied ``wte``/``lm_head``) for the generation tasks: the
causal LM factory (:mod:`dpexp.models.causal_lm`) with GPT-2's defaults, the pretrained GPT-2 small weights
and the hub GPT-2 tokenizer (Li et al. 2022; He et al. 2023). Its sequential view, which a pipeline splits
into stages, is :func:`dpexp.models.sequential.gpt2_sequential`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

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
