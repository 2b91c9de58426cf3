"""Attention sinks: a learnt logit per head that every query row's softmax also normalises over, and whose
column is then dropped (Xiao et al. 2024, Efficient Streaming Language Models with Attention Sinks; the
learnable form of Hugging Face's ``GptOssAttention`` and of the attentions written after it).

Per head h, query position t and example i, with the real scores ``z_j``, the values ``v_j`` and the sink
``s_h`` (a parameter shared by all examples and positions):

    p_j = exp(z_j) / (sum_k exp(z_k) + exp(s_h)),   p_sink = 1 - sum_j p_j,   a = sum_j p_j v_j.

The models write it in two ways: GPT-OSS, Flint, MiMo-V2-Flash, HY-V4 and DeepSeek-V4 append ``s_h`` to the
scores as a last column, softmax and drop it; Granite-SWA and Granite-MoE-SWA scale the plain softmax's
output by ``sigmoid(logsumexp(z) - s_h) = 1 - p_sink``. HY-V4 then gates ``a`` elementwise. Since
``d p_j / d s_h = -p_j p_sink``, in every form the input ``y`` of ``o_proj`` (the heads' outputs, gated or
not) moves as ``dy/ds_h = -p_sink y`` in head h's columns and not at all in another head's, and example
i's gradient is a sum over its query positions,

    d s_i[h] = sum_t <do[i, t, h], dy[i, t, h]/ds_h> + sum_{t, j} dP[i, h, t, j] dP[i, h, t, j]/ds_h,

with ``do = d_out W_o`` the gradient at ``o_proj``'s input (``o_proj`` an ``nn.Linear``; DeepSeek-V4's heads
go through a block-diagonal grouped projection and a mixing one, followed alike) and ``dP`` the
gradient of the probabilities the module returns, where they reach the loss. The rule does not follow
either formula: it runs the module's own forward once more in forward mode, with every sink moved along a
tangent of ones (:func:`~dpexp.privacy.rules.submodule_values.tangents`), and reads the tangents at
``o_proj``'s input and of the returned probabilities. Because a sink moves only its own head's columns,
head h's columns of those tangents are ``dy/ds_h`` and ``dP/ds_h``: how the scores are formed, rotary
positions, windows, masks, gates and float32 casts included, is the module's own. A module whose sinks
reached another head's columns would give example sums that differ from autograd's, which the engine's
verification refuses. The projections are ``nn.Linear`` submodules with their own rules. Without the rule
these modules took the exact fallback, which recomputed them per example.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from dpexp.privacy.per_example import Dense, PerExampleGrad
from dpexp.privacy.rules import CallLayout, qualified_name, refuse, register_rule
from dpexp.privacy.rules.submodule_values import tangents
from dpexp.privacy.rules.window_attention import attention_output_grad, through_o_proj, wrapped_o_proj

_MODELS = "transformers.models"
_ATTENTIONS = (
    f"{_MODELS}.gpt_oss.modeling_gpt_oss.GptOssAttention",
    f"{_MODELS}.flint.modeling_flint.FlintAttention",
    f"{_MODELS}.mimo_v2_flash.modeling_mimo_v2_flash.MiMoV2FlashAttention",  # sinks on its window layers
    f"{_MODELS}.hy_v4.modeling_hy_v4.HYV4Attention",  # a gated output
    f"{_MODELS}.granite_swa.modeling_granite_swa.GraniteSWAAttention",  # the sigmoid(lse - s) form
    f"{_MODELS}.granitemoe_swa.modeling_granitemoe_swa.GraniteMoeSWAAttention",
    f"{_MODELS}.deepseek_v4.modeling_deepseek_v4.DeepseekV4Attention",  # a grouped output projection
)
_FIX = "Otherwise freeze the sinks (requires_grad=False)."
_GROUPED = "transformers.models.deepseek_v4.modeling_deepseek_v4.DeepseekV4GroupedLinear"


def _check(module: nn.Module) -> None:
    own = {name for name, p in module.named_parameters(recurse=False) if p.requires_grad}
    unknown = sorted(own - {"sinks"})
    reason = (
        f"it owns parameters {unknown} the rule does not know" if unknown else _wrapped_projection(module)
    )
    refuse(module, "attention-sinks", "module", reason, _FIX)


def _wrapped_projection(module: nn.Module) -> str | None:
    """Why the heads' outputs cannot be followed through the module's output projection: ``o_proj``, or
    DeepSeek-V4's grouped ``o_a_proj`` then ``o_b_proj``, not the plain layers the rule reads."""
    if not hasattr(module, "o_a_proj"):
        return wrapped_o_proj(module)
    kinds = {"o_a_proj": _GROUPED, "o_b_proj": qualified_name(nn.Linear)}
    wrapped = [name for name, kind in kinds.items() if qualified_name(type(getattr(module, name))) != kind]
    return f"its {' and '.join(wrapped)} are wrapped or replaced; leave them unwrapped" if wrapped else None


