"""Training backends: the only place where configuration objects meet the privacy engine (or the Opacus
baseline). Owns the :class:`~dpexp.backends.base.TrainingBackend` interface, its implementations (one module
each, with a ``build`` function) and the registry from ``clip.method`` to them. Imports: :mod:`dpexp.privacy`
(and Opacus, only when that method is chosen).
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from dpexp.backends.base import TrainingBackend, check_per_example_loss
from dpexp.privacy.aggregation import StepAggregation
from dpexp.privacy.individual import IndividualPrivacy

# clip.method -> the module whose ``build`` wraps the model; a new backend is one module and one line here
METHODS: dict[str, str] = {
    "nonprivate": "dpexp.backends.nonprivate",
    "dpexp": "dpexp.backends.engine",
    "opacus": "dpexp.backends.opacus",
}


def method_of(clip_cfg: Mapping[str, Any]) -> str:
    """``clip_cfg["method"]``; ``backend``, its old name, is accepted for one release."""
    if "method" not in clip_cfg and "backend" in clip_cfg:
        warnings.warn("clip.backend is now clip.method", DeprecationWarning, stacklevel=3)
        return clip_cfg["backend"]
    return clip_cfg["method"]


def build_backend(
    clip_cfg: Mapping[str, Any],
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch_size: int,
    sample_size: int,
    noise_multiplier: float,
    individual: IndividualPrivacy | None = None,
    aggregation: StepAggregation | None = None,
    sharded: bool = False,
) -> TrainingBackend:
    """Wrap ``model`` and ``optimizer`` with the backend of ``clip_cfg["method"]``.

    ``batch_size`` is the expected logical batch size B (the divisor), ``sample_size`` the data set size N,
    ``noise_multiplier`` sigma (noise std sigma * C on the summed clipped gradient; ignored by nonprivate).
    Build ``optimizer`` over the model's trainable parameters before calling this. ``individual``:
    individualized privacy (:mod:`dpexp.privacy.individual`), which only the ``dpexp`` method has.
    ``aggregation``: the processes of a data-parallel job that share every logical step
    (:mod:`dpexp.privacy.aggregation`; the protocol in :mod:`dpexp.backends.base`), also ``dpexp`` only.
    ``sharded``: the model's parameters are sharded by FSDP2 (``distributed=fsdp``,
    :mod:`dpexp.training.sharded`): the engine is built with ``sharded=True``.
    """
    if isinstance(clip_cfg, DictConfig):  # the engine and Opacus expect plain dicts and lists
        clip_cfg = OmegaConf.to_container(clip_cfg, resolve=True)
    method = method_of(clip_cfg)
    if method not in METHODS:
        raise ValueError(f"Unknown clip.method {method!r}; valid choices: {', '.join(METHODS)}.")
    if individual is not None and method != "dpexp":
        raise ValueError(
            f"clip.method={method} has no individualized privacy: privacy.individual needs a dpexp clip "
            "(e.g. clip=bk)."
        )
    if (aggregation is not None or sharded) and method != "dpexp":
        raise ValueError(
            f"clip.method={method} runs in one process: data-parallel training (distributed=ddp or fsdp) "
            "needs a dpexp clip (e.g. clip=bk)."
        )
    extra: dict[str, Any] = {} if individual is None else {"individual": individual}
    if aggregation is not None:
        extra["aggregation"] = aggregation
    if sharded:
        clip_cfg = {**clip_cfg, "engine": {**clip_cfg["engine"], "sharded": True}}
    return importlib.import_module(METHODS[method]).build(
        clip_cfg,
        model=model,
        optimizer=optimizer,
        batch_size=batch_size,
        sample_size=sample_size,
        noise_multiplier=noise_multiplier,
        **extra,
    )


def is_private(clip_cfg: Mapping[str, Any]) -> bool:
    """Whether the clip config adds noise (every method except ``nonprivate``)."""
    return method_of(clip_cfg) != "nonprivate"


__all__ = ["METHODS", "TrainingBackend", "build_backend", "check_per_example_loss", "is_private", "method_of"]
