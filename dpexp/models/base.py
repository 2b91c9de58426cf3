"""The contract between tasks and models: what a task tells a model factory (:class:`TaskInfo`), and what a
factory offers (:class:`ModelFactory`: a network for a task, and the tokenizer a text task must use).

A model factory knows how to build a network for a task; it knows nothing about clipping or privacy. Tasks
import this module (never the other way round).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
from torch import nn

TaskKind = Literal["classification", "generation"]
Objective = Literal["classification", "infilling"]


@dataclass(frozen=True)
class TaskInfo:
    """What a model factory needs to know about a task to build a matching network."""

    name: str  # the task's name, for messages
    kind: TaskKind
    num_labels: int | None = None  # classification tasks
    vocab_size: int | None = None  # text tasks (size of the tokenizer actually used)
    pad_token_id: int | None = None
    eos_token_id: int | None = None  # generation tasks: where generated text ends
    max_length: int | None = None  # longest tokenised input the task produces
    input_shape: tuple[int, ...] | None = None  # vision tasks: (C, H, W)
    objective: Objective = "classification"  # infilling: by a masked LM's label words (Li et al. 2022, 3.2)
    label_prompts: tuple[str, ...] | None = None  # text classification: one public text per label id
    lora: Mapping[str, Any] | None = None  # LoRA adapters the task's paper setup uses (He et al. App. C.2)


def models_for(info: TaskInfo) -> str:
    """The model options (``conf/model``) that serve a task like ``info``, for the message of a factory
    that refuses it."""
    if info.input_shape is not None:
        return (
            "an image model: model=small_cnn (any image size and channels), wrn16_4, convnext_atto, "
            "efficientnet_b0 or vit_small"
        )
    if info.kind == "generation":
        return (
            "a language model: model=gpt2_tiny, llama_tiny, gpt2, gpt2_medium, gpt2_large, gpt2_xl, "
            "gpt2_lora, llama_3_2_1b, t5_tiny, t5_small or flan_t5_small"
        )
    return "a text encoder: model=roberta_base, roberta_large, minilm or roberta_tiny"


class ModelFactory(ABC):
    """Builds a model, and provides the tokenizer that text tasks must use with it."""

    # generation models: True for an encoder-decoder (source to the encoder, target to the decoder), False
    # for a causal LM (source, separator and target in one sequence)
    encoder_decoder: ClassVar[bool] = False

    def tokenizer(self, corpus: Sequence[str] | None = None) -> Any | None:
        """The tokenizer this model expects (None for models without one). ``corpus``: texts a factory
        without a fixed vocabulary may learn one from; what is learnt from private training texts is outside
        the privacy guarantee, so private runs pass public texts or use a fixed vocabulary."""
        return None

    def tokenizer_record(self) -> dict[str, Any] | None:
        """What the run record says of the tokenizer in use (its source, and whether its vocabulary was fixed
        without the training data); None for factories without a choice to record."""
        return None

    @abstractmethod
    def build(self, info: TaskInfo) -> nn.Module:
        """Return a freshly initialised (or pretrained) model for the task described by ``info``.

        Raise ``ValueError`` naming both sides when the model cannot serve this kind of task.
        """


class Chain(nn.Sequential):
    """A sequence of modules (a model's sequential view, or a pipeline stage of one) whose forward passes the
    batch's side inputs, keyword tensors such as an attention mask, to every module: ``x = module(x, **side)``
    (``module(x)`` without side inputs, as ``nn.Sequential``). The model's own call convention maps onto it
    by :meth:`pipeline_inputs` (the model's arguments -> the first module's input and the side inputs) and
    :meth:`pipeline_output` (the last module's output -> what the model returns); here, one batch-first
    tensor in and out. A pipeline stage of a Chain is of the view's class (keeps its convention)."""

    def forward(self, x: Any, **side: Any) -> Any:
        for module in self:
            x = module(x, **side) if side else module(x)
        return x

    @staticmethod
    def pipeline_inputs(*args: Any, **kwargs: Any) -> tuple[Any, dict[str, Any]]:
        if len(args) != 1 or kwargs or not isinstance(args[0], torch.Tensor):
            raise TypeError(
                "a pipeline stage takes the model's one batch-first input tensor; this task passes "
                f"{len(args)} positional and {sorted(kwargs)} keyword arguments"
            )
        return args[0], {}

    @staticmethod
    def pipeline_output(output: Any) -> Any:
        return output


# views of model classes that cannot define a ``sequential()`` method themselves (Hugging Face models), by
# class; a model module registers its own (dpexp.models.sequential: GPT-2, Llama, Qwen2)
SEQUENTIAL_VIEWS: dict[type, Callable[[nn.Module], nn.Sequential]] = {}


def sequential_view(model: nn.Module) -> nn.Sequential | None:
    """``model`` as a sequence of modules whose chained forward is the model's, sharing its modules (and so
    its parameters): the model itself if it is an ``nn.Sequential``, else what its ``sequential()`` method
    returns (models that have such a view define it), else the view registered for its class in
    :data:`SEQUENTIAL_VIEWS` (a peft model: its base model's, with the adapters); None for a model without
    one. A pipeline (``distributed=pipeline``) splits this sequence into stages."""
    if isinstance(model, nn.Sequential):
        return model
    view = getattr(model, "sequential", None)
    if callable(view):
        return view()
    base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model  # peft
    for cls, make in SEQUENTIAL_VIEWS.items():
        if isinstance(base, cls):
            return make(base)
    return None
