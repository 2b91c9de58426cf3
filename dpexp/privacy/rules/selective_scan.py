"""Per-example gradients of a Mamba mixer's state-space parameters: Hugging Face's ``MambaMixer`` and its
Falcon-Mamba and Jamba forms (Gu & Dao 2023, "Mamba", sec. 3.2 and Algorithm 2; Falcon-Mamba and Jamba add
RMSNorms on the time step, B and C).

The mixer owns ``A_log`` (d, n) and ``D`` (d,) and reads its depthwise causal ``conv1d``'s and its
``dt_proj``'s weights itself (it passes them to the scan's kernels), so the rule claims those two
submodules; ``in_proj``, ``x_proj``, ``out_proj`` and Jamba's norms are layers of their own. For one example,
with ``P = in_proj(x)`` split into the scan's input ``p`` and its gate ``z`` (each (d, T)):

    u = mask * act(conv1d(p))                      (the causal depthwise convolution, kernel k)
    (s, B, C) = norms(x_proj(u))                   s (T, r), B and C (T, n); norms the identity for Mamba
    delta = softplus(W_dt s + b_dt)                (d, T)
    h_t = exp(delta_t A) * h_{t-1} + delta_t B_t u_t,   A = -exp(A_log),  h_0 = 0      (Algorithm 2)
    y_t = (<h_t, C_t> + D u_t) * silu(z_t),        the input of out_proj

``P``, ``x_proj``'s input ``u`` and the inputs of the scan (``s``, ``B``, ``C`` after the norms) are read from
the module's own forward, run once more without recording (hooks on those submodules); the rule computes
``u`` and ``y`` again from ``P`` with one copy of ``A_log``, ``D``, ``conv1d`` and ``dt_proj``'s parameters
per example, checks them against what the module computed (a module whose forward differs is refused, not
approximated), and takes every copy's gradient of ``sum_t <y_t, dy_t W_out>`` in one batched backward:
example i's copy only enters example i's output. The time loop keeps one state per step, so its backward
is linear in T (the reference scan's indexing makes the module's own backward quadratic in T).

Refused, with the cause: a key/value cache (a second run would extend it), the fused kernels' path
(``mamba_ssm`` installed in training: ``x_proj`` is then never called), a wrapped ``x_proj`` or ``out_proj``
(the rule reads their weights), norms with submodules, trainable parameters the rule does not know.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dpexp.privacy.per_example import Dense, PerExampleGrad
from dpexp.privacy.rules import CallLayout, first_output, refuse, register_rule
from dpexp.privacy.rules.functional import reproduces

_HF = "transformers.models"
MIXERS = (
    f"{_HF}.mamba.modeling_mamba.MambaMixer",
    f"{_HF}.falcon_mamba.modeling_falcon_mamba.FalconMambaMixer",
    f"{_HF}.jamba.modeling_jamba.JambaMambaMixer",
)
NORMS = ("dt_layernorm", "b_layernorm", "c_layernorm")  # Falcon-Mamba's and Jamba's, on s, B and C
_FIX = "Otherwise freeze A_log, D, conv1d and dt_proj (requires_grad=False)."


def _check(module: nn.Module) -> None:
    own = {name for name, p in module.named_parameters(recurse=False) if p.requires_grad}
    unknown = sorted(own - {"A_log", "D"})
    wrapped = [
        f"{name} is a {type(getattr(module, name, None)).__name__}"
        for name, kind in (("x_proj", nn.Linear), ("out_proj", nn.Linear), ("dt_proj", nn.Linear))
        if type(getattr(module, name, None)) is not kind
    ]
    if type(getattr(module, "conv1d", None)) is not nn.Conv1d:
        wrapped.append(f"conv1d is a {type(getattr(module, 'conv1d', None)).__name__}")
    nested = [name for name in NORMS if hasattr(module, name) and any(getattr(module, name).children())]
    reason = None
    if unknown:
        reason = f"it owns parameters {unknown} the rule does not know"
    elif wrapped:
        reason = (
            f"{', '.join(wrapped)}, not the plain nn.Linear / nn.Conv1d whose weights the rule reads; leave "
            "them unwrapped (adapters on in_proj are fine)"
        )
    elif nested:
        reason = f"its norms {nested} have submodules, which the rule cannot run outside the model's hooks"
    refuse(module, "selective-scan", "mixer", reason, _FIX)


def scan_inputs(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple:
    """``(hidden_states (B, T, d_model), args, kwargs)``: the main input and the call as given, which the
    rule runs again; a call with a cache is refused (the second run would extend it)."""
    call = inspect.signature(module.forward).bind(*args, **kwargs)
    if any(call.arguments.get(name) is not None for name in ("cache", "cache_params")):
        raise ValueError(
            f"{type(module).__name__} was given a cache, which the selective-scan rule's second run of the "
            "mixer would extend; call the model with use_cache=False in training, or freeze the mixer's "
            "A_log, D, conv1d and dt_proj"
        )
    return call.arguments["hidden_states"], args, kwargs


def _recorded(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The mixer's intermediate values from its own forward, run again without recording: ``P`` (in_proj's
    output), ``u`` (x_proj's input) and ``y`` (out_proj's input); each submodule, the norms included where
    present, must be called exactly once."""
    seen: dict[str, list[torch.Tensor]] = {}

    def keep(key: str, value: torch.Tensor) -> None:
        seen.setdefault(key, []).append(value)

    hooks = [
        module.in_proj.register_forward_hook(lambda _, __, out: keep("P", out)),
        module.x_proj.register_forward_pre_hook(lambda _, inputs: keep("u", inputs[0])),
        module.out_proj.register_forward_pre_hook(lambda _, inputs: keep("y", inputs[0])),
    ]
    hooks += [
        getattr(module, name).register_forward_hook(lambda _, __, out, key=key: keep(key, out))
        for name, key in zip(NORMS, "sBC", strict=True)
        if hasattr(module, name)
    ]
    try:
        with torch.no_grad():
            module(*args, **kwargs)
    finally:
        for hook in hooks:
            hook.remove()
    expected = {"P", "u", "y"} | {
        key for name, key in zip(NORMS, "sBC", strict=True) if hasattr(module, name)
    }
    counts = {key: len(seen.get(key, [])) for key in sorted(expected)}
    if any(count != 1 for count in counts.values()):
        raise RuntimeError(
            f"{type(module).__name__}: its second run called its submodules {counts} times, where the "
            "selective-scan rule needs each once (the fused kernels of mamba_ssm skip x_proj in training: "
            f"uninstall them for private training). {_FIX}"
        )
    return {key: values[0] for key, values in seen.items()}


