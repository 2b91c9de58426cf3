"""Benchmark models on generated inputs: a network, a batch of the right shapes, and its per-example loss.

Every builder is instantiated from ``conf/bench_suite/*.yaml`` (``_target_`` plus the architecture's keys) and
offers the three things a timed training step needs (``dpexp.bench``). Inputs are random token ids or pixels,
so nothing is downloaded and the cost of a step does not depend on data. Per-example losses follow the tasks:
the sum of the token cross-entropies of a sequence for language modelling, cross-entropy with
``reduction='none'`` for classification; the non-private baseline averages the same losses.
"""

from __future__ import annotations

import importlib
import inspect
import itertools
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch import nn

Batch = dict[str, torch.Tensor]


class BenchModel(ABC):
    """A randomly initialised network with generated inputs of the shapes of its task."""

    # gpt2 | llama | llama_lora | roberta | wrn | vit | mlp: the report's targets refer to these; fallback: a
    # model measured for the cost of a module without a rule (conf/bench_suite/fallbacks.yaml), no targets;
    # transformer: PyTorch's own nn.TransformerEncoder, either layout (conf/bench_suite/time_major.yaml)
    family: str
    sequence: bool = False  # whether the inputs have a sequence length T

    @abstractmethod
    def build(self) -> nn.Module:
        """A fresh network in training mode."""

    @abstractmethod
    def make_batch(self, batch_size: int, seq_len: int | None, generator: torch.Generator) -> Batch:
        """Random inputs and targets for ``batch_size`` examples (on the CPU; the caller moves them)."""

    @abstractmethod
    def per_example_loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        """One loss per example, shape (B,)."""


def _classification_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float(), labels, reduction="none")


class CausalLM(BenchModel):
    """Shared part of the causal LMs: random token ids with (B, T) position ids, and the language-modelling
    loss of example i, ``sum_{t<T} CE(logits_{i,t}, x_{i,t+1})``."""

    sequence = True
    default_vocab: int
    config: dict

    def make_batch(self, batch_size: int, seq_len: int | None, generator: torch.Generator) -> Batch:
        vocab, length = self.config.get("vocab_size", self.default_vocab), _need(seq_len)
        return {
            "input_ids": torch.randint(0, vocab, (batch_size, length), generator=generator),
            "position_ids": _positions(batch_size, length),
        }

    def per_example_loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        ids = batch["input_ids"]
        logits = model(**batch).logits
        # Next-token targets with the last position ignored: no copy of the (B, T, V) logits is sliced off.
        targets = F.pad(ids[:, 1:], (0, 1), value=-100)
        tokens = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="none")
        return tokens.view(ids.shape).sum(1)


class GPT2LM(CausalLM):
    """Hugging Face ``GPT2LMHeadModel`` (``lm_head`` tied to ``wte``) from a ``GPT2Config``, random weights.

    The keyword arguments are ``GPT2Config`` fields; the defaults are GPT-2 small (124M, vocabulary 50257).
    """

    family = "gpt2"
    default_vocab = 50257

    def __init__(self, **config: int | float | str) -> None:
        self.config = dict(config)

    def build(self) -> nn.Module:
        from transformers import GPT2Config, GPT2LMHeadModel

        return GPT2LMHeadModel(GPT2Config(**self.config)).train()


class LlamaLM(CausalLM):
    """Hugging Face ``LlamaForCausalLM`` (RMSNorm, SwiGLU, rotary attention) from a ``LlamaConfig``, random
    weights; the keyword arguments are ``LlamaConfig`` fields (e.g. Llama-3.2-1B's sizes, and
    ``tie_word_embeddings``). ``lora``: ``{rank, alpha, dropout, target_modules}`` wraps it in LoRA adapters
    (:func:`dpexp.models.lora.apply_lora`; targets default to ``q_proj``, ``v_proj``, Hu et al. 2021) and
    makes the family ``llama_lora``, whose throughput target differs (issue 13)."""

    default_vocab = 32000  # LlamaConfig's default

    def __init__(self, lora: dict | None = None, **config: int | float | str | bool) -> None:
        self.lora = {"target_modules": ["q_proj", "v_proj"], **lora} if lora else None
        self.family = "llama_lora" if lora else "llama"
        self.config = dict(config)

    def build(self) -> nn.Module:
        from transformers import LlamaConfig, LlamaForCausalLM

        from dpexp.models.lora import apply_lora

        model = LlamaForCausalLM(LlamaConfig(**self.config))
        return (apply_lora(model, **self.lora) if self.lora else model).train()


