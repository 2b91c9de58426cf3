"""nGPT's learnt scales (Loshchilov et al. 2025, nGPT: Normalized Transformer with Representation Learning on
the Hypersphere; Hugging Face's Dory, ``DoryDecoderLayer`` and ``DoryMLP``). Each scale is stored as ``s``
and used as ``s * s_init / s_scale`` (sec. 2.6), a constant factor ``c`` written on the module.

*The layer's eigen learning rates* (sec. 2.3.2, eq. 10-11): with ``h`` the normalised input and the
normalised block outputs ``a`` (attention) and ``m`` (MLP),

    h1 = h + |c lambda_1| * (a - h),    h2 = norm(h1),    y = h2 + |c lambda_2| * (m - h2),

so with ``dh1`` the whole gradient at ``h1`` and ``dy`` the layer's output gradient, example i's gradients
are sums over its positions,

    d lambda_1,i = c sign(c lambda_1) sum_t dh1 (a - h),
    d lambda_2,i = c sign(c lambda_2) sum_t dy (m - h2)

(0 where ``lambda = 0``, as autograd's ``abs``).

*The MLP's scaling factors* (sec. 2.5, eq. 16-17): ``gate = G * (c s_v)`` and ``up = U * (c s_u)`` with ``G``,
``U`` the outputs of ``gate_proj`` and ``up_proj``, then ``down_proj(norm(act(gate) * up))``; with ``dgate``
and ``dp`` the gradients at ``gate`` and at the product ``p = act(gate) * up``,

    d s_v,i = c sum_t dgate G,    d s_u,i = c sum_t dp act(gate) U.

*The attention's scaling factors* (sec. 2.3.1-2.3.2, eq. 15): the rotated queries ``q`` (B, heads, T, e) are
scaled per head and channel by ``(c s_qk)^2`` before the attention function, and its output ``o`` gated as
``P = o * sigmoid(g (c s_gate)^2)`` with ``g`` the output of ``gate_proj``; with ``dq`` the gradient at the
scaled queries and ``dP`` at ``P``,

    d s_qk,i = 2 c^2 s_qk sum_t dq q,    d s_gate,i = 2 c^2 s_gate sum_t dP o sigma (1 - sigma) g.

The capture keeps the values each formula names as its submodules see them (``keeps``): ``h`` (the input
norm's output), ``a``, ``h1`` and ``h2`` (the feed-forward norm's input and output), ``m``; ``G``, ``U``,
``gate`` (the activation's input), ``act(gate)`` and ``p`` (the MLP norm's input); the normalised queries
(``q_norm``'s output, rotated again by the module's own ``apply_rotary_pos_emb``), ``g`` and ``P`` (the
output norm's input). The gradients at ``h1``, ``gate``, ``p`` and ``P`` are read off the call's graph at the
nodes that produced those kept values (:func:`~dpexp.privacy.rules.graph.produced_by`), ``o`` from what the
gate's product keeps for its backward, and the gradient at the scaled queries at the one product in the
call's graph that keeps ``(c s_qk)^2``, found by its value (the attention function's own, any implementation:
:func:`~dpexp.privacy.rules.graph.product_with`). Nothing of the module runs again. The rule recomputes
``h1``, ``gate``, ``p`` and the gate from the kept values and its formulas, and refuses a module whose
forward they do not reproduce, and an attention given a cache or the loops' shared keys and values. Before
these rules the fallback recomputed each layer, MLP and attention per example (``dory`` entry of
``bench_suite=sweep_fallbacks``).
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn

from dpexp.privacy.per_example import Dense, PerExampleGrad
from dpexp.privacy.rules import (
    CallLayout,
    as_sequence,
    first_output,
    forward_arguments,
    given_cache,
    refuse,
    register_rule,
    unknown_parameters,
)
from dpexp.privacy.rules.graph import GraphReads, call_nodes, produced_by, product_with, saved_operands
from dpexp.privacy.rules.submodule_values import (
    called_once,
    gradients_at,
    kept_tensor,
    read_call,
    reproduced,
)

_DORY = "transformers.models.dory.modeling_dory"
_LAYER_KEEPS = {
    "h": ("input_layernorm", "output"),
    "a": ("post_attention_layernorm", "output"),
    "h1": ("pre_feedforward_layernorm", "input"),
    "h2": ("pre_feedforward_layernorm", "output"),
    "m": ("post_feedforward_layernorm", "output"),
}
_MLP_KEEPS = {
    "G": ("gate_proj", "output"),
    "U": ("up_proj", "output"),
    "gate": ("act_fn", "input"),
    "act": ("act_fn", "output"),
    "p": ("ffn_sub_norm", "input"),
}
_ATTENTION_KEEPS = {"q": ("q_norm", "output"), "g": ("gate_proj", "output"), "P": ("attn_sub_norm", "input")}
_SCALES = {  # the module's own parameters, by class
    "DoryDecoderLayer": ("lambda_1", "lambda_2"),
    "DoryMLP": ("suv_gate", "suv_up"),
    "DoryAttention": ("sqk", "s_gate"),
}


def _fix(module: nn.Module) -> str:
    return f"Otherwise freeze {' and '.join(_SCALES[type(module).__name__])} (requires_grad=False)."


def _check(module: nn.Module) -> None:
    reason = unknown_parameters(module, set(_SCALES[type(module).__name__]))
    refuse(module, "nGPT", "module", reason, _fix(module))


def _inputs(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple:
    """``(hidden_states (B, T, d),)``, to which the capture appends the kept values and the graph's reads."""
    return (forward_arguments(module, args, kwargs)["hidden_states"],)


