"""DeepSeek-V4's heavily compressed attention's window bias (DeepSeek-V4 report sec. 2.3.2, eq. 20-23; Hugging
Face's ``DeepseekV4HCACompressor``): every whole window of ``m`` tokens is pooled into one key/value entry
with softmax weights over the window's positions,

    C_w = sum_{j in w} softmax_j(Z_j + B_j) * C_j,

where ``Z = gate_proj(x)`` (B, T, d_h) and the bias ``B`` (``position_bias``, (m, d_h)) is added at each
window's j-th position. ``B`` enters only through ``Z + B`` on the whole windows, and ``Z`` only there, so
with ``dZ`` the gradient at ``gate_proj``'s output (zero past the last whole window), example i's gradient is
the sum over its windows

    d B_i = sum_w dZ[i, w m : (w + 1) m].

``dZ`` is read off the call's graph at the node that produced the kept ``gate_proj`` output
(:func:`~dpexp.privacy.rules.submodule_values.gradients_at`); ``kv_proj`` and ``gate_proj`` are ``nn.Linear``
with their own rules. The rule recomputes the window weights ``softmax(Z + B)`` and refuses a compressor
whose call's softmax kept other values (its forward is not the one the rule follows), a call given a cache
(its windows would start where the cache left off) and a ``gate_proj`` called other than once. A call shorter
than one window pools nothing and gives ``B`` no gradient. Before this rule the exact fallback recomputed the
compressor per example (``deepseek_v4`` entry of ``bench_suite=sweep_fallbacks``, where at T = 64 no window
of its 128 closes).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dpexp.privacy.per_example import Dense, PerExampleGrad
from dpexp.privacy.rules import (
    CallLayout,
    first_output,
    forward_arguments,
    given_cache,
    refuse,
    register_rule,
    unknown_parameters,
)
from dpexp.privacy.rules.graph import GraphReads, call_nodes, kept_by
from dpexp.privacy.rules.submodule_values import gradients_at, read_call, reproduced

_HCA = "transformers.models.deepseek_v4.modeling_deepseek_v4.DeepseekV4HCACompressor"
_KEEPS = {"gate": ("gate_proj", "output")}
_FIX = "Otherwise freeze position_bias (requires_grad=False)."


def _check(module: nn.Module) -> None:
    refuse(module, "window-bias", "compressor", unknown_parameters(module, {"position_bias"}), _FIX)


def _inputs(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple:
    """``(hidden_states (B, T, d),)``, to which the capture appends the kept gate and the graph's reads; a
    cache is refused."""
    call = forward_arguments(module, args, kwargs)
    if given_cache(call):
        raise ValueError(f"was given a cache; call the model with use_cache=False in training. {_FIX}")
    return (call["hidden_states"],)


def _windows(module: nn.Module, gate: torch.Tensor) -> torch.Tensor:
    """(B, W, m, d_h): ``gate``'s whole windows (the positions past the last one left out)."""
    m = module.compress_rate
    usable = gate.shape[1] // m * m
    return gate[:, :usable].unflatten(1, (-1, m))


def _pooled(module: nn.Module, call: tuple) -> bool:
    """Whether the call's text closes a whole window (else it pools nothing and ``B`` gets no gradient)."""
    return call[0].shape[1] >= module.compress_rate


def window_graph(module: nn.Module, call: tuple, output: Any, boundary: list) -> GraphReads | None:
    """The gradient at ``gate_proj``'s output and the window weights the call's one softmax kept; None
    where the graph lacks them, and for a call without a whole window (nothing pooled)."""
    if not _pooled(module, call):
        return None
    at_gate = gradients_at(call[-1], ("gate",))
    nodes = call_nodes(output, boundary)
    weights = None if nodes is None else kept_by(nodes, "SoftmaxBackward0", "_saved_result")
    return None if at_gate is None or weights is None else GraphReads({"weights": weights[1]}, at_gate.nodes)


@register_rule(
    _HCA, check=_check, call=CallLayout(_inputs, first_output, keeps=lambda _: _KEEPS, graph=window_graph)
)
def window_bias_grads(module: nn.Module, call: tuple, dy: torch.Tensor) -> dict[str, PerExampleGrad]:
    """``position_bias`` (B, m, d_h) by the module docstring's formula; ``dy`` unused."""
    bias = module.position_bias
    if not _pooled(module, call):
        return {"position_bias": Dense(bias.new_zeros(call[0].shape[0], *bias.shape))}
    _, kept, reads = read_call(module, call, _KEEPS, "window-bias", _FIX)
    with torch.no_grad():
        gate = _windows(module, kept["gate"])
        weights = (gate + bias).softmax(dim=2, dtype=torch.float32)
        reproduced(module, "the window weights", reads["weights"], weights, _FIX)
        d_gate = _windows(module, reads["d_gate"].to(bias.dtype))
        return {"position_bias": Dense(d_gate.sum(1))}