class RobertaClassifier(BenchModel):
    """Hugging Face ``RobertaForSequenceClassification`` from a ``RobertaConfig`` (defaults: roberta-base).

    Token ids avoid the padding id (1) and the special ids below 3, so every position is a real token.
    """

    family = "roberta"
    sequence = True

    def __init__(self, num_labels: int = 2, **config: int | float | str) -> None:
        self.num_labels = num_labels
        self.config = dict(config)

    def build(self) -> nn.Module:
        from transformers import RobertaConfig, RobertaForSequenceClassification

        config = RobertaConfig(num_labels=self.num_labels, **self.config)
        return RobertaForSequenceClassification(config).train()

    def make_batch(self, batch_size: int, seq_len: int | None, generator: torch.Generator) -> Batch:
        vocab = self.config.get("vocab_size", 50265)
        return {
            "input_ids": torch.randint(3, vocab, (batch_size, _need(seq_len)), generator=generator),
            "labels": torch.randint(0, self.num_labels, (batch_size,), generator=generator),
        }

    def per_example_loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        return _classification_loss(model(input_ids=batch["input_ids"]).logits, batch["labels"])


class ImageClassifier(BenchModel):
    """Shared part of the image models: (B, 3, H, W) pixels in [0, 1] and random labels."""

    image_size: int
    num_classes: int

    def make_batch(self, batch_size: int, seq_len: int | None, generator: torch.Generator) -> Batch:
        size = (batch_size, 3, self.image_size, self.image_size)
        return {
            "images": torch.rand(size, generator=generator),
            "labels": torch.randint(0, self.num_classes, (batch_size,), generator=generator),
        }

    def per_example_loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        return _classification_loss(model(batch["images"]), batch["labels"])


class WRN(ImageClassifier):
    """WRN-depth-width of De et al. (2022) (``dpexp.models.wrn``: GroupNorm, weight-standardised convs)."""

    family = "wrn"

    def __init__(self, depth: int = 16, width: int = 4, num_classes: int = 10, image_size: int = 32) -> None:
        self.depth, self.width, self.num_classes, self.image_size = depth, width, num_classes, image_size

    def build(self) -> nn.Module:
        from dpexp.models.wrn import WideResNet

        return WideResNet(self.depth, self.width, self.num_classes).train()


class TimmViT(ImageClassifier):
    """A timm vision transformer with random weights (``pretrained=False``) at ``image_size`` pixels."""

    family = "vit"

    def __init__(
        self, model_name: str = "vit_tiny_patch16_224", num_classes: int = 10, image_size: int = 224
    ) -> None:
        self.model_name, self.num_classes, self.image_size = model_name, num_classes, image_size

    def build(self) -> nn.Module:
        import timm

        net = timm.create_model(
            self.model_name, pretrained=False, num_classes=self.num_classes, img_size=self.image_size
        )
        return net.train()


class TimmImage(ImageClassifier):
    """Any timm image model by name, random weights; ``model_kwargs`` go to ``timm.create_model`` (lists as
    tuples: timm's stage sizes are split with them)."""

    family = "fallback"

    def __init__(self, model_name: str, num_classes: int = 10, image_size: int = 32, **model_kwargs) -> None:
        self.model_name, self.num_classes, self.image_size = model_name, num_classes, image_size
        self.model_kwargs = {
            key: tuple(value) if isinstance(value, Sequence) and not isinstance(value, str) else value
            for key, value in model_kwargs.items()
        }

    def build(self) -> nn.Module:
        import timm

        kwargs = {"pretrained": False, "num_classes": self.num_classes, **self.model_kwargs}
        return timm.create_model(self.model_name, **kwargs).train()


class TorchvisionImage(ImageClassifier):
    """A torchvision image model by its class or builder under ``torchvision.models``
    (``vision_transformer.VisionTransformer``, ``convnext_tiny``) and its keyword arguments, random weights;
    ``image_size`` goes to those that take one (the Vision Transformer)."""

    family = "fallback"

    def __init__(self, model: str, num_classes: int = 10, image_size: int = 32, **model_kwargs) -> None:
        self.model, self.num_classes, self.image_size = model, num_classes, image_size
        self.model_kwargs = model_kwargs

    def build(self) -> nn.Module:
        path, _, name = f"torchvision.models.{self.model}".rpartition(".")
        make = getattr(importlib.import_module(path), name)
        kwargs = {"num_classes": self.num_classes, **self.model_kwargs}
        if "image_size" in inspect.signature(make).parameters:
            kwargs["image_size"] = self.image_size
        return make(**kwargs).train()


_SIZE_AS_PAIR = ("hiera",)  # configurations that take the image size as [height, width] only