def _graph_at(keys: tuple[str, ...]):
    """A :class:`~dpexp.privacy.rules.CallLayout` ``graph`` reading the gradients at the kept values ``keys``
    (:func:`~dpexp.privacy.rules.submodule_values.gradients_at`)."""
    return lambda module, call, output, boundary: gradients_at(call[-1], keys)


def _rate_grad(lam: torch.Tensor, scale: float, summed: torch.Tensor) -> torch.Tensor:
    """(B, d): ``d |scale lambda| / d lambda`` times example i's ``summed`` (B, d)."""
    return summed * (scale * torch.sign(lam.detach() * scale))


@register_rule(
    f"{_DORY}.DoryDecoderLayer",
    check=_check,
    call=CallLayout(_inputs, first_output, keeps=lambda _: _LAYER_KEEPS, graph=_graph_at(("h1",))),
)
def rates_grads(module: nn.Module, call: tuple, dy: torch.Tensor) -> dict[str, PerExampleGrad]:
    """``d lambda_1``, ``d lambda_2`` (B, d) by the module docstring's formulas; ``dy`` (B, T, d)."""
    _, v, reads = read_call(module, call, _LAYER_KEEPS, "nGPT", _fix(module))
    scale = module.lambda_scale
    with torch.no_grad():
        rate = (module.lambda_1 * scale).abs()
        reproduced(module, "h1", v["h1"], v["h"] + rate * (v["a"] - v["h"]), _fix(module))
        first = as_sequence(reads["d_h1"].to(v["h"].dtype) * (v["a"] - v["h"])).sum(1)
        second = as_sequence(dy.to(v["h2"].dtype) * (v["m"] - v["h2"])).sum(1)
        return {
            "lambda_1": Dense(_rate_grad(module.lambda_1, scale, first)),
            "lambda_2": Dense(_rate_grad(module.lambda_2, scale, second)),
        }


