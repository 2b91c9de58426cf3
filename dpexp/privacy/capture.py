"""What the engine captures of a model, and the checks of what it assumes about it.

The engine computes per-example gradients from two tensors captured at every call of a layer: its input ``x``
(forward hook) and the gradient ``dy`` of the loss with respect to its output (tensor hook). Three assumptions
turn them into the per-example gradients the privacy analysis needs. None is taken on trust: each is checked
on the model the user brought, and the engine refuses what it cannot establish.

1. **Per-example structure.** Row i (dim 0) of ``x`` and ``dy`` belongs to example i and to no other. A size
   cannot establish this: a time-major (T, B, d) tensor with T = B, or T5's (q, k) bucket tensor with q = B,
   has the batch size in dim 0. A *probe* does: the graph is backpropagated once more with the per-example
   losses weighted by random ``v_i``. Backpropagation is linear in those weights, so row i of an output
   gradient comes out as exactly ``v_i`` times its row in the unweighted pass if and only if it depends on
   loss i alone (:class:`RowFingerprint`). A layer's input shares dim 0 with its output (linear, convolution,
   embedding, normalisation), and the model's floating-point inputs are probed the same way, which exposes
   examples mixed before the first trainable layer.
2. **Every use of every trainable parameter, attributed to the right example.** Hooks see module calls; a
   parameter can also be used outside them (``F.linear(h, emb.weight)`` as a hand-tied output layer, a weight
   read only through ``F.linear`` or in the loss). On a verified micro-batch the parameters require gradients,
   and for every parameter the engine's per-example gradients weighted by the probe's ``v_i`` must add up to
   autograd's gradient of ``sum_i v_i l_i``: a use the hooks did not see leaves a difference, and so does a
   rule (built in or registered by a user) that gives example i a gradient that is not its own
   (:class:`ProjectedSums`, :func:`mismatched_parameters`).
3. **No cross-example state.** A training forward must not change any buffer of the model: running statistics
   computed from raw batches are neither clipped nor noised and reach evaluation (:class:`BufferWatch`).

Checks 1 and 2 run on the first micro-batch (of at least two examples) of every new input structure: tensor
ranks and dtypes, keyword names, non-tensor arguments (:func:`structure_signature`). Which dimension carries
the example is a property of the code path, not of the sizes: a layer whose dim 0 is something else fails the
probe at its first verification when that dimension happens to have the batch size, and the size check at
every call otherwise. A later micro-batch that calls the layers in a sequence never verified is refused
unless every micro-batch is verified (``verify_every_step``). Check 3 runs on every training forward.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from dpexp.privacy.precision import tolerance
from dpexp.privacy.rules import LayerRule, rule_for, supported_types
from dpexp.privacy.rules.functional import check_deterministic

_PROBE_SEED = 0x5EED  # probe weights and directions come from their own generator, never the user's RNG


@dataclass
class Layer:
    """A module owning trainable parameters, with its rule (None: the exact torch.func fallback)."""

    name: str
    module: nn.Module
    rule: LayerRule | None
    params: dict[str, str]  # attribute name in the module ('weight') -> model parameter name


def discover_layers(model: nn.Module, generic_fallback: bool) -> tuple[list[Layer], dict[str, nn.Parameter]]:
    """Every module that owns trainable parameters, with its rule; the trainable parameters by name.

    Refuses BatchNorm anywhere (its batch statistics mix examples, even with frozen parameters) and a module
    without a rule when ``generic_fallback`` is off.
    """
    names = {id(p): n for n, p in model.named_parameters() if p.requires_grad}
    layers: list[Layer] = []
    for mod_name, module in model.named_modules():
        if isinstance(module, _BatchNorm):
            raise ValueError(
                f"module {mod_name!r} ({type(module).__name__}) mixes examples in a batch, which breaks "
                "per-example privacy; replace it with GroupNorm or LayerNorm."
            )
        own = {attr: names[id(p)] for attr, p in module.named_parameters(recurse=False) if id(p) in names}
        if not own:
            continue
        rule = rule_for(module)
        if rule is None and generic_fallback:
            check_deterministic(mod_name, module)
            warnings.warn(
                f"module {mod_name!r} ({type(module).__name__}) has no per-example gradient rule; its "
                f"parameters {sorted(own)} use the exact but slower torch.func fallback.",
                stacklevel=3,
            )
        elif rule is None:
            raise ValueError(
                f"module {mod_name!r} of type {type(module).__name__} has trainable parameters "
                f"{sorted(own)} but no per-example gradient rule. Supported types: {supported_types()}. "
                "Freeze its parameters, replace the module, or register a rule with "
                "dpexp.privacy.rules.register_rule."
            )
        if rule is not None and rule.check is not None:
            rule.check(module)
        layers.append(Layer(mod_name, module, rule, own))
    params = {n: p for n, p in model.named_parameters() if id(p) in names}
    if not params:
        raise ValueError("the model has no trainable parameters")
    return layers, params


def structure_signature(args: tuple, kwargs: Mapping[str, Any]) -> tuple:
    """The structure of a call, sizes left out: tensor ranks and dtypes, keyword names, other values."""

    def describe(value: Any) -> Any:
        if torch.is_tensor(value):
            return ("tensor", value.dim(), value.dtype)
        if isinstance(value, list | tuple):
            return (type(value).__name__, tuple(describe(v) for v in value))
        if isinstance(value, Mapping):
            return ("mapping", tuple(sorted((str(k), describe(v)) for k, v in value.items())))
        if value is None or isinstance(value, bool | int | float | str):
            return value
        return type(value).__qualname__

    return describe(tuple(args)), describe(dict(kwargs))


def probe_generator(device: torch.device) -> torch.Generator:
    """A generator of its own for probe weights and directions: verification never moves the user's RNG."""
    return torch.Generator(device=device).manual_seed(_PROBE_SEED)


