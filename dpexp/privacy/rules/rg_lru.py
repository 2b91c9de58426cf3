"""Griffin's Real-Gated Linear Recurrent Unit (De et al. 2024, Griffin, sec. 2.4; Hugging Face's
``RecurrentGemmaRglru``). Its input ``x`` (B, T, d) is split into H heads of ``n = d / H`` features, and each
head's gates are block-diagonal affine maps of it, ``res_g = x_h W_{g,h} + b_{g,h}`` (``torch.baddbmm`` over
the heads, rows ``(i, t)``; g the input gate and the recurrence gate, ``W_g`` (H, n, n), ``b_g`` (H, n)),
``r = sigmoid(res_recurrence)``, and the recurrence's log decay is

    log a = (-8 r) * softplus(Lambda)      (``recurrent_param`` Lambda (d,)),

after which the gated, normalised input runs through the scan ``h_t = a_t h_{t-1} + ...``.

Each parameter enters through one of these three products, so with ``dres_g`` (H, B T, n) and ``dlog``
(B, T, d) the gradients at their outputs, example i's gradients are sums over its rows:

    d W_{g,h,i} = sum_t x_{i,t,h} (x) dres_{g,h,(i,t)},    d b_{g,h,i} = sum_t dres_{g,h,(i,t)},
    d Lambda_i = softplus'(Lambda) * sum_t dlog_{i,t} * (-8 r_{i,t}),

the weights' gradients a :class:`~dpexp.privacy.per_example.Routed` with every (head, example, position) row
routed to its head's block (the norm pair by pair, never the (H, n, n) matrix per example; Bu et al. 2023,
eq. 2).
The three gradients are read off the call's graph: the two ``baddbmm`` nodes that keep each weight itself
(:func:`~dpexp.privacy.rules.graph.kept_as`; under autocast its cast copy, with ``-8 r`` recomputed in the
call's autocast state, :mod:`~dpexp.privacy.rules.autocast`) and the one product that keeps
``softplus(Lambda)`` (:func:`~dpexp.privacy.rules.graph.product_with`, by value); the scan, the reset at each
text's start and the gamma normalisation (an ``autograd.Function`` torch.func cannot run) are autograd's own,
nothing of them runs again. The rule refuses a module whose ``baddbmm`` did not multiply its input's heads row
for row, or whose product's other factor is not ``-8 r`` recomputed from the weights (its forward is not the
one the rule follows), and a call whose graph lacks the three nodes. State carried into the call
(``recurrent_states`` a training forward left) is check 3's (:mod:`dpexp.privacy.state`). Before this rule the
exact fallback recomputed the module one example at a time.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dpexp.privacy.per_example import Dense, PerExampleGrad, Routed
from dpexp.privacy.rules import (
    CallLayout,
    first_output,
    forward_arguments,
    refuse,
    register_rule,
    unknown_parameters,
)
from dpexp.privacy.rules.activation import softplus_backward
from dpexp.privacy.rules.autocast import autocast_at, replay
from dpexp.privacy.rules.graph import GraphReads, call_nodes, kept_as, other_operand, product_with, saved
from dpexp.privacy.rules.submodule_values import read_call, reproduced

_RGLRU = "transformers.models.recurrent_gemma.modeling_recurrent_gemma.RecurrentGemmaRglru"
_GATES = {"input": "input_gate", "recurrent": "recurrent_gate"}  # key -> the parameters' prefix
_PARAMS = {"recurrent_param", *(f"{p}_{w}" for p in _GATES.values() for w in ("weight", "bias"))}
_DECAY = -8.0  # the forward's constant c in log a = c r softplus(Lambda) (Griffin, sec. 2.4)
_FIX = "Otherwise freeze the RG-LRU's parameters (requires_grad=False)."


def _check(module: nn.Module) -> None:
    refuse(module, "RG-LRU", "module", unknown_parameters(module, _PARAMS), _FIX)


def _inputs(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple:
    """``(activations (B, T, d), autocast state)``, to which the capture appends the graph's reads; the
    positions (the resets) act inside the graph. The gates' product is recomputed in the call's autocast
    state (:mod:`~dpexp.privacy.rules.autocast`)."""
    x = forward_arguments(module, args, kwargs)["activations"]
    return x, autocast_at(x)


def _weight(module: nn.Module, key: str) -> torch.Tensor:
    return getattr(module, f"{_GATES[key]}_weight")


def rg_lru_graph(module: nn.Module, call: tuple, output: Any, boundary: list) -> GraphReads | None:
    """The gates' products (``d_<gate>``; the rows each multiplied, ``rows_<gate>``) and the log decay's
    product (``d_log``; its other factor ``factor``), the values where autograd kept them (where the
    parameters need a gradient: a verified call); None where the graph lacks a node."""
    nodes = call_nodes(output, boundary, steps=call[0].shape[1])
    if nodes is None:
        return None
    found = {
        f"d_{key}": kept_as(nodes, "BaddbmmBackward0", "_saved_batch2", _weight(module, key), cast=True)
        for key in _GATES
    }
    with torch.no_grad():
        softplus = F.softplus(module.recurrent_param)
    found["d_log"] = product_with(nodes, softplus, by_value=True)
    if any(node is None for node in found.values()):
        return None
    factor = other_operand(found["d_log"], softplus)  # kept where Lambda needs a gradient
    values = {} if factor is None else {"factor": factor}
    for key in _GATES:
        rows = saved(found[f"d_{key}"], "_saved_batch1")  # kept where the weight needs a gradient
        if rows is not None:
            values[f"rows_{key}"] = rows.detach()
    return GraphReads(values, found)


@register_rule(_RGLRU, check=_check, call=CallLayout(_inputs, first_output, graph=rg_lru_graph))
def rg_lru_grads(module: nn.Module, call: tuple, dy: torch.Tensor) -> dict[str, PerExampleGrad]:
    """The gates' weights (Routed rows (H B T, n)) and biases (B, H, n) and ``recurrent_param`` (B, d) by the
    module docstring's formulas; ``dy`` unused (the gradients inside the call are read)."""
    (x, autocast), _, reads = read_call(module, call, None, "RG-LRU", _FIX, inputs=2)
    lam = module.recurrent_param
    batch, steps, width = x.shape
    heads = module.num_attention_heads
    with torch.no_grad():
        rows = x.detach().reshape(batch * steps, heads, -1).transpose(0, 1)  # (H, B T, n), the forward's
        for key in _GATES:
            if f"rows_{key}" in reads:
                reproduced(module, f"the {key} gate's input rows", reads[f"rows_{key}"], rows, _FIX)
        with replay(autocast):
            res = torch.baddbmm(module.recurrent_gate_bias[:, None, :], rows, module.recurrent_gate_weight)
            decay = _DECAY * torch.sigmoid(res.transpose(0, 1).reshape(batch, steps, width))
        if "factor" in reads:
            reproduced(module, "the log decay's factor -8 r", reads["factor"], decay, _FIX)
        left = rows.reshape(-1, rows.shape[-1]).to(lam.dtype)
        expert = torch.arange(heads, device=x.device).repeat_interleave(batch * steps)
        example = torch.arange(batch, device=x.device).repeat_interleave(steps).repeat(heads)
        d_input, d_recurrent = (reads[f"d_{key}"].to(lam.dtype) for key in _GATES)  # (H, B T, n) each
        weight = Routed(left, d_input.flatten(0, 1), expert, example, batch, module.input_gate_weight.shape)
        grads: dict[str, PerExampleGrad] = {
            "input_gate_weight": weight,
            "recurrent_gate_weight": weight.sibling(
                left, d_recurrent.flatten(0, 1), module.recurrent_gate_weight.shape
            ),
        }
        for key, d_res in (("input", d_input), ("recurrent", d_recurrent)):
            grads[f"{_GATES[key]}_bias"] = Dense(d_res.unflatten(1, (batch, steps)).sum(2).transpose(0, 1))
        d_softplus = (reads["d_log"].to(lam.dtype) * decay.to(lam.dtype)).sum(1)  # (B, d)
        d_lam = softplus_backward(d_softplus, lam.detach().expand_as(d_softplus))  # the forward's F.softplus
        grads["recurrent_param"] = Dense(d_lam)
        return grads
