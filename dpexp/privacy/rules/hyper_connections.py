"""Hyper-connections' learnt weights (Zhu et al. 2025, Hyper-Connections; the manifold-constrained form of
DeepSeek-V4, Xie et al. 2026): Hugging Face's ``DeepseekV4HyperConnection``, ``Glm5NextTextHyperConnection``
(DeepSeek-V4's form) and ``HYV4HyperConnection``, which collapse a layer's ``N`` residual streams into its
block's input and give the weights that expand the block's output back (and, except in HY-V4, mix the
streams), and ``DeepseekV4HyperHead`` / ``HYV4HyperHead``, the model's final collapse.

Each module reads the streams ``x`` (B, T, N, d) as ``flat`` (B, T, N d) in float32, normalised per position
by its ``input_norm``, ``a = flat * rsqrt(mean(flat^2) + eps)`` (DeepSeek-V4 normalises before its projection,
HY-V4 scales the projection's output: the same ``mixes = a fn^T``, (B, T, K)), and splits the mixes into
groups ``g`` (pre, post, and except in HY-V4 comb), each an affine map of its own scale ``s_g`` and biases
``b_g`` followed by a fixed function of the position (the sigmoid, or the softmax and Sinkhorn iterations of
comb):

    u_g = mixes_g * s_g + b_g.

With ``du`` the gradient at ``u`` (B, T, K), example i's gradients are sums over its positions,

    d b_i = sum_t du_{i,t},    d s_{g,i} = sum_t sum_{k in g} du_{i,t,k} mixes_{i,t,k},
    d fn_i = sum_t (du_{i,t} * s) (x) a_{i,t},

the last an :class:`~dpexp.privacy.per_example.Outer` (the ghost norm never forms the (K, N d) matrix; Bu et
al. 2023, eq. 2). ``du_g`` is the output gradient of the product ``mixes_g * s_g``, read off the call's graph
at the one product that keeps ``s_g`` for its backward (:func:`~dpexp.privacy.rules.graph.product_with`: the
parameter's own entry, or, where the module takes a float32 copy of a float64 parameter, a tensor equal to
it); whatever follows the product (the sigmoid, the Sinkhorn iterations, the streams' products) is autograd's
own, nothing of it runs again. The capture keeps ``input_norm``'s input and output (``keeps``); the rule
recomputes ``mixes`` (one product with ``fn``, the forward's own; in the call's autocast state,
:mod:`~dpexp.privacy.rules.autocast`, as DeepSeek-V4's projection runs in it, where HY-V4 turns autocast off)
and refuses a module whose forward it does not follow: each group's ``sigmoid(u_g)`` (or softmax) must
reproduce one of the values the call's sigmoid (or softmax) nodes kept. Before these rules the exact fallback
recomputed each module per example (``deepseek_v4`` and ``hy_v4`` entries of ``bench_suite=sweep_fallbacks``;
GLM-5-Next's, stop 52: 95 ms of a 2.4 s private step).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dpexp.privacy.per_example import Dense, Outer, PerExampleGrad
from dpexp.privacy.rules import (
    CallLayout,
    first_output,
    forward_arguments,
    refuse,
    register_rule,
    unknown_parameters,
)
from dpexp.privacy.rules.autocast import autocast_at, replay
from dpexp.privacy.rules.graph import GraphReads, call_nodes, kept_by_each, product_with
from dpexp.privacy.rules.submodule_values import read_call, reproduced


@dataclass(frozen=True)
class _Form:
    """A hyper-connection module's parameters (projection, biases, scales), its groups' functions in the
    order of the projection's rows (``"sigmoid"``: N rows, ``"softmax"``: N x N rows, a softmax over the last
    N), whether ``input_norm`` returns the normalised input (else its factor ``rsqrt(...)``), and whether the
    module turns autocast off around its projection (HY-V4's; DeepSeek-V4's runs in autocast's dtype)."""

    params: tuple[str, str, str]
    groups: tuple[str, ...]
    normalises: bool
    autocast_off: bool


_CONNECTION = ("fn", "base", "scale")
_HEAD = ("hc_fn", "hc_base", "hc_scale")
_FORMS = {
    "DeepseekV4HyperConnection": _Form(_CONNECTION, ("sigmoid", "sigmoid", "softmax"), True, False),
    "DeepseekV4HyperHead": _Form(_HEAD, ("sigmoid",), True, False),
    "Glm5NextTextHyperConnection": _Form(_CONNECTION, ("sigmoid", "sigmoid", "softmax"), True, False),
    "HYV4HyperConnection": _Form(_CONNECTION, ("sigmoid", "sigmoid"), False, True),
    "HYV4HyperHead": _Form(_HEAD, ("sigmoid",), False, True),
}
_NODES = {"sigmoid": "SigmoidBackward0", "softmax": "SoftmaxBackward0"}
_KEEPS = {"flat": ("input_norm", "input"), "normed": ("input_norm", "output")}


def _form(module: nn.Module) -> _Form:
    return _FORMS[type(module).__name__]


def _fix(module: nn.Module) -> str:
    return f"Otherwise freeze {', '.join(_form(module).params)} (requires_grad=False)."


def _check(module: nn.Module) -> None:
    form = _form(module)
    fn, base, scale = (getattr(module, name, None) for name in form.params)
    rows, groups = sum(_sizes(module)), len(form.groups)
    reason = unknown_parameters(module, set(form.params))
    if reason is None and not (fn.shape[0] == rows and base.shape == (rows,) and scale.numel() == groups):
        shapes = ", ".join(f"{name} {tuple(getattr(module, name).shape)}" for name in form.params)
        reason = (
            f"its {shapes} do not fit its groups {form.groups} of {module.hc_mult} streams "
            f"({rows} projection rows and biases, {groups} scale entries)"
        )
    refuse(module, "hyper-connection", "module", reason, _fix(module))


def _inputs(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple:
    """``(streams (B, T, N, d), the call's autocast state)``, to which the capture appends the kept values
    and the graph's reads."""
    (streams,) = forward_arguments(module, args, kwargs).values()
    return streams, autocast_at(streams)


def _sizes(module: nn.Module) -> list[int]:
    """Each group's number of projection rows."""
    n = module.hc_mult
    return [n if kind == "sigmoid" else n * n for kind in _form(module).groups]


def _scales(module: nn.Module) -> tuple[torch.Tensor, ...]:
    """Each group's scale as the forward takes it: the entries of a connection's ``scale`` (3,) or (2,), the
    head's ``hc_scale`` (1,) whole."""
    scale = getattr(module, _form(module).params[2])
    return scale.unbind(0) if len(_form(module).groups) > 1 else (scale,)


def hyper_graph(module: nn.Module, call: tuple, output: Any, boundary: list) -> GraphReads | None:
    """The products ``mixes_g * s_g`` (``d_<g>``: their output gradients are ``du_g``), found by the scale
    each keeps (its storage, else its float32 value), and the values the call's sigmoid and softmax nodes
    kept (``<function>_<j>``); None where the graph lacks them."""
    nodes = call_nodes(output, boundary)
    if nodes is None:
        return None
    products = {}
    with torch.no_grad():
        for g, scale in enumerate(_scales(module)):
            found = product_with(nodes, scale)
            products[f"d_{g}"] = product_with(nodes, scale.float(), by_value=True) if found is None else found
    if any(node is None for node in products.values()):
        return None
    kept = {
        f"{kind}_{j}": value
        for kind in set(_form(module).groups)
        for j, value in enumerate(kept_by_each(nodes, _NODES[kind], "_saved_result"))
    }
    return GraphReads(kept, products)


_DEEPSEEK_V4 = "transformers.models.deepseek_v4.modeling_deepseek_v4"
_HY_V4 = "transformers.models.hy_v4.modeling_hy_v4"
_GLM5_NEXT = "transformers.models.glm5_next.modeling_glm5_next"


@register_rule(
    f"{_DEEPSEEK_V4}.DeepseekV4HyperConnection",
    f"{_DEEPSEEK_V4}.DeepseekV4HyperHead",
    f"{_HY_V4}.HYV4HyperConnection",
    f"{_HY_V4}.HYV4HyperHead",
    f"{_GLM5_NEXT}.Glm5NextTextHyperConnection",
    check=_check,
    call=CallLayout(_inputs, first_output, keeps=lambda _: _KEEPS, graph=hyper_graph),
)
def hyper_grads(module: nn.Module, call: tuple, dy: torch.Tensor) -> dict[str, PerExampleGrad]:
    """``fn`` (an Outer of (B, T, K) and (B, T, N d)), ``base`` (B, K) and ``scale`` (B, groups) by the module
    docstring's formulas; ``dy`` unused (the gradients inside the call are read)."""
    form, fix, n = _form(module), _fix(module), module.hc_mult
    (_, autocast), kept, reads = read_call(module, call, _KEEPS, "hyper-connection", fix, inputs=2)
    fn, base, scale = (getattr(module, name) for name in form.params)
    with torch.no_grad():
        flat, normed, weight = kept["flat"], kept["normed"], fn.detach().float()
        a = normed if form.normalises else flat * normed
        if form.autocast_off:  # HY-V4's modules turn it off around their products
            autocast = replace(autocast, dtype=None)
        with replay(autocast):  # the forward's products, in its precisions
            mixes = F.linear(a, weight) if form.normalises else F.linear(flat, weight) * normed
        parts = mixes.split(_sizes(module), dim=-1)
        biases = base.detach().split(_sizes(module))
        du, scale_grads, left = [], [], []
        for g, (kind, part, b, s) in enumerate(zip(form.groups, parts, biases, _scales(module), strict=True)):
            u = part * s + b
            value = torch.sigmoid(u) if kind == "sigmoid" else torch.softmax(u.unflatten(-1, (n, n)), dim=-1)
            kept_by_kind = [t for key, t in reads.items() if key.startswith(f"{kind}_")]
            reproduced(module, f"group {g}'s {kind}", kept_by_kind, value, fix)
            d = reads[f"d_{g}"].flatten(2).to(fn.dtype)  # (B, T, K_g)
            du.append(d)
            scale_grads.append((d * part.to(fn.dtype)).sum((1, 2)))
            left.append(d * s.to(fn.dtype))
        return {
            form.params[0]: Outer(torch.cat(left, dim=-1), a.to(fn.dtype), fn.shape, fn.shape[0]),
            form.params[1]: Dense(torch.cat(du, dim=-1).sum(1).to(base.dtype)),
            form.params[2]: Dense(torch.stack(scale_grads, dim=-1).view(-1, *scale.shape).to(scale.dtype)),
        }
