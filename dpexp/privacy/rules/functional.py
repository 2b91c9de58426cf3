"""Exact generic fallback: per-example gradients of a module's own parameters with ``torch.func``.

Used for modules that own trainable parameters but have no registered rule, e.g. BEiT's layer-scale
``gamma`` (owned by its block) or a user's custom layer. For the output
gradient ``dy_i`` captured by the engine, ``g_i = d/dtheta <module(x_i; theta), dy_i>``, computed for all
examples at once with ``vmap(grad(...))`` over the module's forward. This recomputes the module's forward
and backward once more, so it costs about as much as the module itself; it is exact as long as the
forward is deterministic (no dropout), which the engine checks at construction.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from dpexp.privacy.per_example import Dense, PerExampleGrad


def check_deterministic(name: str, module: nn.Module) -> None:
    """The recomputed forward must be the one that ran: refuse active dropout inside ``module``."""
    for sub_name, sub in module.named_modules():
        p = (
            getattr(sub, "p", None)
            if isinstance(sub, nn.modules.dropout._DropoutNd)
            else getattr(sub, "drop_prob", None)
        )
        if sub.training and isinstance(p, float) and p > 0:
            raise ValueError(
                f"module {name!r} ({type(module).__name__}) has no per-example gradient rule, and its exact "
                f"fallback needs a deterministic forward, but {sub_name or name!r} applies dropout (p={p}). "
                "Set dropout/drop-path to 0, freeze the module's own parameters, or register a rule."
            )


def functional_per_example_grads(
    module: nn.Module, attrs: list[str], args: tuple, kwargs: dict[str, Any], dy: torch.Tensor
) -> dict[str, PerExampleGrad]:
    """Per-example gradients of ``module``'s own parameters ``attrs``; batched inputs have dim 0 = B."""
    size = dy.shape[0]

    def batched(v: Any) -> bool:
        return torch.is_tensor(v) and v.dim() > 0 and v.shape[0] == size

    arg_dims = tuple(0 if batched(a) else None for a in args)
    kwarg_dims = {k: 0 if batched(v) else None for k, v in kwargs.items()}
    params = {attr: getattr(module, attr).detach() for attr in attrs}

    def inner_product(p: dict[str, torch.Tensor], a: tuple, kw: dict[str, Any], dy_i: torch.Tensor):
        a = tuple(x.unsqueeze(0) if d == 0 else x for x, d in zip(a, arg_dims, strict=True))
        kw = {k: (v.unsqueeze(0) if kwarg_dims[k] == 0 else v) for k, v in kw.items()}
        out = functional_call(module, p, a, kw)
        return (out * dy_i.unsqueeze(0).to(out.dtype)).sum()

    with torch.enable_grad():
        grads = vmap(grad(inner_product), in_dims=(None, arg_dims, kwarg_dims, 0))(params, args, kwargs, dy)
    return {attr: Dense(g) for attr, g in grads.items()}
