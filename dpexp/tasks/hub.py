"""Image classification data sets from the Hugging Face hub (the ``scale=paper`` path when no local copy of
the original release is configured)."""

from __future__ import annotations

import numpy as np
import torch


def load_hub_images(
    dataset: str, split: str, image_key: str, mode: str, offline_fix: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(images, labels)`` of ``dataset``'s ``split``: uint8 images (N, C, H, W) converted to the PIL
    ``mode`` ("RGB": C = 3, "L": C = 1) and int64 labels (N,). A hub that cannot be reached raises one
    RuntimeError ending with ``offline_fix``."""
    from datasets import load_dataset

    try:
        data = load_dataset(dataset, split=split)
    except Exception as err:  # network, cache and hub errors all mean the same thing to the user
        raise RuntimeError(
            f"Could not load {dataset} ({split}) from the Hugging Face hub: {err}. {offline_fix}"
        ) from err
    images = np.stack([np.asarray(image.convert(mode), dtype=np.uint8) for image in data[image_key]])
    images = images[..., None] if images.ndim == 3 else images  # (N, H, W) grey -> (N, H, W, 1)
    labels = torch.tensor(data["label"], dtype=torch.long)
    return torch.from_numpy(images).permute(0, 3, 1, 2).contiguous(), labels