class HFImageClassifier(ImageClassifier):
    """A Hugging Face image classifier from its ``model_type`` (``AutoConfig.for_model``: ``dinov2``,
    ``clip_vision_model``, ``beit``, ``siglip_vision_model``...) and config fields, random weights."""

    family = "fallback"

    def __init__(self, architecture: str, num_classes: int = 10, image_size: int = 32, **config) -> None:
        self.architecture, self.num_classes, self.image_size = architecture, num_classes, image_size
        self.config = {key: _plain(value) for key, value in config.items()}  # nested configs as dicts

    def build(self) -> nn.Module:
        from transformers import AutoConfig, AutoModelForImageClassification

        size = [self.image_size] * 2 if self.architecture in _SIZE_AS_PAIR else self.image_size
        config = AutoConfig.for_model(
            self.architecture, image_size=size, num_labels=self.num_classes, **self.config
        )
        return AutoModelForImageClassification.from_config(config).train()

    def per_example_loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        return _classification_loss(model(pixel_values=batch["images"]).logits, batch["labels"])


class HFCausalLM(CausalLM):
    """A Hugging Face causal LM from its ``model_type`` (e.g. ``mamba``) and config fields, random weights."""

    family = "fallback"
    default_vocab = 32000

    def __init__(self, architecture: str, **config: int | float | str | bool) -> None:
        self.architecture, self.config = architecture, dict(config)

    def build(self) -> nn.Module:
        from transformers import AutoConfig, AutoModelForCausalLM

        return AutoModelForCausalLM.from_config(
            AutoConfig.for_model(self.architecture, **self.config)
        ).train()


class HFSeq2SeqLM(BenchModel):
    """A Hugging Face encoder-decoder LM from its ``model_type`` (e.g. ``switch_transformers``) and config
    fields, random weights: random source ids of length T, targets of length T, and the loss of example i,
    ``sum_t CE(logits_{i,t}, y_{i,t})`` (the decoder's inputs are the targets shifted right)."""

    family = "fallback"
    sequence = True

    def __init__(self, architecture: str, **config: int | float | str | bool) -> None:
        self.architecture, self.config = architecture, dict(config)

    def build(self) -> nn.Module:
        from transformers import AutoConfig, AutoModelForSeq2SeqLM

        config = AutoConfig.for_model(self.architecture, **self.config)
        return AutoModelForSeq2SeqLM.from_config(config).train()

    def make_batch(self, batch_size: int, seq_len: int | None, generator: torch.Generator) -> Batch:
        vocab, length = self.config.get("vocab_size", 32128), _need(seq_len)
        return {
            "input_ids": torch.randint(1, vocab, (batch_size, length), generator=generator),
            "labels": torch.randint(1, vocab, (batch_size, length), generator=generator),
        }

    def per_example_loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        labels = batch["labels"]
        logits = model(**batch).logits
        tokens = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="none")
        return tokens.view(labels.shape).sum(1)


class HFSequenceClassifier(RobertaClassifier):
    """A Hugging Face sequence classifier from its ``model_type`` (e.g. ``deberta``) and config fields, random
    weights; batches and loss as :class:`RobertaClassifier`'s."""

    family = "fallback"

    def __init__(self, architecture: str, num_labels: int = 2, **config: int | float | str | bool) -> None:
        super().__init__(num_labels, **config)
        self.architecture = architecture

    def build(self) -> nn.Module:
        from transformers import AutoConfig, AutoModelForSequenceClassification

        config = AutoConfig.for_model(self.architecture, num_labels=self.num_labels, **self.config)
        return AutoModelForSequenceClassification.from_config(config).train()


class MLP(BenchModel):
    """``in_features -> hidden... -> num_classes`` with ReLU: one 'token' per example and layer (T = 1)."""

    family = "mlp"

    def __init__(
        self, in_features: int = 3072, hidden: tuple[int, ...] = (1024, 1024), num_classes: int = 10
    ) -> None:
        self.in_features, self.hidden, self.num_classes = in_features, tuple(hidden), num_classes

    def build(self) -> nn.Module:
        widths = [self.in_features, *self.hidden]
        layers: list[nn.Module] = []
        for fan_in, fan_out in itertools.pairwise(widths):
            layers += [nn.Linear(fan_in, fan_out), nn.ReLU()]
        return nn.Sequential(*layers, nn.Linear(widths[-1], self.num_classes)).train()

    def make_batch(self, batch_size: int, seq_len: int | None, generator: torch.Generator) -> Batch:
        return {
            "x": torch.randn(batch_size, self.in_features, generator=generator),
            "labels": torch.randint(0, self.num_classes, (batch_size,), generator=generator),
        }

    def per_example_loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        return _classification_loss(model(batch["x"]), batch["labels"])


def _plain(value: Any) -> Any:
    """A value from the suite's YAML as plain Python (Hydra passes nested mappings as ``DictConfig``)."""
    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


