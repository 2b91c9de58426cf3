"""Inkling's hidden-state-conditioned relative position bias (Hugging Face's ``InklingRelativeLogits``): each
token's relative states ``r`` (B, T_q, heads, d_rel) mix a bank of bias-by-distance profiles ``P`` (``proj``,
(d_rel, R)) into logits ``L = r P`` (B, T_q, heads, R), and the bias of query t for key s is the logit at
their distance, ``L[t, t - s]`` for ``0 <= t - s < R``, zero elsewhere.

``P`` enters through that one matrix product alone, so with ``dL`` the gradient at its output, example i's
gradient is the product's weight gradient restricted to its rows,

    d P_i = sum_{t, h} r[i, t, h] (x) dL[i, t, h],

an :class:`~dpexp.privacy.per_example.Outer` (the ghost norm never forms the (d_rel, R) matrix; Bu et al.
2023, eq. 2). ``dL`` is the output gradient of the product itself, read off the call's graph at the one
matrix product that keeps ``P`` for its backward (:func:`~dpexp.privacy.rules.graph.matmul_with`: the same
storage, offset, shape and strides, or under autocast its cast copy): autograd's own transpose of the
gather by distance and of the mask, so the rule copies none of the module's index arithmetic. Where the
graph lacks the product (hooks on saved tensors) the module is refused with the fix. Before this rule the
exact fallback recomputed the module per example (the audit sweep's ``inkling_text``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dpexp.privacy.per_example import Outer, PerExampleGrad
from dpexp.privacy.rules import (
    CallLayout,
    first_output,
    forward_arguments,
    refuse,
    register_rule,
    unknown_parameters,
)
from dpexp.privacy.rules.graph import GraphReads, call_nodes, matmul_with
from dpexp.privacy.rules.submodule_values import read_call

_INKLING = "transformers.models.inkling.modeling_inkling.InklingRelativeLogits"
_FIX = "Otherwise freeze proj (requires_grad=False)."


def _check(module: nn.Module) -> None:
    refuse(module, "relative-logits", "module", unknown_parameters(module, {"proj"}), _FIX)


def _inputs(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple:
    """``(relative_states (B, T_q, heads, d_rel),)``, to which the capture appends the graph's read; the
    positions are the call's, shared by its examples."""
    return (forward_arguments(module, args, kwargs)["relative_states"],)


def relative_logits_graph(module: nn.Module, call: tuple, output: Any, boundary: list) -> GraphReads | None:
    """The product ``r P`` (``d_logits``: its output gradient is ``dL``, rows in ``r``'s order); None where
    the graph lacks it."""
    nodes = call_nodes(output, boundary)
    product = None if nodes is None else matmul_with(nodes, module.proj.t(), cast=True)
    return None if product is None else GraphReads({}, {"d_logits": product})


@register_rule(_INKLING, check=_check, call=CallLayout(_inputs, first_output, graph=relative_logits_graph))
def relative_logits_grads(module: nn.Module, call: tuple, dy: torch.Tensor) -> dict[str, PerExampleGrad]:
    """``proj`` by the module docstring's formula: an Outer of ``r`` and ``dL`` over each example's
    ``T_q * heads`` rows; ``dy`` unused (the gradient at the product is read)."""
    (states,), _, reads = read_call(module, call, None, "relative-logits", _FIX)
    proj = module.proj
    batch, logits = states.shape[0], reads["d_logits"]
    if logits.numel() != states[..., :1].numel() * proj.shape[1]:
        raise RuntimeError(
            f"{type(module).__name__}: the gradient read at r @ proj has {logits.numel()} entries where "
            f"r's rows times proj's columns make {states[..., :1].numel() * proj.shape[1]}; register a rule "
            f"for its type (dpexp.privacy.rules.register_rule). {_FIX}"
        )
    with torch.no_grad():
        left = states.detach().reshape(batch, -1, proj.shape[0]).to(proj.dtype)
        right = logits.reshape(batch, -1, proj.shape[1]).to(proj.dtype)
        return {"proj": Outer(left, right, proj.shape, proj.shape[0])}
