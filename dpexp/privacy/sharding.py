"""The engine on parameters sharded by FSDP2 (``torch.distributed.fsdp.fully_shard``).

``fully_shard`` replaces every parameter of a module by a sharded ``DTensor`` (dim 0 split over the ranks) and
swaps a plain, unsharded parameter into the module for the forward (all-gathered); with
``reshard_after_forward=False`` it stays there until the end of the backward. The engine's hooks see the layer
inputs and output gradients of the unsharded layer, so its per-example norms and clipped sums are those of the
full parameters: an example lives on one rank, which runs its whole forward and backward, so no per-example
norm spans ranks and no (B,) all-reduce of squared norms is needed (flat clipping included). What changes for
the engine is only which object is "the parameter": :class:`LiveParameters` looks it up by name when used (the
verification's autograd check differentiates the unsharded one), and at the step each rank keeps its shard of
the released full tensor (:func:`local_gradient`).

``torch.distributed.tensor`` is imported by whoever shards (:mod:`dpexp.training.sharded`), not here: it costs
about a second of every start-up, and no DTensor exists before it is imported (:func:`is_sharded`).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Mapping, Sequence

import torch
from torch import nn


def is_sharded(tensor: object) -> bool:
    """Whether ``tensor`` is a DTensor. Read through ``sys.modules``: a DTensor can only exist once
    ``torch.distributed.tensor`` has been imported, so an unloaded module means no tensor is one."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)


class LiveParameters(Mapping[str, nn.Parameter]):
    """The model's parameters ``names``, each looked up when used (``model.get_parameter``): FSDP2 swaps the
    registered objects (unsharded from forward to backward, sharded between steps)."""

    def __init__(self, model: nn.Module, names: Sequence[str]) -> None:
        self._model, self._names, self._known = model, list(names), set(names)

    def __getitem__(self, name: str) -> nn.Parameter:
        if name not in self._known:
            raise KeyError(name)
        return self._model.get_parameter(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def check_unsharded(params: Mapping[str, nn.Parameter]) -> None:
    """Refuse a backward while a parameter is still sharded: the engine clips what autograd differentiates,
    the unsharded parameter of the forward, which FSDP2 keeps only with ``reshard_after_forward=False``."""
    sharded = [name for name, p in params.items() if is_sharded(p)]
    if sharded:
        raise RuntimeError(
            f"parameters {sharded[:3]} are sharded during engine.backward: shard the model with "
            "fully_shard(..., reshard_after_forward=False) (dpexp.training.sharded.shard_model), so that the "
            "engine clips and verifies the unsharded parameters of the forward"
        )


def local_gradient(param: nn.Parameter, full: torch.Tensor) -> torch.Tensor:
    """This rank's gradient of ``param`` from the released full-shape gradient ``full`` (the same on every
    rank): ``param``'s own shard as a DTensor of its placements (a local slice, no communication), or
    ``full`` itself for an unsharded parameter."""
    if not is_sharded(param):
        return full
    from torch.distributed.tensor import DTensor, Replicate

    if tuple(full.shape) != tuple(param.shape):
        raise ValueError(
            f"a gradient of shape {tuple(full.shape)} for a parameter of shape {tuple(param.shape)}"
        )
    mesh = param.device_mesh
    replicated = DTensor.from_local(full, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return replicated.redistribute(mesh, param.placements)