def _positions(batch_size: int, seq_len: int) -> torch.Tensor:
    """Position ids of shape (B, T), one row per example: left to the model, GPT-2 broadcasts a (1, T) row
    over the batch, and Opacus' per-example gradient of the position embedding then fails."""
    return torch.arange(seq_len).repeat(batch_size, 1)


def _need(seq_len: int | None) -> int:
    if seq_len is None:
        raise ValueError("a sequence model needs a sequence length: give seq_lens in the suite's model entry")
    return seq_len


class _TokenClassifier(BenchModel):
    """A model of PyTorch's own layers called on token ids (B, T) alone, returning logits: random ids of
    ``vocab_size`` and labels of ``num_labels``."""

    sequence = True
    vocab_size: int
    num_labels: int

    def make_batch(self, batch_size: int, seq_len: int | None, generator: torch.Generator) -> Batch:
        return {
            "input_ids": torch.randint(0, self.vocab_size, (batch_size, _need(seq_len)), generator=generator),
            "labels": torch.randint(0, self.num_labels, (batch_size,), generator=generator),
        }

    def per_example_loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        return _classification_loss(model(batch["input_ids"]), batch["labels"])


class TorchEncoderClassifier(_TokenClassifier):
    """``nn.Embedding -> nn.TransformerEncoder -> mean over tokens -> nn.Linear``, PyTorch's own layers
    (dropout 0); ``batch_first=False``, PyTorch's default, runs every layer on (T, B, d) tensors, which the
    engine reads time-major (``dpexp/privacy/layout.py``)."""

    family = "transformer"

    def __init__(
        self,
        vocab_size: int = 30522,
        d_model: int = 256,
        nhead: int = 4,
        num_layers: int = 4,
        dim_feedforward: int = 1024,
        batch_first: bool = False,
        num_labels: int = 2,
    ) -> None:
        self.vocab_size, self.d_model, self.nhead = vocab_size, d_model, nhead
        self.num_layers, self.dim_feedforward = num_layers, dim_feedforward
        self.batch_first, self.num_labels = batch_first, num_labels

    def build(self) -> nn.Module:
        layer = nn.TransformerEncoderLayer(
            self.d_model, self.nhead, self.dim_feedforward, dropout=0.0, batch_first=self.batch_first
        )
        return _TorchEncoder(
            nn.Embedding(self.vocab_size, self.d_model),
            nn.TransformerEncoder(layer, self.num_layers, enable_nested_tensor=False),
            nn.Linear(self.d_model, self.num_labels),
            self.batch_first,
        ).train()


class _TorchEncoder(nn.Module):
    def __init__(self, embed: nn.Module, encoder: nn.Module, head: nn.Module, batch_first: bool) -> None:
        super().__init__()
        self.embed, self.encoder, self.head, self.batch_first = embed, encoder, head, batch_first

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)  # (B, T, d)
        if self.batch_first:
            return self.head(self.encoder(h).mean(1))
        return self.head(self.encoder(h.transpose(0, 1)).mean(0))


class TorchRecurrentClassifier(_TokenClassifier):
    """``nn.Embedding -> nn.LSTM / nn.GRU / nn.RNN (batch-first) -> mean over steps -> nn.Linear``: Opacus'
    char-LSTM classifier (its ``DPLSTM`` tutorial) with PyTorch's own layers, kept as they are; ``kind``
    ``DPLSTM`` / ``DPGRU`` / ``DPRNN`` builds it with Opacus' re-implementations instead (the layers its
    hooks support), for the Opacus baseline."""

    family = "recurrent"

    def __init__(
        self,
        kind: str = "LSTM",
        vocab_size: int = 256,
        hidden_size: int = 256,
        num_layers: int = 2,
        bidirectional: bool = False,
        num_labels: int = 2,
    ) -> None:
        self.kind, self.vocab_size, self.hidden_size = kind, vocab_size, hidden_size
        self.num_layers, self.bidirectional, self.num_labels = num_layers, bidirectional, num_labels

    def build(self) -> nn.Module:
        layers = importlib.import_module("opacus.layers") if self.kind.startswith("DP") else nn
        rnn = getattr(layers, self.kind)(
            self.hidden_size,
            self.hidden_size,
            self.num_layers,
            batch_first=True,
            bidirectional=self.bidirectional,
        )
        width = self.hidden_size * (2 if self.bidirectional else 1)
        return _Recurrent(
            nn.Embedding(self.vocab_size, self.hidden_size), rnn, nn.Linear(width, self.num_labels)
        )


class _Recurrent(nn.Module):
    def __init__(self, embed: nn.Module, rnn: nn.Module, head: nn.Module) -> None:
        super().__init__()
        self.embed, self.rnn, self.head = embed, rnn, head

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(self.embed(ids))[0].mean(1))
