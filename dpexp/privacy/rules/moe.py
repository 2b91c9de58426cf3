"""Mixture-of-experts layers of Hugging Face transformers 5.x: the top-k routers (``MixtralTopKRouter``,
``Qwen2MoeTopKRouter`` and their copies: MiniMax; Qwen3-MoE, OLMoE, FlexOlmo, Qwen3-Next, ...) and the
experts (``MixtralExperts`` and its copies in some 60 model files: Qwen2/3-MoE, OLMoE, DeepSeek-V2/V3, ...),
whose 3-D weights are ``gate_up_proj`` (E, 2I, d) and ``down_proj`` (E, d, I); Llama 4's router and dense
experts (:func:`llama4_experts_grads`, at the end of the experts section); DeepSeek-V2's softmax router
(greedy or group-limited, :func:`deepseek_v2_scores`), ERNIE-4.5-MoE's (:func:`ernie4_5_moe_scores`) and
DeepSeek-V3's sigmoid router
(:func:`group_limited_sigmoid_scores`) and its copies (GLM-4-MoE, Dots1, EXAONE-MoE, ...), Qwen3.5-MoE's and
Granite-MoE's routers, and Gemma 4's router (:func:`gemma4_router_grads`, at the end); GPT-OSS's router (a
bias on its logits) and experts (OpenAI 2025: weights stored transposed, (E, d, 2I) and (E, I, d) applied as
``x @ W``, a bias per expert after each projection, and the class's own gate on interleaved halves), Aria's
router and experts (transposed), Jamba's router (its top-k softmax probabilities not renormalised) and
Nemotron-H's experts (no gate: ``up_proj`` (E, I, d), ``act(u)``, ``down_proj``): the experts rule follows the
layout that transformers' ``use_experts_implementation`` declares (``is_transposed``, ``has_bias``,
``has_gate``) and the class's ``_apply_gate``. Since stop 53 also the routers of 15 families new in
transformers 5.2x (Cohere2-MoE, HY-V3, MiniMax-M2 and -M3-VL, Step-3.7, DeepSeek-V4's top-k router, Muse
Spark, Kolibri-1, Laguna, Lara-Mini, Flint, AXK2, Mistral 4 and Large 4, Beam: the end of :data:`ROUTERS`)
and the experts classes that write Mixtral's eager forward out again with their own row gates
(:data:`EAGER_EXPERTS`, :data:`ROW_GATES`).

A sparse MoE block flattens its (B, T, d) input to N = B*T rows x_t. The router maps row t to logits
``z_t = W x_t`` (E,), probabilities ``softmax(z_t)`` in float32 and their top k, the scores ``s_t``
(renormalised to sum 1 where the module does) with their experts ``e_{t,1..k}`` (Shazeer et al. 2017; Jiang
et al. 2024).
The experts return ``y_t = sum_j s_{t,j} D_e (act(G_e x_t) * U_e x_t)`` with ``e = e_{t,j}``,
``[G_e; U_e] = gate_up_proj[e]`` and ``D_e = down_proj[e]``. Both act on each row alone: the engine folds the
N rows to (B, T) once its probe establishes that rows [i*T, (i+1)*T) are example i's, and folds the routing
inputs ``top_k_index``, ``top_k_weights`` (N, k) with them (:attr:`CallLayout.rows`).

Experts: for every (token, slot) row r = (t, j) routed to expert e, with ``g_r, u_r`` the halves of
``gate_up_proj[e] x_t`` and ``h_r = act(g_r) * u_r``,

    d down_proj[e] = sum_r (s_r dy_t) (x) h_r,
    d gate_up_proj[e] = sum_r [act'(g_r) * u_r * dh_r ; act(g_r) * dh_r] (x) x_t,   dh_r = D_e^T (s_r dy_t),

example i's gradient the sum over its rows (:class:`~dpexp.privacy.per_example.Routed`). The rule recomputes
each expert's projections of its rows from the captured inputs (one matmul per expert, as the eager forward)
and the gated activation's backward by autograd through the module's own ``act_fn``, whatever kernel the
module dispatches to (``config._experts_implementation``: eager, or grouped_mm / batched_mm, which compute
the same function in another order; rows routed to the expert-parallel sentinel E are skipped, as eager
skips them).

Router: ``dW_i = sum_t dz_t (x) x_t`` (an :class:`~dpexp.privacy.per_example.Outer`), ``dz_t`` the captured
gradient of the logits plus that of the scores taken back through the softmax, top-k and renormalisation,
recomputed from the logits as the module computes them (the same shapes and precision, so the same
routing; under autocast the matmuls in autocast's dtype, recorded at the call) and differentiated by
autograd.

Refused at the call, with the fix: router jitter noise in training (the experts read it from their config),
an activation not known to act elementwise (or a class's own gate not known to act on each row alone),
parameters other than the weights (and the biases the layout declares), a layout other than the one the
class's eager forward computes, another experts implementation, or grouped_mm / batched_mm without a gate,
with a post-expert norm or expert parallel, inputs other than (N, d) rows with (N, k) routing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from dpexp.privacy.per_example import Dense, Outer, PerExampleGrad, Routed
from dpexp.privacy.rules import (
    CallLayout,
    first_output,
    forward_arguments,
    qualified_name,
    refuse,
    register_rule,
)
from dpexp.privacy.rules.activation import activation_refusal

MIXTRAL = "transformers.models.mixtral.modeling_mixtral"
QWEN2_MOE = "transformers.models.qwen2_moe.modeling_qwen2_moe"
LLAMA4 = "transformers.models.llama4.modeling_llama4"
DEEPSEEK_V2 = "transformers.models.deepseek_v2.modeling_deepseek_v2"
ERNIE4_5_MOE = "transformers.models.ernie4_5_moe.modeling_ernie4_5_moe"
DEEPSEEK_V3 = "transformers.models.deepseek_v3.modeling_deepseek_v3"
QWEN3_5_MOE = "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe"
GRANITE_MOE = "transformers.models.granitemoe.modeling_granitemoe"
GEMMA4 = "transformers.models.gemma4.modeling_gemma4"
GPT_OSS = "transformers.models.gpt_oss.modeling_gpt_oss"
ARIA = "transformers.models.aria.modeling_aria"
JAMBA = "transformers.models.jamba.modeling_jamba"
NEMOTRON_H = "transformers.models.nemotron_h.modeling_nemotron_h"
LFM2_MOE = "transformers.models.lfm2_moe.modeling_lfm2_moe"
_MODELS = "transformers.models"

IMPLEMENTATIONS = (None, "eager", "grouped_mm", "batched_mm")  # None: the module's own (eager) forward
GROUPED_LAYOUT = {  # grouped_mm / batched_mm compute the eager forward's function on this layout (the rule
    # follows is_transposed, has_bias and the class's _apply_gate, which they read too)
    "has_gate": True,
    "has_post_expert_norm": False,
    "_is_expert_parallel": False,
}
EAGER_LAYOUTS = {  # (is_transposed, has_bias, has_gate) of the eager forwards; Mixtral's and its copies'
    # (False, False, True)
    f"{GPT_OSS}.GptOssExperts": (True, True, True),
    f"{ARIA}.AriaExperts": (True, False, True),
    f"{NEMOTRON_H}.NemotronHExperts": (False, False, False),  # up_proj, act, down_proj: no gate
}
ROW_GATES = {  # classes' own ``_apply_gate`` known to act on each row alone (through ``act_fn``, where the
    # class has one, which must then act elementwise)
    f"{GPT_OSS}.GptOssExperts._apply_gate",  # interleaved halves: clamped g * sigmoid(alpha g) * (u + 1)
    # stop 53, the halves concatenated: clamped silu(g) * u; act(g) * u clamped; act(g) * u in float32;
    # clamped g * sigmoid(alpha g) * (u + 1)
    f"{_MODELS}.hy_v4.modeling_hy_v4.HYV4Experts._apply_gate",
    f"{_MODELS}.hy_v4_vl.modeling_hy_v4_vl.HYV4VLExperts._apply_gate",
    f"{_MODELS}.glm5_next.modeling_glm5_next.Glm5NextTextExperts._apply_gate",
    f"{_MODELS}.deepseek_v4.modeling_deepseek_v4.DeepseekV4Experts._apply_gate",
    f"{_MODELS}.step3p7.modeling_step3p7.Step3p7Experts._apply_gate",
    f"{_MODELS}.beam.modeling_beam.BeamExperts._apply_gate",
    f"{_MODELS}.minimax_m3_vl.modeling_minimax_m3_vl.MiniMaxM3VLExperts._apply_gate",
}
EAGER_EXPERTS = [  # classes whose eager forward is Mixtral's, written out again, with their own row gate
    f"{_MODELS}.{name}"
    for name in (
        "hy_v4.modeling_hy_v4.HYV4Experts",
        "hy_v4_vl.modeling_hy_v4_vl.HYV4VLExperts",
        "glm5_next.modeling_glm5_next.Glm5NextTextExperts",
        "deepseek_v4.modeling_deepseek_v4.DeepseekV4Experts",
        "step3p7.modeling_step3p7.Step3p7Experts",
        "beam.modeling_beam.BeamExperts",
        "minimax_m3_vl.modeling_minimax_m3_vl.MiniMaxM3VLExperts",
        # rows routed past its experts go to identities
        "longcat_flash.modeling_longcat_flash.LongcatFlashExperts",
    )
]


def _extra_parameters(module: nn.Module, own: tuple[str, ...]) -> str | None:
    """The module's trainable parameters besides ``own`` (a frozen one, read as a constant, is no concern)."""
    extra = sorted(name for name, p in module.named_parameters() if name not in own and p.requires_grad)
    return None if not extra else f"it has parameters {extra} besides {list(own)}"


