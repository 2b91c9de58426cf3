"""Per-layer gradient rules, registered by module type.

A rule maps one call of a layer, given its input activation ``x`` (captured in the forward pass) and the
gradient ``dy`` of the loss with respect to its output (captured in the backward pass), to the per-example
gradients of the layer's own parameters, in factored form (:mod:`dpexp.privacy.per_example`). Norms, cross
terms of shared parameters and clipped sums are then the same code for every layer type.

Lookup is by exact type: a subclass that changes ``forward`` (such as a weight-standardised convolution)
must never silently inherit its parent's rule. Users register rules for their own layers with
:func:`register_rule`. Third-party layer types (transformers' ``Conv1D``, timm's ``LayerNorm``) are
registered by their qualified name, so that importing dpexp does not import those libraries. A rule
registered with ``copies=True`` also covers the classes that are copies of its types (the same bases and
class body but for ``__init__``, :mod:`dpexp.privacy.rules.copies`), as Hugging Face copies one RMSNorm into
140 model files.

A module without a rule whose forward reads a submodule's parameters directly, instead of calling it (the
state-space and linear-attention mixers' ``causal_conv1d_fn(x, self.conv1d.weight.squeeze(1), ...)``), is
declared with :func:`register_reads`: the exact fallback then takes those parameters with its own.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dpexp.privacy.per_example import PerExampleGrad
from dpexp.privacy.rules.copies import configures, is_copy
from dpexp.privacy.rules.graph import GraphReads

GradFn = Callable[..., dict[str, PerExampleGrad]]  # (module, x, dy) -> grads; ``output=`` if it keeps one
CheckFn = Callable[[nn.Module], None]
KeepFn = Callable[[nn.Module, torch.Tensor, torch.Tensor], bool]


@dataclass(frozen=True)
class CallLayout:
    """How the capture records a call of a module that takes several tensors and returns several
    (``nn.LSTM``: ``(output, (h_n, c_n))``; ``nn.MultiheadAttention``: ``(attn_output, attn_weights)``).

    ``inputs(module, args, kwargs)`` refuses (``ValueError``) a call the rule cannot recompute exactly and
    returns the call as a tuple whose entry 0 is the main input: tensors as batch-first views, and whatever
    else the rule needs. Which dimension is the batch comes from the module's configuration (its
    ``batch_first``), never from sizes; the probe establishes it (:mod:`dpexp.privacy.verification`). The
    rule's ``per_example_grads`` receives this tuple as ``x``.

    ``output_grad(module, grads)`` packs the gradients of all the module's outputs into one batch-first
    tensor (B, N), the ``dy`` the engine checks and the rule receives. ``grads`` follows the outputs
    flattened in order (nested tuples unpacked): a tensor output that does not reach the loss has gradient
    zero, an output that is not a tensor (``attn_weights=None``) None.

    ``rows``: the entries of that tuple whose dim 0 is the main input's rows, row for row (a mixture of
    experts' ``top_k_index`` and ``top_k_weights`` go with its flattened tokens). For a ``position_wise``
    rule whose main input arrives flattened to (b*T, ...), the engine folds these entries to (b, T, ...)
    with it, on the strength of the same probe (:class:`LayerRule`); the layout refuses a call whose
    entries do not share the main input's leading size.

    ``output``: the tuple gains the call's output (a tensor, detached), against which a rule that recomputes
    the module checks itself (the forget gates of :mod:`dpexp.privacy.rules.forget_gate`); the engine
    refuses the call if it changes in place before its backward.

    ``keeps(module)`` names values of the module's submodules the rule needs from the call itself
    (key -> (submodule name, "input" or "output"); an input is the submodule's argument tuple): the capture
    keeps what they receive or return during the module's training call, and the tuple gains a last entry,
    ``{key: [value of each call of that submodule in this call]}``. A rule that recomputes part of a module
    from them (:mod:`dpexp.privacy.rules.scan_mixers`) then needs no second run of the module.

    ``graph(module, inputs, output, boundary)`` may read what the rule would otherwise recompute off the
    autograd graph the call built between its input tensors ``boundary`` and its ``output``
    (:mod:`dpexp.privacy.rules.graph`): values at the call, and the nodes whose output gradients the rule
    needs (``nn.MultiheadAttention``'s input projections). The capture then hands the call to the engine
    when the last of those gradients arrives, after the outputs' in the same backward pass (with no nodes,
    with the outputs'), and the tuple gains a last entry ``{**values, key: each node's gradient}``; the
    engine refuses a backward after which a call still waits for one. None: the graph lacks the structure,
    and the rule gets the tuple as it is. What autograd keeps depends on what needs a gradient: from the
    second step on the engine's parameters do not (it forms their gradients itself), so a value a node keeps
    only for a parameter's gradient is there at the first step alone.
    """

    inputs: Callable[[nn.Module, tuple, dict[str, Any]], tuple]
    output_grad: Callable[[nn.Module, list[torch.Tensor | None]], torch.Tensor]
    rows: tuple[int, ...] = (0,)
    output: bool = False
    keeps: Callable[[nn.Module], dict[str, tuple[str, str]]] | None = None
    graph: Callable[[nn.Module, tuple, Any, list[torch.Tensor]], GraphReads | None] | None = None


@dataclass(frozen=True)
class LayerRule:
    """``per_example_grads(module, x, dy) -> {param_name: PerExampleGrad}`` plus a construction-time check.

    ``x`` is the module's input and ``dy`` the gradient of the loss with respect to its output. A rule with a
    ``tap`` instead reads the input of the submodule of that name and the gradient with respect to that input:
    for parameters that enter the computation inside a larger module's forward (a Vision Transformer's class
    token and position embedding are added just before its ``pos_drop``); with ``tap_output``, the output of
    that submodule and the gradient with respect to it (DeBERTa's query and value biases are added just after
    its ``in_proj``). A rule with a ``call`` layout
    covers modules with several inputs and outputs (:class:`CallLayout`). ``claims`` names submodules whose
    parameters the rule covers as its own (keys ``"out_proj.weight"``): ``nn.MultiheadAttention`` reads its
    ``out_proj``'s weight and bias without calling it; a function of the module names them where they depend
    on its configuration (Switch Transformers' one module per expert).

    A ``position_wise`` rule treats every axis between the example axis and the feature axis as a position
    (:func:`as_sequence`): the layer acts on each position alone, so an input flattened to (B*T, ..., F) with
    example i's positions in rows [i*T, (i+1)*T) is folded back to (B, T, ..., F) before the rule runs. The
    engine's probe establishes that layout; it is never inferred from the sizes alone.

    ``private_output``: the module returns the result of one operation, or a view of it, which nothing else
    holds (``F.linear``: the output of a 3-D input is a view of its matmul). The capture then hooks that
    result, whose gradient still arrives when the caller changes the returned view in place: autograd drops
    a hook on a view modified in place (Longformer's ``query /= sqrt(head_dim)``).

    A rule with ``keep_output`` is asked in the forward pass, with ``(module, x, output)``, whether to keep
    the layer's output until its backward; its ``per_example_grads`` then takes ``output=``: the tensor the
    layer returned, or None where it was not kept or was modified in place since (the rule then recomputes
    what it needs). The weight-standardised convolution reads ``<a_t, w_hat_r>`` off its output this way.
    """

    per_example_grads: GradFn
    check: CheckFn | None = None
    expand_broadcast_input: bool = False  # inputs of batch size 1 are expanded to the batch (position ids)
    tap: str | tuple[str, ...] | None = None  # several: each called once per call; the rule gets (x, k)
    position_wise: bool = False  # a flattened (B*T, ...) input may be folded to (B, T, ...)
    call: CallLayout | None = None
    claims: tuple[str, ...] | Callable[[nn.Module], tuple[str, ...]] = ()
    numbered_tap: bool = False  # the tap is called several times per module call; the rule gets (x, k)
    keep_output: KeepFn | None = None
    tap_output: bool = False  # the tap's output and its gradient, instead of its input's
    private_output: bool = False  # the output is one operation's result or a view of it (hooked there)

    def claimed(self, module: nn.Module) -> tuple[str, ...]:
        """The submodules of ``module`` whose parameters the rule covers (``claims``, or what it says of
        ``module``: the experts of a module holding one per expert)."""
        return self.claims(module) if callable(self.claims) else self.claims

    @property
    def taps(self) -> tuple[str, ...]:
        """The names of the tapped submodules (none, ``tap``, or each of a tuple)."""
        return () if self.tap is None else (self.tap,) if isinstance(self.tap, str) else self.tap

    @property
    def numbered(self) -> bool:
        """Whether the rule gets ``(x, k)``: the k-th call of a numbered tap, or the k-th of several taps."""
        return self.numbered_tap or len(self.taps) > 1


_RULES: dict[str, LayerRule] = {}
_READS: dict[str, tuple[str, ...]] = {}  # qualified type of a rule-less module -> submodules it reads
_ORIGINALS: list[str] = []  # registered types whose copies take their rule (``copies=True``)
_RULES_OF_COPIES: dict[type, LayerRule | None] = {}  # a class without a rule of its own -> its original's


def first_output(module: nn.Module, grads: list[torch.Tensor | None]) -> torch.Tensor:
    """A :class:`CallLayout`'s ``output_grad`` where the first output is the only one that reaches the loss
    as a tensor (the others, if any, are None or integers: data2vec-vision's patch grid size, Hiera's MAE
    mask and restore ids): its gradient."""
    return grads[0]


def forward_arguments(module: nn.Module, args: tuple, kwargs: dict[str, Any], defaults: bool = False) -> dict:
    """The call's arguments by name as the module's class ``forward`` binds them (``self`` left out, the
    signature of the class's method: a wrapper set on the instance does not change it); ``defaults`` fills
    in the ones not given."""
    bound = inspect.signature(type(module).forward).bind(module, *args, **kwargs)
    if defaults:
        bound.apply_defaults()
    return dict(list(bound.arguments.items())[1:])


def given_cache(arguments: dict[str, Any]) -> bool:
    """Whether a call (:func:`forward_arguments`) was given a key/value or recurrent cache, which a rule that
    runs the module again would extend, or whose state a rule's recomputation does not start from."""
    return any(arguments.get(name) is not None for name in ("cache", "past_key_values"))


def per_example_copies(param: torch.Tensor, batch: int) -> torch.Tensor:
    """One copy of ``param`` per example, (B, *param.shape), a leaf that requires grad: a rule that computes a
    module again with copy i in example i's output gets every example's gradient in one backward."""
    return param.detach().unsqueeze(0).repeat(batch, *([1] * param.dim())).requires_grad_(True)


def unknown_parameters(module: nn.Module, known: set[str]) -> str | None:
    """A ``check``'s reason to refuse ``module`` when it owns trainable parameters outside ``known`` (the
    ones its rule gives gradients for), else None."""
    own = {name for name, p in module.named_parameters(recurse=False) if p.requires_grad}
    return f"it owns parameters {sorted(own - known)} the rule does not know" if own - known else None


def refuse(module: nn.Module, rule: str, kind: str, reason: str | None, fix: str) -> None:
    """A rule's ``check``: the one-line refusal of a ``module`` the ``rule`` cannot handle, when ``reason``
    (why not) is set; ``fix`` says what to do instead."""
    if reason is not None:
        raise ValueError(
            f"{type(module).__name__}: the privacy engine's {rule} rule cannot handle this {kind}: "
            f"{reason}. {fix}"
        )


def qualified_name(module_type: type) -> str:
    return f"{module_type.__module__}.{module_type.__qualname__}"


def register_rule(
    *module_types: type[nn.Module] | str,
    check: CheckFn | None = None,
    expand_broadcast_input: bool = False,
    tap: str | tuple[str, ...] | None = None,
    position_wise: bool = False,
    call: CallLayout | None = None,
    claims: tuple[str, ...] | Callable[[nn.Module], tuple[str, ...]] = (),
    numbered_tap: bool = False,
    keep_output: KeepFn | None = None,
    copies: bool = False,
    tap_output: bool = False,
    private_output: bool = False,
) -> Callable[[GradFn], GradFn]:
    """Decorator registering ``fn`` as the per-example gradient rule of ``module_types`` (classes, or
    qualified class names such as ``"transformers.pytorch_utils.Conv1D"``); see :class:`LayerRule`.
    ``copies``: classes that are copies of these types (:func:`dpexp.privacy.rules.copies.is_copy`) take
    the rule too."""

    if keep_output is not None and (tap or call or position_wise):
        raise ValueError("keep_output is for rules of a module's own input and output (no tap, call, fold)")
    if tap_output and (not isinstance(tap, str) or numbered_tap):
        raise ValueError("tap_output reads the output of a tap called once per module call: name the tap")

    def decorate(fn: GradFn) -> GradFn:
        for module_type in module_types:
            key = module_type if isinstance(module_type, str) else qualified_name(module_type)
            _RULES[key] = LayerRule(
                fn,
                check,
                expand_broadcast_input,
                tap,
                position_wise,
                call,
                claims,
                numbered_tap,
                keep_output,
                tap_output,
                private_output,
            )
            if copies:
                _ORIGINALS.append(key)
        _RULES_OF_COPIES.clear()
        return fn

    return decorate


def register_reads(module_type: type[nn.Module] | str, *submodules: str) -> None:
    """Declare that the forward of every module of ``module_type`` (a class or its qualified name), which has
    no rule, reads the parameters of its ``submodules`` itself, e.g. ``F.conv1d(x, self.conv1d.weight)``.
    The exact fallback then differentiates the module's forward with respect to those parameters too (keys
    ``"conv1d.weight"``), and the submodules are no layers of their own: every use of their parameters
    inside the module's calls is covered, a call of them as modules included. A use anywhere else is not,
    and verification refuses it (the per-example gradients would not add up to the gradient)."""
    key = module_type if isinstance(module_type, str) else qualified_name(module_type)
    _READS[key] = (*_READS.get(key, ()), *submodules)


def reads_for(module: nn.Module) -> tuple[str, ...]:
    """The submodules whose parameters ``module``'s forward is declared to read (:func:`register_reads`)."""
    return _READS.get(qualified_name(type(module)), ())


def rule_for(module: nn.Module) -> LayerRule | None:
    """:func:`rule_for_type` of ``type(module)``."""
    return rule_for_type(type(module))


def rule_for_type(cls: type) -> LayerRule | None:
    """The rule registered for exactly ``cls``, or for its parent where it only configures it
    (:func:`~dpexp.privacy.rules.copies.configures`), or for a type registered with ``copies=True`` that
    ``cls`` is a copy of, or None."""
    rule = _RULES.get(qualified_name(cls))
    if rule is None:
        if cls not in _RULES_OF_COPIES:
            _RULES_OF_COPIES[cls] = _rule_of_original(cls)
        rule = _RULES_OF_COPIES[cls]
    return rule


def _rule_of_original(cls: type) -> LayerRule | None:
    """The rule of the parent ``cls`` configures, or of the first original ``cls`` is a copy of; originals are
    looked up in ``cls``'s own library only (its modules are imported already or cheaply), never imported
    from another."""
    if len(cls.__bases__) == 1 and configures(cls, cls.__bases__[0]):
        parent = rule_for_type(cls.__bases__[0])
        if parent is not None:
            return parent
    library = cls.__module__.split(".")[0]
    for key in _ORIGINALS:
        module_name, _, name = key.rpartition(".")
        if module_name.split(".")[0] != library:
            continue
        try:
            original = getattr(importlib.import_module(module_name), name)
        except (ImportError, AttributeError):  # not in this version of the library
            continue
        if is_copy(cls, original):
            return _RULES[key]
    return None


def supported_types() -> list[str]:
    return sorted(name.rsplit(".", 1)[-1] for name in _RULES)


def as_sequence(x: torch.Tensor) -> torch.Tensor:
    """(B, ..., F) -> (B, T, F): every position between the batch and feature axes is a 'time step'."""
    return x.reshape(x.shape[0], -1, x.shape[-1])


# Importing the rule modules registers them.
from dpexp.privacy.rules import (  # noqa: E402,F401
    activation,
    attention,
    attention_gate,
    beit_attention,
    bilinear,
    compressor,
    conv,
    dbrx_moe,
    differential,
    dynamic_mask,
    embedding,
    embedding_bag,
    expert_modules,
    forget_gate,
    funnel_attention,
    grn,
    grouped_linear,
    hyper_connections,
    inkling_moe,
    layer_scale,
    linear,
    moe,
    ngpt,
    norm,
    norm_act,
    projection_bias,
    reads,
    recurrent,
    relative_logits,
    residual_scale,
    rg_lru,
    rms_norm,
    rwkv,
    scaled_linear,
    scan_mixers,
    shifted_window,
    short_conv,
    sinks,
    vision_tokens,
    window_attention,
    ws_conv,
)
