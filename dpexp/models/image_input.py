"""Input side of the image models: the task check and the model's own pixel preprocessing.

Image tasks hand models raw pixels scaled to [0, 1], shape (B, C, H, W); each model normalises them with its
own statistics (CIFAR-10 channel statistics for WRN, the pretraining statistics for timm models) and, if it
was pretrained at another resolution, resizes them first (the BK paper's ViT/BEiT CIFAR-10 runs use 224x224).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from dpexp.models.base import TaskInfo, models_for


def image_classification_shape(info: TaskInfo, model: str) -> tuple[int, int, int]:
    """The task's (C, H, W); ValueError naming both sides unless ``info`` is an image classification task."""
    task = info.name
    if info.kind != "classification" or info.num_labels is None:
        raise ValueError(
            f"Model {model} is an image classifier, but task {task} is a {info.kind} task; "
            f"use {models_for(info)}."
        )
    if info.input_shape is None or len(info.input_shape) != 3:
        raise ValueError(
            f"Model {model} needs images (C, H, W), but task {task} gives input_shape={info.input_shape} "
            f"(a text task?); use {models_for(info)}."
        )
    channels, height, width = info.input_shape
    return channels, height, width


class ImageInput(nn.Module):
    """(B, C, H, W) pixels in [0, 1] -> ``(x - mean) / std`` per channel, optionally resized to ``size``.

    Resizing uses bicubic interpolation, the interpolation of timm's pretrained ViT/BEiT configurations.
    ``mean`` and ``std`` are buffers, not parameters: nothing here is trained.
    """

    def __init__(
        self, mean: Sequence[float], std: Sequence[float], size: tuple[int, int] | None = None
    ) -> None:
        super().__init__()
        if len(mean) != len(std):
            raise ValueError(f"mean and std need one value per channel, got {len(mean)} and {len(std)}.")
        self.register_buffer("mean", torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1))
        self.register_buffer("std", torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1))
        self.size = size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.size is not None and tuple(x.shape[-2:]) != self.size:
            x = F.interpolate(x, size=self.size, mode="bicubic", align_corners=False)
        return (x - self.mean) / self.std