# ---------------------------------------------------------------------------------------------- experts
def _layout(module: nn.Module) -> tuple[bool, bool, bool]:
    """(transposed, biased, gated): weights stored (E, in, out) and applied as ``x @ W`` (else (E, out, in),
    ``x W^T``), a bias per expert after each projection, and a gated first projection ``gate_up_proj`` (else
    ``up_proj`` and ``act(up)``, Nemotron-H's); as ``use_experts_implementation`` declares."""
    return (
        bool(getattr(module, "is_transposed", False)),
        bool(getattr(module, "has_bias", False)),
        bool(getattr(module, "has_gate", True)),
    )


def _first_projection(module: nn.Module) -> str:
    """The name of the experts' first 3-D weight: ``gate_up_proj`` (gated), or ``up_proj``."""
    return "gate_up_proj" if _layout(module)[2] else "up_proj"


def _custom_gate(module: nn.Module) -> Callable | None:
    """The class's own ``_apply_gate`` (GPT-OSS's), or None for the default ``act_fn(gate) * up`` of the
    concatenated halves."""
    gate = getattr(type(module), "_apply_gate", None)
    if gate is None:
        return None
    from transformers.integrations.moe import _default_apply_gate

    return None if gate is _default_apply_gate else gate


def _weights_refusal(module: nn.Module) -> tuple[str, str] | None:
    """(reason, fix) if an experts module has parameters besides its two 3-D weights (and their biases where
    its layout declares them), or a gate not known to act on each row alone, else None."""
    first = _first_projection(module)
    own = (first, "down_proj") + (f"{first}_bias", "down_proj_bias") * _layout(module)[1]
    extra = _extra_parameters(module, own)
    if extra is not None:
        return extra, "Freeze the experts or remove the extra parameters."
    gate = _custom_gate(module)
    if gate is not None and f"{gate.__module__}.{gate.__qualname__}" not in ROW_GATES:
        return (
            f"its gate {gate.__qualname__} is not one it knows to act on each row alone",
            "Freeze the experts.",
        )
    if gate is not None and not hasattr(module, "act_fn"):
        return None
    return activation_refusal(module.act_fn, "its", "freeze the experts")


def _experts_refusal(module: nn.Module) -> tuple[str, str] | None:
    """(reason, fix) if the experts rule cannot reproduce ``module``'s forward, else None."""
    eager = EAGER_LAYOUTS.get(qualified_name(type(module)), (False, False, True))
    if _layout(module) != eager:
        return (
            f"its layout (is_transposed, has_bias, has_gate) = {_layout(module)} is not the {eager} its "
            "eager forward computes",
            "Keep the layout the class declares, or freeze the experts.",
        )
    refusal = _weights_refusal(module)
    if refusal is not None:
        return refusal
    config = getattr(module, "config", None)
    implementation = getattr(config, "_experts_implementation", None)
    if implementation not in IMPLEMENTATIONS:
        return (
            f"experts implementation {implementation!r} may compute another function than the eager forward",
            "Set model.set_experts_implementation('eager') (or 'grouped_mm', 'batched_mm').",
        )
    if implementation not in (None, "eager"):
        changed = {k: getattr(module, k, v) for k, v in GROUPED_LAYOUT.items() if getattr(module, k, v) != v}
        if changed:
            return (
                f"under {implementation!r} its layout {changed} is not one the rule is tested on (the "
                "kernels' function is the eager forward's on a gated layout without post-expert norm)",
                "Set model.set_experts_implementation('eager'), or freeze the experts.",
            )
    if module.training and getattr(config, "router_jitter_noise", 0.0):
        return (
            f"router jitter noise ({config.router_jitter_noise}) rescales the block's input at random, in "
            "place, in training, a forward the rule is not tested on",
            "Set router_jitter_noise = 0 before building the model, or freeze the router and the experts.",
        )
    return None


