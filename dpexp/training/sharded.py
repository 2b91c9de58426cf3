"""Sharded data parallel (``distributed=fsdp``): DP-SGD on parameters sharded by FSDP2 (``fully_shard``).

Everything of :mod:`dpexp.training.distributed` (``distributed=ddp``) holds: every rank clips its share
``batch[r::P]`` of the Poisson-sampled logical batch with the engine, rank 0 alone draws the noise, one
all-reduce adds the ranks' noised clipped sums, and every rank divides by the expected B; the plan and the
accounting are the single process' ones. What sharding changes:

* between steps every parameter (and with it the optimizer's state) is a DTensor holding 1/P of dim 0 on each
  rank; :func:`shard_model` shards the whole model as one FSDP2 group with ``reshard_after_forward=False``,
  so the unsharded parameters the forward used stay in the modules until the end of the backward, where the
  engine clips and verifies them (:mod:`dpexp.privacy.sharding`), and with gradient synchronisation off,
  since the engine forms and releases the gradients itself (FSDP2 reduce-scatters nothing);
* per-example norms need no communication, with flat clipping too: an example lives on one rank, which runs
  its whole forward and backward on the all-gathered layers, so its norm (over all layers) is complete there;
* at the step each rank keeps its own shard of the released noised mean. The noise of every coordinate is
  drawn once, by rank 0, over the full shape, exactly as under ddp (one draw by construction, whatever the
  ranks' generators; its argument is in :mod:`dpexp.training.distributed`); the all-reduce carries full-shape
  sums (a reduce-scatter, with each rank drawing its own shard's noise, would move half the bytes: not done).

Memory: parameters and optimizer state are sharded at rest; during a step every rank holds the full
parameters and the full clipped sums, like ddp.

Checkpoints hold the full state, the layout of a single process' ``state_dict()``: :func:`full_state`
gathers every sharded tensor (a collective on every rank), rank 0 writes it, and on resume every rank reads it
and keeps its own shard (:func:`model_shards`, :func:`optimizer_shards`: local slices, no communication).
``torch.distributed.checkpoint.state_dict``'s get/set_optimizer_state_dict are not used: on an optimizer
without state (SGD without momentum, or any before its first step) they call ``optimizer.step()`` on zero
gradients to create it, which would run the engine's step (draw noise, count a step, all-reduce).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from dpexp.privacy.sharding import is_sharded

if TYPE_CHECKING:  # imported where used: about a second of every start-up otherwise
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor


def shard_model(model: nn.Module) -> FSDPModule:
    """``model`` sharded in place over the default process group as one FSDP2 group, for the engine
    (``PrivacyEngine(..., sharded=True)``): unsharded from the forward to the end of the backward, no
    gradient reduction. Every rank must hold the same parameters (broadcast them first)."""
    from torch.distributed.fsdp import fully_shard

    sharded = fully_shard(model, reshard_after_forward=False)
    sharded.set_requires_gradient_sync(False)
    return sharded


@contextmanager
def unsharded(model: FSDPModule) -> Iterator[None]:
    """The full parameters in ``model`` for the micro-batches of one logical step: one all-gather on every
    rank, kept through every backward, and the shards back in place (a local step) for the engine's step.
    FSDP2 alone all-gathers in every forward after a backward: a collective that the ranks would not match, as
    their shares of a Poisson batch split into different numbers of micro-batches (possibly none)."""
    model.set_reshard_after_backward(False)
    model.unshard()
    try:
        yield
    finally:
        model.reshard()
        model.set_reshard_after_backward(True)


def full_state(state: Any) -> Any:
    """``state`` (nested dicts, lists and tuples) with every DTensor gathered whole (``full_tensor``, an
    all-gather every rank must run in the same order: the same layout on every rank) and every tensor on the
    CPU."""
    if is_sharded(state):
        return state.full_tensor().cpu()
    if isinstance(state, torch.Tensor):
        return state.detach().cpu()
    if isinstance(state, Mapping):
        return {key: full_state(value) for key, value in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(full_state(value) for value in state)
    return state


def shard_like(full: torch.Tensor, like: DTensor) -> DTensor:
    """This rank's shard of ``full`` as ``like`` is sharded (its mesh and placements): a local slice."""
    if tuple(full.shape) != tuple(like.shape):
        raise ValueError(f"a tensor of shape {tuple(full.shape)} for one of shape {tuple(like.shape)}")
    from torch.distributed.tensor import DTensor, Replicate

    mesh = like.device_mesh
    full = full.to(device=like.device, dtype=like.dtype)
    return DTensor.from_local(full, mesh, [Replicate()] * mesh.ndim, run_check=False).redistribute(
        mesh, like.placements
    )


def model_shards(model: nn.Module, full: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The full model state ``full`` (:func:`full_state` of ``model.state_dict()``) as ``model`` holds it:
    this rank's shard of every sharded entry, the others as they are; for ``model.load_state_dict``."""
    current = model.state_dict()
    return {
        key: shard_like(value, current[key]) if is_sharded(current.get(key)) else value
        for key, value in full.items()
    }


def optimizer_shards(optimizer: torch.optim.Optimizer, full: Mapping[str, Any]) -> dict[str, Any]:
    """The full optimizer state ``full`` (:func:`full_state` of ``optimizer.state_dict()``) as ``optimizer``
    holds it: every per-parameter tensor of a sharded parameter's shape (momentum, Adam's moments) sharded
    like that parameter, scalars (Adam's step) as they are; for ``optimizer.load_state_dict``."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = {}
    for index, values in full["state"].items():
        param = params[int(index)]
        state[index] = {
            key: shard_like(value, param)
            if is_sharded(param)
            and isinstance(value, torch.Tensor)
            and value.dim() > 0
            and tuple(value.shape) == tuple(param.shape)
            else value
            for key, value in values.items()
        }
    return {**full, "state": state}
