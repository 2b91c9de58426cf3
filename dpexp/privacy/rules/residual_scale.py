"""Learnt per-channel scales of a decoder layer's residual stream: Hugging Face's ``DogeDecoderLayer`` (the
SmallDoge models'), whose two residual connections each scale the stream before adding the block's output,

    h = p1 * x + attn(norm(x)),   y = p2 * h + mlp(norm(h)),

with ``x`` the layer's input and ``p1`` (``input_residual``), ``p2`` (``post_attention_residual``) vectors
over the features. Example i's gradients are sums over its positions,

    d p1_i = sum_t dh[i, t] * x[i, t],   d p2_i = sum_t dy[i, t] * h[i, t],

where ``dh`` is the whole gradient at ``h`` (through the MLP and through ``p2``): the output gradient of the
product ``p1 * x``, which the rule reads off the call's autograd graph
(:func:`~dpexp.privacy.rules.graph.product_with`: the one product that keeps ``p1`` itself, as its backward to
``x`` needs it), ``dy`` arriving at the product ``p2 * h`` likewise, and ``h`` kept from the call as
``post_attention_layernorm``'s input. Nothing of the layer runs again. Where the graph lacks those products
(autocast's copies of the parameters, activation checkpointing's hooks) the layer is refused with the fix: the
fallback took it before (``doge`` entry of ``bench_suite=sweep_fallbacks``), recomputing the whole layer,
attention and MLP, per example.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dpexp.privacy.per_example import Dense, PerExampleGrad
from dpexp.privacy.rules import (
    CallLayout,
    as_sequence,
    first_output,
    forward_arguments,
    refuse,
    register_rule,
    unknown_parameters,
)
from dpexp.privacy.rules.graph import GraphReads, call_nodes, product_with
from dpexp.privacy.rules.submodule_values import read_call

_DOGE = "transformers.models.doge.modeling_doge.DogeDecoderLayer"
_SCALES = ("input_residual", "post_attention_residual")
_KEEPS = {"h": ("post_attention_layernorm", "input")}
_FIX = "Otherwise freeze input_residual and post_attention_residual (requires_grad=False)."


def _check(module: nn.Module) -> None:
    refuse(module, "residual-scale", "layer", unknown_parameters(module, set(_SCALES)), _FIX)


def _inputs(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple:
    """``(hidden_states (B, T, d),)``, to which the capture appends the kept ``h`` and the graph's reads."""
    return (forward_arguments(module, args, kwargs)["hidden_states"],)


def residual_graph(module: nn.Module, call: tuple, output: torch.Tensor, boundary: list) -> GraphReads | None:
    """The products ``p1 * x`` and ``p2 * h`` of the call's graph, whose output gradients are ``dh`` and
    ``dy``; None where the graph lacks them."""
    nodes = call_nodes(output, boundary)
    if nodes is None:
        return None
    products = {f"d_{name}": product_with(nodes, getattr(module, name)) for name in _SCALES}
    if any(node is None for node in products.values()):
        return None
    return GraphReads({}, products)


@register_rule(
    _DOGE, check=_check, call=CallLayout(_inputs, first_output, keeps=lambda _: _KEEPS, graph=residual_graph)
)
def residual_scale_grads(module: nn.Module, call: tuple, dy: torch.Tensor) -> dict[str, PerExampleGrad]:
    """``d input_residual`` and ``d post_attention_residual`` (B, d) by the module docstring's formula;
    ``call`` = (x, kept, reads), ``dy`` (B, T, d) the layer's output gradient (its product's, from the
    graph: the same)."""
    (x,), kept, reads = read_call(module, call, _KEEPS, "residual-scale", _FIX)
    h = kept["h"]
    first, second = (reads[f"d_{name}"] for name in _SCALES)
    with torch.no_grad():
        return {
            "input_residual": Dense(as_sequence(first.to(x.dtype) * x.detach()).sum(1)),
            "post_attention_residual": Dense(as_sequence(second.to(h.dtype) * h).sum(1)),
        }
