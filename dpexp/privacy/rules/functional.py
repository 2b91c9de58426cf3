"""Exact generic fallback: per-example gradients of a module's own parameters with ``torch.func``.

Used for modules that own trainable parameters but have no registered rule, e.g. BEiT's layer-scale
``gamma`` (owned by its block) or a user's custom layer. For the output gradient ``dy_i`` captured by the
engine, ``g_i = d/dtheta <module(x_i; theta), dy_i>``, computed for all examples at once with
``vmap(grad(...))`` over the module's forward. This recomputes the module's forward and backward once more,
so it costs about as much as the module itself; it is exact as long as the forward is deterministic (no
dropout), which the engine checks at construction. A forward that ``torch.func`` cannot transform (an
``autograd.Function`` written without ``setup_context``, as RecurrentGemma's ``SqrtBoundDerivative``, or a
detour through NumPy) is run one example at a time with plain autograd instead (:func:`_looped`): the same
gradients and the same checks, at B times the module's forward and backward, with a warning. A module that
keeps tensors as plain attributes from one call to the next (RecurrentGemma's RG-LRU, whose owner resets
its ``recurrent_states`` before each call) is recomputed with them as they were at its call, which the
capture records (:func:`attributes_at_call`).

Which arguments carry the example index is established, not guessed from their sizes: only tensors whose
dim 0 has the batch size *can* be batched, and a choice of batched arguments is accepted only if the
vmapped forward reproduces the output the module actually produced in the forward pass (a tensor shared by
all examples whose first dimension happens to equal the batch size, vmapped as if it were per-example,
changes the output). No reproducing choice, or several that disagree: the module is refused. An output that
the model modified in place after the call (Falcon adds its residual with ``mlp_output += attention_output``)
is no record of the call any more; the module's forward is then recomputed on the whole micro-batch, from the
same inputs (unchanged: the engine checks their versions) and parameters, as the reference.

A module that returns several tensors (nested tuples: DeBERTa's attention returns its context and
probabilities, I-BERT's embedding its values and their scale) is taken with all its outputs at once:
``g_i = d/dtheta sum_k <y_k(x_i; theta), dy_{k,i}>`` over the floating-point outputs y_k with one row per
example (:func:`batch_outputs`), whose gradients the engine packs into one (B, F) ``dy``
(:func:`pack_output_grads`), and whose recomputation must reproduce every one of them. An output without a
row per example (a scale shared by the batch) cannot be split per example: the engine refuses the module if
such an output gets a gradient (:func:`dpexp.privacy.verification.check_outputs`).
"""

from __future__ import annotations

import contextlib
import math
import sys
import warnings
from collections.abc import Iterator
from functools import partial
from itertools import product
from typing import Any

import torch
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

from dpexp.privacy.per_example import Dense, PerExampleGrad
from dpexp.privacy.precision import tolerance

MAX_AMBIGUOUS_ARGUMENTS = 6  # tensors with dim 0 = B whose role is searched (2^n vmapped forwards at most,
# once per call structure: see ``known``)


def check_deterministic(name: str, module: nn.Module) -> None:
    """The recomputed forward must be the one that ran: refuse active dropout inside ``module``."""
    for sub_name, sub in module.named_modules():
        p = (
            getattr(sub, "p", None)
            if isinstance(sub, nn.modules.dropout._DropoutNd)
            else getattr(sub, "drop_prob", None)
        )
        if sub.training and isinstance(p, float) and p > 0:
            raise ValueError(
                f"module {name!r} ({type(module).__name__}) has no per-example gradient rule, and its exact "
                f"fallback needs a deterministic forward, but {sub_name or name!r} applies dropout (p={p}). "
                "Set dropout/drop-path to 0, freeze the module's own parameters, or register a rule."
            )


def _cache_type() -> type | None:
    """Hugging Face's key/value cache class, if transformers is loaded (a model can only pass one then)."""
    return getattr(sys.modules.get("transformers.cache_utils"), "Cache", None)


def tensor_outputs(value: Any) -> tuple[torch.Tensor, ...]:
    """The floating-point tensors of a module's output (a tensor, or nested tuples), in order."""
    if isinstance(value, tuple):
        return tuple(t for v in value for t in tensor_outputs(v))
    return (value,) if torch.is_tensor(value) and value.is_floating_point() else ()