def _per_example(param: torch.Tensor, batch: int) -> torch.Tensor:
    """One copy of ``param`` per example, (B, *param.shape), a leaf that requires grad."""
    return param.detach().unsqueeze(0).repeat(batch, *([1] * param.dim())).requires_grad_(True)


@register_rule(
    *MIXERS, check=_check, call=CallLayout(scan_inputs, first_output), claims=("conv1d", "dt_proj")
)
def selective_scan_grads(module: nn.Module, call: tuple, dy: torch.Tensor) -> dict[str, PerExampleGrad]:
    """Per-example gradients of ``A_log``, ``D``, ``conv1d.*`` and ``dt_proj.*`` by the recomputation of the
    module docstring; ``dy`` (B, T, d_model) the gradient of the mixer's output. Computed in float64 for a
    float64 mixer, else in float32; ``A_log``, ``D`` and ``dt_proj``'s bias pass through float32 as in the
    module."""
    from transformers.activations import ACT2FN  # only Hugging Face mixers take this rule

    hidden, args, kwargs = call
    seen = _recorded(module, args, kwargs)
    batch, length = hidden.shape[:2]
    dtype = torch.float64 if module.A_log.dtype == torch.float64 else torch.float32
    mask = inspect.signature(module.forward).bind(*args, **kwargs).arguments.get("attention_mask")
    conv, dt_proj = module.conv1d, module.dt_proj
    leaves = {
        "A_log": _per_example(module.A_log, batch),
        "D": _per_example(module.D, batch),
        "conv1d.weight": _per_example(conv.weight, batch),
        "dt_proj.weight": _per_example(dt_proj.weight, batch),
    }
    if conv.bias is not None:
        leaves["conv1d.bias"] = _per_example(conv.bias, batch)
    if dt_proj.bias is not None:
        leaves["dt_proj.bias"] = _per_example(dt_proj.bias, batch)
    p, z = seen["P"].to(dtype).transpose(1, 2).chunk(2, dim=1)  # (B, d, T) each
    width, kernel = p.shape[1], conv.kernel_size[0]
    rank, state = module.time_step_rank, module.ssm_state_size
    with torch.enable_grad():
        weight = leaves["conv1d.weight"].to(dtype).reshape(batch * width, 1, kernel)
        bias = leaves["conv1d.bias"].to(dtype).reshape(-1) if "conv1d.bias" in leaves else None
        grouped = F.conv1d(
            p.reshape(1, batch * width, length), weight, bias, padding=kernel - 1, groups=batch * width
        )
        act = ACT2FN[module.activation]  # as the module's convolution applies it (module.act may differ)
        u = act(grouped[..., :length].reshape(batch, width, length)).transpose(1, 2)  # (B, T, d)
        if mask is not None:
            u = u * mask[:, :, None].to(dtype)
        _same(module, "x_proj's input", seen["u"], u)
        s, b, c = F.linear(u, module.x_proj.weight.to(dtype)).split([rank, state, state], dim=-1)
        if hasattr(module, NORMS[0]):  # Falcon-Mamba's, Jamba's: called outside the model's hooks
            s, b, c = (getattr(module, name).forward(t) for name, t in zip(NORMS, (s, b, c), strict=True))
        delta = torch.einsum("bdr,btr->bdt", leaves["dt_proj.weight"].to(dtype), s)
        if "dt_proj.bias" in leaves:
            delta = delta + leaves["dt_proj.bias"].float().to(dtype)[:, :, None]
        delta = F.softplus(delta)  # (B, d, T)
        a = -torch.exp(leaves["A_log"].float().to(dtype))  # (B, d, n)
        decay = torch.exp(a[:, :, None, :] * delta[..., None])  # (B, d, T, n)
        # B and u pass through float32 in the drive term, as in the module
        drive = (
            delta[..., None] * b[:, None].float().to(dtype) * u.transpose(1, 2).float().to(dtype)[..., None]
        )
        h = decay.new_zeros(batch, width, state)
        outputs = []
        for decay_t, drive_t, c_t in zip(
            decay.unbind(2), drive.unbind(2), c.to(dtype).unbind(1), strict=True
        ):
            h = decay_t * h + drive_t
            outputs.append(torch.einsum("bdn,bn->bd", h, c_t))
        y = torch.stack(outputs, dim=-1) + u.transpose(1, 2) * leaves["D"].float().to(dtype)[:, :, None]
        y = (y * F.silu(z)).transpose(1, 2)  # (B, T, d)
        _same(module, "out_proj's input", seen["y"], y)
        d_y = dy.to(dtype) @ module.out_proj.weight.to(dtype)
        grads = torch.autograd.grad((y * d_y).sum(), list(leaves.values()))
    return {name: Dense(g.to(leaves[name].dtype)) for name, g in zip(leaves, grads, strict=True)}


def _same(module: nn.Module, what: str, recorded: torch.Tensor, recomputed: torch.Tensor) -> None:
    """Refuse a mixer whose forward the rule's recomputation does not reproduce, to float32's precision at
    best: the module rounds ``A``, ``D``, ``B`` and ``u`` (Falcon-Mamba's norms also ``s``, ``B``, ``C``) to
    float32 whatever its dtype, and a recomputation equal to float64's rounding may round them the other
    way."""
    coarse = torch.float32 if recorded.dtype == torch.float64 else recorded.dtype
    if not reproduces(recorded.to(coarse), recomputed.detach().to(coarse)):
        raise RuntimeError(
            f"{type(module).__name__}: the selective-scan rule's recomputation of {what} does not reproduce "
            "the module's (its forward differs from Mamba's); register a rule for its type "
            f"(dpexp.privacy.rules.register_rule). {_FIX}"
        )
