"""What the engine captures of a model: its layers, and every call of them in a training forward.

A *layer* is a module that owns trainable parameters, with the rule that turns one call of it into
per-example gradients (:mod:`dpexp.privacy.rules`; None: the exact ``torch.func`` fallback). :class:`Capture`
hooks the model: each call of a layer in a forward with gradients enabled becomes a :class:`Use` (its input,
and the versions of its input tensors, so that an in-place change is caught), and in backward the gradient
of the loss with respect to the layer's output is handed, with the use, to the engine (for a layer with
several inputs and outputs, such as ``nn.LSTM``, as its rule's :class:`~dpexp.privacy.rules.CallLayout`
presents them: the gradients of all its outputs at once, batch-first; for a layer without a rule that returns
a tuple, the gradients of all its floating-point outputs, as a tuple). What the engine
assumes of these tensors (dim 0 is the example, every use is seen) is established by
:mod:`dpexp.privacy.verification`.
"""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from dpexp.privacy.broadcast import BroadcastExpander
from dpexp.privacy.containers import tensors_in
from dpexp.privacy.grouping import ParameterLayout
from dpexp.privacy.layout import BATCH_FIRST, Layout
from dpexp.privacy.per_example import PerExampleGrad
from dpexp.privacy.rules import CallLayout, LayerRule, reads_for, rule_for, supported_types
from dpexp.privacy.rules.functional import (
    attributes_at_call,
    check_deterministic,
    functional_per_example_grads,
    shared_per_example_grads,
    tensor_outputs,
)
from dpexp.privacy.shared import SharedTensor, follow, plain, share, shared_modules, shared_weights


@dataclass
class Layer:
    """A module owning trainable parameters, with its rule (None: the exact torch.func fallback, or for a
    shared layer one batched vector-Jacobian product through its recomputed forward)."""

    name: str
    module: nn.Module
    rule: LayerRule | None
    params: dict[str, str]  # attribute name in the module ('weight') -> model parameter name
    shared: bool = False  # its output is shared by all examples (dpexp.privacy.shared)


def discover_layers(model: nn.Module, generic_fallback: bool) -> tuple[list[Layer], dict[str, nn.Parameter]]:
    """Every module that owns trainable parameters, with its rule; the trainable parameters by name.

    Refuses BatchNorm anywhere (its batch statistics mix examples, even with frozen parameters) and a module
    without a rule when ``generic_fallback`` is off. The parameters of submodules a rule claims
    (``LayerRule.claims``), or that a module without a rule is declared to read (:func:`reads_for`), are its
    layer's, under ``"submodule.attr"``; those submodules are no layers. A parameter registered in a module
    and again in one of its submodules belongs to the innermost one (:func:`_registered_below`).
    """
    names = {id(p): n for n, p in model.named_parameters() if p.requires_grad}
    below = _registered_below(model)
    shared = shared_modules(model)
    layers: list[Layer] = []
    claimed: set[int] = set()  # submodules whose parameters a parent's rule covers (LayerRule.claims)
    for mod_name, module in model.named_modules():
        if isinstance(module, _BatchNorm):
            raise ValueError(
                f"module {mod_name!r} ({type(module).__name__}) mixes examples in a batch, which breaks "
                "per-example privacy; replace it with GroupNorm or LayerNorm."
            )
        if id(module) in claimed:
            continue
        rule = rule_for(module)
        parts = _parts(mod_name, module, rule)
        claimed.update(id(part) for sub, part in parts.items() if sub)
        own = {key: names[id(p)] for key, p in _layer_params(parts, below).items()}
        if not own:
            continue
        fallback = rule is None and id(module) not in shared  # a shared one: shared_per_example_grads
        if fallback and not generic_fallback:
            raise ValueError(
                f"module {mod_name!r} of type {type(module).__name__} has trainable parameters "
                f"{sorted(own)} but no per-example gradient rule. Supported types: {supported_types()}. "
                "Freeze its parameters, replace the module, or register a rule with "
                "dpexp.privacy.rules.register_rule."
            )
        if rule is None:
            check_deterministic(mod_name, module)  # its forward is recomputed
        if fallback:
            warnings.warn(
                f"module {mod_name!r} ({type(module).__name__}) has no per-example gradient rule; its "
                f"parameters {sorted(own)} use the exact but slower torch.func fallback.",
                stacklevel=3,
            )
        if rule is not None and rule.check is not None:
            rule.check(module)
        if id(module) in shared and rule is not None and rule.tap is not None:
            raise ValueError(
                f"module {mod_name!r} ({type(module).__name__}) produces a tensor shared by all examples; "
                "the privacy engine splits its gradient per example only at its own output, but its rule "
                "taps a submodule. Freeze its parameters or register a rule on its output."
            )
        layers.append(Layer(mod_name, module, rule, own, id(module) in shared))
    params = {n: p for n, p in model.named_parameters() if id(p) in names}
    if not params:
        raise ValueError("the model has no trainable parameters")
    return layers, params


