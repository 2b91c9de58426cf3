"""Exact generic fallback: per-example gradients of a module's own parameters with ``torch.func``.

Used for modules that own trainable parameters but have no registered rule, e.g. BEiT's layer-scale
``gamma`` (owned by its block) or a user's custom layer. For the output gradient ``dy_i`` captured by the
engine, ``g_i = d/dtheta <module(x_i; theta), dy_i>``, computed for all examples at once with
``vmap(grad(...))`` over the module's forward. This recomputes the module's forward and backward once more,
so it costs about as much as the module itself; it is exact as long as the forward is deterministic (no
dropout), which the engine checks at construction.

Which arguments carry the example index is established, not guessed from their sizes: only tensors whose
dim 0 has the batch size *can* be batched, and a choice of batched arguments is accepted only if the
vmapped forward reproduces the output the module actually produced in the forward pass (a tensor shared by
all examples whose first dimension happens to equal the batch size, vmapped as if it were per-example,
changes the output). No reproducing choice, or several that disagree: the module is refused. An output that
the model modified in place after the call (Falcon adds its residual with ``mlp_output += attention_output``)
is no record of the call any more; the module's forward is then recomputed on the whole micro-batch, from the
same inputs (unchanged: the engine checks their versions) and parameters, as the reference.
"""

from __future__ import annotations

from itertools import product
from typing import Any

import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from dpexp.privacy.per_example import Dense, PerExampleGrad
from dpexp.privacy.precision import tolerance

MAX_AMBIGUOUS_ARGUMENTS = 4  # tensors with dim 0 = B whose role is searched (2^n vmapped forwards at most)


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


def _reproduces(recorded: torch.Tensor, recomputed: torch.Tensor) -> bool:
    if recorded.shape != recomputed.shape:
        return False
    tol = tolerance(recorded.dtype)
    scale = float(recorded.detach().abs().max()) if recorded.numel() else 0.0
    return bool(torch.allclose(recomputed, recorded.detach(), rtol=tol, atol=tol * scale))


def functional_per_example_grads(
    module: nn.Module,
    attrs: list[str],
    args: tuple,
    kwargs: dict[str, Any],
    dy: torch.Tensor,
    output: torch.Tensor | None,
    name: str,
) -> dict[str, PerExampleGrad]:
    """Per-example gradients of ``module``'s own parameters ``attrs`` for one call (``args``, ``kwargs``,
    recorded ``output``, None if it was modified in place since; output gradient ``dy`` of shape (B, ...));
    ``name`` is the module's name in the model, for errors."""
    size = dy.shape[0]
    keys = [*range(len(args)), *kwargs]
    values = [*args, *kwargs.values()]
    candidates = [
        i for i, v in enumerate(values) if torch.is_tensor(v) and v.dim() > 0 and v.shape[0] == size
    ]
    if len(candidates) > MAX_AMBIGUOUS_ARGUMENTS:
        raise RuntimeError(
            f"module {name!r} ({type(module).__name__}) has no per-example gradient rule and "
            f"{len(candidates)} tensor arguments with the batch size in dim 0; the fallback cannot establish "
            "which of them carry the example index. Register a rule for it or freeze its parameters."
        )
    params = {attr: getattr(module, attr).detach() for attr in attrs}
    if output is None:
        with torch.no_grad():
            output = functional_call(module, params, args, kwargs)
    found: list[tuple[dict[str, torch.Tensor], torch.Tensor]] = []
    for choice in product((0, None), repeat=len(candidates)):  # all batched first
        batched = {i for i, d in zip(candidates, choice, strict=True) if d == 0}
        dims = [0 if i in batched else None for i in range(len(values))]
        try:
            grads, recomputed = _vmapped(module, params, keys, values, dims, dy, len(args))
        except RuntimeError:
            continue  # shapes that do not fit this choice
        if _reproduces(output, recomputed):
            found.append((grads, recomputed))
            if len(found) > 1:
                break
    if not found:
        raise RuntimeError(
            f"module {name!r} ({type(module).__name__}) has no per-example gradient rule, and no choice of "
            "which of its inputs carry the example index in dim 0 reproduces its output per example: its "
            "inputs are not batch-first, or its forward mixes examples. Register a rule, make it "
            "batch-first, or freeze its parameters."
        )
    if len(found) > 1 and not all(_reproduces(found[0][0][attr], found[1][0][attr]) for attr in attrs):
        raise RuntimeError(
            f"module {name!r} ({type(module).__name__}) has no per-example gradient rule, and its tensor "
            "arguments with the batch size in dim 0 reproduce its output both as per-example and as shared "
            "inputs, with different gradients: which of them carry the example index cannot be established. "
            "Register a rule for it or freeze its parameters."
        )
    return {attr: Dense(g) for attr, g in found[0][0].items()}


def _vmapped(
    module: nn.Module,
    params: dict[str, torch.Tensor],
    keys: list,
    values: list,
    dims: list[int | None],
    dy: torch.Tensor,
    num_args: int,
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """``(g_i, module(x_i))`` for every example i, vmapping dim 0 of the values with ``dims[j] == 0``."""

    def inner_product(p: dict[str, torch.Tensor], vals: list, dy_i: torch.Tensor):
        vals = [v.unsqueeze(0) if d == 0 else v for v, d in zip(vals, dims, strict=True)]
        kw = dict(zip(keys[num_args:], vals[num_args:], strict=True))
        out = functional_call(module, p, tuple(vals[:num_args]), kw)
        return (out * dy_i.unsqueeze(0).to(out.dtype)).sum(), out.squeeze(0)

    with torch.enable_grad():
        return vmap(grad(inner_product, has_aux=True), in_dims=(None, dims, 0))(params, values, dy)


def shared_per_example_grads(
    module: nn.Module,
    attrs: list[str],
    args: tuple,
    kwargs: dict[str, Any],
    dy: torch.Tensor,
    output: torch.Tensor,
    name: str,
) -> dict[str, PerExampleGrad]:
    """Per-example gradients of the parameters ``attrs`` of a layer whose output S is shared by all examples
    (called on no per-example input, :mod:`dpexp.privacy.shared`), for ``dy`` (B, *S.shape), row i example
    i's gradient of S where S met the batch. S is the same function of the parameters W for every example,
    so ``dW_i = J_W^T dS_i`` with the one Jacobian ``J_W = dS/dW``: one recomputed forward (checked against
    the recorded ``output``) and one batched vector-Jacobian product for all examples."""
    params = {attr: module.get_parameter(attr).detach().requires_grad_(True) for attr in attrs}
    with torch.enable_grad():
        recomputed = functional_call(module, params, args, kwargs)
    if not torch.is_tensor(recomputed) or not _reproduces(output, recomputed):
        raise RuntimeError(
            f"layer {name!r} ({type(module).__name__}) is shared by all examples and has no per-example "
            "gradient rule; recomputing its forward did not reproduce its output, so its per-example "
            "gradients cannot be taken through it. Make its forward deterministic or freeze its parameters."
        )
    grads = torch.autograd.grad(
        recomputed, list(params.values()), dy.to(recomputed.dtype), is_grads_batched=True, allow_unused=True
    )
    return {
        attr: Dense(p.new_zeros(dy.shape[0], *p.shape) if g is None else g)
        for (attr, p), g in zip(params.items(), grads, strict=True)
    }
