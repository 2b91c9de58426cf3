"""Per-example gradients of the mixers that scan over time with a state: Mamba's ``MambaMixer`` with its
Falcon-Mamba and Jamba forms (Gu & Dao 2023, "Mamba", sec. 3.2 and Algorithm 2; Falcon-Mamba and Jamba add
RMSNorms on the time step, B and C) and Zamba's multi-head form, Mamba-2's ``Mamba2Mixer`` with its copies in
Bamba, Nemotron-H, Granite-hybrid, Zamba2 and Falcon-H1 (Dao & Gu 2024, "Transformers are SSMs", sec. 7, the
SSD layer), and Qwen3.5's gated delta net with its copies (Yang et al. 2025, "Gated Delta Networks", eq. 10).

Each mixer reads its causal depthwise ``conv1d``'s weights itself (it passes them to a kernel), so its rule
claims that submodule. The rules share one pattern: the capture keeps what enters and leaves the mixer's
submodules during its training call (:class:`~dpexp.privacy.rules.CallLayout`'s ``keeps``, each submodule
called once); the rule computes the mixer's output again from there with one copy of each parameter per
example, checks it against the module's (a module whose forward differs is refused, not approximated), and
takes every copy's gradient of ``<output, dy>`` in one batched backward: example i's copy only enters example
i's output.

**Mamba.** The mixer owns ``A_log`` (d, n) and ``D`` (d,) and reads its depthwise causal ``conv1d``'s and its
``dt_proj``'s weights itself (it passes them to the scan's kernels), so the rule claims those two
submodules; ``in_proj``, ``x_proj``, ``out_proj`` and Jamba's norms are layers of their own. For one example,
with ``P = in_proj(x)`` split into the scan's input ``p`` and its gate ``z`` (each (d, T)):

    u = mask * act(conv1d(p))                      (the causal depthwise convolution, kernel k)
    (s, B, C) = norms(x_proj(u))                   s (T, r), B and C (T, n); norms the identity for Mamba
    delta = softplus(W_dt s + b_dt)                (d, T)
    h_t = exp(delta_t A) * h_{t-1} + delta_t B_t u_t,   A = -exp(A_log),  h_0 = 0      (Algorithm 2)
    y_t = (<h_t, C_t> + D u_t) * silu(z_t),        the input of out_proj

The rule reads ``P``, ``u`` and ``y`` in the module's call, computes ``u`` and ``y`` again from ``P`` (the
scan written out: it has no function a per-example ``A`` could pass through) and takes the copies' gradients
of ``sum_t <y_t, dy_t W_out>``. Its time loop keeps one state per step, so its backward is linear in T (the
reference scan's indexing makes the module's own backward quadratic in T).

**Zamba** (v1) splits Mamba's channels into heads, each with its own ``x_proj`` and ``dt_proj`` weights,
which the mixer owns as parameters (:func:`zamba_scan_grads`); the scan is the same, written out once
(:func:`_selective_scan`).

**Mamba-2.** The mixer owns ``A_log``, ``D`` and ``dt_bias`` (one per head) and reads its ``conv1d``'s
weights (claimed); ``in_proj``, the gated RMSNorm ``norm`` and ``out_proj`` are layers of their own. With
``P = in_proj(x)`` split into the gate ``z``, the convolution's input ``xBC`` and the time step ``dt``:
``(x, B, C) = mask * act(conv1d(xBC))``, then the module's own chunked scan function (``mamba2_chunk_scan``
of its modeling file: ``h_t = exp(delta_t A) h_{t-1} + delta_t x_t B_t^T``, ``y_t = h_t C_t + D x_t``,
``delta = clamp(softplus(dt + dt_bias))``, per head), then ``norm(y, z)`` and ``out_proj``. The rule reads
its gradients off the call's graph (below); where it cannot, it calls that same scan function with the
per-example copies shaped (B, 1, heads), which its broadcasting takes as one parameter per example, checks
its output against the norm's input in the module's call, and runs the norm's forward on it to reach
``out_proj``'s input. Falcon-H1's mixer (``FalconH1Mixer.forward``) scales ``P``
by its µP multipliers (the buffer ``mup_vector``) and, without its norm (``mamba_rms_norm`` false), gates the
scan's output as ``y * silu(z)``; the rule follows both and checks at ``out_proj``'s input then.

**Gated delta net** (Qwen3.5, Qwen3.5-MoE, Qwen4-exp, LaraMini: the same forward). It owns ``A_log`` and
``dt_bias`` (one per value head). ``(q, k, v) = act(conv1d(in_proj_qkv(x)))``,
``beta = sigmoid(in_proj_b(x))``, ``g = -exp(A_log) * softplus(in_proj_a(x) + dt_bias)``, then the module's
own chunked delta rule (``torch_chunk_gated_delta_rule`` of its modeling file), its gated RMSNorm with
``in_proj_z(x)`` and ``out_proj``. The rule recomputes the convolution and ``g`` with the copies and calls the
same function. Two other forms differ only in where ``q, k, v``, ``a`` and ``b`` come from
(:data:`DELTA_FORMS`): Qwen3-Next's fused ``in_proj_qkvz`` and ``in_proj_ba``, interleaved per key head and
taken apart by the module's own ``fix_query_key_value_ordering``; OLMo-hybrid's separate projections, its
``beta`` doubled where ``allow_neg_eigval`` (eigenvalues in [-1, 1]), its norm ``o_norm`` and output
``o_proj``.

**Kimi Linear's delta attention** (Kimi Team 2025, "Kimi Linear", the Kimi Delta Attention; Bailing-hybrid's
is the same) decays per channel, not per head: ``g`` comes from its ``forget_gate``, a layer of its own that
owns ``A_log`` and ``dt_bias`` (its own rule, :mod:`dpexp.privacy.rules.forget_gate`), so the attention's rule
has only the convolution to take, through the module's own ``chunk_kimi_delta_attention`` with ``g`` and
``beta`` as recorded.

**Read off the graph** (stop 65). The delta nets and the Kimi attention need no recomputation where the
call's autograd graph holds what their gradients need (:mod:`dpexp.privacy.rules.graph`): the convolution's
output gradient at the one convolution node that keeps ``conv1d``'s weight (its per-example gradient is then
the depthwise convolution's own rule, :func:`~dpexp.privacy.rules.conv.conv_grads`), and a delta net's
``dg`` at the one product that keeps ``-exp(A_log)`` (by value), from which ``A_log``'s and ``dt_bias``'s
follow in closed form (:func:`delta_rule_grads`). Mamba-2's (stop 66) likewise: the scan's products
``A dt`` (found by ``-exp(A_log)``) and ``D x`` (by ``D``), its one softplus and the convolution
(:func:`ssd_grads`). The chunked function, the norm and ``out_proj`` are then autograd's own, run once.
Where the graph lacks these nodes (autocast, hooks on saved tensors) the rules recompute as above.

Refused, with the cause: a key/value cache (the recomputation starts from no state), the fused kernels' path
(``mamba_ssm`` installed in training: ``x_proj`` or ``norm`` is then never called), a wrapped ``x_proj`` or
``out_proj`` (the rule reads their weights), norms with submodules, trainable parameters the rule does not
know, a forward the recomputation does not reproduce.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.graph import Node

from dpexp.privacy.per_example import Dense, PerExampleGrad
from dpexp.privacy.rules import (
    CallLayout,
    CheckFn,
    first_output,
    forward_arguments,
    per_example_copies,
    refuse,
    register_rule,
)
from dpexp.privacy.rules.activation import softplus_backward
from dpexp.privacy.rules.autocast import Autocast, autocast_at, replay
from dpexp.privacy.rules.conv import conv_grads
from dpexp.privacy.rules.graph import GraphReads, call_nodes, kept_as, other_operand, product_with, saved
from dpexp.privacy.rules.submodule_values import once, reproduced, unfollowed

_HF = "transformers.models"
MIXERS = (
    f"{_HF}.mamba.modeling_mamba.MambaMixer",
    f"{_HF}.falcon_mamba.modeling_falcon_mamba.FalconMambaMixer",
    f"{_HF}.jamba.modeling_jamba.JambaMambaMixer",
)
MAMBA2_MIXERS = (
    f"{_HF}.mamba2.modeling_mamba2.Mamba2Mixer",
    f"{_HF}.bamba.modeling_bamba.BambaMixer",
    f"{_HF}.nemotron_h.modeling_nemotron_h.NemotronHMamba2Mixer",
    f"{_HF}.granitemoehybrid.modeling_granitemoehybrid.GraniteMoeHybridMambaLayer",
    f"{_HF}.zamba2.modeling_zamba2.Zamba2MambaMixer",
    f"{_HF}.falcon_h1.modeling_falcon_h1.FalconH1Mixer",
)
DELTA_NETS = tuple(
    f"{_HF}.{family}.modeling_{family}.{name}GatedDeltaNet"
    for family, name in (
        ("qwen3_5", "Qwen3_5"),
        ("qwen3_5_moe", "Qwen3_5Moe"),
        ("qwen4_exp", "Qwen4ExpText"),
        ("lara_mini", "LaraMini"),
        ("qwen3_next", "Qwen3Next"),
        ("olmo_hybrid", "OlmoHybrid"),
    )
)
NORMS = ("dt_layernorm", "b_layernorm", "c_layernorm")  # Falcon-Mamba's and Jamba's, on s, B and C
_SCAN = "mamba2_chunk_scan"  # the chunked SSD scan of each Mamba-2 modeling file
_DELTA_RULE = "torch_chunk_gated_delta_rule"  # the chunked gated delta rule of each Qwen3.5-form file
_KDA = (  # the Kimi Delta Attention: Kimi Linear's, Bailing-hybrid's, GLM-5-Next's (one forward but the gate)
    f"{_HF}.kimi_linear.modeling_kimi_linear.KimiLinearDeltaAttention",
    f"{_HF}.bailing_hybrid.modeling_bailing_hybrid.BailingHybridDeltaAttention",
    f"{_HF}.glm5_next.modeling_glm5_next.Glm5NextTextLinearAttention",
)
_KIMI_RULE = "chunk_kimi_delta_attention"  # its chunked delta rule with a decay per channel
_FIX = "Otherwise freeze the mixer's own parameters and its conv1d (and dt_proj) (requires_grad=False)."


def _refusal(module: nn.Module, own: set[str], plain: dict[str, type], norms: tuple[str, ...]) -> str | None:
    """Why a mixer cannot take its rule (:func:`~dpexp.privacy.rules.submodule_values.unfollowed`, or a
    norm of ``norms``, run outside the hooks, with submodules); None if it can."""
    reason = unfollowed(module, own, plain)
    nested = [name for name in norms if hasattr(module, name) and any(getattr(module, name).children())]
    if reason is None and nested:
        return f"its norms {nested} have submodules, which the rule cannot run outside the model's hooks"
    return reason


def _check(module: nn.Module) -> None:
    plain = {"x_proj": nn.Linear, "out_proj": nn.Linear, "dt_proj": nn.Linear, "conv1d": nn.Conv1d}
    refuse(module, "selective-scan", "mixer", _refusal(module, {"A_log", "D"}, plain, NORMS), _FIX)


def _check_calling(
    rule: str, own: set[str], function: str, parts: Callable[[nn.Module], tuple[str, str] | None]
) -> CheckFn:
    """The check of a rule that calls ``function`` of the mixer's modeling file and runs its norm; ``parts``
    names the mixer's output projection and norm (None: a form the rule does not know)."""

    def check(module: nn.Module) -> None:
        named = parts(module)
        if named is None:
            reason = "it has none of the input projections the rule knows"
        else:
            out, norm = named
            reason = _refusal(module, own, {out: nn.Linear, "conv1d": nn.Conv1d}, (norm,))
        if reason is None and not callable(getattr(sys.modules[type(module).__module__], function, None)):
            reason = f"its modeling file has no {function} function"
        refuse(module, rule, "mixer", reason, _FIX)

    return check


