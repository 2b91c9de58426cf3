"""Per-example derivatives of an attention's loss along a direction of its own parameters, read in one more
run of the module's forward in forward mode (the rules of :mod:`~dpexp.privacy.rules.sinks`,
:mod:`~dpexp.privacy.rules.differential` and :mod:`~dpexp.privacy.rules.dynamic_mask`).

For a parameter moved along a tangent ``u``, example i's directional derivative of the loss is, per head h,

    D_u L_i[h] = sum_t <do[i, t, h], dy[i, t, h]/du> + sum_{t, j} dP[i, h, t, j] dP[i, h, t, j]/du,

with ``y`` the input of the output projection (the heads' outputs), ``do`` the gradient there and ``dP`` the
gradient of the probabilities the module returns, where they reach the loss. The tangents ``dy/du`` and
``dP/du`` come from :func:`~dpexp.privacy.rules.submodule_values.tangents`: how the module forms its scores,
masks and casts is its own. A rule turns these derivatives into gradients (a sink moves only its head: the
derivative is the gradient; a scalar's vectors: the derivative along ``slope / |slope|^2``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dpexp.privacy.rules import forward_arguments, given_cache, qualified_name
from dpexp.privacy.rules.submodule_values import tangents
from dpexp.privacy.rules.window_attention import through_o_proj, wrapped_o_proj

_GROUPED = "transformers.models.deepseek_v4.modeling_deepseek_v4.DeepseekV4GroupedLinear"


def wrapped_projection(module: nn.Module) -> str | None:
    """Why the heads' outputs cannot be followed through the module's output projection: ``o_proj``, or
    DeepSeek-V4's grouped ``o_a_proj`` then ``o_b_proj``, not the plain layers the rule reads."""
    if not hasattr(module, "o_a_proj"):
        return wrapped_o_proj(module)
    kinds = {"o_a_proj": _GROUPED, "o_b_proj": qualified_name(nn.Linear)}
    wrapped = [name for name, kind in kinds.items() if qualified_name(type(getattr(module, name))) != kind]
    return f"its {' and '.join(wrapped)} are wrapped or replaced; leave them unwrapped" if wrapped else None


def heads_grad(module: nn.Module, dy: torch.Tensor, length: int, dtype: torch.dtype) -> tuple:
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
    call = forward_arguments(module, args, kwargs)
    if given_cache(call):
        raise ValueError(
            "was given a key/value cache, which the rule's second run of the attention would extend; call "
            f"the model with use_cache=False in training, or {fix}"
        )
    return call["hidden_states"], args, kwargs


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
    dP[i, h, t, j]/dθ``, with ``do`` the gradient at the output projection's input (:func:`heads_grad`) and
    the tangents read in one more run
    of the module's forward in forward mode (:func:`~dpexp.privacy.rules.submodule_values.tangents`).
    ``call``: :func:`rerun_inputs`' triple; ``dy`` (B, T*d [+ heads*T*S]) the gradients of the output and of
    the returned probabilities. Summed in float64 for float64 parameters, else in float32."""
    hidden, args, kwargs = call
    batch, length = hidden.shape[:2]
    dtype = torch.float64 if next(iter(directions.values())).dtype == torch.float64 else torch.float32
    with torch.no_grad():
        tap, d_heads, d_returned = heads_grad(module, dy, length, dtype)  # do: (B, T, heads * head_dim)
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
