"""GPT-2 language models (``GPT2LMHeadModel``, tied ``wte``/``lm_head`` kept) for the generation tasks.

Pretrained sizes come from the Hugging Face hub (Li et al. 2022 fine-tune gpt2, -medium, -large, -xl;
He et al. 2023 use gpt2 for E2E/DART and gpt2-xl with LoRA for SAMSum). For offline runs a randomly
initialised small config is built instead, with a tokenizer chosen by ``tokenizer``:

- ``hub``: the hub GPT-2 tokenizer (required for pretrained weights); padding reuses ``<|endoftext|>``,
  which is harmless because the tasks mask padding by position, not by token id;
- ``trained``: a byte-level BPE tokenizer trained with the ``tokenizers`` library on the task's training
  texts (deterministic: same texts, same vocabulary), with ``<|endoftext|>`` (bos = eos = separator) and a
  separate ``<|pad|>`` token. Its vocabulary is a function of the private training texts and is NOT covered
  by the DP guarantee (a rare name can become a token): it serves offline development runs; private runs
  should use a tokenizer fixed without the training data (the hub one);
- ``auto``: the hub tokenizer if it is already in the local Hugging Face cache, else ``trained``. The hub is
  not contacted (an offline lookup takes about a minute to time out); the choice is logged.

If the task asks for LoRA (``TaskInfo.lora``, SAMSum) or the factory's ``lora`` is set, the model
is wrapped by :func:`dpexp.models.lora.apply_lora`; the factory's setting wins.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any, Literal

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from torch import nn
from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

from dpexp.models.base import ModelFactory, TaskInfo, models_for
from dpexp.models.lora import apply_lora

logger = logging.getLogger(__name__)

HUB_TOKENIZER = "openai-community/gpt2"
EOS = "<|endoftext|>"
PAD = "<|pad|>"


def train_byte_level_bpe(
    corpus: Iterable[str], vocab_size: int, model_max_length: int
) -> PreTrainedTokenizerFast:
    """Train a GPT-2 style byte-level BPE tokenizer on ``corpus`` (deterministic for the same texts).

    All 256 byte symbols are in the initial alphabet, so any text is encodable; ``EOS`` (id 0) serves as
    bos, eos and separator, ``PAD`` (id 1) as padding.
    """
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(corpus, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=EOS,
        eos_token=EOS,
        pad_token=PAD,
        model_max_length=model_max_length,
    )


def hub_tokenizer(name: str, local_files_only: bool = False) -> Any:
    """The hub tokenizer ``name`` with its eos reused as pad token when it has none (GPT-2 has none)."""
    tokenizer = AutoTokenizer.from_pretrained(name, local_files_only=local_files_only)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


class GPT2Factory(ModelFactory):
    """GPT-2 LM head model: pretrained from the hub (``pretrained``) or randomly initialised (``config``)."""

    def __init__(
        self,
        pretrained: str | None = "openai-community/gpt2",
        config: dict[str, Any] | None = None,
        tokenizer: Literal["hub", "trained", "auto"] = "hub",
        tokenizer_name: str | None = None,
        tokenizer_vocab_size: int = 4096,
        dropout: float | None = None,
        lora: dict[str, Any] | None = None,
    ) -> None:
        if (pretrained is None) == (config is None):
            raise ValueError(
                "give either `pretrained` (a hub id or local path of GPT-2 weights) or `config` (n_layer, "
                f"n_embd, ... of a random GPT-2), not {'both' if config else 'neither'}"
            )
        if tokenizer not in ("hub", "trained", "auto"):
            raise ValueError(f"tokenizer must be 'hub', 'trained' or 'auto', got {tokenizer!r}")
        if pretrained is not None and tokenizer != "hub":
            raise ValueError(
                f"pretrained GPT-2 weights ({pretrained}) need their own hub tokenizer; "
                f"tokenizer={tokenizer!r} only works with a random `config`"
            )
        defaults = GPT2Config()
        unknown = sorted(key for key in (config or {}) if not hasattr(defaults, key) or key == "vocab_size")
        if unknown:
            raise ValueError(
                f"unknown or task-determined GPT-2 config keys {unknown}; use GPT2Config fields such as "
                "n_layer, n_embd, n_head, n_positions (vocab_size comes from the tokenizer)"
            )
        self.pretrained = pretrained
        self.config = dict(config or {})
        self.tokenizer_source = tokenizer
        self.tokenizer_name = tokenizer_name or pretrained or HUB_TOKENIZER
        self.tokenizer_vocab_size = tokenizer_vocab_size
        self.dropout = dropout
        self.lora = dict(lora) if lora else None
        self._tokenizer: Any = None

    @property
    def _n_positions(self) -> int | None:
        return None if self.pretrained else int(self.config.get("n_positions", GPT2Config().n_positions))

    def tokenizer(self, corpus: Sequence[str] | None = None) -> Any:
        """The tokenizer the model expects; ``corpus`` (the task's training texts) trains one if needed."""
        if self._tokenizer is None:
            self._tokenizer = self._make_tokenizer(corpus)
        return self._tokenizer

    def _make_tokenizer(self, corpus: Sequence[str] | None) -> Any:
        if self.tokenizer_source == "hub":
            tokenizer = hub_tokenizer(self.tokenizer_name)
        elif self.tokenizer_source == "auto":
            try:
                tokenizer = hub_tokenizer(self.tokenizer_name, local_files_only=True)
                logger.info("GPT-2: using the cached hub tokenizer %s", self.tokenizer_name)
            except OSError:
                tokenizer = None
                logger.info(
                    "GPT-2: %s is not in the local cache; training a BPE tokenizer on the task's texts",
                    self.tokenizer_name,
                )
        else:
            tokenizer = None
        if tokenizer is None:
            if corpus is None:
                raise ValueError(
                    f"GPT-2 with tokenizer={self.tokenizer_source!r} learns its vocabulary from the task's "
                    "training texts, which the generation tasks (e2e, dart, samsum) pass as "
                    "tokenizer(corpus=...); this task passed none. GPT-2 serves generation tasks only."
                )
            logger.warning(
                "GPT-2: training the tokenizer on the task's training texts; its vocabulary is not covered "
                "by the differential-privacy guarantee (use tokenizer=hub for private runs)"
            )
            return train_byte_level_bpe(corpus, self.tokenizer_vocab_size, self._n_positions)
        if self._n_positions is not None:
            tokenizer.model_max_length = min(int(tokenizer.model_max_length), self._n_positions)
        return tokenizer

    def build(self, info: TaskInfo) -> nn.Module:
        """GPT-2 for ``info`` (a generation task); ValueError for other task kinds or mismatched sizes."""
        if info.kind != "generation":
            what = "an image classification" if info.input_shape is not None else f"a {info.kind}"
            raise ValueError(
                f"GPT-2 is a language model for generation tasks (e2e, dart, samsum), but task {info.name} "
                f"is {what} task; use {models_for(info)}"
            )
        eos = info.eos_token_id
        if info.vocab_size is None or info.pad_token_id is None or eos is None:
            raise ValueError(
                "the task info lacks vocab_size, pad_token_id or eos_token_id; "
                "call task.setup(factory) before factory.build(task.info)"
            )
        overrides: dict[str, Any] = {}
        if self.dropout is not None:
            overrides = {"resid_pdrop": self.dropout, "embd_pdrop": self.dropout, "attn_pdrop": self.dropout}
        if self.pretrained is not None:
            model = GPT2LMHeadModel.from_pretrained(self.pretrained, **overrides)
            if info.vocab_size > model.config.vocab_size:
                raise ValueError(
                    f"the task's tokenizer has {info.vocab_size} tokens but {self.pretrained} only "
                    f"{model.config.vocab_size} embeddings; use the model's own hub tokenizer"
                )
        else:
            config = GPT2Config(
                vocab_size=info.vocab_size,
                bos_token_id=eos,
                eos_token_id=eos,
                pad_token_id=info.pad_token_id,
                **self.config,
                **overrides,
            )
            model = GPT2LMHeadModel(config)
        if info.max_length is not None and info.max_length > model.config.n_positions:
            raise ValueError(
                f"the task produces sequences of {info.max_length} tokens but the model has "
                f"{model.config.n_positions} positions; lower task.max_length / max_new_tokens"
            )
        model.config.pad_token_id = info.pad_token_id
        model.generation_config.pad_token_id = info.pad_token_id
        model.generation_config.eos_token_id = eos
        lora = self.lora if self.lora is not None else info.lora
        return apply_lora(model, **lora) if lora else model