def scan_inputs(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple:
    """``(hidden_states (B, T, d_model), arguments, autocast)``: the main input, the call's arguments by name
    (where the rule finds the padding mask: a tensor of the tuple would count as an input of the verified
    path, which would then differ between micro-batches with and without padding) and its autocast state (in
    which a recomputation runs, :mod:`~dpexp.privacy.rules.autocast`); the capture appends the values the
    rule keeps (``keeps``). A call with a cache is refused (the rule recomputes from no state)."""
    call = forward_arguments(module, args, kwargs)
    if any(call.get(name) is not None for name in ("cache", "cache_params")):
        raise ValueError(
            f"{type(module).__name__} was given a cache, which the rule's recomputation of the mixer cannot "
            "start from; call the model with use_cache=False in training, or freeze the mixer's own "
            "parameters and its conv1d"
        )
    return call["hidden_states"], call, autocast_at(call["hidden_states"])


def _kept(module: nn.Module, kept: dict[str, list[Any]], taps: dict[str, tuple[str, str]]) -> dict[str, Any]:
    """The values of ``taps`` the capture kept in the mixer's call, each submodule called once."""
    why = "the fused kernels of mamba_ssm skip them in training: uninstall them for private training."
    return once(module, kept, taps, f"{why} {_FIX}")


def _conv_leaves(conv: nn.Conv1d, batch: int) -> dict[str, torch.Tensor]:
    leaves = {"conv1d.weight": per_example_copies(conv.weight, batch)}
    if conv.bias is not None:
        leaves["conv1d.bias"] = per_example_copies(conv.bias, batch)
    return leaves


def _convolved(
    module: nn.Module, x: torch.Tensor, leaves: dict[str, torch.Tensor], mask: torch.Tensor | None
) -> torch.Tensor:
    """``mask * act(conv1d(x))`` (B, T, C) for the convolution's input ``x`` (B, C, T), each example
    through its own copy of the causal depthwise convolution (one group per example and channel)."""
    from transformers.activations import ACT2FN  # only Hugging Face mixers take these rules

    batch, channels, length = x.shape
    kernel = module.conv1d.kernel_size[0]
    weight = leaves["conv1d.weight"].to(x.dtype).reshape(batch * channels, 1, kernel)
    bias = leaves["conv1d.bias"].to(x.dtype).reshape(-1) if "conv1d.bias" in leaves else None
    out = F.conv1d(
        x.reshape(1, batch * channels, length), weight, bias, padding=kernel - 1, groups=batch * channels
    )
    # the activation as the module's convolution applies it (its ``act`` attribute may differ)
    out = ACT2FN[module.activation](out[..., :length].reshape(batch, channels, length)).transpose(1, 2)
    return out if mask is None else out * mask[:, :, None].to(out.dtype)


def _dtype(param: torch.Tensor) -> torch.dtype:
    """The rules' working precision: float64 for a float64 mixer, else float32."""
    return torch.float64 if param.dtype == torch.float64 else torch.float32


def _grads(
    leaves: dict[str, torch.Tensor],
    out: nn.Linear,
    y: torch.Tensor,
    dy: torch.Tensor,
    rounded: tuple[str, ...] = (),
) -> dict[str, PerExampleGrad]:
    """Every copy's gradient of ``<out(y), dy>`` for the output projection's input ``y`` (B, T, d) computed
    from the copies, in ``y``'s dtype; ``dy`` (B, T, d_model). The parameters ``rounded`` pass through
    float32 in the module (``A_log.float()``), so in a float64 mixer autograd rounds their batch gradient to
    float32: their per-example gradients are then given in float32, which is what they are accurate to (the
    engine's check of the per-example sums expects float32's agreement for them, not float64's)."""
    loss = (y * (dy.to(y.dtype) @ out.weight.to(y.dtype))).sum()
    grads = torch.autograd.grad(loss, list(leaves.values()))
    out_dtypes = {
        name: torch.float32 if name in rounded and leaf.dtype == torch.float64 else leaf.dtype
        for name, leaf in leaves.items()
    }
    return {name: Dense(g.to(out_dtypes[name])) for name, g in zip(leaves, grads, strict=True)}


def _selective_keeps(module: nn.Module) -> dict[str, tuple[str, str]]:
    taps = {"P": ("in_proj", "output"), "u": ("x_proj", "input"), "y": ("out_proj", "input")}
    return taps | {name: (name, "output") for name in NORMS if hasattr(module, name)}  # counted only


@register_rule(
    *MIXERS,
    check=_check,
    call=CallLayout(scan_inputs, first_output, keeps=_selective_keeps),
    claims=("conv1d", "dt_proj"),
)
def selective_scan_grads(module: nn.Module, call: tuple, dy: torch.Tensor) -> dict[str, PerExampleGrad]:
    """Per-example gradients of ``A_log``, ``D``, ``conv1d.*`` and ``dt_proj.*`` of a Mamba mixer by the
    recomputation of the module docstring; ``dy`` (B, T, d_model) the gradient of the mixer's output.
    ``A_log``, ``D`` and ``dt_proj``'s bias pass through float32 as in the module."""
    hidden, arguments, autocast, kept = call
    seen = _kept(module, kept, _selective_keeps(module))
    batch = hidden.shape[0]
    dtype = _dtype(module.A_log)
    dt_proj = module.dt_proj
    leaves = {
        "A_log": per_example_copies(module.A_log, batch),
        "D": per_example_copies(module.D, batch),
        "dt_proj.weight": per_example_copies(dt_proj.weight, batch),
        **_conv_leaves(module.conv1d, batch),
    }
    if dt_proj.bias is not None:
        leaves["dt_proj.bias"] = per_example_copies(dt_proj.bias, batch)
    p, z = seen["P"].transpose(1, 2).chunk(2, dim=1)  # (B, d, T) each; the gate in the module's dtype
    p = p.to(dtype)
    rank, state = module.time_step_rank, module.ssm_state_size
    with torch.enable_grad(), replay(autocast):
        u = _convolved(module, p, leaves, arguments.get("attention_mask"))  # (B, T, d)
        _same(module, "x_proj's input", seen["u"][0], u, autocast)
        s, b, c = F.linear(u, module.x_proj.weight.to(dtype)).split([rank, state, state], dim=-1)
        if hasattr(module, NORMS[0]):  # Falcon-Mamba's, Jamba's: called outside the model's hooks
            s, b, c = (getattr(module, name).forward(t) for name, t in zip(NORMS, (s, b, c), strict=True))
        delta = torch.einsum("bdr,btr->bdt", leaves["dt_proj.weight"].to(dtype), s)
        if "dt_proj.bias" in leaves:  # in float32, then in delta's dtype (autocast's), as the module adds it
            delta = delta + leaves["dt_proj.bias"].float().to(delta.dtype)[:, :, None]
        y = _selective_scan(
            u.transpose(1, 2), F.softplus(delta), leaves["A_log"], leaves["D"], b[:, None], c[:, None], z
        )
        _same(module, "out_proj's input", seen["y"][0], y, autocast)
    with torch.enable_grad():
        return _grads(leaves, module.out_proj, y, dy, rounded=("A_log", "D", "dt_proj.bias"))


def _selective_scan(
    u: torch.Tensor,
    delta: torch.Tensor,
    a_log: torch.Tensor,
    d: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    z: torch.Tensor,
) -> torch.Tensor:
    """Mamba's selective scan (Gu & Dao 2023, Algorithm 2) with one parameter copy per example, written out:
    ``h_t = exp(delta_t A) * h_{t-1} + delta_t B_t u_t`` (``A = -exp(A_log)``, ``h_0 = 0``) and
    ``y_t = (<h_t, C_t> + D u_t) * silu(z_t)``, returned as (B, T, d) in ``A_log``'s precision. ``u``,
    ``delta``, ``z``: (B, d, T); ``a_log`` (B, d, n); ``d`` (B, d); ``b``, ``c``: (B, G, T, n), block g of the
    d / G channels reading ``b[:, g]`` and ``c[:, g]`` (Mamba: G = 1; Zamba: a block per head). ``A``,
    ``D``, ``B`` and ``u`` pass through float32 as in the modules' scan, the state in ``A_log``'s precision
    (under autocast too, where the products with ``C`` run in autocast's dtype). The loop keeps one state per
    step, so its backward is linear in T."""
    dtype = _dtype(a_log)
    batch, width, length = u.shape
    groups, state = b.shape[1], b.shape[-1]
    a = -torch.exp(a_log.float().to(dtype))
    decay = torch.exp(a[:, :, None, :] * delta[..., None])  # (B, d, T, n)
    blocks = (batch, groups, width // groups, length)
    # B and u pass through float32 in the drive term, as in the module
    drive = (delta.reshape(blocks)[..., None] * b.float().to(dtype)[:, :, None]) * u.reshape(
        blocks
    ).float().to(dtype)[..., None]
    drive = drive.reshape(batch, width, length, state)
    h = decay.new_zeros(batch, width, state)
    outputs = []
    # unbind, not indexing: one backward for all steps (an index's backward fills a whole (B, d, T, n) zero)
    for decay_t, drive_t, c_t in zip(decay.unbind(2), drive.unbind(2), c.to(dtype).unbind(2), strict=True):
        h = decay_t * h + drive_t
        outputs.append(torch.einsum("bgpn,bgn->bgp", h.view(*blocks[:3], state), c_t).reshape(batch, width))
    y = torch.stack(outputs, dim=-1) + u * d.float().to(dtype)[:, :, None]
    return (y * F.silu(z)).transpose(1, 2)


def _ssd_keeps(module: nn.Module) -> dict[str, tuple[str, str]]:
    normed = getattr(module, "mamba_rms_norm", True)  # Falcon-H1's may gate without its norm
    return {"P": ("in_proj", "output"), "y": ("norm", "input") if normed else ("out_proj", "input")}


def ssd_graph(module: nn.Module, call: tuple, output: Any, boundary: list) -> GraphReads | None:
    """The nodes of the scan's parameters in the call's graph, each found by what it keeps: the
    discretisation ``A dt`` (``d_a``, (B, T, heads)) by its factor ``A = -exp(A_log)`` (by value); the time
    step's one softplus (``d_softplus``, at ``F.softplus``'s defaults); the skip ``D x`` (``d_d``) by ``D``
    itself; and the convolution's (:func:`_conv_graph`). With them the values they keep where autograd kept
    them (where the parameter needs a gradient: not once the engine has released it), checked by the rule
    against its recomputation: ``dt``, the softplus' input ``pre`` and ``x`` (``skip``: (B, T', heads,
    head_dim), padded to whole chunks). None where the graph lacks one of the nodes."""
    nodes = call_nodes(output, boundary)
    if nodes is None:
        return None
    decay, skip = _decay(module), module.D[..., None]  # the scan's A and D[..., None]
    step_node = product_with(nodes, decay, by_value=True)
    skip_node = product_with(nodes, skip)
    softplus = [node for node in nodes if type(node).__name__ == "SoftplusBackward0"]
    if step_node is None or skip_node is None or len(softplus) != 1:
        return None
    if (softplus[0]._saved_beta, softplus[0]._saved_threshold) != (1, 20):
        return None
    found = {"d_a": step_node, "d_softplus": softplus[0], "d_d": skip_node}
    kept = {
        "dt": other_operand(step_node, decay),
        "pre": saved(softplus[0], "_saved_self"),
        "skip": other_operand(skip_node, skip),
    }
    return _conv_graph(module, nodes, found, {key: t.detach() for key, t in kept.items() if t is not None})


@register_rule(
    *MAMBA2_MIXERS,
    check=_check_calling(
        "state-space-duality", {"A_log", "D", "dt_bias"}, _SCAN, lambda _: ("out_proj", "norm")
    ),
    call=CallLayout(scan_inputs, first_output, keeps=_ssd_keeps, graph=ssd_graph),
    claims=("conv1d",),
)
def ssd_grads(module: nn.Module, call: tuple, dy: torch.Tensor) -> dict[str, PerExampleGrad]:
    """Per-example gradients of ``A_log``, ``D``, ``dt_bias`` and ``conv1d.*`` of a Mamba-2 mixer; ``dy``
    (B, T, d_model) the gradient of the mixer's output. Where the call's graph gave the gradients at the
    scan's three products and the convolution's output (:func:`ssd_graph`), with ``dt`` and ``x`` the
    products kept and ``pre = dt_raw + dt_bias`` (each checked against its recomputation from the kept
    ``in_proj`` output),

        d A_log_i = A sum_t dA_{i,t} dt_{i,t},    d dt_bias_i = sum_t softplus'(pre_{i,t}) dsoftplus_{i,t},
        d D_i = sum_{t,p} dD_{i,t,p} x_{i,t,p}     (per head),

    and the convolution's own rule (:func:`_conv_read`): the scan, the norm and ``out_proj`` are autograd's
    own, nothing of them runs again. Else (autocast, hooks on saved tensors) the module's own scan on
    per-example copies (:func:`_ssd_recomputed`)."""
    hidden, arguments, autocast, kept = call[:4]
    seen = _kept(module, kept, _ssd_keeps(module))
    projected = seen["P"] * getattr(module, "mup_vector", 1.0)  # Falcon-H1's µP multipliers (a buffer)
    if len(call) > 4:
        return _ssd_read(module, projected, arguments.get("attention_mask"), autocast, call[4])
    mask = arguments.get("attention_mask")
    return _ssd_recomputed(module, hidden.shape[:2], projected, mask, autocast, seen, dy)


def _ssd_read(
    module: nn.Module,
    projected: torch.Tensor,
    mask: torch.Tensor | None,
    autocast: Autocast,
    reads: dict[str, Any],
) -> dict[str, PerExampleGrad]:
    """:func:`ssd_grads`' formulas on the gradients read off the graph; ``projected`` (B, T, ...) the
    ``in_proj`` output as the scan takes it apart. ``dt``, ``pre`` and ``x`` are recomputed from it as the
    scan forms them (``x`` by the module's convolution, in the call's ``autocast`` state), and checked
    against the values the nodes kept where they kept them. ``A_log``'s gradient passes through float32 (the
    module's ``A_log.float()``) and is given in float32 in a float64 mixer, what it is accurate to (as
    :func:`_grads`' ``rounded``)."""
    batch, length = projected.shape[:2]
    heads = module.num_heads
    _, xbc, dt = projected.detach().split([module.intermediate_size, module.conv_dim, heads], dim=-1)
    conv = {f"conv1d.{n}": p.detach().expand(batch, *p.shape) for n, p in module.conv1d.named_parameters()}
    with torch.no_grad():
        pre = _checked(
            module, "the time step's softplus input", reads, "pre", dt + module.dt_bias.to(dt.dtype)
        )
        step = torch.clamp(F.softplus(pre), *module.time_step_limit).float()  # the scan's dt, float32
        step = _checked(module, "the time step", reads, "dt", step)
        with replay(autocast):
            x = _convolved(module, xbc.transpose(1, 2), conv, mask)[..., : module.intermediate_size]
        x = F.pad(
            x.reshape(batch, length, heads, -1).float(), (0, 0, 0, 0, 0, reads["d_d"].shape[1] - length)
        )
        x = _checked(module, "the skip's input", reads, "skip", x)
        decay = _decay(module)
        d_log = (reads["d_a"] * step).sum(1).to(decay.dtype) * decay  # through -exp(A_log.float())
        rounded = module.A_log.dtype == torch.float64  # given in float32, as _grads' ``rounded``
        d_pre = softplus_backward(reads["d_softplus"], pre)  # the scan's F.softplus
        grads: dict[str, PerExampleGrad] = {
            "A_log": Dense(d_log if rounded else d_log.to(module.A_log.dtype)),
            "dt_bias": Dense(d_pre.sum(1).to(module.dt_bias.dtype)),
            "D": Dense((reads["d_d"] * x).sum((1, 3)).to(module.D.dtype)),
        }
    return grads | _conv_read(module, xbc, reads)


def _checked(
    module: nn.Module, what: str, reads: dict[str, Any], key: str, recomputed: torch.Tensor
) -> torch.Tensor:
    """The value a node kept under ``key``, checked against its recomputation; the recomputation where the
    node kept none."""
    if key not in reads:
        return recomputed
    _same(module, what, reads[key], recomputed)
    return reads[key]


def _ssd_recomputed(
    module: nn.Module,
    size: torch.Size,
    projected: torch.Tensor,
    mask: torch.Tensor | None,
    autocast: Autocast,
    seen: dict[str, Any],
    dy: torch.Tensor,
) -> dict[str, PerExampleGrad]:
    """The module's own scan function on per-example copies (module docstring), from the ``in_proj``
    output ``projected``; ``size`` (B, T). The scan computes in float32 whatever the mixer's dtype, as in
    the module; the convolution and the scan's products in the call's ``autocast`` state."""
    batch, length = size
    normed = _ssd_keeps(module)["y"][0] == "norm"
    dtype = _dtype(module.A_log)
    heads, head_dim, groups, state = module.num_heads, module.head_dim, module.n_groups, module.ssm_state_size
    leaves = {
        "A_log": per_example_copies(module.A_log, batch),
        "D": per_example_copies(module.D, batch),
        "dt_bias": per_example_copies(module.dt_bias, batch),
        **_conv_leaves(module.conv1d, batch),
    }
    z, xbc, dt = projected.split([module.intermediate_size, module.conv_dim, heads], dim=-1)
    xbc, dt = xbc.to(dtype), dt.to(dtype)  # the gate in the module's dtype
    scan = getattr(sys.modules[type(module).__module__], _SCAN)
    with torch.enable_grad(), replay(autocast):
        xbc = _convolved(module, xbc.transpose(1, 2), leaves, mask)
        x, b, c = xbc.split([module.intermediate_size, groups * state, groups * state], dim=-1)
        y = scan(  # the copies as (B, 1, heads): one parameter per example under the scan's broadcasting
            x.reshape(batch, length, heads, head_dim),
            dt,
            -torch.exp(leaves["A_log"].float())[:, None],
            b.reshape(batch, length, groups, state),
            c.reshape(batch, length, groups, state),
            chunk_size=module.chunk_size,
            D=leaves["D"][:, None],
            dt_bias=leaves["dt_bias"][:, None],
            dt_softplus=True,
            dt_limit=module.time_step_limit,
        ).reshape(batch, length, -1)
        if not normed:
            out = y * F.silu(z)
            _same(module, "out_proj's input", seen["y"][0], out, autocast)
        else:
            recorded, gate = seen["y"]  # the norm's arguments: the scan's output and the gate
            _same(module, "the norm's input", recorded, y, autocast)
            out = module.norm.forward(y.to(recorded.dtype), gate).to(dtype)  # outside the model's hooks
    with torch.enable_grad():
        return _grads(leaves, module.out_proj, out, dy)


_ZAMBA = f"{_HF}.zamba.modeling_zamba.ZambaMambaMixer"
_ZAMBA_OWN = ("A_log", "D", "x_proj_weight", "dt_proj_weight", "dt_proj_bias")


def _check_zamba(module: nn.Module) -> None:
    plain = {"in_proj": nn.Linear, "out_proj": nn.Linear, "conv1d": nn.Conv1d}
    refuse(module, "selective-scan", "mixer", unfollowed(module, set(_ZAMBA_OWN), plain), _FIX)


def _zamba_keeps(module: nn.Module) -> dict[str, tuple[str, str]]:
    return {"P": ("in_proj", "output"), "y": ("out_proj", "input")}


@register_rule(
    _ZAMBA,
    check=_check_zamba,
    call=CallLayout(scan_inputs, first_output, keeps=_zamba_keeps),
    claims=("conv1d",),
)
def zamba_scan_grads(module: nn.Module, call: tuple, dy: torch.Tensor) -> dict[str, PerExampleGrad]:
    """Per-example gradients of Zamba's mixer (Glorioso et al. 2024, "Zamba", sec. 2: Mamba's scan split into
    ``H`` heads of ``P`` channels, each with its own ``x_proj`` and ``dt_proj`` as parameters of the mixer):
    ``A_log`` (H, P, n), ``D`` and ``dt_proj_bias`` (H, P), ``x_proj_weight`` (H, r + 2n, P),
    ``dt_proj_weight`` (H, P, r) and ``conv1d.*``, which it reads. With ``P = in_proj(x)`` whose channels
    alternate between the convolution's input ``p`` and the gate ``z``, per head h:
    ``u = mask * act(conv1d(p))``, ``(s, B, C) = x_proj_weight[h] u_h``, ``delta = softplus(dt_proj_weight[h]
    s + dt_proj_bias[h])``, then Mamba's scan (:func:`_selective_scan`, B and C per head), the heads'
    outputs concatenated into ``out_proj``'s input, recomputed with the copies and checked against it; ``dy``
    (B, T, d_model) the gradient of the mixer's output. Without the rule the exact fallback took 2.2x the
    non-private step and 4.8x its memory (``fallbacks`` suite, entry ``zamba``)."""
    hidden, arguments, autocast, kept = call
    seen = _kept(module, kept, _zamba_keeps(module))
    batch, length = hidden.shape[:2]
    dtype = _dtype(module.A_log)
    heads, head_dim = module.n_mamba_heads, module.mamba_head_dim
    rank, state = module.time_step_rank, module.ssm_state_size
    leaves = {name: per_example_copies(getattr(module, name), batch) for name in _ZAMBA_OWN}
    leaves |= _conv_leaves(module.conv1d, batch)
    projected = seen["P"].transpose(1, 2).reshape(batch, -1, 2, length)  # (B, d, 2, T)
    p, z = projected[:, :, 0].to(dtype), projected[:, :, 1]  # the gate in the module's dtype
    with torch.enable_grad(), replay(autocast):
        u = _convolved(module, p, leaves, arguments.get("attention_mask")).transpose(1, 2)  # (B, d, T)
        heads_u = u.reshape(batch, heads, head_dim, length)
        ssm = torch.einsum("bhkp,bhpt->bhkt", leaves["x_proj_weight"].to(dtype), heads_u)
        s, b, c = ssm.split([rank, state, state], dim=2)  # (B, H, r or n, T)
        delta = torch.einsum("bhpr,bhrt->bhpt", leaves["dt_proj_weight"].to(dtype), s)
        # float32, then delta's dtype (autocast's), as in the module
        delta = delta + leaves["dt_proj_bias"].float().to(delta.dtype)[..., None]
        y = _selective_scan(
            u,
            F.softplus(delta).reshape(batch, -1, length),
            leaves["A_log"].reshape(batch, -1, state),
            leaves["D"].reshape(batch, -1),
            b.transpose(2, 3),
            c.transpose(2, 3),
            z,
        )
        _same(module, "out_proj's input", seen["y"][0], y, autocast)
    with torch.enable_grad():
        return _grads(leaves, module.out_proj, y, dy, rounded=("A_log", "D", "dt_proj_bias"))


@dataclass(frozen=True)
class DeltaForm:
    """Where one form of gated delta net takes its convolution's input and its gates from: the values ``taps``
    names in its call (kept as :class:`~dpexp.privacy.rules.CallLayout`'s ``keeps``), ``inputs(module, seen)``
    -> ``(qkv (B, T, 2 key_dim + value_dim), a (B, T, heads), beta (B, T, heads))``, and the names of its
    gated norm and output projection."""

    taps: dict[str, tuple[str, str]]
    inputs: Callable[[nn.Module, dict[str, Any]], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    norm: str = "norm"
    out: str = "out_proj"


def _fused_qkvz(module: nn.Module, seen: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Qwen3-Next's: q, k, v, z and b, a interleaved per key head, taken apart by the module's own method."""
    batch, length = seen["qkvz"].shape[:2]
    q, k, v, _, b, a = module.fix_query_key_value_ordering(seen["qkvz"], seen["ba"])
    return torch.cat([t.reshape(batch, length, -1) for t in (q, k, v)], dim=-1), a, b.sigmoid()


def _separate(module: nn.Module, seen: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """OLMo-hybrid's: one projection each, ``beta`` doubled where negative eigenvalues are allowed."""
    beta = seen["b"].sigmoid() * (2.0 if module.allow_neg_eigval else 1.0)
    return torch.cat([seen["q"], seen["k"], seen["v"]], dim=-1), seen["a"], beta


DELTA_FORMS = {  # the input projection that tells the form -> the form
    "in_proj_qkv": DeltaForm(
        {"qkv": ("in_proj_qkv", "output"), "a": ("in_proj_a", "output"), "b": ("in_proj_b", "output")},
        lambda _, seen: (seen["qkv"], seen["a"], seen["b"].sigmoid()),
    ),
    "in_proj_qkvz": DeltaForm(
        {"qkvz": ("in_proj_qkvz", "output"), "ba": ("in_proj_ba", "output")}, _fused_qkvz
    ),
    "q_proj": DeltaForm(
        {name: (f"{name}_proj", "output") for name in "qkvab"}, _separate, norm="o_norm", out="o_proj"
    ),
}


def _delta_form(module: nn.Module) -> DeltaForm | None:
    return next((form for name, form in DELTA_FORMS.items() if hasattr(module, name)), None)


def _delta_keeps(module: nn.Module) -> dict[str, tuple[str, str]]:
    form = _delta_form(module)  # None: refused by the check
    return {} if form is None else form.taps | {"norm": (form.norm, "input")}


def _delta_parts(module: nn.Module) -> tuple[str, str] | None:
    form = _delta_form(module)
    return None if form is None else (form.out, form.norm)


def _chunked_nodes(
    module: nn.Module, call: tuple, output: Any, boundary: list, function: str
) -> list[Node] | None:
    """The call's graph (:func:`~dpexp.privacy.rules.graph.call_nodes`) around the modeling file's chunked
    ``function``, which loops over a chunk's positions and over the chunks: the search allows for both."""
    chunk = inspect.signature(getattr(sys.modules[type(module).__module__], function)).parameters[
        "chunk_size"
    ]
    return call_nodes(output, boundary, steps=call[0].shape[1] + chunk.default)


def _conv_graph(
    module: nn.Module, nodes: list[Node] | None, found: dict[str, Node], values: dict[str, torch.Tensor]
) -> GraphReads | None:
    """``found`` and ``values`` with the causal convolution's node, found by the ``conv1d`` weight it keeps
    (``d_conv``: its output gradient is that of ``conv1d``'s own (B, C, T + K - 1) output, before the causal
    cut and the activation), and the input it kept (``x`` (B, C, T), where the weight needs a gradient);
    None where the graph lacks the node."""
    weight = module.conv1d.weight
    if nodes is None:
        return None
    node = kept_as(nodes, "ConvolutionBackward0", "_saved_weight", weight, cast=True)  # autocast's: its copy
    if node is None:
        return None
    x = saved(node, "_saved_input")
    return GraphReads(values | ({} if x is None else {"x": x.detach()}), found | {"d_conv": node})


def _conv_read(module: nn.Module, qkv: torch.Tensor, reads: dict[str, Any]) -> dict[str, PerExampleGrad]:
    """``conv1d.*``'s per-example gradients from the gradient read at its output (:func:`_conv_graph`): the
    depthwise convolution's own rule on the convolution's input ``qkv`` (B, T, C), checked against the one
    the node kept."""
    conv = module.conv1d
    x = _checked(
        module, "the convolution's input", reads, "x", qkv.detach().transpose(1, 2).to(conv.weight.dtype)
    )
    with torch.no_grad():
        return {f"conv1d.{name}": grad for name, grad in conv_grads(conv, x, reads["d_conv"]).items()}


def _decay(module: nn.Module) -> torch.Tensor:
    """``-exp(A_log)`` (heads,) as a delta net computes it, in float32."""
    return -module.A_log.detach().float().exp()


def delta_graph(module: nn.Module, call: tuple, output: Any, boundary: list) -> GraphReads | None:
    """The decay's product ``g = -exp(A_log) * softplus(a + dt_bias)`` (``d_g``), found by the factor
    ``-exp(A_log)`` it keeps (by value), and its other factor (``softplus``, where kept), with the
    convolution's node and input (:func:`_conv_graph`); None where the graph lacks either product."""
    nodes = _chunked_nodes(module, call, output, boundary, _DELTA_RULE)
    decay = _decay(module)
    product = None if nodes is None else product_with(nodes, decay, by_value=True)
    if product is None:
        return None
    softplus = other_operand(product, decay)
    return _conv_graph(module, nodes, {"d_g": product}, {} if softplus is None else {"softplus": softplus})


@register_rule(
    *DELTA_NETS,
    check=_check_calling("gated-delta-rule", {"A_log", "dt_bias"}, _DELTA_RULE, _delta_parts),
    call=CallLayout(scan_inputs, first_output, keeps=_delta_keeps, graph=delta_graph),
    claims=("conv1d",),
)
def delta_rule_grads(module: nn.Module, call: tuple, dy: torch.Tensor) -> dict[str, PerExampleGrad]:
    """Per-example gradients of ``A_log``, ``dt_bias`` and ``conv1d.*`` of a gated delta net (module
    docstring, :data:`DELTA_FORMS`); ``dy`` (B, T, d_model) the gradient of the mixer's output. Where the
    call's graph gave the gradients at the convolution's output and at ``g`` (:func:`delta_graph`), with
    ``s = softplus(a + dt_bias)`` recomputed from the kept ``a`` (checked against the product's factor),

        d A_log_i = -exp(A_log) sum_t dg_{i,t} s_{i,t},    d dt_bias_i = -exp(A_log) sum_t dg_{i,t} s'_{i,t},

    and the convolution's own rule (:func:`_conv_read`): the delta rule, its norm and ``out_proj`` are
    autograd's own (stop 65; they ran again before). Else (autocast, hooks on saved tensors) the module's own
    delta rule on the recomputed convolution and gates with per-example copies. ``A_log`` passes through
    float32 and the gate's input ``a`` is float32, as in the module."""
    hidden, _, autocast, kept = call[:4]  # the convolution's input comes masked
    form = _delta_form(module)
    seen = _kept(module, kept, _delta_keeps(module))
    qkv, a, beta = form.inputs(module, seen)
    if len(call) > 4:
        return _delta_read(module, qkv, a, call[4])
    batch, length = hidden.shape[:2]
    dtype = _dtype(module.A_log)
    leaves = {
        "A_log": per_example_copies(module.A_log, batch),
        "dt_bias": per_example_copies(module.dt_bias, batch),
        **_conv_leaves(module.conv1d, batch),
    }
    rule = getattr(sys.modules[type(module).__module__], _DELTA_RULE)
    recorded, gate = seen["norm"]  # the norm's arguments: the delta rule's output and the gate, per head
    with torch.enable_grad(), replay(autocast):
        qkv = _convolved(module, qkv.to(dtype).transpose(1, 2), leaves, None)
        q, k, v = qkv.split([module.key_dim, module.key_dim, module.value_dim], dim=-1)
        g = -leaves["A_log"].float().exp()[:, None] * F.softplus(a.float() + leaves["dt_bias"][:, None])
        out, _ = rule(
            q.reshape(batch, length, -1, module.head_k_dim),
            k.reshape(batch, length, -1, module.head_k_dim),
            v.reshape(batch, length, -1, module.head_v_dim),
            g=g,
            beta=beta,
            initial_state=None,
            output_final_state=False,
            use_qk_l2norm_in_kernel=True,
        )
        out = out.reshape(-1, module.head_v_dim)
        _same(module, "the norm's input", recorded, out, autocast)
        normed = getattr(module, form.norm).forward(out.to(recorded.dtype), gate).reshape(batch, length, -1)
    with torch.enable_grad():
        return _grads(leaves, getattr(module, form.out), normed.to(dtype), dy)


def _delta_read(
    module: nn.Module, qkv: torch.Tensor, a: torch.Tensor, reads: dict[str, Any]
) -> dict[str, PerExampleGrad]:
    """:func:`delta_rule_grads`' formulas on the gradients read off the graph; ``a`` (B, T, heads). In a
    float64 mixer ``A_log``'s gradient passes through float32 (the module's ``A_log.float()``), and is given
    in float32, what it is accurate to (as :func:`_grads`' ``rounded``)."""
    decay = _decay(module)
    with torch.no_grad():
        pre = a.detach().float() + module.dt_bias.detach()  # the module's promotion
        softplus = _checked(module, "the decay's softplus factor", reads, "softplus", F.softplus(pre))
        d_g = reads["d_g"].to(softplus.dtype)  # (B, T, heads)
        d_log = (d_g * softplus).sum(1).to(decay.dtype) * decay  # through -exp(A_log.float())
        d_pre = softplus_backward(d_g * decay.to(d_g.dtype), pre)  # the module's F.softplus
        grads: dict[str, PerExampleGrad] = {
            "A_log": Dense(d_log if module.A_log.dtype == torch.float64 else d_log.to(module.A_log.dtype)),
            "dt_bias": Dense(d_pre.sum(1).to(module.dt_bias.dtype)),
        }
    return grads | _conv_read(module, qkv, reads)


def _kimi_keeps(module: nn.Module) -> dict[str, tuple[str, str]]:
    taps = {name: (f"{name}_proj", "output") for name in "qkvb"}
    return taps | {"g": ("forget_gate", "output"), "norm": ("o_norm", "input")}


def kimi_graph(module: nn.Module, call: tuple, output: Any, boundary: list) -> GraphReads | None:
    """The convolution's node and input (:func:`_conv_graph`); None where the graph lacks them."""
    return _conv_graph(module, _chunked_nodes(module, call, output, boundary, _KIMI_RULE), {}, {})


@register_rule(
    *_KDA,
    check=_check_calling("kimi-delta-attention", set(), _KIMI_RULE, lambda _: ("o_proj", "o_norm")),
    call=CallLayout(scan_inputs, first_output, keeps=_kimi_keeps, graph=kimi_graph),
    claims=("conv1d",),
)
def kimi_delta_grads(module: nn.Module, call: tuple, dy: torch.Tensor) -> dict[str, PerExampleGrad]:
    """Per-example gradients of ``conv1d.*`` of Kimi Linear's delta attention; ``dy`` (B, T, d_model) the
    gradient of its output. Where the call's graph gave the gradient at the convolution's output
    (:func:`kimi_graph`), the depthwise convolution's own rule on it and on the projections' kept outputs (the
    delta rule, its gated norm and ``o_proj`` are autograd's own, nothing runs again: stop 65, 598 of a
    2,580 ms ``kimi_linear`` step before); else (autocast, hooks on saved tensors) the convolution recomputed
    with the copies, then the module's own ``chunk_kimi_delta_attention`` with the forget gate's and
    ``b_proj``'s recorded outputs (layers of their own, constants here), its gated norm and ``o_proj``."""
    hidden, _, autocast, kept = call[:4]  # the convolution's input comes masked
    seen = _kept(module, kept, _kimi_keeps(module))
    batch, length = hidden.shape[:2]
    dtype = _dtype(module.conv1d.weight)
    qkv = torch.cat([seen["q"], seen["k"], seen["v"]], dim=-1).to(dtype)
    if len(call) > 4:
        return _conv_read(module, qkv, call[4])
    leaves = _conv_leaves(module.conv1d, batch)
    attend = getattr(sys.modules[type(module).__module__], _KIMI_RULE)
    recorded, gate = seen["norm"]  # the norm's arguments: the attention's output and the gate, per head
    with torch.enable_grad(), replay(autocast):
        qkv = _convolved(module, qkv.transpose(1, 2), leaves, None)
        q, k, v = (t.reshape(batch, length, -1, module.head_dim) for t in qkv.split(module.qkv_dim, dim=-1))
        out, _ = attend(
            q,
            k,
            v,
            g=seen["g"],
            beta=seen["b"].sigmoid(),
            initial_state=None,
            output_final_state=False,
            use_qk_l2norm_in_kernel=True,
        )
        _same(module, "the norm's input", recorded, out, autocast)
        normed = module.o_norm.forward(out.to(recorded.dtype), gate).reshape(batch, length, -1)
    with torch.enable_grad():
        return _grads(leaves, module.o_proj, normed.to(dtype), dy)


def _same(
    module: nn.Module,
    what: str,
    recorded: torch.Tensor,
    recomputed: torch.Tensor,
    autocast: Autocast | None = None,
) -> None:
    """:func:`~dpexp.privacy.rules.submodule_values.reproduced` to float32's precision at best: the modules
    round ``A``, ``D``, ``B`` and ``u`` (Falcon-Mamba's norms also ``s``, ``B``, ``C``; Mamba-2's scan all of
    it) to float32 whatever their dtype, and a recomputation equal to float64's rounding may round them the
    other way. Under ``autocast`` to its dtype's: a float32 value formed from its products (a sum of them
    in another order) may differ by their rounding."""
    coarse = torch.float32 if recorded.dtype == torch.float64 else recorded.dtype
    if autocast is not None and autocast.dtype is not None:
        coarse = autocast.dtype
    reproduced(module, what, recorded.to(coarse), recomputed.to(coarse), _FIX)