def _parts(name: str, module: nn.Module, rule: LayerRule | None) -> dict[str, nn.Module]:
    """``module`` under ``""`` and the submodules whose parameters its layer covers, by name: those its rule
    claims, or without a rule those its forward is declared to read."""
    reads = reads_for(module)
    if rule is not None and reads:
        raise ValueError(
            f"module {name!r} ({type(module).__name__}) has a rule and is also declared to read the "
            f"parameters of {list(reads)} (register_reads): a rule covers its own submodules "
            "through LayerRule.claims; remove one of the two."
        )
    subs = rule.claimed(module) if rule is not None else reads
    return {"": module, **{sub: module.get_submodule(sub) for sub in subs}}


def _layer_params(parts: dict[str, nn.Module], below: Mapping[int, set[int]]) -> dict[str, nn.Parameter]:
    """The trainable parameters of a layer's ``parts`` (:func:`_parts`) by their key in the layer: ``attr``
    for the module's own, ``"submodule.attr"`` for a claimed or read submodule's."""
    return {
        f"{sub}.{attr}" if sub else attr: p
        for sub, part in parts.items()
        for attr, p in _own_trainable(part, below).items()
    }


def _registered_below(model: nn.Module) -> dict[int, set[int]]:
    """``id`` of each module -> ``id`` of the parameters registered directly in any of its strict submodules.

    A parameter registered twice on one path, as Hugging Face's masked-LM heads tie ``decoder.bias`` to the
    head's own ``bias``, is used by the outer module through the inner one's call, which the inner one's hook
    sees: the outer module does not own it too (its fallback would count that use twice). An outer use of its
    own, outside the inner call, is unseen, and verification (check 2) refuses it.
    """
    below: dict[int, set[int]] = {}

    def visit(module: nn.Module) -> set[int]:
        if id(module) not in below:
            below[id(module)] = set()  # a module reached again through a cycle adds nothing more
            inner: set[int] = set()
            for child in module.children():
                inner |= visit(child)
            below[id(module)] = inner
        return below[id(module)] | {id(p) for p in module.parameters(recurse=False)}

    visit(model)
    return below


def _own_trainable(module: nn.Module, below: Mapping[int, set[int]]) -> dict[str, nn.Parameter]:
    """The trainable parameters ``module`` registers itself and no submodule registers again (``below``:
    :func:`_registered_below`), by attribute name."""
    return {
        attr: p
        for attr, p in module.named_parameters(recurse=False)
        if p.requires_grad and id(p) not in below[id(module)]
    }


def parameter_layout(layers: Sequence[Layer], params: Mapping[str, nn.Parameter]) -> ParameterLayout:
    """What :func:`dpexp.privacy.grouping.partition` needs of :func:`discover_layers`' result: the trainable
    parameters in model order, their sizes and the layers that use each."""
    owners = {n: [layer.name for layer in layers if n in layer.params.values()] for n in params}
    return ParameterLayout(list(params), {n: p.numel() for n, p in params.items()}, owners)


def unsupported_modules(model: nn.Module) -> dict[str, list[str]]:
    """Module types owning trainable parameters that no rule covers (they take the fallback, or are refused
    without it): ``{qualified type name: sorted parameter attribute names}``, every offending type at once."""
    found: dict[str, set[str]] = {}
    parts = {name: _parts(name, module, rule_for(module)) for name, module in model.named_modules()}
    claimed = shared_modules(model) | {  # a shared layer needs no rule (dpexp.privacy.shared)
        id(part) for subs in parts.values() for sub, part in subs.items() if sub
    }
    below = _registered_below(model)
    for name, module in model.named_modules():
        own = list(_layer_params(parts[name], below))
        if own and rule_for(module) is None and id(module) not in claimed:
            kind = f"{type(module).__module__}.{type(module).__qualname__}"
            found.setdefault(kind, set()).update(own)
    return {kind: sorted(names) for kind, names in sorted(found.items())}