def batch_outputs(outputs: tuple[torch.Tensor, ...], size: int) -> list[int]:
    """Indices of the outputs with ``size`` rows in dim 0: the only ones that can be per example (necessary,
    not sufficient: the fallback's reproduction and the engine's probe establish the rest)."""
    return [k for k, y in enumerate(outputs) if y.dim() > 0 and y.shape[0] == size]


def pack_output_grads(
    outputs: tuple[torch.Tensor, ...], grads: tuple[torch.Tensor, ...], size: int
) -> torch.Tensor:
    """The gradients of a module's several outputs (:func:`tensor_outputs`) as one (size, F) tensor: those of
    :func:`batch_outputs`, flattened per row and concatenated (:func:`unpack_output_grads` inverts it)."""
    parts = [grads[k].reshape(size, -1) for k in batch_outputs(outputs, size)]
    return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]


def unpack_output_grads(outputs: tuple[torch.Tensor, ...], dy: torch.Tensor) -> dict[int, torch.Tensor]:
    """Output index -> its gradient (B, ...), from :func:`pack_output_grads`' (B, F)."""
    parts = batch_outputs(outputs, dy.shape[0])
    sizes = [outputs[k][0].numel() for k in parts]
    pieces = dy.split(sizes, dim=1)
    return {k: piece.reshape(outputs[k].shape) for k, piece in zip(parts, pieces, strict=True)}


def reproduces(recorded: torch.Tensor, recomputed: torch.Tensor) -> bool:
    """Whether ``recomputed`` is ``recorded`` up to the rounding of ``recorded``'s dtype (relative to its
    largest finite magnitude): the same computation, run again, NaN and infinities where it gave them (an
    example whose forward gave NaN, as a text of padding only can in some attentions). ``torch.allclose``'s
    test, ``max(|recomputed - recorded| - rtol |recorded|) <= atol``, with two temporaries where every value
    is finite (these checks run at every call of a recomputing rule)."""
    if recorded.shape != recomputed.shape:
        return False
    recorded = recorded.detach()
    tol = tolerance(recorded.dtype)
    scale = float(recorded.abs().max()) if recorded.numel() else 0.0
    if not math.isfinite(scale):
        finite = recorded[torch.isfinite(recorded)]
        scale = float(finite.abs().max()) if finite.numel() else 0.0
    atol = tol * scale
    if recorded.numel() == 0 or not recorded.is_floating_point():
        return bool(torch.allclose(recomputed, recorded, rtol=tol, atol=atol))
    excess = torch.sub(recomputed.detach(), recorded).abs_().sub_(recorded.abs().mul_(tol))  # two temporaries
    if bool(excess.max() <= atol):
        return True
    return bool(torch.isclose(recomputed, recorded, rtol=tol, atol=atol, equal_nan=True).all())


def _out_of_memory(error: RuntimeError) -> bool:
    """Whether ``error`` is an allocation failure: CUDA's ``OutOfMemoryError``, or the CPU allocator's
    plain RuntimeError."""
    return isinstance(error, torch.OutOfMemoryError) or "can't allocate memory" in str(error)


