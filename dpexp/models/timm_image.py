"""timm image classifiers: vision transformers (ViT, BEiT), ConvNeXt and mobile CNNs (EfficientNet,
MobileNetV2) for image classification, e.g. on CIFAR-10.

The BK paper (Bu et al. 2023, Table 1 and sec. 3.2) fine-tunes ImageNet-pretrained ViT/BEiT models on CIFAR-10
with images resized to the model's 224x224 input. Here the model itself resizes: it receives the task's raw
pixels in [0, 1] (B, C, H, W), resizes them to ``image_size`` (bicubic; by default the pretrained input size)
and normalises them with the pretraining mean and std (see :class:`dpexp.models.image_input.ImageInput`), then
runs the timm network with a fresh ``num_classes`` head. CNNs trained from scratch keep the task's own size
(``image_size: null``).

BatchNorm mixes the examples of a batch and is refused by the privacy engine. timm's EfficientNet and
MobileNet builders take a ``norm_layer``; ``norm_layer: group_norm`` builds them with timm's ``GroupNormAct``
(GroupNorm, Wu & He 2018, fused with the activation; groups of ``group_size`` channels, as timm's own
``efficientnet_b0_gn``), the replacement De et al. (2022) use for DP training. ImageNet weights trained with
BatchNorm do not fit such a model, so ``pretrained`` is refused with it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any, Literal

import torch
from torch import nn

from dpexp.models.base import ModelFactory, TaskInfo
from dpexp.models.image_input import ImageInput, image_classification_shape

NormLayer = Literal["group_norm"]


class TimmImageFactory(ModelFactory):
    """Builds ``ImageInput -> timm.create_model(model_name)`` as an ``nn.Sequential`` (``input``, ``net``).

    Args:
        model_name: a timm model name, optionally with its pretrained tag,
            e.g. ``vit_small_patch16_224.augreg_in21k_ft_in1k`` or ``convnext_atto``.
        pretrained: load pretrained weights from the Hugging Face hub (true for real runs, false offline).
        drop_path_rate: stochastic depth rate passed to timm (0 disables it).
        image_size: ``pretrained`` (resize to the pretrained configuration's input size), null (the task's own
            size) or ``[H, W]``.
        norm_layer: null (the model's own norm layers) or ``group_norm`` (timm ``GroupNormAct``; for builders
            that take a norm_layer, e.g. EfficientNet and MobileNetV2, replacing their BatchNorm).
        group_size: channels per GroupNorm group with ``norm_layer: group_norm``.
        model_kwargs: further keyword arguments of the timm model (e.g. ``dims``, ``depths`` of ConvNeXt).
    """

    def __init__(
        self,
        model_name: str,
        pretrained: bool = True,
        drop_path_rate: float = 0.0,
        image_size: str | Sequence[int] | None = "pretrained",
        norm_layer: NormLayer | None = None,
        group_size: int = 8,
        model_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        if isinstance(image_size, str) and image_size != "pretrained":
            raise ValueError(f"image_size must be 'pretrained', null or [H, W], got {image_size!r}")
        if image_size is not None and not isinstance(image_size, str):
            if len(image_size) != 2 or not all(isinstance(s, int) and s > 0 for s in image_size):
                raise ValueError(f"image_size must be 'pretrained', null or [H, W], got {list(image_size)}")
            image_size = (int(image_size[0]), int(image_size[1]))
        if norm_layer not in (None, "group_norm"):
            raise ValueError(f"norm_layer must be null or 'group_norm', got {norm_layer!r}")
        if norm_layer is not None and pretrained:
            raise ValueError(
                f"{model_name}: its pretrained weights were trained with BatchNorm and do not fit "
                "norm_layer=group_norm; set model.pretrained=false (random init) or model.norm_layer=null "
                "with a model that has no BatchNorm (e.g. model=convnext_atto)"
            )
        if not (isinstance(group_size, int) and group_size > 0):
            raise ValueError(f"group_size must be a positive integer, got {group_size!r}")
        self.model_name = model_name
        self.pretrained = pretrained
        self.drop_path_rate = drop_path_rate
        self.image_size = image_size
        self.norm_layer = norm_layer
        self.group_size = group_size
        self.model_kwargs = dict(model_kwargs or {})

    def _create(self, channels: int, num_classes: int) -> nn.Module:
        import timm
        from timm.layers import GroupNormAct

        kwargs = dict(self.model_kwargs)
        if self.norm_layer == "group_norm":
            kwargs["norm_layer"] = partial(GroupNormAct, group_size=self.group_size)
        try:
            return timm.create_model(
                self.model_name,
                pretrained=self.pretrained,
                num_classes=num_classes,
                in_chans=channels,
                drop_path_rate=self.drop_path_rate,
                **kwargs,
            )
        except (OSError, RuntimeError) as err:
            if not self.pretrained:
                raise
            raise OSError(
                f"Could not load pretrained {self.model_name} from the hub ({err}); offline, set "
                "model.pretrained=false (random init) or use model=wrn16_4."
            ) from err
        except (AssertionError, TypeError) as err:  # timm's message for a bad norm layer or group size
            raise ValueError(
                f"timm could not build {self.model_name} with {sorted(kwargs)} ({type(err).__name__}: "
                f"{err}); "
                "norm_layer=group_norm needs a builder that takes a norm_layer (EfficientNet, MobileNetV2) "
                "and a group_size dividing every width"
            ) from err

    def build(self, info: TaskInfo) -> nn.Module:
        channels, height, width = image_classification_shape(info, self.model_name)
        net = self._create(channels, info.num_labels)
        batch_norms = [n for n, m in net.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
        if batch_norms:
            hint = "model.norm_layer=group_norm" if self.norm_layer is None else "another timm model"
            raise ValueError(
                f"{self.model_name} has BatchNorm layers ({batch_norms[0]}, ...), which mix the examples of "
                f"a batch and are refused by the privacy engine; use {hint}"
            )
        config = net.pretrained_cfg
        mean, std = config["mean"], config["std"]
        if len(mean) != channels:  # e.g. grey images with an RGB-pretrained model: average the statistics
            mean, std = [sum(mean) / len(mean)] * channels, [sum(std) / len(std)] * channels
        size = tuple(config["input_size"][1:]) if self.image_size == "pretrained" else self.image_size
        model = nn.Sequential(OrderedDict(input=ImageInput(mean, std, size), net=net))
        if self.image_size != "pretrained":  # the pretrained input size is one the network was built for
            self._check_input_size(model, channels, size or (height, width), info.name)
        return model

    def _check_input_size(self, model: nn.Module, channels: int, size: tuple[int, int], task: str) -> None:
        """One image through the network (eval, no gradients): a too small input fails here, by name."""
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                model.net(torch.zeros(1, channels, *size))
        except RuntimeError as err:
            raise ValueError(
                f"{self.model_name} cannot run on {size[0]}x{size[1]} images (task {task}): "
                f"{str(err).splitlines()[0]}; set model.image_size=[H, W] larger (e.g. [32, 32] for "
                "ConvNeXt, whose stages downsample by 32) or 'pretrained'"
            ) from err
        finally:
            model.train(was_training)
