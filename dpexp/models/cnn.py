"""A small convolutional net for small images (the offline digits default).

Blocks of 3x3 conv -> GroupNorm -> activation; every block after the first has stride 2 (halving H and W,
rounding up). The final feature map is flattened into a linear head, keeping the spatial layout that small
images need. GroupNorm (Wu & He 2018) normalises within one example, so per-example gradients
stay well defined, unlike BatchNorm (De et al. 2022 use GroupNorm for DP training for this reason).
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from dpexp.models.base import ModelFactory, TaskInfo, models_for

ACTIVATIONS = {"tanh": nn.Tanh, "relu": nn.ReLU}


class SmallCNN(nn.Sequential):
    """(b, C_in, H, W) images -> (b, num_classes) logits."""

    def __init__(
        self,
        input_shape: Sequence[int],
        num_classes: int,
        channels: Sequence[int],
        num_groups: int,
        activation: str,
    ) -> None:
        if activation not in ACTIVATIONS:
            raise ValueError(f"Unknown activation {activation!r}; valid choices: {', '.join(ACTIVATIONS)}.")
        layers: list[nn.Module] = []
        previous, height, width_px = input_shape
        for index, width in enumerate(channels):
            if width % num_groups:
                raise ValueError(f"num_groups={num_groups} must divide every channel count, got {width}.")
            layers += [
                nn.Conv2d(previous, width, kernel_size=3, stride=1 if index == 0 else 2, padding=1),
                nn.GroupNorm(num_groups, width),
                ACTIVATIONS[activation](),
            ]
            previous = width
            if index > 0:
                height, width_px = (height + 1) // 2, (width_px + 1) // 2
        layers += [nn.Flatten(), nn.Linear(previous * height * width_px, num_classes)]
        super().__init__(*layers)


class SmallCNNFactory(ModelFactory):
    """Builds :class:`SmallCNN` for image classification tasks (``TaskInfo.input_shape`` = (C, H, W))."""

    def __init__(
        self, channels: Sequence[int] = (16, 32), num_groups: int = 4, activation: str = "tanh"
    ) -> None:
        self.channels = list(channels)
        self.num_groups = num_groups
        self.activation = activation

    def build(self, info: TaskInfo) -> nn.Module:
        if info.kind != "classification" or info.input_shape is None or info.num_labels is None:
            raise ValueError(
                f"model=small_cnn needs an image classification task, but task {info.name} is a {info.kind} "
                f"task without images; use {models_for(info)}."
            )
        return SmallCNN(info.input_shape, info.num_labels, self.channels, self.num_groups, self.activation)
