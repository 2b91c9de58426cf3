"""The checks of what the engine assumes about a model; it refuses what it cannot establish.

The engine computes per-example gradients from two tensors captured at every call of a layer: its input ``x``
(forward hook) and the gradient ``dy`` of the loss with respect to its output (tensor hook). Three assumptions
turn them into the per-example gradients the privacy analysis needs. None is taken on trust: each is checked
on the model the user brought (:class:`Verifier`), and the engine refuses what it cannot establish with a
:class:`VerificationError`.

1. **Per-example structure.** Row i (dim 0) of ``x`` and ``dy`` belongs to example i and to no other. A size
   cannot establish this: a time-major (T, B, d) tensor with T = B, or T5's (q, k) bucket tensor with q = B,
   has the batch size in dim 0. A *probe* does: the graph is backpropagated once more with the per-example
   losses weighted by random ``v_i``. Backpropagation is linear in those weights, so row i of an output
   gradient comes out as exactly ``v_i`` times its row in the unweighted pass if and only if it depends on
   loss i alone (:class:`RowFingerprint`). A layer's input shares dim 0 with its output (linear, convolution,
   embedding, normalisation), and the model's floating-point inputs are probed the same way, which exposes
   examples mixed before the first trainable layer. A position-wise layer may also get its input flattened
   to (b*T, ..., F) (OPT's MLP): it is folded to (b, T, ..., F) and the probe establishes the same of each
   block of T rows, so a time-major (T*b) flattening is refused. Or time-major, (T, b, ..., F)
   (``nn.TransformerEncoderLayer`` with ``batch_first=False``): it is read with dims 0 and 1 swapped where
   the probe establishes that column i is example i's, at T = b too, where both readings fit the sizes
   (:mod:`dpexp.privacy.layout`, :meth:`Verifier.layout`).
2. **Every use of every trainable parameter, attributed to the right example.** Hooks see module calls; a
   parameter can also be used outside them (``F.linear(h, emb.weight)`` as a hand-tied output layer, a weight
   read only through ``F.linear`` or in the loss). On a verified micro-batch the parameters require gradients,
   and for every parameter the engine's per-example gradients weighted by the probe's ``v_i`` must add up to
   autograd's gradient of ``sum_i v_i l_i``: a use the hooks did not see leaves a difference, and so does a
   rule (built in or registered by a user) that gives example i a gradient that is not its own
   (:class:`ProjectedSums`, :func:`mismatched_parameters`).
3. **No state carried across batches.** A training forward must not change any buffer of the model (running
   statistics computed from raw batches are neither clipped nor noised and reach evaluation), a verified
   one must not change a parameter's values out of autograd's sight (a data-dependent initialisation), and
   a tensor a forward leaves in a plain attribute must not be read by a later call unless check 4's replay
   established that it holds none of the batch's data (:mod:`dpexp.privacy.state`).
4. **Examples processed independently, gradients or not.** The probe of check 1 sees only differentiable
   dependencies from the first probed tensor on: a batch mean that is detached, computed under ``no_grad``,
   or taken after a frozen prefix on integer inputs (token ids -> frozen embedding -> ``h - h.mean(0)``)
   mixes examples invisibly to it. So the verified micro-batch is run once more, without gradients, from the
   same random and autocast state, with example 0's data replaced by another example's (row 0 of every input
   tensor with the micro-batch size in dim 0; :func:`replaced_example`); every layer call's input and every
   batch-indexed output of the model must keep the rows of the other examples (:func:`moved_rows`), and the
   layers must be called in the same sequence (:meth:`Verifier.check_independence`). Which input rows to
   replace is the one thing chosen from sizes: a wrong choice can refuse a model or leave this check without
   a changed example (then the micro-batch does not count as verified), never pass a mixing forward that
   the replacement reached. The per-example loss is computed outside the model, by the caller, and is
   checked only by the probe.

Checks 1, 2 and 4 run on the first micro-batch (of at least two examples) of every new input structure:
tensor ranks and dtypes, keyword names, non-tensor arguments (:func:`structure_signature`). Which dimension
carries the example is a property of the code path, not of the sizes: a layer whose dim 0 is something else
fails the probe at its first verification when that dimension happens to have the batch size, and the size
check at every call otherwise; a later micro-batch is read in the layout its layers were verified in, and
one whose sizes fit only another layout is refused. A later micro-batch that calls the layers in a
sequence never verified is refused unless every micro-batch is verified (``verify_every_step``). Check 3
runs on every training forward.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import nn

from dpexp.privacy.capture import Forward, Layer, Use
from dpexp.privacy.containers import map_tensors, tensors_in
from dpexp.privacy.layout import BATCH_FIRST, TIME_MAJOR, Layout
from dpexp.privacy.per_example import PerExampleGrad
from dpexp.privacy.precision import runs_tf32, tolerance
from dpexp.privacy.rules.functional import batch_outputs, pack_output_grads
from dpexp.privacy.state import StateWatch

_PROBE_SEED = 0x5EED  # probe weights and directions come from their own generator, never the user's RNG


class VerificationError(RuntimeError):
    """The engine could not establish what the privacy guarantee needs of this model (per-example structure,
    every use of every parameter) and refuses to continue."""


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


def differentiable_inputs(args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any], list]:
    """Floating-point tensor arguments (dim > 0) replaced by probed copies, so that a probe can see whether
    one example's input reaches another example's loss; returns the new arguments and the probed tensors.
    An argument that needs no gradient becomes a copy of a leaf that does; one that already requires a
    gradient (a user's input leaf, or the output of an upstream computation) becomes a differentiable copy
    that keeps its gradient (``retain_grad``), so the user's own gradient still flows through it."""
    probed: list[torch.Tensor] = []

    def alias(value: Any) -> Any:
        if not (torch.is_tensor(value) and value.is_floating_point() and value.dim() > 0):
            return value
        if value.requires_grad:
            copy = value.clone()
            copy.retain_grad()
            probed.append(copy)
            return copy
        leaf = value.detach().requires_grad_(True)
        probed.append(leaf)
        return leaf.clone()  # not a leaf: in-place operations of the model stay legal

    return tuple(alias(a) for a in args), {k: alias(v) for k, v in kwargs.items()}, probed


# the fix for a layer whose output has no example dimension, in every refusal that names it
DECLARE_SHARED = (
    "declare a layer whose output is shared by all examples and meets the batch later with "
    "dpexp.privacy.shared.register_shared"
)


def check_outputs(use: Use, grads: tuple[torch.Tensor, ...], batch_size: int) -> torch.Tensor:
    """The gradients of a rule-less layer's several outputs (``use.output``) packed into one (b, F) tensor
    for the fallback (:func:`~dpexp.privacy.rules.functional.pack_output_grads`). An output without b rows
    cannot be split per example: it must get no gradient, or the layer is refused."""
    layer, outputs = use.layer, use.output
    where = f"layer {layer.name!r} ({type(layer.module).__name__}) has no per-example gradient rule and"
    rows = set(batch_outputs(outputs, batch_size))
    if not rows:
        multiples = {y.shape[0] // batch_size for y in outputs if y.dim() and y.shape[0] % batch_size == 0}
        flattened = (
            f" (dim 0 holds {multiples.pop()} x the batch size: if that is its input flattened to "
            "(B*T, ...), as a mixture-of-experts router's tokens, the fallback cannot fold it back per "
            "example; a rule registered with position_wise=True can, once the probe establishes the layout)"
            if len(multiples) == 1 and 0 not in multiples
            else ""
        )
        raise VerificationError(
            f"{where} none of its outputs {[tuple(y.shape) for y in outputs]} has dim 0 of the "
            f"micro-batch's {batch_size} examples{flattened}. Make its outputs batch-first, register a rule, "
            "or freeze its parameters."
        )
    for k, (y, g) in enumerate(zip(outputs, grads, strict=True)):
        if k not in rows and bool(g.any()):
            raise VerificationError(
                f"{where} its output {k} of shape {tuple(y.shape)} reaches the loss without a row per "
                f"example (dim 0 is not the micro-batch's {batch_size} examples): its gradient cannot be "
                "split per example. Register a rule for the layer, or freeze its parameters."
            )
    return pack_output_grads(outputs, grads, batch_size)


def reads_time_major(layer: Layer) -> bool:
    """Whether the layer's rule can read a time-major (T, b, ..., F) call: a position-wise rule of the layer's
    own input and output gradient (no call layout, tap or kept output), of a layer not shared."""
    rule = layer.rule
    return (
        rule is not None
        and rule.position_wise
        and rule.call is None
        and not rule.taps
        and not rule.numbered
        and rule.keep_output is None
        and not layer.shared
    )


def is_time_major_shaped(x: torch.Tensor, dy: torch.Tensor, batch_size: int) -> bool:
    """Input (T, b, ...) and output gradient (T, b, ..., F): dim 1 of both has b, and the output gradient has
    a feature axis after it (a (T, F) matrix whose F happens to be b is not time-major)."""
    return x.dim() >= 2 and dy.dim() >= 3 and x.shape[:2] == dy.shape[:2] and x.shape[1] == batch_size


def check_use(use: Use, dy: torch.Tensor, batch_size: int) -> list[Layout]:
    """The captured input is unchanged since the call, and the sizes of input and output gradient allow
    the examples to be where a layout puts them (:mod:`dpexp.privacy.layout`): dim 0 has the batch size b,
    or b*T for a position-wise rule (a flattened (B*T, ..., F) input, e.g. OPT's MLP), or dim 1 has b for
    a position-wise rule's (T, b, ..., F) input (time-major). Returns the layouts the sizes allow, dim 0's
    first. Sizes are necessary, not sufficient: the probe establishes which one holds
    (:meth:`Verifier.layout`)."""
    layer, tensors = use.layer, use.tensors
    if [t._version for t in tensors] != use.versions:
        raise RuntimeError(
            f"a tensor of layer {layer.name!r}'s call (an input, or the output its rule checks itself "
            "against) was modified in place after the call; per-example gradients would be wrong. Disable "
            "in-place operations (e.g. inplace=True)."
        )
    if layer.shared and not (use.args and torch.is_tensor(use.args[0])):
        # a shared table read as a whole, or called on tensors without an example dimension only (position
        # ids passed by keyword, as Blenderbot's): dy's rows are where its output met the batch
        if dy.dim() and dy.shape[0] == batch_size:
            return [BATCH_FIRST]
        raise VerificationError(
            f"layer {layer.name!r} ({type(layer.module).__name__}) is shared by all examples and met the "
            f"batch in a tensor of leading size {dy.shape[0] if dy.dim() else 0} for a micro-batch of "
            f"{batch_size} examples: where a shared output meets the batch, dim 0 must be the example "
            "index. Make that tensor batch-first, or freeze the layer's parameters."
        )
    if not tensors:
        raise VerificationError(
            f"layer {layer.name!r} ({type(layer.module).__name__}) was called without a tensor input, so its "
            "output is the same for every example (a table read as a whole) and its gradient cannot be "
            "split per example at the layer. If its output meets the batch later (as BEiT's relative "
            "position bias, added to the attention scores), declare it with "
            "dpexp.privacy.shared.register_shared; otherwise freeze its parameters."
        )
    x = tensors[0]
    rows = x.shape[0] if x.dim() else 0
    position_wise = layer.rule is not None and layer.rule.position_wise
    layouts = []
    if rows == batch_size and dy.dim() and dy.shape[0] == batch_size:
        layouts.append(BATCH_FIRST)
    elif position_wise and rows > batch_size and rows % batch_size == 0 and dy.dim() and dy.shape[0] == rows:
        layouts.append(Layout(fold=rows // batch_size))
    if reads_time_major(layer) and is_time_major_shaped(x, dy, batch_size):
        layouts.append(TIME_MAJOR)
    if layouts:
        return layouts
    shape = f"{layer.name!r} ({type(layer.module).__name__}) got an input of shape {tuple(x.shape)}"
    if rows == batch_size:
        cause = (
            "its input is batch-first but its output does not follow the input's rows: the layer computed "
            "it from something else, e.g. position ids of batch size 1 passed by keyword (BioGPT's "
            f"embed_positions), and it is broadcast over the batch later. Make its output batch-first, "
            f"{DECLARE_SHARED}, or freeze its parameters."
        )
    elif rows == 1:
        cause = (
            "its input is broadcast over the batch (leading size 1). Expand it to the batch before the "
            "layer, or freeze its parameters."
        )
    elif rows and rows % batch_size == 0 and not position_wise:
        cause = (
            f"its leading size is {rows // batch_size} x the batch size, which the sizes alone cannot "
            "explain: an input flattened to (B*T, ...) cannot be folded back per example by a rule that "
            "acts on whole examples (or by the fallback), and a tensor without an example dimension "
            "(positions arange(T), broadcast over the batch later) needs its layer declared shared. Keep "
            f"its input batch-first, {DECLARE_SHARED}, or freeze its parameters."
        )
    else:
        cause = (
            "its leading dimension is not the example index (a time-major tensor, which only a "
            "position-wise rule reads, or a tensor shared by all examples). Make its input batch-first, "
            "declare a layer whose output is shared by all examples and meets the batch later (as T5's "
            "relative_attention_bias) with "
            "dpexp.privacy.shared.register_shared (or a weight read directly and passed to submodules, as "
            "DeBERTa-v2's rel_embeddings, with register_shared_weight), or freeze its parameters."
        )
    raise VerificationError(
        f"layer {shape} and an output gradient of shape {tuple(dy.shape)} for a micro-batch of "
        f"{batch_size} examples, but dim 0 must be the example index: {cause}"
    )


def replaced_example(args: tuple, kwargs: dict[str, Any], batch_size: int) -> tuple[tuple, dict] | None:
    """The call's arguments with example 0 replaced by the first example j whose data differs from it: row 0
    of every tensor with ``batch_size`` rows in dim 0 set to its row j (copies; ids stay valid ids). None if
    no such tensor exists or every example is the same."""
    batched = [t for t in tensors_in((args, kwargs)) if t.dim() and t.shape[0] == batch_size]
    differs = [j for j in range(1, batch_size) if any(not torch.equal(t[j], t[0]) for t in batched)]
    if not differs:
        return None
    j = differs[0]

    def replace(t: torch.Tensor) -> torch.Tensor:
        if not (t.dim() and t.shape[0] == batch_size):
            return t
        t = t.detach().clone()
        t[0] = t[j]
        return t

    return map_tensors(args, replace), map_tensors(kwargs, replace)


def moved_rows(real: torch.Tensor, replayed: torch.Tensor, batch_size: int, tol: float) -> str | None:
    """What moved in ``replayed`` against ``real`` outside example 0, or None: a tensor whose dim 0 is a
    multiple of the micro-batch size is example-major (row blocks of dim0 / b rows; check 1 refuses it
    otherwise) and must keep the rows of examples 1..b-1; any other tensor (shared by all examples) must
    not move at all. Floating-point rows agree up to ``tol`` relative to their norm."""
    if real.shape != replayed.shape:
        return f"its shape changed from {tuple(real.shape)} to {tuple(replayed.shape)}"
    rows = real.shape[0] if real.dim() else 0
    start = rows // batch_size if rows and rows % batch_size == 0 else 0
    a, b = real.detach()[start:], replayed.detach()[start:]
    if not a.numel():
        return None
    where = "rows of other examples" if start else "a tensor that is not batch-indexed"
    if not a.is_floating_point():
        return None if torch.equal(a, b) else f"{where} changed"
    a = a.reshape(a.shape[0], -1) if a.dim() else a.reshape(1, 1)
    b = b.reshape(a.shape)
    dtype = _wide(a.dtype)
    gap = torch.linalg.vector_norm((b.to(dtype) - a.to(dtype)), dim=1)
    scale = torch.linalg.vector_norm(a.to(dtype), dim=1)
    moved = (gap > tol * scale + torch.finfo(dtype).tiny ** 0.5).nonzero().flatten()
    if not moved.numel():
        return None
    row = int(moved[0]) + start
    return (
        f"{where} changed (row {row} of dim 0, relative change {float(gap[moved[0]] / scale[moved[0]]):.2g})"
    )


def _paired_tensors(real: Use, replayed: Use) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The tensor arguments of a layer's call in training and in check 4's replay, paired by position and
    keyword. An argument that is a tensor in one call only is left out: Hugging Face passes no attention
    mask (None) where no example is padded, and replacing a padded example 0 can remove the batch's only
    padding. What such an argument changes for the other examples shows in the inputs of the layers after,
    and in the model's outputs, which are compared all the same."""
    pairs = list(zip(real.args, replayed.args, strict=False))
    pairs += [(value, replayed.kwargs[key]) for key, value in real.kwargs.items() if key in replayed.kwargs]
    return [(t, r) for t, r in pairs if torch.is_tensor(t) and torch.is_tensor(r)]


def _mixed_error(what: str) -> VerificationError:
    return VerificationError(
        f"{what}, which per-example clipping cannot bound. Compute every example on its own."
    )


def _moved_input_error(layer: Layer, moved: str) -> VerificationError:
    return _mixed_error(
        f"layer {layer.name!r} ({type(layer.module).__name__}): when example 0's data changed, its input "
        f"moved for other examples ({moved}), so the forward mixes examples before this layer (batch "
        "statistics, a value computed from the whole batch under no_grad or detached, or a frozen module "
        "that mixes examples)"
    )


def _control_flow_error(what: str) -> VerificationError:
    return VerificationError(
        f"when example 0's data changed, the model called {what}, so one example's data decides how the "
        "others are computed; per-example clipping cannot bound that example's influence."
    )


@dataclass
class ModelCall:
    """One verified forward of the model: its arguments as given, the random and autocast state it started
    from, and its output: what :meth:`Verifier.check_independence` replays and compares."""

    args: tuple
    kwargs: dict[str, Any]
    device: torch.device
    rng: tuple[torch.Tensor, torch.Tensor | None]  # CPU state, and the accelerator's if on one
    autocast: tuple[bool, torch.dtype]
    output: Any = None


def _rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    accelerator = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), accelerator


@dataclass
class _Probe:
    """The verification of one forward/backward pair."""

    structure: tuple
    leaves: list[torch.Tensor]  # the model's floating-point inputs, as probed tensors that require gradients
    dtypes: set[torch.dtype]  # precisions seen (compute, output gradients, rule results): the tolerance
    tf32: bool  # float32 products may run in TF32 (precision.runs_tf32): the float32 tolerance is TF32's
    weights: torch.Tensor | None = None  # v, shape (b,)
    leaf_grads: list[torch.Tensor | None] = field(default_factory=list)  # of sum_i v_i l_i
    fingerprints: dict[int, RowFingerprint] = field(default_factory=dict)  # id(use) -> probe output gradient
    engine_sums: ProjectedSums | None = None  # sum_i v_i g_i from the engine's per-example gradients
    autograd_sums: ProjectedSums | None = None  # sum_i v_i grad l_i from autograd
    path: tuple = ()
    batch_first: set[int] = field(default_factory=set)  # indices in the path of uses verified unfolded
    time_major: set[int] = field(default_factory=set)  # indices in the path of uses verified time-major
    # check 4 on a use with two readings (dim 0 or dim 1 the examples): what moved under each, by index
    readings: dict[int, dict[bool, str | None]] = field(default_factory=dict)
    delivered: set[str] = field(default_factory=set)  # layers whose output gradient reached the engine
    calls: list[ModelCall] = field(default_factory=list)  # the forwards of the model being verified
    independent: bool = False  # check 4 ran with a changed example and passed
    mixed: VerificationError | None = None  # check 4's refusal, raised after checks 1 and 2 (more specific)


_TF32_HINT = (
    " The model's float32 products may run in TF32 on CUDA (torch.backends.cudnn.allow_tf32, PyTorch's "
    "default for convolutions and recurrent layers, or torch.backends.cuda.matmul.allow_tf32), which the "
    "per-example gradients do not reproduce: where a ReLU's input lies within that rounding of 0 the two "
    "differ by whole terms (an nn.RNN with nonlinearity='relu'). If so, set both flags to False."
)


class Verifier:
    """Checks 1-3 of the module docstring for one model: which forwards are verified (a new input structure,
    or every one with ``every_step``), the probe backward, and the comparisons in the plain pass."""

    def __init__(
        self,
        model: nn.Module,
        params: Mapping[str, nn.Parameter],
        owners: Mapping[str, list[str]],
        every_step: bool,
    ) -> None:
        self._params, self._owners, self._every_step = params, owners, every_step
        self._structures: set[tuple] = set()
        self._paths: set[tuple] = set()
        self._batch_first: dict[tuple, set[int]] = {}  # verified path -> its uses verified unfolded
        self._time_major: dict[tuple, set[int]] = {}  # verified path -> its uses verified time-major
        self._path: tuple = ()  # the path of the current backward
        self._index: dict[int, int] = {}  # id(use) -> its position in the current path
        self._state = StateWatch(model)
        self._model = model
        self._next: _Probe | None = None  # set by a verified forward, taken by its backward
        self.probe: _Probe | None = None  # the backward being verified

    # ------------------------------------------------------------------ forward
    def begin_forward(self, args: tuple, kwargs: dict[str, Any]) -> tuple | None:
        """Start of a training forward of the model: watch its state (check 3); if its input structure is new,
        make the parameters require gradients and the floating-point inputs probed leaves (new arguments)."""
        param = next(iter(self._params.values()))
        dtype = compute_dtype(param.device, param.dtype)
        call = ModelCall(
            args,
            kwargs,
            param.device,
            _rng_state(param.device),
            (torch.is_autocast_enabled(param.device.type), torch.get_autocast_dtype(param.device.type)),
        )
        if self._next is not None:  # another forward before the backward: part of the same verification
            self._state.start()
            self._next.dtypes.add(dtype)
            self._next.calls.append(call)
            return None
        structure = structure_signature(args, kwargs)
        if not self._every_step and structure in self._structures:
            self._state.start()
            return None
        self._state.start(snapshot=True)  # check 4 replays this verification from the state as it is now
        for p in self._params.values():
            p.requires_grad_(True)
        args, kwargs, leaves = differentiable_inputs(args, kwargs)
        self._next = _Probe(structure, leaves, {dtype}, runs_tf32(self._model, param.device), calls=[call])
        return args, kwargs

    def end_forward(self, output: Any) -> None:
        self._state.check()
        if self._next is not None:
            self._next.calls[-1].output = output

    # ------------------------------------------------------------------ backward
    def start_backward(self, forward: Forward, batch_size: int) -> bool:
        """Whether this backward is probed. A micro-batch of one example needs no probe (nothing to mix); a
        sequence of layer calls never verified, in a forward that was not verified, is refused."""
        probe, self._next = self._next, None
        path = self._path = forward.path
        self._index = {id(use): i for i, use in enumerate(forward.uses)}
        if batch_size < 2 or (probe is None and path in self._paths):
            return False
        if probe is None:
            raise VerificationError(
                "the model called its layers in a sequence that was never verified (data-dependent "
                "control flow), and parameters did not require gradients in this forward, so their uses "
                "cannot be checked. Construct the PrivacyEngine with verify_every_step=True."
            )
        probe.path = path
        self.probe = probe
        return True

    def check_independence(
        self,
        model: nn.Module,
        replaying: Callable[[Callable[[Use], None]], Any],
        uses: list[Use],
        batch_size: int,
    ) -> None:
        """Check 4: replay every verified forward of ``model`` with example 0 replaced by another example
        (``replaying(on_use)``: the capture's context in which a forward hands its layer calls to
        ``on_use``), from the random and autocast state it started from; every layer input and every
        batch-indexed output must keep the other examples' rows. The user's random state is left as it is.
        A failure is raised by :meth:`after_first_pass`, after checks 1 and 2, which name a layout problem
        (a time-major layer, an unseen use) more precisely."""
        try:
            self.probe.independent = self._replay_changed(model, replaying, uses, batch_size)
        except VerificationError as error:
            self.probe.mixed = error

    def _replay_changed(
        self,
        model: nn.Module,
        replaying: Callable[[Callable[[Use], None]], Any],
        uses: list[Use],
        batch_size: int,
    ) -> bool:
        """Check 4's replay and comparisons; False if every example is the same (nothing to replace)."""
        probe = self.probe
        tol = max(tolerance(dtype, probe.tf32) for dtype in probe.dtypes)
        inputs = [tensors_in((c.args, c.kwargs)) for c in probe.calls]
        if not any(t.dim() and t.shape[0] == batch_size for ts in inputs for t in ts):
            raise VerificationError(
                f"no input of the model has the micro-batch's {batch_size} examples in dim 0, so the "
                "engine cannot check that it processes every example on its own (check 4 of "
                "dpexp.privacy.verification). Pass the model's inputs batch-first."
            )
        changed = [replaced_example(c.args, c.kwargs, batch_size) for c in probe.calls]
        if not any(changed):
            return False
        position = iter(range(len(uses) + 1))

        def compare(replayed: Use) -> None:
            i = next(position)
            real = uses[i] if i < len(uses) else None
            if real is None or real.layer is not replayed.layer:
                raise _control_flow_error(f"another sequence (call {i}: layer {replayed.layer.name!r})")
            if [t._version for t in real.tensors] != real.versions:
                return  # changed in place after the call: check_use refuses it with its own message
            time_major = reads_time_major(real.layer)
            for t, r in _paired_tensors(real, replayed):
                moved = moved_rows(t, r, batch_size, tol)
                if time_major and t.dim() >= 2 and t.shape[1] == batch_size and r.shape == t.shape:
                    # which reading holds, check 1 establishes: keep what moved under each
                    moved_across = moved_rows(t.transpose(0, 1), r.transpose(0, 1), batch_size, tol)
                    if moved is None or moved_across is None:
                        readings = probe.readings.setdefault(i, {False: None, True: None})
                        readings[False] = readings[False] or moved
                        readings[True] = readings[True] or moved_across
                        continue
                if moved is not None:
                    raise _moved_input_error(real.layer, moved)

        with self._state.replaying():  # from the attributes as they were: check 3 learns which hold data
            outputs = [
                self._replay(model, replaying, compare, call, *(replaced or (call.args, call.kwargs)))
                for call, replaced in zip(probe.calls, changed, strict=True)
            ]
        if next(position) != len(uses):
            raise _control_flow_error("fewer layers")
        for call, output in zip(probe.calls, outputs, strict=True):
            pairs = zip(tensors_in(call.output), tensors_in(output), strict=False)
            for k, (real, replayed) in enumerate(pairs):
                rows = real.shape[0] if real.dim() else 0
                if not rows or rows % batch_size or not real.is_floating_point():
                    continue  # a batch-level summary (e.g. a mean loss): not part of any example's output
                moved = moved_rows(real, replayed, batch_size, tol)
                if moved is not None:
                    raise _mixed_error(
                        f"output tensor {k} of the model (shape {tuple(real.shape)}): when example 0's data "
                        f"changed, it moved for other examples ({moved}), so the forward mixes examples "
                        "after its trainable layers (e.g. a normalisation by a batch statistic, detached or "
                        "not)"
                    )
        return True

    def _replay(
        self,
        model: nn.Module,
        replaying: Callable[[Callable[[Use], None]], Any],
        on_use: Callable[[Use], None],
        call: ModelCall,
        args: tuple,
        kwargs: dict[str, Any],
    ) -> Any:
        """The model run on ``args`` from ``call``'s random and autocast state, its parameters frozen (no
        graph is built: the replay holds no activations); the user's random state is restored after."""
        devices = [call.device] if call.device.type == "cuda" else []
        enabled, autocast_dtype = call.autocast
        kept = {name: p.requires_grad for name, p in self._params.items()}
        try:
            for p in self._params.values():
                p.requires_grad_(False)
            with torch.random.fork_rng(devices=devices), replaying(on_use):
                torch.set_rng_state(call.rng[0])
                if call.rng[1] is not None:
                    torch.cuda.set_rng_state(call.rng[1], call.device)
                with torch.autocast(call.device.type, dtype=autocast_dtype, enabled=enabled):
                    return model(*args, **kwargs)
        finally:
            for name, p in self._params.items():
                p.requires_grad_(kept[name])

    def run_probe(self, per_example_loss: torch.Tensor) -> None:
        """Backpropagate ``sum_i v_i l_i`` through the same graph; the engine hands every output gradient to
        :meth:`record` meanwhile. Autograd's gradient of every parameter is projected as it arrives (one at
        a time: no parameter-sized state), and the gradients of the probed inputs are kept."""
        probe = self.probe
        probe.weights = probe_weights(per_example_loss.shape[0], per_example_loss)
        directions = ProjectedSums.directions_for(self._params)
        probe.engine_sums, probe.autograd_sums = ProjectedSums(directions), ProjectedSums(directions)

        def project(name: str, param: nn.Parameter) -> None:
            probe.autograd_sums.add(name, param.grad)
            param.grad = None

        kept = {name: p.grad for name, p in self._params.items()}
        handles = [p.register_post_accumulate_grad_hook(partial(project, n)) for n, p in self._params.items()]
        try:
            for p in [*self._params.values(), *probe.leaves]:
                p.grad = None
            torch.autograd.backward(
                per_example_loss,
                probe.weights,
                retain_graph=True,
                inputs=[*self._params.values(), *probe.leaves],
            )
        finally:
            for handle in handles:
                handle.remove()
            for name, p in self._params.items():
                p.grad = kept[name]
        probe.leaf_grads = [leaf.grad for leaf in probe.leaves]
        for leaf in probe.leaves:
            leaf.grad = None

    def layout(
        self, use: Use, dy: torch.Tensor, layouts: list[Layout], phase: str, batch_size: int
    ) -> Layout:
        """Which of the ``layouts`` the sizes allow (:func:`check_use`, dim 0's first) holds for ``use``.

        Probe pass: every one is fingerprinted. First plain pass of a probed backward: the first whose rows
        of ``dy`` are the probe's scaled by ``v_i`` (check 1) and under whose reading check 4's replay kept
        the other examples, remembered by the use's position in the path. Any other pass: the layout verified
        there. A use verified batch-first must not arrive flattened, nor one verified time-major otherwise
        (or the reverse): only a probe can tell an example-major (B*T) layout from a time-major (T*B) one, or
        a (T, b) tensor from a (b, T) one at T = b."""
        probe = self.probe
        if probe is not None and phase == "probe":
            probe.fingerprints[id(use)] = [RowFingerprint(ly.batch_first(dy, batch_size)) for ly in layouts]
            probe.dtypes.add(dy.dtype)
            return layouts[0]
        index = self._index.get(id(use), -1)
        if probe is not None and phase == "first":
            chosen = self._establish(use, dy, layouts, index)
            if chosen.time_major:
                probe.time_major.add(index)
            elif chosen.fold == 1:
                probe.batch_first.add(index)
            return chosen
        time_major = index in self._time_major.get(self._path, ())
        matching = [ly for ly in layouts if ly.time_major == time_major]
        layer = use.layer
        where = f"layer {layer.name!r} ({type(layer.module).__name__})"
        never_probed = (
            "which example a row belongs to cannot be established without a probe. Construct the "
            "PrivacyEngine with verify_every_step=True."
        )
        flattened = bool(matching) and matching[0].fold > 1 and index in self._batch_first.get(self._path, ())
        if (not matching or flattened) and not bool(dy.any()):
            # no output gradient: every reading gives every example a zero gradient (rules are linear in
            # dy). A layer without one when verified (Longformer's last local attention, which the
            # classifier's token does not read) may have had its layout chosen without evidence.
            return layouts[0]
        if not matching:
            verified = "time-major (examples in dim 1)" if time_major else "with its examples in dim 0"
            raise VerificationError(
                f"{where} got an input of shape {tuple(use.tensors[0].shape)}, whose examples can only be "
                f"{layouts[0].describe()}, where the model was verified {verified}; {never_probed}"
            )
        if flattened:
            raise VerificationError(
                f"{where} got {matching[0].fold} rows per example, flattened into dim 0, where it had one "
                f"row per example when the model was verified; {never_probed}"
            )
        return matching[0]

    def _establish(self, use: Use, dy: torch.Tensor, layouts: list[Layout], index: int) -> Layout:
        """Check 1 of a use in the first plain pass: the first layout whose rows of ``dy`` scale with ``v_i``
        and that check 4 did not see mixing (its refusal is raised after checks 1 and 2, as any check-4
        failure); a use the probe did not reach keeps dim 0's layout and is never read time-major."""
        probe = self.probe
        fingerprints = probe.fingerprints.pop(id(use), None)
        layer = use.layer
        readings = probe.readings.get(index, {})
        if fingerprints is None:
            unprobed = [ly for ly in layouts if not ly.time_major]
            if not unprobed:
                raise VerificationError(
                    f"layer {layer.name!r} ({type(layer.module).__name__}): its input is time-major only if "
                    "the probe establishes it, and the probe's backward did not reach the layer"
                )
            if readings.get(False) is not None:  # check 4 saw dim 0's reading mix examples
                probe.mixed = probe.mixed or _moved_input_error(layer, readings[False])
            return unprobed[0]
        mixed = {
            ly: fingerprint.mixed_rows(ly.batch_first(dy, len(probe.weights)), probe.weights)
            for ly, fingerprint in zip(layouts, fingerprints, strict=True)
        }
        scaled = [ly for ly in layouts if not mixed[ly].numel()]
        for ly in scaled:
            if readings.get(ly.time_major) is None:
                return ly
        if scaled:  # check 1 holds only under a reading whose input moved for other examples
            probe.mixed = probe.mixed or _moved_input_error(layer, readings[scaled[0].time_major])
            return scaled[0]
        which = "dim 0" if len(layouts) == 1 else "neither dim 0 nor dim 1 (read time-major)"
        which = "dim 1" if layouts[0].time_major else which
        row = int(mixed[layouts[0]][0])
        raise VerificationError(
            f"layer {layer.name!r} ({type(layer.module).__name__}): row {row} of its output gradient "
            f"depends on other examples' losses, so {which} of its input and output is not the example "
            "index (a time-major or flattened tensor whose leading size happens to equal the batch size, a "
            "tensor shared by all examples, or examples mixed after this layer). Make the "
            f"layer's input batch-first and per-example, {DECLARE_SHARED}, or freeze its parameters."
        )

    def add_engine_sums(self, use: Use, grads: Mapping[str, PerExampleGrad]) -> None:
        """First plain pass: the engine's side of check 2, ``sum_i v_i g_i`` of this use."""
        self.probe.delivered.add(use.layer.name)
        for attr, grad in grads.items():
            if attr in use.layer.params:
                total = grad.weighted_sum(self.probe.weights)
                self.probe.dtypes.add(total.dtype)  # a rule may compute in lower precision
                self.probe.engine_sums.add(use.layer.params[attr], total)

    def after_first_pass(self) -> None:
        """Check 2 for every parameter and check 1 at the model's inputs, then mark the structure and the
        sequence of layer calls as verified."""
        probe = self.probe
        self._check_parameter_uses(probe)
        self._check_model_inputs(probe)
        if probe.mixed is not None:
            raise probe.mixed
        if probe.independent:  # else verified again at the next forward of this structure
            self._structures.add(probe.structure)
        self._paths.add(probe.path)
        self._batch_first[probe.path] = probe.batch_first
        self._time_major[probe.path] = probe.time_major

    def _check_parameter_uses(self, probe: _Probe) -> None:
        tol = max(tolerance(dtype, probe.tf32) for dtype in probe.dtypes)
        mismatched = mismatched_parameters(probe.engine_sums, probe.autograd_sums, tol)
        if not mismatched:
            return
        name, gap = mismatched[0]
        owners = self._owners[name]
        called = {entry[0] for entry in probe.path}
        if any(owner in called for owner in owners) and not any(owner in probe.delivered for owner in owners):
            raise VerificationError(
                f"parameter {name!r} has a gradient, but the gradient of the output of its "
                f"module{'s' * (len(owners) > 1)} {owners} never reached the engine, so it cannot be "
                "clipped. Autograd drops the hook on a layer's output when that output is a view (a Linear's "
                "3-D output) modified in place afterwards (Longformer's `query /= sqrt(head_dim)`). Make "
                "that change out of place (q = q / s), or freeze the parameter."
            )
        raise VerificationError(
            f"parameter {name!r}: the per-example gradients from its module{'s' * (len(owners) > 1)} "
            f"{owners} do not add up to its gradient (relative difference {gap:.2g}): it is used outside "
            "their forward (e.g. F.linear(h, emb.weight) as a hand-tied output layer, or in the loss), "
            "where the engine cannot clip it, or a rule is wrong. Use it through a module (an nn.Linear "
            "whose weight is the tied parameter is exact), declare the module whose forward reads it "
            "(dpexp.privacy.register_reads, for a module without a rule), or freeze it."
            + (f" Also: {[n for n, _ in mismatched[1:5]]}." if len(mismatched) > 1 else "")
            + (_TF32_HINT if probe.tf32 else "")
        )

    @staticmethod
    def _check_model_inputs(probe: _Probe) -> None:
        """The gradient of a floating-point input with the batch size in dim 0 must scale row by row with the
        probe weights, or examples are mixed before or between the layers."""
        for i, (leaf, grad) in enumerate(zip(probe.leaves, probe.leaf_grads, strict=True)):
            if grad is None or leaf.grad is None or leaf.shape[0] != probe.weights.shape[0]:
                continue
            if RowFingerprint(grad).mixed_rows(leaf.grad, probe.weights).numel():
                raise VerificationError(
                    f"floating-point input {i} of the model (shape {tuple(leaf.shape)}): the loss of one "
                    "example depends on another example's input, so the forward mixes examples before or "
                    "between its layers (batch statistics, or a tensor shared by all examples passed with "
                    "the batch). Per-example clipping cannot bound such an example's influence."
                )

    def release_parameters(self) -> None:
        """Parameters stop requiring gradients: from here on the engine forms their gradients itself."""
        for p in self._params.values():
            p.requires_grad_(False)

    def remove(self) -> None:
        """Take check 3's hooks off the model."""
        self._state.remove()

    def end_backward(self) -> None:
        self.release_parameters()
        self._state.settle()
        self.probe = None