def functional_per_example_grads(
    module: nn.Module,
    attrs: list[str],
    args: tuple,
    kwargs: dict[str, Any],
    dy: torch.Tensor,
    output: torch.Tensor | tuple[torch.Tensor, ...] | None,
    name: str,
    known: dict[tuple, set[int]],
    state: dict[str, Any] | None = None,
) -> dict[str, PerExampleGrad]:
    """Per-example gradients of ``module``'s own parameters ``attrs`` (and those of submodules its forward
    reads, ``"conv1d.weight"``: :func:`~dpexp.privacy.rules.register_reads`) for one call (``args``,
    ``kwargs``, recorded ``output``, None if it was modified in place since; output gradient ``dy`` of shape
    (B, ...)); ``name`` is the module's name in the model, for errors. A tuple ``output``: the module's
    :func:`tensor_outputs`, and ``dy`` their gradients packed by :func:`pack_output_grads`. ``known``, kept by
    the caller across calls: for every call structure (module name, argument nesting, shapes and dtypes), the
    batched leaves established when exactly one choice reproduced the output; tried first, and still checked
    against the recorded output, the search runs again if they do not reproduce it. ``state``: the module's
    plain attributes that were tensors or None at the call (:func:`attributes_at_call`), set so while it is
    recomputed (RecurrentGemma's RG-LRU keeps its last call's ``recurrent_states``, which its owner resets
    before every call)."""
    size = dy.shape[0]
    values, spec = tree_flatten((tuple(args), dict(kwargs)))  # nested too (Funnel's attention_inputs)
    cache = _cache_type()
    stateful = [type(v).__name__ for v in values if cache is not None and isinstance(v, cache)]
    if stateful:
        raise RuntimeError(
            f"module {name!r} ({type(module).__name__}) has no per-example gradient rule, and its exact "
            f"fallback recomputes its forward, but it was given a {stateful[0]} (a key/value cache), which "
            "every recomputation would extend. Call the model with use_cache=False in training, or register "
            "a rule."
        )
    candidates = list(  # one role per tensor: a tensor passed twice (query = key = value) is one candidate
        dict.fromkeys(id(v) for v in values if torch.is_tensor(v) and v.dim() > 0 and v.shape[0] == size)
    )
    if len(candidates) > MAX_AMBIGUOUS_ARGUMENTS:
        raise RuntimeError(
            f"module {name!r} ({type(module).__name__}) has no per-example gradient rule and "
            f"{len(candidates)} tensor arguments with the batch size in dim 0; the fallback cannot establish "
            "which of them carry the example index. Register a rule for it or freeze its parameters."
        )
    params = {attr: module.get_parameter(attr).detach() for attr in attrs}  # "conv1d.weight": a read one
    as_called = partial(_as_called, module, state or {})
    if output is None:
        with torch.no_grad(), as_called():
            output = functional_call(module, params, args, kwargs)
    outputs = tensor_outputs(output)
    dys = unpack_output_grads(outputs, dy) if isinstance(output, tuple) else {0: dy}

    def attempt(batched: set[int], rows: int = size) -> dict[str, torch.Tensor] | None:
        """The gradients if vmapping the leaves at positions ``batched`` reproduces all outputs, or None;
        with ``rows`` < B, of the first ``rows`` examples only, as a cheap test of a choice."""
        dims = [0 if j in batched else None for j in range(len(values))]
        head = [v[:rows] if d == 0 else v for v, d in zip(values, dims, strict=True)]
        head_dys = {k: g[:rows] for k, g in dys.items()}
        try:
            if looped in known:
                raise _NotTransformable("torch.func could not run it on an earlier call")
            with as_called():
                grads, recomputed = _vmapped(module, params, spec, head, dims, head_dys)
        except RuntimeError as error:
            if _out_of_memory(error):  # not a sign of a wrong choice: say so, not "mixes examples"
                raise RuntimeError(
                    f"module {name!r} ({type(module).__name__}) has no per-example gradient rule, and its "
                    "exact fallback ran out of memory recomputing it per example. Lower physical_batch_size, "
                    f"register a rule for it, or freeze its parameters. ({str(error).splitlines()[0]})"
                ) from error
            try:  # shapes that do not fit this choice, or a forward torch.func cannot run: one at a time
                with as_called():
                    grads, recomputed = _looped(module, params, spec, head, dims, head_dys)
            except RuntimeError:
                failures.append(_first_line(error))
                return None
            if not isinstance(error, _NotTransformable):
                vmap_errors[frozenset(batched)] = _first_line(error)
        reproduced = all(reproduces(outputs[k][:rows], y) for k, y in zip(dys, recomputed, strict=True))
        if not reproduced:
            gaps.append(max(relative_gap(outputs[k][:rows], y) for k, y in zip(dys, recomputed, strict=True)))
        return grads if reproduced else None

    failures: list[str] = []  # why a choice could not be run per example
    gaps: list[float] = []  # how far a choice that ran was from the recorded output
    vmap_errors: dict[frozenset, str] = {}  # choice -> why torch.func could not run it (then run in a loop)
    signature = (name, str(spec), tuple(_describe(v) for v in values))
    looped = (name, "one example at a time")  # in ``known``: torch.func cannot run this module
    if signature in known:  # established on an earlier call of the same structure: checked again
        grads = attempt(known[signature])
        if grads is not None:
            return {attr: Dense(g) for attr, g in grads.items()}
    found: list[tuple[set[int], dict[str, torch.Tensor]]] = []
    for choice in product((0, None), repeat=len(candidates)):  # all batched first
        chosen = {i for i, d in zip(candidates, choice, strict=True) if d == 0}
        batched = {j for j, v in enumerate(values) if id(v) in chosen}
        # first on one example: a wrong choice that takes an input of B rows as shared would otherwise
        # backpropagate the whole batch once per example (B times the module's memory)
        if size > 1 and attempt(batched, rows=1) is None:
            continue
        grads = attempt(batched)
        if grads is not None:
            found.append((batched, grads))
            if len(found) > 1:
                break
    if not found:
        raise RuntimeError(
            f"module {name!r} ({type(module).__name__}) has no per-example gradient rule, and no choice of "
            "which of its inputs carry the example index in dim 0 reproduces its output per example: "
            f"{_search_failure(failures, gaps, outputs[next(iter(dys))].dtype)}. "
            "Register a rule, make it batch-first, or freeze its parameters."
        )
    if len(found) > 1 and not all(reproduces(found[0][1][attr], found[1][1][attr]) for attr in attrs):
        raise RuntimeError(
            f"module {name!r} ({type(module).__name__}) has no per-example gradient rule, and its tensor "
            "arguments with the batch size in dim 0 reproduce its output both as per-example and as shared "
            "inputs, with different gradients: which of them carry the example index cannot be established. "
            "Register a rule for it or freeze its parameters."
        )
    if len(found) == 1:  # unambiguous: remembered for the calls of the same structure
        known[signature] = found[0][0]
    cause = vmap_errors.get(frozenset(found[0][0]))
    if cause is not None and looped not in known:  # the choice found ran only one example at a time
        known[looped] = set()
        warnings.warn(
            f"module {name!r} ({type(module).__name__}): torch.func cannot run its forward "
            f"({cause}); the exact fallback computes its per-example gradients one example at a "
            "time, B times its forward and backward. Register a rule for it to make it faster.",
            stacklevel=2,
        )
    return {attr: Dense(g) for attr, g in found[0][1].items()}


