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
"""

from __future__ import annotations

from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard


def shard_model(model: nn.Module) -> FSDPModule:
    """``model`` sharded in place over the default process group as one FSDP2 group, for the engine
    (``PrivacyEngine(..., sharded=True)``): unsharded from the forward to the end of the backward, no
    gradient reduction. Every rank must hold the same parameters (broadcast them first)."""
    sharded = fully_shard(model, reshard_after_forward=False)
    sharded.set_requires_gradient_sync(False)
    return sharded