@register_rule(
    f"{_DORY}.DoryMLP",
    check=_check,
    call=CallLayout(_inputs, first_output, keeps=lambda _: _MLP_KEEPS, graph=_graph_at(("gate", "p"))),
)
def suv_grads(module: nn.Module, call: tuple, dy: torch.Tensor) -> dict[str, PerExampleGrad]:
    """``d suv_gate``, ``d suv_up`` (B, intermediate) by the module docstring's formulas; ``dy`` unused (the
    gradients at ``gate`` and ``p`` are read)."""
    _, v, reads = read_call(module, call, _MLP_KEEPS, "nGPT", _fix(module))
    scale = module.suv_scale
    with torch.no_grad():
        reproduced(module, "the scaled gate", v["gate"], v["G"] * (module.suv_gate * scale), _fix(module))
        up = v["U"] * (module.suv_up * scale)
        reproduced(module, "the MLP's product", v["p"], v["act"] * up, _fix(module))
        gate = as_sequence(reads["d_gate"].to(v["G"].dtype) * v["G"]).sum(1)
        product = as_sequence(reads["d_p"].to(v["U"].dtype) * v["act"] * v["U"]).sum(1)
        return {"suv_gate": Dense(gate * scale), "suv_up": Dense(product * scale)}


def _query_scale(module: nn.Module) -> torch.Tensor:
    """``(c s_qk)^2`` as the forward forms it: (heads, 1, e)."""
    return (module.sqk * module.sqk_scale).view(-1, 1, module.head_dim).square()


def _attention_inputs(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple:
    """``(hidden_states (B, T, d), (cos, sin))``, to which the capture appends the kept values and the graph's
    reads; a cache or the recurrent loops' shared keys and values are refused (they enter the attention
    beside the call's own queries)."""
    call = forward_arguments(module, args, kwargs)
    if given_cache(call) or call.get("shared_kv_states") is not None:
        raise ValueError(
            "was given a cache or shared keys and values; call the model with use_cache=False in training. "
            f"{_fix(module)}"
        )
    return call["hidden_states"], tuple(call["position_embeddings"])


def attention_graph(module: nn.Module, call: tuple, output: Any, boundary: list) -> GraphReads | None:
    """The gradients at the scaled queries (the one product keeping ``(c s_qk)^2``, found by its value) and at
    ``P`` (its node's kept operands give ``o`` and the gate); None where the graph lacks them."""
    kept = call[-1]
    if not called_once(kept, _ATTENTION_KEEPS):
        return None
    nodes = call_nodes(output[0] if isinstance(output, tuple) else output, boundary)
    gated = produced_by(kept_tensor(kept["P"][0]))
    operands = None if gated is None else saved_operands(gated)
    if nodes is None or operands is None or any(t is None for t in operands):
        return None
    with torch.no_grad():
        scaled = product_with(nodes, _query_scale(module), by_value=True)
    if scaled is None:
        return None
    return GraphReads({"o": operands[0], "sigma": operands[1]}, {"d_q": scaled, "d_P": gated})


@register_rule(
    f"{_DORY}.DoryAttention",
    check=_check,
    call=CallLayout(_attention_inputs, first_output, keeps=lambda _: _ATTENTION_KEEPS, graph=attention_graph),
)
def attention_scales_grads(module: nn.Module, call: tuple, dy: torch.Tensor) -> dict[str, PerExampleGrad]:
    """``d sqk``, ``d s_gate`` (B, heads * e) by the module docstring's formulas; ``dy`` unused (the
    gradients inside the call are read)."""
    (_, (cos, sin)), v, reads = read_call(module, call, _ATTENTION_KEEPS, "nGPT", _fix(module), inputs=2)
    rotate = sys.modules[type(module).__module__].apply_rotary_pos_emb
    with torch.no_grad():
        q = v["q"].transpose(1, 2)
        q, _ = rotate(q, q, cos, sin)  # (B, heads, T, e)
        sqk = module.sqk * module.sqk_scale
        d_scale = (reads["d_q"].to(q.dtype) * q).sum(2).flatten(1)  # (B, heads * e) at (c s_qk)^2
        gate = (module.s_gate * module.s_gate_scale).square()
        sigma = reads["sigma"]
        reproduced(module, "the output gate", sigma, torch.sigmoid(v["g"] * gate), _fix(module))
        inner = reads["d_P"].to(sigma.dtype) * reads["o"] * sigma * (1 - sigma) * v["g"]
        d_gate = as_sequence(inner).sum(1)
        return {
            "sqk": Dense(d_scale * (2 * module.sqk_scale * sqk)),
            "s_gate": Dense(d_gate * (2 * module.s_gate_scale**2 * module.s_gate)),
        }