def _looped(
    module: nn.Module,
    params: dict[str, torch.Tensor],
    spec: TreeSpec,
    values: list,
    dims: list[int | None],
    dys: dict[int, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], tuple[torch.Tensor, ...]]:
    """What :func:`_vmapped` returns, computed one example at a time with plain autograd: for forwards
    ``torch.func`` cannot transform (an ``autograd.Function`` without ``setup_context``, as RecurrentGemma's
    ``SqrtBoundDerivative``). Example i's call gets row i of the leaves with ``dims[j] == 0`` (kept as a
    batch of one) and the others whole; ``g_i = d/dtheta sum_k <y_k(x_i), dy_{k,i}>``."""
    grads: dict[str, list[torch.Tensor]] = {attr: [] for attr in params}
    recomputed: list[list[torch.Tensor]] = [[] for _ in dys]
    for i in range(next(iter(dys.values())).shape[0]):
        leaves = {attr: p.detach().requires_grad_(True) for attr, p in params.items()}
        vals = [
            (v[i : i + 1] if d == 0 else v).detach() if torch.is_tensor(v) else v
            for v, d in zip(values, dims, strict=True)
        ]
        args, kwargs = tree_unflatten(vals, spec)
        with torch.enable_grad():
            outputs = tensor_outputs(functional_call(module, leaves, args, kwargs))
            ys = [outputs[k] for k in dys]
            total = sum((y * dy[i : i + 1].to(y.dtype)).sum() for y, dy in zip(ys, dys.values(), strict=True))
            found = torch.autograd.grad(total, list(leaves.values()), allow_unused=True)
        for (attr, leaf), g in zip(leaves.items(), found, strict=True):
            grads[attr].append(torch.zeros_like(leaf) if g is None else g)
        for kept, y in zip(recomputed, ys, strict=True):
            kept.append(y.detach().squeeze(0))
    return {attr: torch.stack(g) for attr, g in grads.items()}, tuple(torch.stack(y) for y in recomputed)


class _NotTransformable(RuntimeError):
    """torch.func could not run the module on an earlier call: go straight to one example at a time."""


def _first_line(error: BaseException) -> str:
    return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"


def relative_gap(recorded: torch.Tensor, recomputed: torch.Tensor) -> float:
    """``max |recomputed - recorded| / max |recorded|`` (inf where the shapes differ)."""
    if recorded.shape != recomputed.shape:
        return math.inf
    scale = float(recorded.detach().abs().max()) if recorded.numel() else 0.0
    return float((recomputed.detach() - recorded.detach()).abs().max()) / max(scale, 1e-30)


