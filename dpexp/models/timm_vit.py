"""timm vision transformers (ViT, BEiT) for image classification fine-tuning, e.g. on CIFAR-10.

The BK paper (Bu et al. 2023, Table 1 and sec. 3.2) fine-tunes ImageNet-pretrained ViT/BEiT models on CIFAR-10
with images resized to the model's 224x224 input. Here the model itself resizes: it receives the task's raw
pixels in [0, 1] (B, C, 32, 32), resizes them to its pretrained input size (bicubic) and normalises them with
its pretraining mean and std (see :class:`dpexp.models.image_input.ImageInput`), then runs the timm network
with a fresh ``num_classes`` head.
"""

from __future__ import annotations

from collections import OrderedDict

from torch import nn

from dpexp.models.base import ModelFactory, TaskInfo
from dpexp.models.image_input import ImageInput, image_classification_shape


class TimmImageFactory(ModelFactory):
    """Builds ``ImageInput -> timm.create_model(model_name)`` as an ``nn.Sequential`` (``input``, ``net``).

    Args:
        model_name: a timm model name with its pretrained tag,
            e.g. ``vit_small_patch16_224.augreg_in21k_ft_in1k``.
        pretrained: load pretrained weights from the Hugging Face hub (true for real runs, false in tests).
        drop_path_rate: stochastic depth rate passed to timm (0 disables it).
    """

    def __init__(self, model_name: str, pretrained: bool = True, drop_path_rate: float = 0.0) -> None:
        self.model_name = model_name
        self.pretrained = pretrained
        self.drop_path_rate = drop_path_rate

    def build(self, info: TaskInfo) -> nn.Module:
        import timm

        channels, _, _ = image_classification_shape(info, self.model_name)
        try:
            net = timm.create_model(
                self.model_name,
                pretrained=self.pretrained,
                num_classes=info.num_labels,
                in_chans=channels,
                drop_path_rate=self.drop_path_rate,
            )
        except (OSError, RuntimeError) as err:
            if not self.pretrained:
                raise
            raise OSError(
                f"Could not load pretrained {self.model_name} from the hub ({err}); offline, set "
                "model.pretrained=false (random init) or use model=wrn16_4."
            ) from err
        config = net.pretrained_cfg
        mean, std = config["mean"], config["std"]
        if len(mean) != channels:  # e.g. grey images with an RGB-pretrained model: average the statistics
            mean, std = [sum(mean) / len(mean)] * channels, [sum(std) / len(std)] * channels
        size = tuple(config["input_size"][1:])
        return nn.Sequential(OrderedDict(input=ImageInput(mean, std, size), net=net))