def _heads_grad(module: nn.Module, dy: torch.Tensor, length: int, dtype: torch.dtype) -> tuple:
    """``(tap, do, rest)``: the submodule whose input holds the heads' outputs, the gradient at that input
    (rows, length, heads * head_dim) in ``dtype`` and the rest of ``dy``'s rows (:func:`through_o_proj`).
    DeepSeek-V4 projects G groups of heads on their own (``o_a_proj``, a block-diagonal (G r, n) weight) and
    mixes them (``o_b_proj``): ``do_g = (dy W_b)_g W_a,g``."""
    if not hasattr(module, "o_a_proj"):
        return ("o_proj", *through_o_proj(module, dy, length, dtype))
    grouped, mixing = module.o_a_proj, module.o_b_proj
    width = length * mixing.out_features
    d_mixed = dy[:, :width].reshape(dy.shape[0], length, -1).to(dtype) @ mixing.weight.to(dtype)
    blocks = grouped.weight.to(dtype).view(grouped.n_groups, -1, grouped.in_features)  # (G, r, n)
    d_heads = torch.einsum("btgr,grn->btgn", d_mixed.unflatten(-1, (grouped.n_groups, -1)), blocks)
    return "o_a_proj", d_heads.flatten(2), dy[:, width:]


def rerun_inputs(module: nn.Module, args: tuple, kwargs: dict[str, Any], fix: str) -> tuple:
    """``(hidden_states (B, T, d), args, kwargs)``: the main input and the call as given, for a rule that runs
    the module again (:func:`directional_grads`). Refuses a key/value cache, which a second run would
    extend; ``fix`` is the alternative the message offers."""
    call = inspect.signature(module.forward).bind(*args, **kwargs)
    if any(call.arguments.get(name) is not None for name in ("cache", "past_key_values")):
        raise ValueError(
            "was given a key/value cache, which the rule's second run of the attention would extend; call "
            f"the model with use_cache=False in training, or {fix}"
        )
    return call.arguments["hidden_states"], args, kwargs


def eager_inputs(module: nn.Module, args: tuple, kwargs: dict[str, Any], rule: str, fix: str) -> tuple:
    """:func:`rerun_inputs`, also refusing a call the ``rule`` cannot run again to the same output in forward
    mode: another attention implementation than eager (a kernel may have no forward-mode derivative, or not
    apply the module's parameters at all) and attention dropout in training (its mask is drawn inside the
    attention function)."""
    implementation = getattr(module.config, "_attn_implementation", None)
    if implementation != "eager":
        raise ValueError(
            f"attention implementation {implementation!r}: the {rule} rule differentiates the 'eager' "
            f"implementation's forward; load the model with attn_implementation='eager', or {fix}"
        )
    if module.training and module.attention_dropout > 0:
        raise ValueError(
            f"applies attention dropout (p={module.attention_dropout}) inside the attention function in "
            f"training, whose mask the rule cannot see; set attention_dropout=0, or {fix}"
        )
    return rerun_inputs(module, args, kwargs, fix)


def sinks_inputs(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple:
    """:func:`eager_inputs` for the sinks: a kernel may not apply them at all."""
    return eager_inputs(module, args, kwargs, "attention-sinks", "freeze the sinks")


def directional_grads(
    module: nn.Module,
    call: tuple,
    dy: torch.Tensor,
    directions: dict[str, torch.Tensor],
    heads: int,
    fix: str,
) -> torch.Tensor:
    """(B, heads): example i's derivative of the loss along ``directions`` (name -> tangent of the module's
    own parameter), split by head: ``sum_t <do[i, t, h], dy[i, t, h]/dθ> + sum_{t, j} dP[i, h, t, j]
    dP[i, h, t, j]/dθ``, with ``do`` the gradient at the output projection's input (:func:`_heads_grad`) and
    the tangents read in one more run
    of the module's forward in forward mode (:func:`~dpexp.privacy.rules.submodule_values.tangents`).
    ``call``: :func:`rerun_inputs`' triple; ``dy`` (B, T*d [+ heads*T*S]) the gradients of the output and of
    the returned probabilities. Summed in float64 for float64 parameters, else in float32."""
    hidden, args, kwargs = call
    batch, length = hidden.shape[:2]
    dtype = torch.float64 if next(iter(directions.values())).dtype == torch.float64 else torch.float32
    with torch.no_grad():
        tap, d_heads, d_returned = _heads_grad(module, dy, length, dtype)  # do: (B, T, heads * head_dim)
    output, seen = tangents(module, args, kwargs, directions, {"out": (tap, "input")}, fix)
    moved, moved_probs = seen["out"][0], output[1] if isinstance(output, tuple) else None
    grad = torch.zeros(batch, heads, dtype=dtype, device=dy.device)
    with torch.no_grad():
        if moved is not None:
            moved = moved.to(dtype).reshape(d_heads.shape)  # DeepSeek-V4's groups (B, T, G, n) flattened
            grad += (d_heads * moved).reshape(batch, length, heads, -1).sum((1, 3))
        if d_returned.shape[1] and moved_probs is not None:
            d_probs = d_returned.reshape(moved_probs.shape).to(dtype)
            grad += (d_probs * moved_probs.to(dtype)).reshape(batch, heads, -1).sum(2)
    return grad


@register_rule(*_ATTENTIONS, check=_check, call=CallLayout(sinks_inputs, attention_output_grad))
def sinks_grads(module: nn.Module, call: tuple, dy: torch.Tensor) -> dict[str, PerExampleGrad]:
    """``d sinks`` (B, heads) by the formula of the module docstring (:func:`directional_grads` along a
    tangent of ones); ``dy`` (B, T*d [+ heads*T*S]): the gradients of the output and of the returned
    probabilities. The tangents are those of the module's dtype (float32 where it casts)."""
    sinks = module.sinks
    grad = directional_grads(
        module, call, dy, {"sinks": torch.ones_like(sinks)}, sinks.shape[0],
        "register a rule for this attention, or freeze the sinks",
    )  # fmt: skip
    return {"sinks": Dense(grad.to(sinks.dtype))}
