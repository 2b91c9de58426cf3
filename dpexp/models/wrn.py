"""WRN-16-4 for DP training on CIFAR-10, as De et al. (2022) and He et al. (2023, appendix A.1).

The wide residual network of Zagoruyko & Komodakis (2016) (pre-activation blocks, depth 6n+4, widths
16k/32k/64k) with the DP modifications of De et al.: GroupNorm instead of BatchNorm (BatchNorm mixes the
examples of a batch, so per-example gradients would not be defined) and weight-standardised convolutions
(:class:`dpexp.layers.WSConv2d`) everywhere; no augmentation multiplicity. As in their implementation, the
stem is a 3x3 convolution to 16 channels, the first block of each stage has a 1x1 projection shortcut, the
head is GroupNorm -> ReLU -> global average pooling -> linear, and the linear head starts at zero.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from dpexp.layers import WSConv2d
from dpexp.models.base import ModelFactory, TaskInfo
from dpexp.models.image_input import ImageInput, image_classification_shape

# CIFAR-10 training-set channel statistics (pixels in [0, 1]), used by De et al. to normalise the inputs.
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)


class WideResNetBlock(nn.Module):
    """Pre-activation block: GN -> ReLU -> conv3x3(stride) -> GN -> ReLU -> conv3x3, plus the shortcut.

    The projection shortcut (1x1 WS conv) takes the first activation, as in Zagoruyko & Komodakis.
    """

    def __init__(
        self, in_channels: int, out_channels: int, stride: int, num_groups: int, project: bool
    ) -> None:
        super().__init__()
        self.norm1 = nn.GroupNorm(num_groups, in_channels)
        self.conv1 = WSConv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.norm2 = nn.GroupNorm(num_groups, out_channels)
        self.conv2 = WSConv2d(out_channels, out_channels, 3, stride=1, padding=1, bias=False)
        self.shortcut = WSConv2d(in_channels, out_channels, 1, stride=stride, bias=False) if project else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        activated = F.relu(self.norm1(x))
        skip = x if self.shortcut is None else self.shortcut(activated)
        out = self.conv1(activated)
        out = self.conv2(F.relu(self.norm2(out)))
        return out + skip


class WideResNet(nn.Module):
    """WRN-depth-width: (B, C, H, W) pixels in [0, 1] -> (B, num_classes) logits."""

    def __init__(
        self,
        depth: int = 16,
        width: int = 4,
        num_classes: int = 10,
        in_channels: int = 3,
        num_groups: int = 16,
        mean: Sequence[float] = CIFAR10_MEAN,
        std: Sequence[float] = CIFAR10_STD,
    ) -> None:
        super().__init__()
        if (depth - 4) % 6 or depth < 10:
            raise ValueError(f"WRN depth must be 6n+4 with n >= 1 (e.g. 16, 28), got {depth}.")
        widths = [16, 16 * width, 32 * width, 64 * width]
        if any(channels % num_groups for channels in widths):
            raise ValueError(f"num_groups={num_groups} must divide every channel count {widths}.")
        if len(mean) != in_channels:
            raise ValueError(f"mean/std have {len(mean)} channels, the images have {in_channels}.")
        self.input = ImageInput(mean, std)
        self.stem = WSConv2d(in_channels, widths[0], 3, padding=1, bias=False)
        blocks = []
        for stage in range(3):
            for index in range((depth - 4) // 6):
                stride = 2 if stage > 0 and index == 0 else 1
                in_channels_block = widths[stage] if index == 0 else widths[stage + 1]
                blocks.append(
                    WideResNetBlock(in_channels_block, widths[stage + 1], stride, num_groups, index == 0)
                )
        self.blocks = nn.Sequential(*blocks)
        self.norm = nn.GroupNorm(num_groups, widths[-1])
        self.head = nn.Linear(widths[-1], num_classes)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = F.relu(self.norm(self.blocks(self.stem(self.input(x)))))
        return self.head(features.mean(dim=(2, 3)))

    def sequential(self) -> nn.Sequential:
        """The model as a sequence of its own modules, whose chained forward is :meth:`forward`: input, stem,
        ``block<i>`` for every block, and ``head`` (GroupNorm -> ReLU -> average pooling -> linear); what a
        pipeline splits into stages (:func:`dpexp.models.base.sequential_view`). Its parameter names are the
        view's (``block0.conv1.weight``, ``head.norm.weight``), its parameters the model's."""
        blocks = [(f"block{index}", block) for index, block in enumerate(self.blocks)]
        pooled = PooledHead(self.norm, self.head)
        return nn.Sequential(
            OrderedDict([("input", self.input), ("stem", self.stem), *blocks, ("head", pooled)])
        )


class PooledHead(nn.Module):
    """GroupNorm -> ReLU -> global average pooling -> linear: the end of :class:`WideResNet` as one module."""

    def __init__(self, norm: nn.GroupNorm, head: nn.Linear) -> None:
        super().__init__()
        self.norm, self.head = norm, head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.relu(self.norm(x)).mean(dim=(2, 3)))


class WideResNetFactory(ModelFactory):
    """Builds :class:`WideResNet` for an image classification task (``conf/model/wrn16_4.yaml``)."""

    def __init__(
        self,
        depth: int = 16,
        width: int = 4,
        num_groups: int = 16,
        mean: Sequence[float] = CIFAR10_MEAN,
        std: Sequence[float] = CIFAR10_STD,
    ) -> None:
        self.depth, self.width, self.num_groups = depth, width, num_groups
        self.mean, self.std = tuple(mean), tuple(std)

    def build(self, info: TaskInfo) -> nn.Module:
        channels, _, _ = image_classification_shape(info, f"WRN-{self.depth}-{self.width}")
        if len(self.mean) != channels:
            raise ValueError(
                f"model.mean and model.std of WRN-{self.depth}-{self.width} normalise {len(self.mean)} "
                f"channels, task {info.name} has {channels}-channel images: set one value per channel "
                f"(e.g. model.mean=[0.5] model.std=[0.5] for grey images) or use model=small_cnn."
            )
        return WideResNet(
            self.depth, self.width, info.num_labels, channels, self.num_groups, self.mean, self.std
        )
