"""RWKV-4's own parameters (Peng et al. 2023, RWKV: Reinventing RNNs for the Transformer Era, sec. 3.1;
Hugging Face's ``RwkvSelfAttention`` and ``RwkvFeedForward``): the token shift's mixing vectors of both
blocks, and the time mixing's decay ``w`` and bonus ``u``. The projections are ``nn.Linear`` submodules with
their own rules.

*Token shift* (eq. 12-14, 17-18): each projection reads ``x * mu + shifted * (1 - mu)``, with ``shifted`` the
input moved one position later (``time_shift``, zero at the first position). With ``dz`` the gradient at
that mix (the projection's input), example i's gradient is

    d mu_i = sum_t dz[i, t] * (x[i, t] - shifted[i, t]).

*Time mixing* (eq. 15-16): ``out = output(r * wkv)`` with ``r = sigmoid(receptance(.))`` and ``wkv`` the
weighted average of the values over past positions with weights ``exp(-(t - 1 - s) e^w + k_s)``, the current
one's ``exp(u + k_t)``. With ``g`` the gradient at ``output``'s input, ``dwkv = g * r``; the rule runs the
module's own recurrence (``rwkv_linear_attention_cpu`` of its modeling file) once more on the kept keys and
values with one copy of ``w`` and ``u`` per example, and backpropagates ``dwkv``: example i's gradients are
the copies' (:func:`~dpexp.privacy.rules.per_example_copies`).

The capture keeps the values the formulas name as the submodules see them (``keeps``): ``shifted`` (the time
shift's output), each projection's input (the mix) and the keys, values and receptance; the gradients at the
mixes and at ``output``'s input are read off the call's graph at the nodes that produced them
(:func:`~dpexp.privacy.rules.submodule_values.gradients_at`). The rule recomputes each mix and ``r * wkv`` and
refuses a module whose forward it does not reproduce, and a call with a recurrent state (the rule's recurrence
starts from none). Before these rules the exact fallback recomputed each block per example (``rwkv`` entry of
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
    per_example_copies,
    refuse,
    register_rule,
)
from dpexp.privacy.rules.graph import GraphReads
from dpexp.privacy.rules.submodule_values import gradients_at, read_call, reproduced, unfollowed

_RWKV = "transformers.models.rwkv.modeling_rwkv"
_MIXES = {  # mixing vector -> the projection that reads its mix
    "RwkvFeedForward": {"time_mix_key": "key", "time_mix_receptance": "receptance"},
    "RwkvSelfAttention": {
        "time_mix_key": "key",
        "time_mix_value": "value",
        "time_mix_receptance": "receptance",
    },
}
_ATTENTION_KEEPS = {
    "k": ("key", "output"),
    "v": ("value", "output"),
    "R": ("receptance", "output"),
    "y": ("output", "input"),
}


def _time_mixing(module: nn.Module) -> bool:
    """Whether ``module`` is the time mixing (``w``, ``u`` and the recurrence), not the channel mixing."""
    return type(module).__name__ == "RwkvSelfAttention"


def _fix(module: nn.Module) -> str:
    own = [name for name, _ in module.named_parameters(recurse=False)]
    return f"Otherwise freeze {', '.join(own)} (requires_grad=False)."


def _keeps(module: nn.Module) -> dict[str, tuple[str, str]]:
    """``shifted``, each mix (``mix_<vector>``) and, for the time mixing, the recurrence's values."""
    mixes = {
        f"mix_{name}": (projection, "input") for name, projection in _MIXES[type(module).__name__].items()
    }
    extra = _ATTENTION_KEEPS if _time_mixing(module) else {}
    return {"shifted": ("time_shift", "output"), **mixes, **extra}


def _graph_keys(module: nn.Module) -> tuple[str, ...]:
    """The kept values whose gradients the rule reads: the mixes and ``output``'s input."""
    return tuple(key for key in _keeps(module) if key.startswith("mix_") or key == "y")


def _check(module: nn.Module) -> None:
    mixes = _MIXES[type(module).__name__]
    projections = dict.fromkeys(mixes.values(), nn.Linear)
    own = set(mixes) | ({"time_decay", "time_first"} if _time_mixing(module) else set())
    reason = unfollowed(module, own, {**projections, "time_shift": nn.ZeroPad2d})
    refuse(module, "RWKV", "block", reason, _fix(module))


def _inputs(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple:
    """``(hidden (B, T, d),)``, to which the capture appends the kept values and the graph's reads; a call
    with a recurrent state is refused."""
    arguments = forward_arguments(module, args, kwargs)
    if arguments.get("state") is not None:
        raise ValueError(
            "was given a recurrent state, from which the rule's recurrence does not start; call the model "
            f"with use_cache=False in training. {_fix(module)}"
        )
    return (arguments["hidden"],)


def rwkv_graph(module: nn.Module, call: tuple, output: Any, boundary: list) -> GraphReads | None:
    """The gradients at the mixes (and at ``output``'s input) (:func:`gradients_at`)."""
    return gradients_at(call[-1], _graph_keys(module))


@register_rule(
    f"{_RWKV}.RwkvFeedForward",
    f"{_RWKV}.RwkvSelfAttention",
    check=_check,
    call=CallLayout(_inputs, first_output, keeps=_keeps, graph=rwkv_graph),
)
def rwkv_grads(module: nn.Module, call: tuple, dy: torch.Tensor) -> dict[str, PerExampleGrad]:
    """The mixing vectors (B, 1, 1, d) and, for the time mixing, ``time_decay`` and ``time_first`` (B, d) by
    the module docstring's formulas; ``dy`` unused (the gradients inside the call are read)."""
    fix = _fix(module)
    (hidden,), seen, reads = read_call(module, call, _keeps(module), "RWKV", fix)
    x, shifted = hidden.detach(), seen["shifted"]
    grads: dict[str, PerExampleGrad] = {}
    with torch.no_grad():
        for name in _MIXES[type(module).__name__]:
            mu = getattr(module, name)
            mix = seen[f"mix_{name}"]
            reproduced(module, f"the mix of {name}", mix, x * mu + shifted * (1 - mu), fix)
            summed = as_sequence(reads[f"d_mix_{name}"].to(x.dtype) * (x - shifted)).sum(1)
            grads[name] = Dense(summed.view(-1, *mu.shape))
    if _time_mixing(module):
        grads.update(_time_grads(module, seen, reads["d_y"], fix))
    return grads


def _time_grads(module: nn.Module, seen: dict[str, torch.Tensor], g: torch.Tensor, fix: str) -> dict:
    """``time_decay`` and ``time_first`` (B, d): the module's recurrence run again with one copy of each per
    example, ``dwkv = g * sigmoid(R)`` backpropagated."""
    recurrence = sys.modules[type(module).__module__].rwkv_linear_attention_cpu
    batch = seen["k"].shape[0]
    decay = per_example_copies(module.time_decay, batch)
    first = per_example_copies(module.time_first, batch)
    with torch.enable_grad():
        wkv, _ = recurrence(decay, first, seen["k"], seen["v"])
    r = torch.sigmoid(seen["R"])
    reproduced(module, "the receptance-weighted recurrence", seen["y"], r * wkv.detach(), fix)
    d_decay, d_first = torch.autograd.grad(wkv, (decay, first), g.to(r.dtype) * r)
    return {"time_decay": Dense(d_decay), "time_first": Dense(d_first)}