def _wide(dtype: torch.dtype) -> torch.dtype:
    """float32 for half-precision tensors (reductions and random draws), else the dtype itself."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


PROBE_EXPONENTS = 9  # v_i = 2^k, k in [-4, 4]: distinct for up to 9 examples, within float16's range


def probe_weights(batch_size: int, like: torch.Tensor) -> torch.Tensor:
    """Per-example loss weights ``v_i``, shape (b,), in ``like``'s dtype and device: powers of two, so that
    they scale every rounding step of example i's backward exactly (an output gradient that is per-example
    scales exactly in any precision, bfloat16 included), in random order and distinct for up to
    ``PROBE_EXPONENTS`` examples (two examples mixed with equal weights would be invisible)."""
    generator = probe_generator(like.device)
    order = torch.randperm(batch_size, generator=generator, device=like.device)
    exponents = order % PROBE_EXPONENTS - PROBE_EXPONENTS // 2
    return torch.pow(2.0, exponents.double()).to(like.dtype)


def compute_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """The precision a forward on ``device`` computes in: the autocast dtype if autocast is on."""
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return dtype


class RowFingerprint:
    """Two random projections and the norm of every row (dim 0) of a tensor, shape (b, 2) and (b,): enough to
    test whether the rows of another tensor of the same shape are these rows scaled by ``v_i``, without
    holding the tensor itself."""

    def __init__(self, t: torch.Tensor) -> None:
        generator = probe_generator(t.device)
        self.directions = torch.randn(
            (2, t[0].numel()), generator=generator, device=t.device, dtype=_wide(t.dtype)
        ).to(t.dtype)
        self.projections, self.norms = self._measure(t)

    def _measure(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = t.reshape(t.shape[0], -1)  # no copies: the output gradient of an LM head is large
        norms = torch.linalg.vector_norm(rows, dim=1, dtype=_wide(rows.dtype))
        return (rows @ self.directions.T).double(), norms.double()

    def mixed_rows(self, plain: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Indices of the rows where ``self`` (the probe, weights ``v``) is not ``v_i`` times ``plain``'s."""
        projections, norms = self._measure(plain)
        v = v.double()[:, None]
        gap = (self.projections - v * projections).abs().amax(1)
        scale = self.norms + v[:, 0] * norms
        tiny = torch.finfo(plain.dtype).tiny ** 0.5
        return (gap > tolerance(plain.dtype) * scale + tiny).nonzero().flatten()