def _versions(args: tuple, kwargs: dict[str, Any]) -> list[int]:
    return [t._version for t in (*args, *kwargs.values()) if torch.is_tensor(t)]


@dataclass
class Use:
    """One call of a layer in the current forward pass: its inputs and their versions at call time."""

    layer: Layer
    args: tuple
    kwargs: dict[str, Any]
    versions: list[int]
    # kept for the torch.func fallback (a tuple: the tensors of a tuple output) and rules with ``keep_output``
    output: torch.Tensor | tuple[torch.Tensor, ...] | None = None
    output_version: int | tuple[int, ...] = 0
    # a rule-less layer's plain attributes that were tensors or None at its call (recomputed so)
    state: dict[str, Any] = field(default_factory=dict)

    def kept_output(self) -> torch.Tensor | tuple[torch.Tensor, ...] | None:
        """The layer's output if it was kept and is unchanged since the call, else None."""
        if isinstance(self.output, tuple):
            unchanged = tuple(t._version for t in self.output) == self.output_version
        else:
            unchanged = self.output is not None and self.output._version == self.output_version
        return self.output if unchanged else None

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (*self.args, *self.kwargs.values()) if torch.is_tensor(t)]

    def release(self) -> None:
        """Last pass over this use: drop the activation with the layer's gradient."""
        self.args, self.kwargs, self.output, self.state = (), {}, None, {}


@dataclass
class Forward:
    """What one or more training forwards recorded before the next backward."""

    uses: list[Use] = field(default_factory=list)
    model_calls: int = 0  # forwards of the engine's model (not just of its layers)
    # (layer name, its outputs' gradient while it waits for the nodes its rule reads) of each use whose rule
    # reads the call's graph: empty again once the nodes' gradients have come (:meth:`unread`)
    reading: list[tuple[str, list[torch.Tensor]]] = field(default_factory=list)

    def unread(self) -> list[str]:
        """After a backward: the layers whose outputs got their gradient but some node their rule reads
        did not, so their gradients were never formed (the graph reads do not hold)."""
        return sorted({name for name, waiting in self.reading if waiting})

    @property
    def path(self) -> tuple:
        """(layer, input ranks) of every use in call order: the sequence a verification covers. A layer
        without a rule counts its floating-point inputs only: its fallback covers every use of its parameters
        inside the call and establishes which inputs carry the example at every call, so an integer mask
        passed or not (Hugging Face passes None where no example is padded) is the same path."""
        return tuple(
            (
                use.layer.name,
                tuple(t.dim() for t in use.tensors if use.layer.rule is not None or t.is_floating_point()),
            )
            for use in self.uses
        )

    @property
    def calls(self) -> Counter[str]:
        """How many times each layer was called."""
        return Counter(use.layer.name for use in self.uses)


class _Anchor(torch.autograd.Function):
    """Makes the output of an input layer (whose input and parameters need no gradient) require one, so
    that backpropagation still reaches the layer and its output-gradient hook fires; and the main input of
    a layer whose rule reads its call's graph, so that the call builds one
    (:meth:`Capture._anchoring_input`)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None]:
        return None, None


class _Outputs(torch.autograd.Function):
    """Passes a layer's tensor outputs through; its backward receives the gradients of all of them at once
    (zeros for an output that does not reach the loss) and hands them to ``on_grads``. The anchor makes the
    outputs require a gradient when nothing else does (as :class:`_Anchor`)."""

    @staticmethod
    def forward(ctx: Any, on_grads: Callable, anchor: torch.Tensor, *outputs: torch.Tensor) -> tuple:
        ctx.on_grads = on_grads
        return tuple(o.clone() for o in outputs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        ctx.on_grads(grads)
        return (None, None, *grads)


def _leaves(value: Any) -> list:
    """The leaves of nested tuples, in order (``(out, (h, c))`` -> ``[out, h, c]``)."""
    return [leaf for v in value for leaf in _leaves(v)] if isinstance(value, tuple) else [value]


def _floating(leaf: Any) -> bool:
    return torch.is_tensor(leaf) and leaf.is_floating_point()


def _aligned(floating: list[bool], grads: tuple[torch.Tensor, ...]) -> list[torch.Tensor | None]:
    """The gradients of an output's floating-point leaves, in order, placed among all its leaves (which of
    them are floating point: ``floating``); None at the others (an integer tensor, a None)."""
    grads_iter = iter(grads)
    return [next(grads_iter) if is_floating else None for is_floating in floating]


def _rebuild(value: Any, leaves: Any) -> Any:
    """``value``'s nesting filled with the next items of the iterator ``leaves``."""
    return tuple(_rebuild(v, leaves) for v in value) if isinstance(value, tuple) else next(leaves)