def _search_failure(failures: list[str], gaps: list[float], dtype: torch.dtype) -> str:
    """Why the fallback's search found no choice, as far as it can tell: every choice failed to run per
    example (the first error), or the closest that ran missed the recorded output by more than rounding
    (a forward that mixes examples or is not batch-first; or, a gap near the tolerance, one that rounds
    differently per example)."""
    if not gaps:
        return f"recomputing it per example failed for every choice ({failures[0]})"
    if min(gaps) == math.inf:
        return "no choice that ran gave outputs of the shapes it returned (its inputs are not batch-first)"
    return (
        f"the closest choice missed its output by {min(gaps):.1e} of its largest value, where {dtype} "
        f"rounding allows {tolerance(dtype):.0e}: its inputs are not batch-first, its forward mixes "
        "examples, or it rounds differently per example"
    )


def attributes_at_call(module: nn.Module) -> dict[str, Any]:
    """``module``'s plain attributes (neither parameters nor buffers) that are tensors or None: what a
    forward may keep from one call to the next."""
    return {name: value for name, value in vars(module).items() if value is None or torch.is_tensor(value)}


@contextlib.contextmanager
def _as_called(module: nn.Module, state: dict[str, Any]) -> Iterator[None]:
    """``module`` with its plain attributes set to ``state`` (as they were at the call being recomputed),
    put back afterwards."""
    now = {name: vars(module).get(name) for name in state}
    changed = [name for name, value in state.items() if now[name] is not value]
    for name in changed:
        setattr(module, name, state[name])
    try:
        yield
    finally:
        for name in changed:
            setattr(module, name, now[name])


def _describe(value: Any) -> tuple | str:
    """A leaf of a call's arguments as far as the choice of batched leaves depends on it."""
    return (tuple(value.shape), value.dtype) if torch.is_tensor(value) else type(value).__name__


def _vmapped(
    module: nn.Module,
    params: dict[str, torch.Tensor],
    spec: TreeSpec,
    values: list,
    dims: list[int | None],
    dys: dict[int, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], tuple[torch.Tensor, ...]]:
    """``(g_i, y_k(x_i))`` for every example i and every output k of ``dys`` (index among the module's
    :func:`tensor_outputs` -> its gradient (B, ...)), vmapping dim 0 of the leaves ``values`` of the call's
    ``(args, kwargs)`` (``spec``) with ``dims[j] == 0``."""

    def inner_product(p: dict[str, torch.Tensor], vals: list, dys_i: dict[int, torch.Tensor]):
        vals = [v.unsqueeze(0) if d == 0 else v for v, d in zip(vals, dims, strict=True)]
        args, kwargs = tree_unflatten(vals, spec)
        outputs = tensor_outputs(functional_call(module, p, args, kwargs))
        ys = [outputs[k] for k in dys]
        total = sum(
            (y * dy_i.unsqueeze(0).to(y.dtype)).sum() for y, dy_i in zip(ys, dys_i.values(), strict=True)
        )
        return total, tuple(y.squeeze(0) for y in ys)

    with torch.enable_grad():
        return vmap(grad(inner_product, has_aux=True), in_dims=(None, dims, 0))(params, values, dys)


def shared_per_example_grads(
    module: nn.Module,
    attrs: list[str],
    args: tuple,
    kwargs: dict[str, Any],
    dy: torch.Tensor,
    output: torch.Tensor,
    name: str,
) -> dict[str, PerExampleGrad]:
    """Per-example gradients of the parameters ``attrs`` of a layer whose output S is shared by all examples
    (called on no per-example input, :mod:`dpexp.privacy.shared`), for ``dy`` (B, *S.shape), row i example
    i's gradient of S where S met the batch. S is the same function of the parameters W for every example,
    so ``dW_i = J_W^T dS_i`` with the one Jacobian ``J_W = dS/dW``: one recomputed forward (checked against
    the recorded ``output``) and one batched vector-Jacobian product for all examples."""
    params = {attr: module.get_parameter(attr).detach().requires_grad_(True) for attr in attrs}
    with torch.enable_grad():
        recomputed = functional_call(module, params, args, kwargs)
    if not torch.is_tensor(recomputed) or not reproduces(output, recomputed):
        raise RuntimeError(
            f"layer {name!r} ({type(module).__name__}) is shared by all examples and has no per-example "
            "gradient rule; recomputing its forward did not reproduce its output, so its per-example "
            "gradients cannot be taken through it. Make its forward deterministic or freeze its parameters."
        )
    grads = torch.autograd.grad(
        recomputed, list(params.values()), dy.to(recomputed.dtype), is_grads_batched=True, allow_unused=True
    )
    return {
        attr: Dense(p.new_zeros(dy.shape[0], *p.shape) if g is None else g)
        for (attr, p), g in zip(params.items(), grads, strict=True)
    }