class ProjectedSums:
    """Two random rank-one projections ``u_j^T G w_j`` of the gradient sum G of every parameter (G flattened
    to (rows, rest)), and a bound on its norm, accumulated piece by piece. Two computations of the same
    gradients agree on them up to rounding, and any difference D shows (``u^T D w`` has standard deviation
    ``||D||_F`` for Gaussian u, w), while only one parameter-sized tensor is held at a time."""

    def __init__(self, directions: Mapping[str, list[tuple[torch.Tensor, torch.Tensor]]]) -> None:
        self.directions = directions
        self.projections: dict[str, torch.Tensor] = {}
        self.norms: dict[str, float] = {}

    @staticmethod
    def directions_for(
        params: Mapping[str, torch.Tensor],
    ) -> dict[str, list[tuple[torch.Tensor, torch.Tensor]]]:
        """Gaussian (u, w) pairs for every parameter, from the probe's own generator."""
        out = {}
        for name, p in params.items():
            generator = probe_generator(p.device)
            rows = p.shape[0] if p.dim() else 1
            out[name] = [
                tuple(
                    torch.randn(n, generator=generator, device=p.device, dtype=torch.float64)
                    for n in (rows, p.numel() // rows)
                )
                for _ in range(2)
            ]
        return out

    def add(self, name: str, value: torch.Tensor) -> None:
        """Accumulate one piece of parameter ``name``'s gradient sum (no copy of it is made)."""
        matrix = value.detach().reshape(len(self.directions[name][0][0]), -1)
        dtype = _wide(matrix.dtype)
        projections = torch.stack(
            [(u.to(dtype) @ matrix.to(dtype) @ w.to(dtype)).double() for u, w in self.directions[name]]
        )
        self.projections[name] = self.projections.get(name, 0) + projections
        self.norms[name] = self.norms.get(name, 0.0) + float(torch.linalg.vector_norm(matrix, dtype=dtype))


def mismatched_parameters(
    engine: ProjectedSums, autograd: ProjectedSums, tol: float
) -> list[tuple[str, float]]:
    """Parameters whose two gradient sums differ by more than ``tol`` times the larger, with an estimate of
    the relative difference; a parameter one side never reached has gradient 0.

    Differences below ``tol`` times the norm of the whole gradient are rounding: a parameter whose exact
    gradient is 0 (a key bias, which softmax cancels) has two unrelated round-off values.
    """
    names = [n for n in engine.directions if n in engine.norms or n in autograd.norms]
    zero = torch.zeros(2, dtype=torch.float64)
    scales = {n: max(engine.norms.get(n, 0.0), autograd.norms.get(n, 0.0)) for n in names}
    floor = tol * sum(v**2 for v in scales.values()) ** 0.5
    out = []
    for name in names:
        gap = engine.projections.get(name, zero).cpu() - autograd.projections.get(name, zero).cpu()
        gap = float(gap.abs().max())
        if gap > tol * scales[name] + floor:
            out.append((name, gap / scales[name]))
    return out


class BufferWatch:
    """Refuses a training forward that changes a buffer of the model (replaced, modified in place, added).

    Running statistics (``InstanceNorm(track_running_stats=True)``, BatchNorm) and any other state a forward
    accumulates are computed from raw batches, neither clipped nor noised; they reach the model's later
    outputs, so a private run cannot keep them. Detected from the buffers themselves, for every module type.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._before: dict[str, tuple[int, int]] = {}

    def _state(self) -> dict[str, tuple[int, int]]:
        return {name: (id(b), b._version) for name, b in self.model.named_buffers()}

    def start(self) -> None:
        self._before = self._state()

    def check(self) -> None:
        after = self._state()
        changed = [name for name, state in after.items() if self._before.get(name) != state]
        if not changed:
            return
        name = changed[0]
        owner, _, buffer = name.rpartition(".")
        module = self.model.get_submodule(owner)
        raise ValueError(
            f"module {owner!r} ({type(module).__name__}) changed its buffer {buffer!r} in a training "
            "forward: state computed from raw batches is neither clipped nor noised and leaks through the "
            "model's later outputs. Stop the module from tracking it (e.g. track_running_stats=False), or "
            "replace the module." + (f" Also changed: {changed[1:5]}." if len(changed) > 1 else "")
        )

    def hooks(self) -> list[Any]:
        """Check around every training forward of the model; returns the removable hook handles."""

        def before(module: nn.Module, args: tuple) -> None:
            if torch.is_grad_enabled():
                self.start()

        def after(module: nn.Module, args: tuple, output: Any) -> None:
            if torch.is_grad_enabled():
                self.check()

        return [self.model.register_forward_pre_hook(before), self.model.register_forward_hook(after)]


def differentiable_inputs(args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any], list]:
    """Floating-point tensor arguments that need no gradient, replaced by copies of leaves that do, so that a
    probe can see whether one example's input reaches another example's loss; returns the new arguments
    and the leaves."""
    leaves: list[torch.Tensor] = []

    def alias(value: Any) -> Any:
        if (
            torch.is_tensor(value)
            and value.is_floating_point()
            and value.dim() > 0
            and not value.requires_grad
        ):
            leaf = value.detach().requires_grad_(True)
            leaves.append(leaf)
            return leaf.clone()  # not a leaf: in-place operations of the model stay legal
        return value

    return tuple(alias(a) for a in args), {k: alias(v) for k, v in kwargs.items()}, leaves