def _check_experts(module: nn.Module) -> None:
    refusal = _experts_refusal(module)
    refuse(module, "mixture-of-experts", "experts module", *(refusal or (None, "")))


def experts_inputs(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple:
    """``(hidden_states (N, d), top_k_index (N, k), top_k_weights (N, k), compute dtype)`` of one call."""
    refusal = _experts_refusal(module)
    if refusal is not None:
        raise ValueError(
            f"the privacy engine's mixture-of-experts rule cannot handle it: {refusal[0]}. {refusal[1]}"
        )
    call = forward_arguments(module, args, kwargs, defaults=True)
    x, index, weights = list(call.values())
    shapes = [tuple(t.shape) if torch.is_tensor(t) else type(t).__name__ for t in (x, index, weights)]
    if not (
        torch.is_tensor(x)
        and torch.is_tensor(index)
        and torch.is_tensor(weights)
        and x.dim() == 2
        and index.dim() == 2
        and weights.shape == index.shape
        and index.shape[0] == x.shape[0]
        and not index.is_floating_point()
        and weights.is_floating_point()
    ):
        raise ValueError(
            f"got hidden_states, top_k_index, top_k_weights of shapes {shapes}; the privacy engine's "
            "mixture-of-experts rule needs (N, d) rows with (N, k) routing. Call the experts as the sparse "
            "MoE block does."
        )
    return x, index, weights, compute_dtype(x)


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the call's matmuls run in: autocast's where it is on (the rules run in the backward pass,
    outside it, and recompute in this dtype explicitly), else the input's."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


class RoutedRows(NamedTuple):
    """Every (token, slot) row of a call routed to an expert, sorted by expert (tokens in order within each):
    its token's input ``x_t`` (n, d) and ``s_r dy_t`` (n, d), its expert and example (n,), and the number of
    rows of each expert."""

    inputs: torch.Tensor
    scaled: torch.Tensor
    expert: torch.Tensor
    example: torch.Tensor
    sizes: list[int]


def routed_rows(
    hidden: torch.Tensor,
    index: torch.Tensor,
    weights: torch.Tensor,
    dy: torch.Tensor,
    experts: int,
    dtype: torch.dtype,
) -> RoutedRows:
    """The rows of a call with ``hidden`` (b, T, d) (or (b, d)), its routing ``index``, ``weights`` (b, T, k)
    and output gradient ``dy``, folded per example; rows routed to ``experts`` or beyond (the sentinel
    expert E that expert parallelism uses, or DBRX's extra one-hot class) are skipped. ``s_r dy_t`` is formed
    in the precision in which the eager forward multiplies the expert's output by its weight."""
    batch, width = hidden.shape[0], hidden.shape[-1]
    rows = hidden.detach().reshape(-1, width).to(dtype)  # (N, d), N = b*T in example-major order
    slots = index.shape[-1]
    flat = index.reshape(-1)
    routed = (flat < experts).nonzero().squeeze(1)
    expert, order = torch.sort(flat[routed], stable=True)  # by expert, tokens in order within each
    slot = routed[order]
    token = slot // slots
    scaled = (dy.reshape(-1, width)[token] * weights.reshape(-1)[slot, None]).to(dtype)
    sizes = torch.bincount(expert, minlength=experts).tolist()
    return RoutedRows(rows[token], scaled, expert, token // (rows.shape[0] // batch), sizes)


def _parameterised_experts(module: nn.Module) -> int:
    """The number of experts with weights: LongCat-Flash's zero-computation experts (Meituan 2025,
    LongCat-Flash Technical Report, sec. 2.1: identities, their indices after its ``num_routed_experts``
    routed ones; its ``gate_up_proj`` holds unused slices for them) have none."""
    return getattr(module, "num_routed_experts", None) or module.num_experts


def experts_grads(module: nn.Module, x: tuple, dy: torch.Tensor) -> dict[str, PerExampleGrad]:
    """``gate_up_proj`` and ``down_proj`` of one call, see the module docstring, and their biases where the
    layout has them (:func:`_layout`: GPT-OSS); without a gate (Nemotron-H) ``up_proj`` and ``h_r =
    act(u_r)``, ``d up_proj[e] = sum_r (act'(u_r) * dh_r) (x) x_t``. ``x`` is :func:`experts_inputs`' tuple,
    its tensors (b, T, ...) folded or (b, ...) with one row per example, ``dy`` likewise; the recomputation
    runs in the call's compute dtype."""
    hidden, index, weights, dtype = x
    transposed, biased, gated = _layout(module)
    first = _first_projection(module)
    experts = _parameterised_experts(module)
    inputs, scaled, expert, example, sizes = routed_rows(hidden, index, weights, dy, experts, dtype)
    gate_up, down = module.get_parameter(first).detach().to(dtype), module.down_proj.detach().to(dtype)
    if not transposed:  # (E, in, out) views: every product below is x @ W
        gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
    projected = inputs.new_empty(len(expert), gate_up.shape[2])
    for e, (a, out) in enumerate(zip(inputs.split(sizes), projected.split(sizes), strict=True)):
        torch.mm(a, gate_up[e], out=out)  # the expert's projection of its rows, as the eager forward
    if biased:
        projected += module.get_parameter(f"{first}_bias").detach().to(dtype)[expert]
    gate = _custom_gate(module)
    with torch.enable_grad():
        leaf = projected.requires_grad_()
        if not gated:
            activated = module.act_fn(leaf)
        elif gate is None:
            gate_half, up = leaf.chunk(2, dim=-1)
            activated = module.act_fn(gate_half) * up
        else:
            activated = gate(module, leaf)
    hidden_grad = scaled.new_empty(activated.shape)
    for e, (g, out) in enumerate(zip(scaled.split(sizes), hidden_grad.split(sizes), strict=True)):
        torch.mm(g, down[e].T, out=out)  # the down projection's backward to its input
    (projected_grad,) = torch.autograd.grad(activated, leaf, hidden_grad)
    activated = activated.detach()
    batch = hidden.shape[0]
    shape = module.get_parameter(first).shape
    down_shape = module.down_proj.shape
    if transposed:  # gate_up_proj[e] (d, 2I), down_proj[e] (I, d)
        first_grad = Routed(inputs, projected_grad, expert, example, batch, shape)
        down_factors = (activated, scaled)
    else:  # gate_up_proj[e] (2I, d), down_proj[e] (d, I)
        first_grad = Routed(projected_grad, inputs, expert, example, batch, shape)
        down_factors = (scaled, activated)
    if down_shape[0] == shape[0]:
        down_grad = first_grad.sibling(*down_factors, down_shape)
    else:  # LongCat-Flash: gate_up_proj holds slices for its identity experts too, down_proj does not
        down_grad = Routed(*down_factors, expert, example, batch, down_shape)
    grads: dict[str, PerExampleGrad] = {first: first_grad, "down_proj": down_grad}
    if biased:  # the biases' gradients: the rows' output gradients, summed per (example, expert)
        ones = projected_grad.new_ones(len(expert), 1)
        grads[f"{first}_bias"] = first_grad.sibling(
            ones, projected_grad, module.get_parameter(f"{first}_bias").shape
        )
        grads["down_proj_bias"] = first_grad.sibling(ones, scaled, module.down_proj_bias.shape)
    return grads


register_rule(
    f"{MIXTRAL}.MixtralExperts",
    f"{GPT_OSS}.GptOssExperts",
    f"{ARIA}.AriaExperts",
    f"{NEMOTRON_H}.NemotronHExperts",
    *EAGER_EXPERTS,
    check=_check_experts,
    position_wise=True,
    call=CallLayout(experts_inputs, first_output, rows=(0, 1, 2)),
    copies=True,
)(experts_grads)


def _check_llama4_experts(module: nn.Module) -> None:
    refuse(module, "mixture-of-experts", "experts module", *(_weights_refusal(module) or (None, "")))


def llama4_experts_inputs(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple:
    """``(inputs (N, E, d), compute dtype)``: row n's input to every expert. ``Llama4TextExperts`` receives
    them expert-major, (E*N, d) (every token goes to every expert, scaled by its score, 0 where the router
    did not pick it), and the view makes dim 0 the N = B*T flattened tokens."""
    call = forward_arguments(module, args, kwargs)
    (x,) = list(call.values())
    experts = module.gate_up_proj.shape[0]
    if not (torch.is_tensor(x) and x.dim() == 2 and x.shape[0] % experts == 0):
        shape = tuple(x.shape) if torch.is_tensor(x) else type(x).__name__
        raise ValueError(
            f"got hidden_states of shape {shape}; the privacy engine's Llama 4 experts rule needs the "
            f"(E*N, d) rows of its E = {experts} experts, expert-major. Call them as Llama4TextMoe does."
        )
    return x.view(experts, -1, x.shape[-1]).transpose(0, 1), compute_dtype(x)


def llama4_experts_output_grad(module: nn.Module, grads: list[torch.Tensor | None]) -> torch.Tensor:
    """The output's gradient (E*N, d) as (N, E, d), like the inputs."""
    dy = grads[0]
    return dy.view(module.gate_up_proj.shape[0], -1, dy.shape[-1]).transpose(0, 1)


@register_rule(
    f"{LLAMA4}.Llama4TextExperts",
    check=_check_llama4_experts,
    position_wise=True,
    call=CallLayout(llama4_experts_inputs, llama4_experts_output_grad),
    copies=True,
)
def llama4_experts_grads(module: nn.Module, x: tuple, dy: torch.Tensor) -> dict[str, PerExampleGrad]:
    """``Llama4TextExperts`` (Meta's Llama 4): expert e maps its row x to ``(up * act(gate)) D_e`` with
    ``[gate, up] = x G_e``, ``G_e = gate_up_proj[e]`` (d, 2I), ``D_e = down_proj[e]`` (I, d), so

        d gate_up_proj[e] = sum_r x_r (x) [act'(g_r) * u_r * dh_r ; act(g_r) * dh_r],   dh_r = dy_r D_e^T,
        d down_proj[e] = sum_r h_r (x) dy_r,

    example i's the sum over its tokens' rows of each expert (:class:`~dpexp.privacy.per_example.Routed`).
    ``x`` is :func:`llama4_experts_inputs`' tuple, its inputs folded to (b, T, E, d) (or (b, E, d)), ``dy``
    likewise; recomputed in the call's compute dtype, one batched matmul per projection as the module."""
    hidden, dtype = x
    batch, experts, width = hidden.shape[0], module.gate_up_proj.shape[0], hidden.shape[-1]

    def expert_major(t: torch.Tensor) -> torch.Tensor:
        """(E, b*T, d): each expert's rows, tokens in example order."""
        return t.reshape(batch, -1, experts, width).permute(2, 0, 1, 3).reshape(experts, -1, width).to(dtype)

    inputs, out_grad = expert_major(hidden.detach()), expert_major(dy)
    tokens = inputs.shape[1]
    projected = torch.bmm(inputs, module.gate_up_proj.detach().to(dtype))  # (E, b*T, 2I)
    with torch.enable_grad():
        leaf = projected.requires_grad_()
        gate, up = leaf.chunk(2, dim=-1)
        activated = up * module.act_fn(gate)
    hidden_grad = torch.bmm(out_grad, module.down_proj.detach().to(dtype).transpose(1, 2))  # (E, b*T, I)
    (projected_grad,) = torch.autograd.grad(activated, leaf, hidden_grad)
    device = inputs.device
    expert = torch.arange(experts, device=device).repeat_interleave(tokens)
    example = (torch.arange(tokens, device=device) // (tokens // batch)).repeat(experts)
    gate_up_grad = Routed(
        inputs.reshape(-1, width),
        projected_grad.reshape(experts * tokens, -1),
        expert,
        example,
        batch,
        module.gate_up_proj.shape,
    )
    down_grad = gate_up_grad.sibling(
        activated.detach().reshape(experts * tokens, -1), out_grad.reshape(-1, width), module.down_proj.shape
    )
    return {"gate_up_proj": gate_up_grad, "down_proj": down_grad}


# ---------------------------------------------------------------------------------------------- routers
def _top_k_probabilities(logits: torch.Tensor, k: int, renormalise: bool) -> torch.Tensor:
    """The k largest of ``softmax(logits)`` taken in float32, (N, k), renormalised to sum 1 if asked."""
    top, _ = torch.topk(F.softmax(logits, dtype=torch.float, dim=-1), k, dim=-1)
    return top / top.sum(dim=-1, keepdim=True) if renormalise else top


def mixtral_scores(module: nn.Module, logits: torch.Tensor) -> torch.Tensor:
    """``MixtralTopKRouter``'s scores from its logits (N, E): softmax in float32, top k, renormalised."""
    return _top_k_probabilities(logits, module.top_k, True)


def qwen2_moe_scores(module: nn.Module, logits: torch.Tensor) -> torch.Tensor:
    """``Qwen2MoeTopKRouter``'s scores: softmax in float32, top k, renormalised if ``norm_topk_prob``, cast
    back to the logits' dtype."""
    return _top_k_probabilities(logits, module.top_k, module.norm_topk_prob).to(logits.dtype)


def jamba_scores(module: nn.Module, logits: torch.Tensor) -> torch.Tensor:
    """``JambaTopKRouter``'s scores: softmax in float32, top k, not renormalised, cast back to the logits'
    dtype (the input's)."""
    return _top_k_probabilities(logits, module.top_k, False).to(logits.dtype)


def _check_router(module: nn.Module) -> None:
    form = ROUTERS.get(qualified_name(type(module)), RouterForm(mixtral_scores))
    refuse(
        module,
        "mixture-of-experts",
        "router",
        _extra_parameters(module, (form.weight,) + ("bias",) * form.bias),
        "Freeze the router or remove the extra parameters (biases).",
    )


def top_k_softmax_scores(module: nn.Module, logits: torch.Tensor) -> torch.Tensor:
    """``GptOssTopKRouter``'s and ``AriaTextTopKRouter``'s scores (N, k): the softmax of the top-k logits, in
    their dtype."""
    top, _ = torch.topk(logits, module.top_k, dim=-1)
    return F.softmax(top, dim=1, dtype=top.dtype)


def qwen3_5_moe_scores(module: nn.Module, logits: torch.Tensor) -> torch.Tensor:
    """``Qwen3_5MoeTopKRouter``'s scores (Qwen3.5-MoE, Qwen3-VL-MoE, Qwen3-Omni-MoE): softmax in float32,
    top k, always renormalised, cast back to the logits' dtype."""
    return _top_k_probabilities(logits, module.top_k, True).to(logits.dtype)


def granite_moe_scores(module: nn.Module, logits: torch.Tensor) -> torch.Tensor:
    """``GraniteMoeTopKRouter``'s scores (Granite-MoE and its shared, hybrid and sliding-window forms): the
    softmax of the top-k logits (taken in float32), in the dtype of its input (the logits' dtype here: the
    rule recomputes them in it)."""
    top, _ = logits.float().topk(module.top_k, dim=-1)
    return torch.softmax(top, dim=-1).type_as(logits)


def llama4_scores(module: nn.Module, logits: torch.Tensor) -> torch.Tensor:
    """``Llama4Router``'s scores (N, E): the sigmoid of its top-k logits in float32, cast back; 0 for the
    other experts (the sigmoid of -inf)."""
    top, index = torch.topk(logits, module.top_k, dim=1)
    scores = torch.full_like(logits, float("-inf")).scatter_(1, index, top)
    return torch.sigmoid(scores.float()).to(scores.dtype)


def _group_limited(
    choice: torch.Tensor, groups: int, topk_group: int, fill: float, best_two: bool = True
) -> torch.Tensor:
    """``choice`` (N, E) with the experts outside the ``topk_group`` best of ``groups`` equal groups set to
    ``fill``, a group's score the sum of its two highest entries (DeepSeek-AI 2024, DeepSeek-V3, sec. 2.1.2:
    node-limited routing) or, not ``best_two``, its highest (DeepSeek-V2, sec. 2.2)."""
    experts = choice.shape[-1]
    grouped = choice.view(-1, groups, experts // groups)
    group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1) if best_two else grouped.max(dim=-1).values
    group_index = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_index, 1)
    mask = group_mask.unsqueeze(-1).expand(-1, groups, experts // groups).reshape(-1, experts)
    return choice.masked_fill(~mask.bool(), fill)


def _chosen(scores: torch.Tensor, choice: torch.Tensor, k: int, sorted: bool = False) -> torch.Tensor:
    """``scores`` (N, E) of the k experts with the highest ``choice`` (N, E), in ``torch.topk``'s order."""
    return scores.gather(1, torch.topk(choice, k=k, dim=-1, sorted=sorted)[1])


def _renormalised(weights: torch.Tensor, eps: float = 0.0, scale: float = 1.0) -> torch.Tensor:
    """``weights / (sum + eps) * scale`` over the last dim (eps 0 and scale 1 change no bit)."""
    return weights / (weights.sum(dim=-1, keepdim=True) + eps) * scale


def group_limited_sigmoid_scores(
    fill: float, sorted: bool = False, scaled: bool = True
) -> Callable[[nn.Module, torch.Tensor], torch.Tensor]:
    """The scores (N, k) of DeepSeek-V3's router form (DeepSeek-AI 2024, sec. 2.1.2) from its float32 logits:
    sigmoid scores; the experts chosen by scores plus the load-balancing bias ``e_score_correction_bias`` (a
    buffer) among the ``topk_group`` groups of the best two-score sums (the other groups set to ``fill``; no
    groups where ``n_group`` is None), in ``torch.topk``'s order (``sorted``); their scores, renormalised
    (sum + 1e-20) if ``norm_topk_prob``, times ``routed_scaling_factor`` where ``scaled``. DeepSeek-V3's and
    its copies' (GLM-4-MoE, Dots1, EXAONE-MoE, ...): -inf, unsorted, scaled; AXK2's: 0, unsorted, scaled;
    Beam's: -inf, sorted, not scaled (its block scales after the experts)."""

    def scores_of(module: nn.Module, logits: torch.Tensor) -> torch.Tensor:
        scores = logits.sigmoid()
        choice = scores + module.e_score_correction_bias
        if module.num_group is not None:
            choice = _group_limited(choice, module.num_group, module.topk_group, fill)
        weights = _chosen(scores, choice, module.top_k, sorted)
        weights = _renormalised(weights, 1e-20) if module.norm_topk_prob else weights
        return weights * module.routed_scaling_factor if scaled else weights

    return scores_of


def deepseek_v2_scores(module: nn.Module, logits: torch.Tensor) -> torch.Tensor:
    """``DeepseekV2TopkRouter``'s weights of its chosen experts (N, k) from its float32 logits (DeepSeek-AI
    2024, DeepSeek-V2, sec. 2.2): the softmax, restricted for ``group_limited_greedy`` to the ``topk_group``
    groups of the highest maximum, its top k (unsorted, as the module) times ``routed_scaling_factor``."""
    scores = logits.softmax(dim=-1, dtype=torch.float32)
    if module.topk_method == "group_limited_greedy":
        scores = _group_limited(scores, module.num_group, module.topk_group, 0.0, best_two=False)
    weights, _ = torch.topk(scores, k=module.top_k, dim=-1, sorted=False)
    return weights * module.routed_scaling_factor


def ernie4_5_moe_scores(module: nn.Module, logits: torch.Tensor) -> torch.Tensor:
    """``Ernie4_5_MoeTopKRouter``'s weights (N, k) from its float32 logits: the softmax, the top k chosen by
    the softmax plus the load-balancing bias of its ``moe_statics`` (frozen), their weights renormalised with
    the sum clamped at ``norm_min``."""
    probs = F.softmax(logits, dim=1, dtype=torch.float)
    index = torch.topk(module.moe_statics(probs), module.top_k, dim=-1)[1]
    weights = torch.gather(probs, dim=-1, index=index)
    return weights / torch.clamp(weights.sum(dim=-1, keepdim=True), min=module.norm_min)


def lfm2_moe_scores(
    module: nn.Module, logits: torch.Tensor, expert_bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``Lfm2MoeTopKRouter``'s weights of its chosen experts (N, k): sigmoid scores; the top k chosen by the
    scores plus the load-balancing ``expert_bias`` (its block's buffer, passed to it) where
    ``use_expert_bias``; renormalised (sum + 1e-6) if ``norm_topk_prob``, times ``routed_scaling_factor``."""
    scores = logits.sigmoid()
    if module.use_expert_bias:
        index = torch.topk(scores + expert_bias, k=module.top_k, dim=-1)[1]
        weights = torch.gather(scores, dim=1, index=index).type_as(logits)
    else:
        weights = torch.topk(scores, k=module.top_k, dim=-1)[0]
    if module.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-6)
    return weights * module.routed_scaling_factor


def cohere2_moe_scores(module: nn.Module, logits: torch.Tensor) -> torch.Tensor:
    """``Cohere2MoeTopKRouter``'s scores (N, k): its top-k logits through a softmax taken in float32, or
    (``expert_selection_fn = "sigmoid"``) a sigmoid renormalised if ``norm_topk_prob``; cast back to the
    logits' dtype."""
    top = torch.topk(logits, module.top_k, dim=-1)[0]
    if module.expert_selection_fn == "softmax":
        return F.softmax(top, dim=1, dtype=torch.float).to(logits.dtype)
    scores = top.sigmoid()  # the module refuses any other function itself
    return (_renormalised(scores) if module.norm_topk_prob else scores).to(logits.dtype)


def biased_sigmoid_scores(
    eps: float = 0.0, scale: str | None = None, float32: bool = False
) -> Callable[..., torch.Tensor]:
    """The scores (N, k) of the sigmoid routers that choose by scores plus a load-balancing bias
    (DeepSeek-AI 2024, DeepSeek-V3, sec. 2.1.2, without groups): the module's ``score_fn`` (else a sigmoid) of
    the logits (taken to float32 first where ``float32``), the top k of scores + bias unsorted, renormalised
    (sum + ``eps``) and times the module's attribute ``scale``. The bias is the router's argument where its
    block passes it (HY-V3, MiniMax-M2), else its buffer ``e_score_correction_bias``."""

    def scores_of(module: nn.Module, logits: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        score_fn = getattr(module, "score_fn", torch.sigmoid)
        scores = score_fn(logits.float() if float32 else logits)
        bias = module.e_score_correction_bias if bias is None else bias
        factor = getattr(module, scale) if scale else 1.0
        return _renormalised(_chosen(scores, scores + bias, module.top_k), eps, factor)

    return scores_of


def hash_scores(module: nn.Module, logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V4's hash router (its first MoE layers): the experts fixed per token id by its frozen
    ``tid2eid`` table, their ``score_fn`` scores renormalised (sum + 1e-20) and times
    ``routed_scaling_factor``. The choice reads the example's own token ids only."""
    scores = module.score_fn(logits)
    weights = scores.gather(1, module.tid2eid[input_ids.reshape(-1)].long())
    return _renormalised(weights, 1e-20, module.routed_scaling_factor)


def longcat_flash_scores(module: nn.Module, logits: torch.Tensor) -> torch.Tensor:
    """``LongcatFlashTopkRouter``'s scores (N, k): the softmax of its float32 logits over routed and
    zero-computation experts, the top k of scores plus the load-balancing bias unsorted, not renormalised,
    times ``routed_scaling_factor``."""
    scores = logits.softmax(dim=-1)
    chosen = _chosen(scores, scores + module.e_score_correction_bias, module.top_k)
    return chosen * module.routed_scaling_factor


def kolibri1_scores(module: nn.Module, logits: torch.Tensor) -> torch.Tensor:
    """``Kolibri1TopKRouter``'s scores (N, k): the top k of its float32 logits plus the load-balancing bias
    (sorted), the sigmoid of their logits, renormalised if ``norm_topk_prob``."""
    scores = _chosen(logits, logits + module.e_score_correction_bias, module.top_k, sorted=True).sigmoid()
    return _renormalised(scores) if module.norm_topk_prob else scores


def laguna_logits(module: nn.Module, linear: torch.Tensor) -> torch.Tensor:
    """``LagunaTopKRouter``'s logits from ``W x``: taken to float32, soft-capped by ``c tanh(z / c)`` where
    ``router_logit_softcapping`` c > 0."""
    logits = linear.float()
    cap = module.router_logit_softcapping
    return torch.tanh(logits / cap) * cap if cap > 0.0 else logits


def laguna_scores(module: nn.Module, logits: torch.Tensor) -> torch.Tensor:
    """``LagunaTopKRouter``'s scores (N, k): sigmoid; the top k of scores plus its frozen bias (sorted),
    renormalised, in the model's dtype (its weight's)."""
    scores = logits.sigmoid()
    bias = module.e_score_correction_bias.to(scores.dtype)
    return _renormalised(_chosen(scores, scores + bias, module.top_k, sorted=True)).to(module.weight.dtype)


def lara_mini_scores(module: nn.Module, logits: torch.Tensor) -> torch.Tensor:
    """``LaraMiniTopKRouter``'s scores (N, k): the top k of the softmax of its float32 logits, renormalised
    if ``norm_topk_prob``, in the model's dtype (its weight's)."""
    top = torch.topk(F.softmax(logits, dim=-1), module.top_k, dim=-1)[0]
    return (_renormalised(top) if module.norm_topk_prob else top).to(module.weight.dtype)


def flint_scores(module: nn.Module, logits: torch.Tensor) -> torch.Tensor:
    """``FlintTopKRouter``'s scores (N, k): the top k of the sigmoid of its float32 logits, renormalised if
    ``norm_topk_prob``."""
    top = torch.topk(logits.sigmoid(), module.top_k, dim=-1)[0]
    return _renormalised(top) if module.norm_topk_prob else top


def mistral4_scores(module: nn.Module, logits: torch.Tensor) -> torch.Tensor:
    """``Mistral4TopkRouter``'s and ``MistralLarge4TextTopkRouter``'s scores (N, k): the softmax of the
    logits, the top k within the ``topk_group`` best groups (by two-score sums, the others set to 0),
    renormalised (sum + 1e-20; the large model always, the other if ``norm_topk_prob``), times
    ``routed_scaling_factor``."""
    scores = logits.softmax(-1)
    choice = _group_limited(scores, module.num_group, module.topk_group, 0.0)
    weights = _chosen(scores, choice, module.top_k)
    weights = _renormalised(weights, 1e-20) if getattr(module, "norm_topk_prob", True) else weights
    return weights * module.routed_scaling_factor


def muse_spark_logits(module: nn.Module, linear: torch.Tensor) -> torch.Tensor:
    """``MuseSparkTopkRouter``'s logits: ``W x`` (float32) times ``output_multiplier``."""
    return linear * module.output_multiplier


def router_inputs(
    float32_logits: bool, autocast_off: bool = False
) -> Callable[[nn.Module, tuple, dict[str, Any]], tuple]:
    """The router's call as ``(hidden_states, compute dtype, *its other arguments)``: the states as the
    (N, d) rows it computes on (it flattens them itself), the dtype of its logits' matmul (autocast's where it
    is on, else the input's, or float32 for a router that casts both factors to it, ``float32_logits``;
    under autocast too where it turns autocast off, ``autocast_off``), and what else it is passed, for its
    scores (LFM2-MoE's ``expert_bias``)."""

    def inputs(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple:
        call = forward_arguments(module, args, kwargs, defaults=True)
        hidden, *others = list(call.values())
        dtype = compute_dtype(hidden)
        if float32_logits and (autocast_off or not torch.is_autocast_enabled(hidden.device.type)):
            dtype = torch.float32
        return hidden.reshape(-1, hidden.shape[-1]), dtype, *others

    return inputs


def router_output_grad(logits_at: int) -> Callable[[nn.Module, list[torch.Tensor | None]], torch.Tensor]:
    """The gradients of a router's logits (N, E), its output ``logits_at``, and of its scores (N, k or E), the
    other of its first two outputs, as one (N, E + k) tensor, logits first, in the wider of their dtypes (so
    that each converts back exactly)."""

    def output_grad(module: nn.Module, grads: list[torch.Tensor | None]) -> torch.Tensor:
        logits, scores = grads[logits_at], grads[1 - logits_at]
        dtype = torch.promote_types(logits.dtype, scores.dtype)
        return torch.cat([logits.to(dtype), scores.to(dtype)], dim=-1)

    return output_grad


def router_rule(form: RouterForm) -> Callable:
    """The router rule for a module whose logits come from ``W x (+ b)`` by ``form.logits`` and its scores
    from its logits by ``form.scores``: the gradients of both taken back to ``W x`` by autograd."""

    def router_grads(module: nn.Module, x: tuple, dy: torch.Tensor) -> dict[str, PerExampleGrad]:
        hidden, dtype, *others = x
        batch, width = hidden.shape[0], hidden.shape[-1]
        rows = hidden.detach().reshape(-1, width).to(dtype)  # the module's (N, d), as its matmul reads
        weight = module.get_parameter(form.weight)
        experts = weight.shape[0]
        dy = dy.reshape(rows.shape[0], -1)
        bias = module.bias.detach().to(dtype) if form.bias else None
        with torch.enable_grad():
            linear = F.linear(rows, weight.detach().to(dtype), bias).requires_grad_()
            logits = linear if form.logits is None else form.logits(module, linear)
            scores = form.scores(module, logits, *others)
        (left,) = torch.autograd.grad(
            (logits, scores), linear, (dy[:, :experts].to(logits.dtype), dy[:, experts:].to(scores.dtype))
        )
        left = left.view(batch, -1, experts)
        grads: dict[str, PerExampleGrad] = {
            form.weight: Outer(left, rows.view(batch, -1, width), weight.shape, experts)
        }
        if form.bias:
            grads["bias"] = Dense(left.sum(1))
        return grads

    return router_grads


class RouterForm(NamedTuple):
    """A top-k router whose outputs are its logits, its scores and more: ``scores`` recomputes the scores from
    the logits (and the router's other arguments), ``logits`` the logits it returns from ``W x (+ b)``
    (None: those), ``logits_at`` is the output holding the logits (the scores are the other of the first
    two), ``float32_logits`` whether it casts both factors of its logits' matmul to float32, ``bias`` whether
    it adds a bias to its logits, ``autocast_off`` whether it turns autocast off around them."""

    scores: Callable[..., torch.Tensor]  # (module, logits, *other arguments) -> scores
    logits: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None
    logits_at: int = 0
    float32_logits: bool = False
    bias: bool = False  # logits W x + b
    autocast_off: bool = False  # float32 logits under autocast too
    weight: str = "weight"  # the parameter of its logits' matmul (a child Linear's, which it never calls)


ROUTERS = {
    f"{MIXTRAL}.MixtralTopKRouter": RouterForm(mixtral_scores),  # (logits, scores (N, k), indices)
    f"{QWEN2_MOE}.Qwen2MoeTopKRouter": RouterForm(qwen2_moe_scores),  # the same
    f"{LLAMA4}.Llama4Router": RouterForm(llama4_scores, logits_at=1),  # (scores (N, E), logits)
    f"{DEEPSEEK_V3}.DeepseekV3TopkRouter": RouterForm(
        group_limited_sigmoid_scores(float("-inf")), float32_logits=True
    ),
    f"{QWEN3_5_MOE}.Qwen3_5MoeTopKRouter": RouterForm(qwen3_5_moe_scores),
    f"{GRANITE_MOE}.GraniteMoeTopKRouter": RouterForm(granite_moe_scores),  # logits returned in float32
    f"{GPT_OSS}.GptOssTopKRouter": RouterForm(top_k_softmax_scores, bias=True),
    f"{ARIA}.AriaTextTopKRouter": RouterForm(top_k_softmax_scores),
    f"{JAMBA}.JambaTopKRouter": RouterForm(jamba_scores),
    f"{DEEPSEEK_V2}.DeepseekV2TopkRouter": RouterForm(deepseek_v2_scores, float32_logits=True),
    f"{ERNIE4_5_MOE}.Ernie4_5_MoeTopKRouter": RouterForm(
        ernie4_5_moe_scores, float32_logits=True, autocast_off=True
    ),
    f"{LFM2_MOE}.Lfm2MoeTopKRouter": RouterForm(lfm2_moe_scores),  # (logits, weights (N, k), indices)
    # stop 53: the routers of the MoE models new in transformers 5.2x
    f"{_MODELS}.cohere2_moe.modeling_cohere2_moe.Cohere2MoeTopKRouter": RouterForm(cohere2_moe_scores),
    f"{_MODELS}.hy_v3.modeling_hy_v3.HYV3TopKRouter": RouterForm(
        biased_sigmoid_scores(1e-20, "router_scaling_factor"), float32_logits=True
    ),
    f"{_MODELS}.minimax_m2.modeling_minimax_m2.MiniMaxM2TopKRouter": RouterForm(
        biased_sigmoid_scores(float32=True)
    ),
    f"{_MODELS}.minimax_m3_vl.modeling_minimax_m3_vl.MiniMaxM3VLTopKRouter": RouterForm(
        biased_sigmoid_scores(float32=True)
    ),
    f"{_MODELS}.step3p7.modeling_step3p7.Step3p7TopKRouter": RouterForm(biased_sigmoid_scores(float32=True)),
    f"{_MODELS}.deepseek_v4.modeling_deepseek_v4.DeepseekV4TopKRouter": RouterForm(
        biased_sigmoid_scores(1e-20, "routed_scaling_factor")
    ),
    # stop 58: (logits, weights (N, k), indices), the experts chosen by the token ids (its second argument)
    f"{_MODELS}.deepseek_v4.modeling_deepseek_v4.DeepseekV4HashRouter": RouterForm(hash_scores),
    f"{_MODELS}.muse_spark.modeling_muse_spark.MuseSparkTopkRouter": RouterForm(
        biased_sigmoid_scores(1e-15, "routed_scaling_factor"), logits=muse_spark_logits, float32_logits=True
    ),
    f"{_MODELS}.kolibri1.modeling_kolibri1.Kolibri1TopKRouter": RouterForm(
        kolibri1_scores, float32_logits=True
    ),
    f"{_MODELS}.laguna.modeling_laguna.LagunaTopKRouter": RouterForm(laguna_scores, logits=laguna_logits),
    f"{_MODELS}.lara_mini.modeling_lara_mini.LaraMiniTopKRouter": RouterForm(
        lara_mini_scores, float32_logits=True
    ),
    f"{_MODELS}.flint.modeling_flint.FlintTopKRouter": RouterForm(
        flint_scores, float32_logits=True, autocast_off=True
    ),
    f"{_MODELS}.axk2.modeling_axk2.AXK2TopkRouter": RouterForm(
        group_limited_sigmoid_scores(0.0), float32_logits=True
    ),
    f"{_MODELS}.mistral4.modeling_mistral4.Mistral4TopkRouter": RouterForm(mistral4_scores),
    f"{_MODELS}.mistral_large4.modeling_mistral_large4.MistralLarge4TextTopkRouter": RouterForm(
        mistral4_scores, float32_logits=True
    ),
    f"{_MODELS}.beam.modeling_beam.BeamTopKRouter": RouterForm(
        group_limited_sigmoid_scores(float("-inf"), sorted=True, scaled=False), float32_logits=True
    ),
    # stop 62: its classifier's weight read in float32, (logits, weights (N, k), indices)
    f"{_MODELS}.longcat_flash.modeling_longcat_flash.LongcatFlashTopkRouter": RouterForm(
        longcat_flash_scores, float32_logits=True, weight="classifier.weight"
    ),
}
for _name, _form in ROUTERS.items():
    register_rule(
        _name,
        check=_check_router,
        position_wise=True,
        call=CallLayout(
            router_inputs(_form.float32_logits, _form.autocast_off), router_output_grad(_form.logits_at)
        ),
        claims=(_form.weight.rpartition(".")[0],) if "." in _form.weight else (),
        copies=True,
    )(router_rule(_form))


def _check_gemma4_router(module: nn.Module) -> None:
    refuse(
        module,
        "mixture-of-experts",
        "router",
        _extra_parameters(module, ("scale", "per_expert_scale", "proj.weight")),
        "Freeze the router or remove the extra parameters.",
    )


@register_rule(
    f"{GEMMA4}.Gemma4TextRouter",
    check=_check_gemma4_router,
    position_wise=True,
    call=CallLayout(router_inputs(False), router_output_grad(0)),
    copies=True,
)
def gemma4_router_grads(module: nn.Module, x: tuple, dy: torch.Tensor) -> dict[str, PerExampleGrad]:
    """``Gemma4TextRouter`` (Gemma 4's MoE layers): ``z = W (rmsnorm(h) * scale / sqrt(d))`` by its child
    ``proj`` (whose weight the linear rule covers), probabilities ``softmax(z)`` in float32 (returned), the
    top k renormalised and multiplied by ``per_expert_scale`` of their experts (returned with the indices).
    Its own parameters' per-example gradients, from the gradients ``dp`` of the probabilities and ``dw`` of
    the weights (``dy``, in that order), the first taken back to ``s = rmsnorm(h) * scale / sqrt(d)`` through
    the recomputed router by autograd, row by row:

        d scale_i = sum_t ds_t * rmsnorm(h_t) / sqrt(d),
        d per_expert_scale_i[e] = sum_t sum_j [e_tj = e] dw_tj * top_tj,

    summed over example i's tokens."""
    hidden, dtype = x
    batch, width = hidden.shape[0], hidden.shape[-1]
    rows = hidden.detach().reshape(-1, width).to(dtype)
    experts = module.per_expert_scale.shape[0]
    dy = dy.reshape(rows.shape[0], -1)
    normed = module.norm(rows)  # no parameter (with_scale=False)
    per_expert = module.per_expert_scale.detach().to(dtype)
    with torch.enable_grad():
        scaled = (normed * module.scale.detach().to(dtype) * module.scalar_root_size).requires_grad_()
        probs = F.softmax(
            F.linear(scaled, module.proj.weight.detach().to(dtype)), dim=-1, dtype=torch.float32
        )
        top, index = torch.topk(probs, k=module.config.top_k_experts, dim=-1)
        top = top / top.sum(dim=-1, keepdim=True)
        weights = top * per_expert[index]
    probs_grad, weights_grad = dy[:, :experts].to(probs.dtype), dy[:, experts:].to(weights.dtype)
    (scaled_grad,) = torch.autograd.grad((probs, weights), scaled, (probs_grad, weights_grad))
    scale_grad = scaled_grad * normed * module.scalar_root_size  # (N, d)
    expert_grad = torch.zeros_like(probs).scatter_add_(
        1, index, (weights_grad * top.detach()).to(probs.dtype)
    )
    return {
        "scale": Dense(scale_grad.view(batch, -1, width).sum(1)),
        "per_expert_scale": Dense(expert_grad.view(batch, -1, experts).sum(1)),
    }