class Capture:
    """Hooks on a model that record every call of its layers in a training forward and hand each call's
    output gradient to ``deliver(use, dy)`` in backward.

    ``on_model_call(args, kwargs)`` runs at the start of every training forward of the model itself (it may
    return replaced arguments) and ``after_model_call(output)`` at its end. Forwards without gradients, and
    the fallback's recomputation of a layer (:meth:`per_example_grads`), are not recorded; a replayed forward
    (:meth:`replaying`) hands its uses to a callback instead.
    """

    def __init__(
        self,
        model: nn.Module,
        layers: list[Layer],
        deliver: Callable[[Use, torch.Tensor | tuple[torch.Tensor, ...]], None],
        on_model_call: Callable[[tuple, dict[str, Any]], tuple | None],
        after_model_call: Callable[[Any], None],
    ) -> None:
        self.forward = Forward()
        self._deliver, self._on_model_call, self._after_model_call = deliver, on_model_call, after_model_call
        self._recomputing = False
        self._replayed: Callable[[Use], None] | None = None  # set while a forward is replayed
        self._anchor = torch.zeros((), requires_grad=True)
        self._tap_calls: dict[int, int] = {}  # id(module) of a numbered-tap layer -> tap calls in its call
        self._batched_leaves: dict[tuple, set[int]] = {}  # the fallback's established choices (``known``)
        expanded = [
            ly.module
            for ly in layers
            if ly.rule is not None and ly.rule.expand_broadcast_input and not ly.shared
        ]
        self._handles: list[Any] = [
            BroadcastExpander(model, expanded, active=lambda: not self._recomputing),
            model.register_forward_pre_hook(self._model_called, with_kwargs=True),
            model.register_forward_hook(self._model_returned),
        ]
        by_module = {id(layer.module): layer for layer in layers}
        for owner, table in shared_weights(model):  # the weight becomes shared where the owner passes it
            hook = partial(self._shared_weight_passed, by_module.get(id(table)), table.weight)
            self._handles += [m.register_forward_pre_hook(hook, with_kwargs=True) for m in owner.modules()]
        self._kept: dict[int, dict[str, list[Any]]] = {}  # id(module) -> its keeps' values in its call
        self._states: dict[int, dict[str, Any]] = {}  # id(rule-less module) -> its attributes at its call
        self._handles += [
            layer.module.register_forward_pre_hook(partial(self._state_at_call, layer))
            for layer in layers
            if layer.rule is None and not layer.shared
        ]
        for layer in layers:
            keeps = layer.rule.call.keeps if layer.rule is not None and layer.rule.call is not None else None
            if keeps is not None:
                self._handles += self._keeping(layer.module, keeps(layer.module))
            if layer.rule is not None and layer.rule.call is not None and layer.rule.call.graph is not None:
                hook = partial(self._anchoring_input, layer)
                self._handles.append(layer.module.register_forward_pre_hook(hook, with_kwargs=True))
            tap = layer.rule.tap if layer.rule is not None else None
            if tap is None:
                # first of the module's hooks: the others (Hugging Face's output recorders) and the caller
                # see the outputs as passed through the engine, so every use of them is captured
                self._handles.append(
                    layer.module.register_forward_hook(
                        partial(self._layer_called, layer), with_kwargs=True, prepend=True
                    )
                )
            elif layer.rule.tap_output:
                tapped = layer.module.get_submodule(tap)
                self._handles.append(tapped.register_forward_hook(partial(self._tapped_output, layer)))
            else:
                self._handles += self._tapping(layer)

    def _anchoring_input(
        self, layer: Layer, module: nn.Module, args: tuple, kwargs: dict[str, Any]
    ) -> tuple[tuple, dict[str, Any]] | None:
        """The main input (the layout's entry 0, found among the arguments as itself) of a layer whose rule
        reads its call's graph, anchored where it needs no gradient (the first decoder layer above frozen
        embeddings): with its parameters released, nothing in the call would then need one, autograd would
        build no graph inside it, and the rule would find nothing to read and refuse the layer."""
        if not self._recording() or self._replayed is not None:
            return None
        try:
            main = layer.rule.call.inputs(module, args, kwargs)[0]
        except ValueError:
            return None  # refused at the call, with the layer's name
        if not torch.is_tensor(main) or main.requires_grad or not main.is_floating_point():
            return None
        anchored = _Anchor.apply(main, self._anchor)
        args = tuple(anchored if value is main else value for value in args)
        return args, {key: anchored if value is main else value for key, value in kwargs.items()}

    def _tapping(self, layer: Layer) -> list[Any]:
        """Pre-hooks on the submodules a layer's rule taps (and, for a numbered tap, one on the layer that
        restarts the count in each of its calls); several taps must be distinct modules, each tapped once."""
        tapped = [layer.module.get_submodule(name) for name in layer.rule.taps]
        if len({id(module) for module in tapped}) < len(tapped):
            raise ValueError(
                f"layer {layer.name!r} ({type(layer.module).__name__}): its rule taps "
                f"{list(layer.rule.taps)}, which are one module here, so their calls cannot be told apart; "
                "register a rule for it."
            )
        handles = [m.register_forward_pre_hook(partial(self._tapped, layer, k)) for k, m in enumerate(tapped)]
        if layer.rule.numbered_tap:
            handles.append(layer.module.register_forward_pre_hook(self._count_taps))
        return handles

    def _recording(self) -> bool:
        return torch.is_grad_enabled() and not self._recomputing

    def _keeping(self, module: nn.Module, taps: dict[str, tuple[str, str]]) -> list[Any]:
        """Hooks that keep, in every recorded call of ``module``, what its submodules named in ``taps``
        receive or return (:class:`~dpexp.privacy.rules.CallLayout`'s ``keeps``)."""
        kept = self._kept[id(module)] = {key: [] for key in taps}

        def start(_: nn.Module, __: tuple) -> None:
            if self._recording():
                for values in kept.values():
                    values.clear()

        def keep(key: str, value: Any) -> None:
            if self._recording():
                kept[key].append(value)

        handles = [module.register_forward_pre_hook(start)]
        for key, (name, where) in taps.items():
            submodule = module.get_submodule(name)
            handles.append(
                submodule.register_forward_pre_hook(lambda _, args, key=key: keep(key, args))
                if where == "input"
                else submodule.register_forward_hook(lambda _, __, out, key=key: keep(key, out))
            )
        return handles

    @contextmanager
    def replaying(self, on_use: Callable[[Use], None]) -> Iterator[None]:
        """A forward run inside this context hands every layer call to ``on_use`` as a :class:`Use`, in call
        order, and hooks nothing: no output gradient, no verification, no shared tensors. Gradient mode is
        left as the model sets it (a layer it calls under ``no_grad`` is skipped as in training), so the
        caller freezes the parameters to keep autograd from building a graph. The verifier replays a
        micro-batch with one example changed this way
        (:meth:`dpexp.privacy.verification.Verifier.check_independence`)."""
        self._replayed = on_use
        try:
            with torch.enable_grad():
                yield
        finally:
            self._replayed = None

    def _append(self, use: Use) -> None:
        if self._replayed is not None:
            self._replayed(use)
        else:
            self.forward.uses.append(use)

    def _model_called(self, model: nn.Module, args: tuple, kwargs: dict[str, Any]) -> Any:
        if not self._recording() or self._replayed is not None:
            return None
        self.forward.model_calls += 1
        return self._on_model_call(args, kwargs)

    def _model_returned(self, model: nn.Module, args: tuple, output: Any) -> None:
        if self._recording() and self._replayed is None:
            self._after_model_call(output)

    def _state_at_call(self, layer: Layer, module: nn.Module, args: tuple) -> None:
        if self._recording():
            self._states[id(module)] = attributes_at_call(module)

    def _layer_called(
        self, layer: Layer, module: nn.Module, args: tuple, kwargs: dict[str, Any], output: torch.Tensor
    ) -> Any:
        if not self._recording():
            return None
        if args and isinstance(args[0], SharedTensor):
            return self._called_on_shared(layer, args, kwargs, output)
        if layer.rule is not None and layer.rule.call is not None:
            return self._called_with_layout(layer, layer.rule.call, args, kwargs, output)
        if not torch.is_tensor(output):
            if layer.rule is None and not layer.shared and tensor_outputs(output):
                return self._called_with_outputs(layer, args, kwargs, output)
            raise TypeError(
                f"layer {layer.name!r} ({type(module).__name__}) returned {type(output).__name__}, but the "
                "privacy engine needs a tensor output (or, without a rule, a tuple of them) to capture its "
                f"gradient; freeze its parameters {sorted(layer.params.values())[:5]} (those it owns itself) "
                "or register a rule for it."
            )
        if not output.is_floating_point():  # indices (a sparse attention's top-k): no gradient flows back
            raise TypeError(
                f"layer {layer.name!r} ({type(module).__name__}) returned a {output.dtype} tensor, through "
                f"which no gradient reaches its parameters {sorted(layer.params)}; freeze them "
                "(requires_grad=False) or register a rule for it."
            )
        use = Use(layer, args, kwargs, _versions(args, kwargs))
        if layer.shared:
            self._append(use)
            if self._replayed is not None:
                return None
            if layer.rule is None:  # recomputed for its per-example gradients, checked against this output
                use.output, use.output_version = output, output._version
            x = args[0] if args and torch.is_tensor(args[0]) else None
            return share(layer.name, self._anchored(output), x, partial(self._deliver_shared, use))
        keep = layer.rule.keep_output if layer.rule is not None else None
        if layer.rule is None or (keep and self._replayed is None and keep(module, args[0], output)):
            use.output, use.output_version = output, output._version
        if layer.rule is None:
            use.state = self._states.pop(id(module), {})
        return self._record(use, output)

    def _called_on_shared(
        self, layer: Layer, args: tuple, kwargs: dict[str, Any], output: Any
    ) -> torch.Tensor:
        """A layer called on a tensor shared by all examples (DeBERTa-v2's ``query_proj`` on the relative
        embeddings): its output is shared in turn, a node of the same shared graph (dpexp.privacy.shared)."""
        others = [t for t in (*args[1:], *kwargs.values()) if torch.is_tensor(t)]
        if layer.rule is None or layer.rule.call is not None or others or not torch.is_tensor(output):
            raise ValueError(
                f"layer {layer.name!r} ({type(layer.module).__name__}) is called on a tensor shared by all "
                f"examples (from {[node.name for node in args[0].lineage]}); the privacy engine splits the "
                "gradient of a shared input only for a layer with a rule, one tensor argument and one tensor "
                "output. Freeze its parameters or those of the shared layers."
            )
        x = plain(args[0]).detach()
        use = Use(layer, (x,), {}, _versions((x,), {}))
        self.forward.uses.append(use)
        deliver = partial(self._deliver_shared, use)
        return share(layer.name, self._anchored(plain(output)), x, deliver, parents=args[0].lineage)

    def _shared_weight_passed(
        self,
        layer: Layer | None,
        weight: nn.Parameter,
        module: nn.Module,
        args: tuple,
        kwargs: dict[str, Any],
    ) -> tuple | None:
        """Forward pre-hook on every submodule of the owner of a weight declared with
        ``register_shared_weight``: where the weight itself is passed, it becomes a shared tensor whose
        per-example gradient is delivered to its Embedding ``layer`` (input ``arange(n)``: the identity), or
        one that is only followed if the Embedding is frozen (None)."""
        if not self._recording() or not any(a is weight for a in (*args, *kwargs.values())):
            return None
        source = weight.view_as(weight)  # no leaf: a node's hook must not stay on the parameter
        if layer is None:
            shared = source if self._replayed is not None else follow(source)
        else:
            indices = torch.arange(weight.shape[0], device=weight.device)
            use = Use(layer, (indices,), {}, _versions((indices,), {}))
            self._append(use)
            # replayed: passed on as a plain view, so that the submodules it reaches do not record it again
            shared = (
                source
                if self._replayed is not None
                else share(layer.name, self._anchored(source), indices, partial(self._deliver_shared, use))
            )
        return (
            tuple(shared if a is weight else a for a in args),
            {k: shared if v is weight else v for k, v in kwargs.items()},
        )

    def _deliver_shared(self, use: Use, x: torch.Tensor | None, dy: torch.Tensor) -> None:
        """A shared layer's per-example output gradients (B, ...), with its input expanded to the batch (None:
        it was called without a tensor input)."""
        if x is not None:
            use.args = (x, *use.args[1:])
        self._deliver(use, dy)

    def _called_with_layout(
        self, layer: Layer, layout: CallLayout, args: tuple, kwargs: dict, output: Any
    ) -> Any:
        """A call of a layer with several inputs and outputs: its inputs as the layout presents them, and
        every tensor output passed through one :class:`_Outputs`, whose backward hands all their gradients,
        packed batch-first by the layout, to the engine at once."""
        try:
            inputs = layout.inputs(layer.module, args, kwargs)
        except ValueError as error:
            raise ValueError(f"layer {layer.name!r} ({type(layer.module).__name__}): {error}") from None
        if layout.output:
            if not torch.is_tensor(output):
                returned = type(output).__name__
                raise ValueError(
                    f"layer {layer.name!r} ({type(layer.module).__name__}) returned a {returned}, where its "
                    "rule checks itself against one tensor output; register a rule for its call"
                )
            inputs = (*inputs, output.detach())
        if layout.keeps is not None:  # this call's values (the lists are refilled by the next call)
            inputs = (*inputs, {key: list(values) for key, values in self._kept[id(layer.module)].items()})
        use = Use(layer, inputs, {}, _versions(inputs, {}))
        self._append(use)
        if self._replayed is not None:
            return None
        floating = [_floating(leaf) for leaf in _leaves(output)]  # not the outputs: no reference kept
        reads = None
        if layout.graph is not None:
            reads = layout.graph(layer.module, inputs, output, tensors_in((args, kwargs)))
        if reads is None:

            def on_grads(grads: tuple[torch.Tensor, ...]) -> None:
                self._deliver(use, layout.output_grad(layer.module, _aligned(floating, grads)))

            return self._through_outputs(output, on_grads)
        use.args = (*inputs, dict(reads.values))
        if not reads.nodes:  # values only: the rule runs on the outputs' gradient

            def on_values(grads: tuple[torch.Tensor, ...]) -> None:
                self._deliver(use, layout.output_grad(layer.module, _aligned(floating, grads)))

            return self._through_outputs(output, on_values)
        waiting: list[torch.Tensor] = []  # the outputs' gradient until the nodes' arrive, in every pass
        self.forward.reading.append((layer.name, waiting))
        arrived: set[str] = set()
        keys = tuple(reads.nodes)  # the hooks must not hold the nodes: a node -> hook -> node cycle runs
        # through autograd's C++ graph, which Python's collector cannot see, and would keep every step's
        # graph alive

        def on_outputs(grads: tuple[torch.Tensor, ...]) -> None:
            waiting[:] = [layout.output_grad(layer.module, _aligned(floating, grads))]
            arrived.clear()

        def on_node(key: str, grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
            if not waiting or not use.args or key in arrived:
                raise RuntimeError(
                    f"layer {layer.name!r} ({type(layer.module).__name__}): a gradient reached a node inside "
                    "its call without passing its outputs; the rule's graph reads do not hold"
                )
            use.args[-1][key] = grad_outputs[0]
            arrived.add(key)
            if len(arrived) == len(keys):
                self._deliver(use, waiting.pop())
                if use.args:  # kept for a second pass: its gradients come again, not held meanwhile
                    for name in keys:
                        del use.args[-1][name]

        for key, node in reads.nodes.items():
            node.register_prehook(partial(on_node, key))
        return self._through_outputs(output, on_outputs)

    def _called_with_outputs(self, layer: Layer, args: tuple, kwargs: dict[str, Any], output: tuple) -> Any:
        """A call of a rule-less layer that returned several tensors (nested tuples): they are kept for the
        fallback (:func:`~dpexp.privacy.rules.functional.tensor_outputs`) and passed through one
        :class:`_Outputs`, whose backward hands the gradients of all of them to the engine as a tuple."""
        use = Use(layer, args, kwargs, _versions(args, kwargs), state=self._states.pop(id(layer.module), {}))
        self._append(use)
        if self._replayed is not None:
            return None
        use.output = tensor_outputs(output)  # the model changes only the passed copies in place
        use.output_version = tuple(t._version for t in use.output)
        return self._through_outputs(output, partial(self._deliver, use))

    def _through_outputs(self, output: Any, on_grads: Callable[[tuple[torch.Tensor, ...]], None]) -> Any:
        """``output`` with its floating-point tensors (:func:`~dpexp.privacy.rules.functional.tensor_outputs`)
        passed through one :class:`_Outputs`, whose backward hands their gradients, in order, to
        ``on_grads``."""
        leaves = _leaves(output)
        slots = [i for i, leaf in enumerate(leaves) if _floating(leaf)]
        passed = _Outputs.apply(on_grads, self._anchor, *(leaves[i] for i in slots))
        for i, tensor in zip(slots, passed, strict=True):
            leaves[i] = tensor
        return _rebuild(output, iter(leaves))

    def _tapped(self, layer: Layer, index: int, tap: nn.Module, args: tuple) -> Any:
        """Forward pre-hook of a rule's ``index``-th tap: the gradient is captured at the tap's input
        ``args[0]``."""
        if not self._recording():
            return None
        recorded: tuple = args[:1]
        if layer.rule.numbered_tap:
            index = self._tap_calls[id(layer.module)]
            self._tap_calls[id(layer.module)] = index + 1
        if layer.rule.numbered:
            recorded = (args[0], index)
        x = self._record(Use(layer, recorded, {}, _versions(args[:1], {})), args[0])
        return (x, *args[1:])

    def _tapped_output(self, layer: Layer, tap: nn.Module, args: tuple, output: Any) -> Any:
        """Forward hook of a rule's output tap: the gradient is captured at the tap's output."""
        if not self._recording():
            return None
        if not torch.is_tensor(output):
            raise TypeError(
                f"layer {layer.name!r} ({type(layer.module).__name__}): its rule reads the output of its "
                f"submodule, which returned {type(output).__name__}, not a tensor; register a rule for it."
            )
        return self._record(Use(layer, (output,), {}, _versions((output,), {})), output)

    def _count_taps(self, module: nn.Module, args: tuple) -> None:
        """Forward pre-hook of a numbered-tap layer: its tap calls are counted from 0 in every call."""
        if self._recording():
            self._tap_calls[id(module)] = 0

    def _record(self, use: Use, tensor: torch.Tensor) -> torch.Tensor:
        """Record a use and hook the gradient of ``tensor`` (anchored if it needs none); of its base where the
        rule says the layer's output is a view of a result nothing else holds (``private_output``)."""
        self._append(use)
        if self._replayed is not None:
            return tensor
        tensor = self._anchored(tensor)
        base = tensor._base if tensor._is_view() else None
        rule = use.layer.rule
        if (
            rule is not None
            and rule.private_output
            and base is not None
            and base.requires_grad
            and base.numel() == tensor.numel()
            and base.is_contiguous()
            and tensor.is_contiguous()
        ):  # the same values in the same order: the base's gradient, reshaped, is the output's
            shape = tensor.shape
            base.register_hook(lambda grad: self._deliver(use, grad.reshape(shape)))
        else:
            tensor.register_hook(partial(self._deliver, use))
        return tensor

    def _anchored(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor if tensor.requires_grad else _Anchor.apply(tensor, self._anchor)

    def take(self) -> Forward:
        """The forwards recorded since the last call; recording starts afresh."""
        forward, self.forward = self.forward, Forward()
        return forward

    def per_example_grads(
        self, use: Use, dy: torch.Tensor, layout: Layout = BATCH_FIRST
    ) -> dict[str, PerExampleGrad]:
        """The per-example gradients of ``use``'s trainable parameters for output gradient ``dy`` (b, ...),
        by its layer's rule or, without one, the exact fallback (which recomputes the layer, unrecorded).
        ``layout``: where the examples are in the input (:mod:`dpexp.privacy.layout`); a (position-wise)
        rule gets it as (b, ...), folded or transposed like ``dy``."""
        layer = use.layer
        if layer.rule is not None:
            x = use.args if layer.rule.call is not None or layer.rule.numbered else use.args[0]
            if layout != BATCH_FIRST:  # of a call layout's tuple, the main input and the entries of its rows
                view = partial(layout.batch_first, batch_size=dy.shape[0])
                rows = layer.rule.call.rows if layer.rule.call is not None else (0,)
                x = (
                    tuple(view(t) if i in rows else t for i, t in enumerate(x))
                    if isinstance(x, tuple)
                    else view(x)
                )
            kept = {} if layer.rule.keep_output is None else {"output": use.kept_output()}
            grads = layer.rule.per_example_grads(layer.module, x, dy, **kept)
            missing = set(layer.params) - set(grads)
            if missing:  # never leave a trainable parameter without its per-example gradient
                raise RuntimeError(
                    f"the rule for layer {layer.name!r} ({type(layer.module).__name__}) gave no per-example "
                    f"gradient for its trainable parameters {sorted(missing)}; fix or replace the rule."
                )
            return grads
        self._recomputing = True
        try:
            if layer.shared:
                return shared_per_example_grads(
                    layer.module, list(layer.params), use.args, use.kwargs, dy, use.output, layer.name
                )
            # plain: the recomputation must not follow a shared argument (DeBERTa's rel_embeddings) again
            args, kwargs = tuple(map(plain, use.args)), {k: plain(v) for k, v in use.kwargs.items()}
            return functional_per_example_grads(
                layer.module,
                list(layer.params),
                args,
                kwargs,
                dy,
                use.kept_output(),
                layer.name,
                self._batched_leaves,
                use.state,
            )
        finally:
            self._recomputing = False

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
