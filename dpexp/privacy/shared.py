"""Tensors shared by all examples that meet the batch later.

T5's (and mT5's, UMT5's, LongT5's) ``relative_attention_bias`` is an ``nn.Embedding`` called on a (q, k)
tensor of relative-position buckets: its output S, shape (q, k, heads), has no example dimension. It becomes
the bias (1, heads, q, k) that every attention layer of the stack adds to its (B, heads, q, k) scores, so the
gradient reaching S is already summed over the examples, and clipping it would clip the batch, not an
example. The learned positions of BART's, mBART's and PLBART's decoders and of BioGPT are the same kind:
looked up for position ids of batch size 1 (``arange(T)``, passed by keyword) and added to every example's
token embeddings.

The per-example gradient of S is taken where S meets the batch. Let X = f(S) be the tensor that a
broadcasting operation combines with per-example tensors (``scores + bias``, ``torch.where(mask, bias, m)``,
``scaled_dot_product_attention(..., attn_mask=bias)``), where f is the batch-free chain of operations from S
(permute, unsqueeze, ...). X is broadcast over dim 0 (leading size 1); the operation is given X expanded to
the size of that dimension in its result instead, which leaves its output unchanged, and the gradient of the
expansion, (B, ...), has example i's part ``dX_i`` in row i. Then ``dS_i = J_f^T dX_i``, one batched
vector-Jacobian product through f (``torch.autograd.grad(..., is_grads_batched=True)``), summed over every
place where S meets the batch (every attention layer), is example i's gradient of S. The layer's rule then
runs unchanged on its input expanded to the batch: ``dW_i = rule(x, dS_i)``.

Tables read as a whole. BEiT's relative position bias (Hugging Face's ``BeitRelativePositionBias``, and
data2vec-vision's; Bao et al. 2022, BEiT, sec. 2.5, after Swin's eq. 4) is called without a tensor input:
it resamples its own ``relative_position_bias_table`` to the patch grid and gathers it into S, the
(1, heads, N, N) bias added to the scores (the model's ``BeitModel.shared_position_bias`` once for all layers,
or one per layer). A declared shared layer without a rule gets its per-example gradients through its own
forward: S is the same function of its parameters W for every example, so ``dW_i = J_W^T dS_i`` with the
one Jacobian ``J_W = dS/dW``, every example at once, by one recomputed forward (checked against the
recorded S) and one batched vector-Jacobian product
(:func:`dpexp.privacy.rules.functional.shared_per_example_grads`; exact for any forward, resampling
included).

Shared *subgraphs*. DeBERTa-v2 (He et al. 2021, DeBERTa, section 3.1: the c2p and p2c terms of disentangled
attention) reads its relative position embeddings P = ``rel_embeddings.weight`` (2k, d) directly, normalises
them (``LayerNorm``, optional) and projects them in every layer, with that layer's ``query_proj`` and
``key_proj`` (``share_att_key``, the same Linear layers that project the batch) or with ``pos_query_proj`` /
``pos_key_proj``; the projections (h, 2k, d_head) are repeated ``B`` times along dim 0 and meet the
(B*h, T, d_head) queries and keys in a ``bmm``. Every layer on that path is a node of one batch-free graph:
a layer called on a shared tensor (its input is a :class:`SharedTensor`) makes its output shared in turn.
At every meeting the batched product ``J^T dX_i`` is taken to the output of *every* node the meeting
descends from at once, so each node N receives ``dN_i`` summed over all paths and meetings below it, and its
rule gives ``rule(x_N, dN_i)`` for its parameters (a layer used on the batch too, such as DeBERTa's
``query_proj``, then has one more use, added per example as for any parameter used twice). A weight read
outside its module's forward (P) is declared with :func:`register_shared_weight`: where the owner passes it
to one of its submodules, the argument becomes a shared tensor whose gradient is delivered to the
``nn.Embedding`` that holds it, through its own rule on the indices ``0..n-1`` (``Embedding(arange(n)) =
P`` exactly, for a table without ``padding_idx``); a frozen table's weight is only followed
(:func:`follow`), so that the trainable layers it reaches still know their input is shared.

How S and its batch-free descendants are followed: the output is returned as a :class:`SharedTensor` (a tensor
subclass whose ``__torch_function__`` wraps the results of operations on it), for the training forwards the
engine records only. S meets the batch at a broadcasting operation where X (its shape padded with leading 1s)
has size 1 in dim 0 and the result does not, or another operand is an activation (needs a gradient and is no
``nn.Parameter``; with a micro-batch of one the expansion is to size 1), and at ``X.repeat(r, 1, ..., 1)`` (a
repetition along dim 0 only: DeBERTa-v2's ``query_layer.size(0) // heads`` copies, expanded to (r, *X.shape)
and flattened) and ``X.expand(b, ...)`` from size 1 in dim 0 (MPNet's one relative attention bias for all
layers, expanded to the batch and then added to the scores in place; an in-place update of an activation by X
is a meeting too); other operations on X alone, with parameters (a Linear inside a shared layer) or with
constants (a causal mask), keep it a SharedTensor. The batch size is never compared with anything here:
whether dim 0 of the expanded tensors is the example index is established by the engine's verification: the
size check of every use, the probe (row i of every output gradient scales by its example's weight ``v_i``) and
check 2 (``sum_i v_i g_i`` of every parameter against autograd). On every backward, the per-example parts must
also add up to the gradient autograd delivers to every node, so a use of a shared tensor that this module did
not see (an operation it does not split) is refused, naming the operations.

Which layers produce shared outputs is declared by the type of the module that owns them
(:func:`register_shared`, :func:`register_shared_weight`).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from dpexp.privacy.precision import tolerance

_SHARED: dict[str, tuple[str, ...]] = {}  # qualified owner type -> attribute names of its shared layers
_SHARED_WEIGHTS: dict[str, tuple[str, ...]] = {}  # qualified owner type -> Embeddings whose weight it reads


def _qualified_name(module_type: type) -> str:
    return f"{module_type.__module__}.{module_type.__qualname__}"


def _key(owner_type: type[nn.Module] | str) -> str:
    return owner_type if isinstance(owner_type, str) else _qualified_name(owner_type)


def register_shared(owner_type: type[nn.Module] | str, *attrs: str) -> None:
    """Declare that the submodules ``attrs`` of every module of ``owner_type`` (a class or its qualified
    name) are called on inputs without an example dimension, their outputs shared by all examples."""
    _SHARED[_key(owner_type)] = (*_SHARED.get(_key(owner_type), ()), *attrs)


def register_shared_weight(owner_type: type[nn.Module] | str, *attrs: str) -> None:
    """Declare that every module of ``owner_type`` reads the weight of its ``nn.Embedding`` submodules
    ``attrs`` directly (outside their forward) and passes it, shared by all examples, to its submodules."""
    _SHARED_WEIGHTS[_key(owner_type)] = (*_SHARED_WEIGHTS.get(_key(owner_type), ()), *attrs)


register_shared("transformers.models.t5.modeling_t5.T5Attention", "relative_attention_bias")
register_shared("transformers.models.mt5.modeling_mt5.MT5Attention", "relative_attention_bias")
register_shared("transformers.models.umt5.modeling_umt5.UMT5Attention", "relative_attention_bias")
register_shared(
    "transformers.models.switch_transformers.modeling_switch_transformers.SwitchTransformersAttention",
    "relative_attention_bias",
)
for _attention in ("LongT5Attention", "LongT5LocalAttention", "LongT5TransientGlobalAttention"):
    register_shared(f"transformers.models.longt5.modeling_longt5.{_attention}", "relative_attention_bias")
# learned positions looked up for position ids of batch size 1 (arange(T)), added to every example
for _family, _owner in (("bart", "BartDecoder"), ("mbart", "MBartDecoder"), ("plbart", "PLBartDecoder")):
    register_shared(f"transformers.models.{_family}.modeling_{_family}.{_owner}", "embed_positions")
register_shared("transformers.models.biogpt.modeling_biogpt.BioGptModel", "embed_positions")
# learned positions called on a shape, with position ids (T,) passed by keyword (Blenderbot's,
# Blenderbot-small's and BigBird-Pegasus' encoders and decoders), added to every example
for _family, _name in (
    ("blenderbot", "Blenderbot"),
    ("blenderbot_small", "BlenderbotSmall"),
    ("bigbird_pegasus", "BigBirdPegasus"),  # the encoder's called on a shape without position ids
):
    for _stack in ("Encoder", "Decoder"):
        register_shared(
            f"transformers.models.{_family}.modeling_{_family}.{_name}{_stack}", "embed_positions"
        )
# one relative attention bias for all layers, expanded to the batch and added to the scores in place
register_shared("transformers.models.mpnet.modeling_mpnet.MPNetEncoder", "relative_attention_bias")
register_shared("transformers.models.beit.modeling_beit.BeitLayer", "relative_position_bias")
register_shared("transformers.models.beit.modeling_beit.BeitModel", "shared_position_bias")
_DATA2VEC = "transformers.models.data2vec.modeling_data2vec_vision"
register_shared(f"{_DATA2VEC}.Data2VecVisionSelfAttention", "relative_position_bias")
register_shared(f"{_DATA2VEC}.Data2VecVisionSdpaSelfAttention", "relative_position_bias")
register_shared(f"{_DATA2VEC}.Data2VecVisionEncoder", "relative_position_bias")
register_shared_weight(
    "transformers.models.deberta_v2.modeling_deberta_v2.DebertaV2Encoder", "rel_embeddings"
)
register_shared_weight("transformers.models.deberta.modeling_deberta.DebertaEncoder", "rel_embeddings")


def shared_modules(model: nn.Module) -> set[int]:
    """``id`` of every module of ``model`` declared shared by :func:`register_shared`."""
    found = set()
    for module in model.modules():
        for attr in _SHARED.get(_qualified_name(type(module)), ()):
            child = getattr(module, attr, None)
            if isinstance(child, nn.Module):
                found.add(id(child))
    return found


def shared_weights(model: nn.Module) -> list[tuple[nn.Module, nn.Embedding]]:
    """(owner, embedding) for every weight declared by :func:`register_shared_weight` in ``model``; refuses a
    declared table that is not an ``nn.Embedding`` without ``padding_idx`` (its rule on ``arange(n)`` would
    then not be the identity)."""
    found = []
    for name, module in model.named_modules():
        for attr in _SHARED_WEIGHTS.get(_qualified_name(type(module)), ()):
            table = getattr(module, attr, None)
            if table is None:
                continue
            if type(table) is not nn.Embedding or table.padding_idx is not None:
                raise ValueError(
                    f"module {name}.{attr} ({type(table).__name__}) is declared a weight read directly and "
                    "shared by all examples; the engine splits its gradient only for an nn.Embedding without "
                    "padding_idx. Freeze its parameters."
                )
            found.append((module, table))
    return found


# -------------------------------------------------------------------------------------------- meeting ops
_ELEMENTWISE = {
    torch.add,
    torch.sub,
    torch.mul,
    torch.div,
    torch.where,
    torch.Tensor.add,
    torch.Tensor.sub,
    torch.Tensor.mul,
    torch.Tensor.div,
    torch.Tensor.__add__,
    torch.Tensor.__radd__,
    torch.Tensor.__sub__,
    torch.Tensor.__rsub__,
    torch.Tensor.__mul__,
    torch.Tensor.__rmul__,
    torch.Tensor.__truediv__,
    torch.Tensor.__rtruediv__,
}
_IN_PLACE = {  # an activation updated in place by a shared operand (MPNet's ``scores += position_bias``)
    torch.Tensor.add_,
    torch.Tensor.sub_,
    torch.Tensor.mul_,
    torch.Tensor.div_,
    torch.Tensor.__iadd__,
    torch.Tensor.__isub__,
    torch.Tensor.__imul__,
    torch.Tensor.__itruediv__,
}
_MATMUL = {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.Tensor.__rmatmul__}


def plain(value: Any) -> Any:
    """``value`` as a plain tensor if it is a :class:`SharedTensor` (an alias in the same autograd graph)."""
    if not isinstance(value, SharedTensor):
        return value
    with torch._C.DisableTorchFunctionSubclass():
        return value.as_subclass(torch.Tensor)


def _activation(t: torch.Tensor) -> bool:
    """A tensor that carries examples: it needs a gradient and is not a parameter (parameters need one on
    the engine's verified forwards, and combined with a shared tensor they keep it shared)."""
    return t.requires_grad and not isinstance(t, nn.Parameter)


def _target_shape(func: Callable, args: tuple, kwargs: dict[str, Any]) -> torch.Size | None:
    """The shape a broadcasting operation gives its result (dims a shared operand may be expanded to), or
    None for an operation that is not split here."""
    tensors = [t for t in (*args, *kwargs.values()) if torch.is_tensor(t)]
    if func in _ELEMENTWISE or func in _IN_PLACE:
        return torch.broadcast_shapes(*(t.shape for t in tensors))
    if func in _MATMUL and len(tensors) == 2 and min(t.dim() for t in tensors) >= 2:
        a, b = tensors
        return torch.Size((*torch.broadcast_shapes(a.shape[:-2], b.shape[:-2]), 1, 1))
    if func is F.scaled_dot_product_attention:
        query = args[0] if args else kwargs["query"]
        return torch.Size((*query.shape[:-1], 1))
    return None


def _repeats(func: Callable, args: tuple, kwargs: dict[str, Any]) -> int | None:
    """r for ``X.repeat(r, 1, ..., 1)`` (a repetition of X along dim 0 only, as many counts as X has dims),
    else None."""
    if func is not torch.Tensor.repeat or kwargs or len(args) < 2:
        return None
    counts = tuple(args[1]) if len(args) == 2 and not isinstance(args[1], int) else args[1:]
    if len(counts) != args[0].dim() or any(int(c) != 1 for c in counts[1:]):
        return None
    return int(counts[0])


def _expansion(func: Callable, args: tuple, kwargs: dict[str, Any]) -> tuple[int, ...] | None:
    """The sizes of ``X.expand(*sizes)`` where it expands dim 0 (of X's shape padded with leading 1s) from 1
    to more (MPNet's ``bias.expand((bsz, -1, q, k))``), else None."""
    if func is not torch.Tensor.expand or kwargs or len(args) < 2:
        return None
    sizes = tuple(args[1]) if len(args) == 2 and not isinstance(args[1], int) else tuple(args[1:])
    x = args[0]
    if len(sizes) < x.dim() or (len(sizes) == x.dim() and x.shape[0] != 1) or int(sizes[0]) in (-1, 1):
        return None
    return tuple(int(size) for size in sizes)


class SharedOutput:
    """One node of a shared graph: the output S (``root``) of one call of a shared layer (or a weight read
    directly), the per-example parts of its gradient as the places where its descendants meet the batch
    report them, and their delivery once autograd has S's whole gradient.

    ``deliver(per_example_input, dS)`` receives the layer's input expanded to the batch (None for a layer
    called without a tensor input) and ``dS`` of shape (B, *S.shape), whose row i is example i's gradient of
    S.
    """

    def __init__(
        self, name: str, output: torch.Tensor, root: torch.Tensor, x: torch.Tensor | None, deliver: Callable
    ) -> None:
        self.name, self.root, self.x, self._deliver = name, root, x, deliver
        self.meetings: list[str] = []  # operations where S or a descendant met the batch (split)
        self.unsplit: list[str] = []  # operations combining them with activations (not split)
        self._parts: torch.Tensor | None = None  # sum of dS_i over the meetings seen in this backward
        self.splitting = False  # a product J^T dX_i to an older node passes through ``output`` (no total)
        output.register_hook(self._total)  # not on root: the products through f stop at root

    def add(self, part: torch.Tensor) -> None:
        """One meeting's ``dS_i`` (b, *S.shape); every meeting of a backward must have the same b."""
        if self._parts is not None and self._parts.shape != part.shape:
            sizes = f"{self._parts.shape[0]} and {part.shape[0]}"
            raise _refusal(
                f"the output of layer {self.name!r} is shared by all examples and met the batch with leading "
                f"sizes {sizes} in one backward (in {sorted(set(self.meetings))}): they cannot both be the "
                "examples. Freeze the layer's parameters."
            )
        self._parts = part if self._parts is None else self._parts + part

    def _total(self, grad: torch.Tensor) -> None:
        """S's whole gradient has arrived: every meeting of this backward has reported. The parts must add up
        to it; then the per-example gradients go to the engine."""
        if self.splitting:
            return
        parts, self._parts = self._parts, None
        if parts is None:
            raise _refusal(
                f"the output of layer {self.name!r} is shared by all examples but never met the batch in an "
                f"operation the engine splits per example (elementwise arithmetic, in place on an activation "
                f"too, torch.where, matmul, scaled_dot_product_attention with a bias broadcast over dim 0, "
                f"repeat or expand along dim 0)"
                + (
                    f"; it was combined with per-example tensors in {sorted(set(self.unsplit))}"
                    * bool(self.unsplit)
                )
                + ". Its per-example gradient cannot be formed: freeze the layer's parameters."
            )
        gap = float((parts.sum(0) - grad).abs().max())
        scale = float(grad.abs().max()) + float(parts.abs().max())
        if gap > tolerance(grad.dtype) * scale:
            unsplit = sorted(set(self.unsplit)) or "unknown"
            raise _refusal(
                f"the output of layer {self.name!r} is shared by all examples and reaches the loss through "
                f"operations the engine does not split per example ({unsplit}; "
                f"split: {sorted(set(self.meetings))}): its per-example gradients would miss part of it "
                f"(relative gap {gap / max(scale, 1e-300):.2g}). Freeze the layer's parameters."
            )
        x = None if self.x is None else self.x.expand(parts.shape[0], *self.x.shape)
        self._deliver(x, parts)


Lineage = tuple[SharedOutput, ...]  # the nodes a shared tensor descends from, oldest first


def _meet(lineage: Lineage, x: torch.Tensor, size: int, op: str) -> torch.Tensor:
    """``x`` (a batch-free descendant of ``lineage``, leading size 1) expanded to ``size`` in dim 0, its
    gradient hooked to hand every node its per-example part."""
    expanded = x.expand(size, *x.shape[1:])
    if lineage:  # else a frozen shared tensor (:func:`follow`): no gradient to split
        expanded.register_hook(partial(_split, lineage, x))
    for node in lineage:
        node.meetings.append(op)
    return expanded


def _split(lineage: Lineage, x: torch.Tensor, grad: torch.Tensor) -> None:
    """``dN_i = J^T dX_i`` for every node N and example i at once: one batched vector-Jacobian product through
    the batch-free graph from the nodes' outputs to ``x``. The product to an older node passes through the
    outputs of the newer ones (all in ``lineage``), whose hooks must not take it for their gradient."""
    for node in lineage:
        node.splitting = True
    try:
        parts = torch.autograd.grad(
            x,
            [node.root for node in lineage],
            grad.unsqueeze(1),
            retain_graph=True,
            is_grads_batched=True,
            allow_unused=True,
        )
    finally:
        for node in lineage:
            node.splitting = False
    for node, part in zip(lineage, parts, strict=True):
        if part is not None:
            node.add(part)


def _refusal(message: str) -> Exception:
    from dpexp.privacy.verification import VerificationError  # verification imports capture, which imports us

    return VerificationError(message)


class SharedTensor(torch.Tensor):
    """A batch-free descendant of shared outputs. Operations on it return SharedTensors, except where it meets
    the batch: a broadcasting operation whose result has it broadcast over dim 0, and either the result's
    dim 0 is not 1 or another operand is an activation, or a repetition along dim 0. There it is expanded
    (:func:`_meet`) and the result is a plain tensor. Any other operation combining it with an activation is
    recorded as not split and returns a plain tensor: the parts then miss that use, and
    :meth:`SharedOutput._total` refuses."""

    lineage: Lineage

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        flat, spec = tree_flatten((args, kwargs or {}))
        shared = [i for i, a in enumerate(flat) if isinstance(a, SharedTensor)]
        if not shared:
            return super().__torch_function__(func, types, args, kwargs)
        lineage = tuple(dict.fromkeys(node for i in shared for node in flat[i].lineage))
        with torch._C.DisableTorchFunctionSubclass():
            flat = [plain(a) for a in flat]
            others = [t for i, t in enumerate(flat) if torch.is_tensor(t) and i not in shared]
            met = _met(lineage, func, flat, set(shared), others, spec)
            if met is not None:
                return met
            args, kwargs = tree_unflatten(flat, spec)
            out = func(*args, **kwargs)
        if any(_activation(t) for t in others):  # combined with activations without a split: not shared
            for node in lineage:
                node.unsplit.append(_op_name(func))
            return out
        return tree_map(lambda t: _wrap(t, lineage) if torch.is_tensor(t) else t, out)


def _op_name(func: Callable) -> str:
    return getattr(func, "__name__", repr(func))


def _wrap(t: torch.Tensor, lineage: Lineage) -> SharedTensor:
    shared = t.as_subclass(SharedTensor)
    shared.lineage = lineage
    return shared


def _met(lineage: Lineage, func: Callable, flat: list, shared: set[int], others: list, spec: Any) -> Any:
    """The result of ``func`` with the shared operands expanded where they meet the batch, or None."""
    args, kwargs = tree_unflatten(flat, spec)
    repeats = _repeats(func, args, kwargs)
    if repeats is not None and 0 in shared:
        x = args[0]
        return _meet(lineage, x.unsqueeze(0), repeats, "repeat").flatten(0, 1)
    sizes = _expansion(func, args, kwargs)
    if sizes is not None and 0 in shared:
        x = args[0]
        padded = x.reshape((1,) * (len(sizes) - x.dim()) + tuple(x.shape))
        return _meet(lineage, padded, sizes[0], "expand").expand(sizes)
    if func in _IN_PLACE and 0 in shared:
        return None  # the shared tensor itself updated: no meeting
    target = _target_shape(func, args, kwargs)
    if target is None or len(target) == 0:
        return None
    if target[0] == 1 and not any(_activation(t) for t in others):
        return None  # still batch-free (a constant mask, or a micro-batch of one before the activations)
    out, met = list(flat), False
    for i in shared:
        value = flat[i]
        padded = value.reshape((1,) * (len(target) - value.dim()) + tuple(value.shape))
        if padded.shape[0] == 1:
            out[i], met = _meet(lineage, padded, target[0], _op_name(func)), True
    if not met:
        return None
    args, kwargs = tree_unflatten(out, spec)
    return func(*args, **kwargs)


def share(
    name: str, output: torch.Tensor, x: torch.Tensor | None, deliver: Callable, parents: Lineage = ()
) -> SharedTensor:
    """Follow a shared output (which needs a gradient, and is no leaf) to where it meets the batch; returns
    the tensor the layer's caller receives instead (numerically the same). ``x``: the layer's input (None:
    called without a tensor input); ``parents``: the nodes of the shared graph that ``output`` descends from
    (those of the layer's shared input)."""
    root = output.view_as(output)  # the chain f starts here; the whole gradient is taken at ``output``
    # the caller gets a copy: an in-place update of it (DeBERTa's ``pos_query_layer /= scale``) must not
    # change root, whose gradient would then be that of the updated values
    return _wrap(root.clone(), (*parents, SharedOutput(name, output, root, x, deliver)))


def follow(t: torch.Tensor) -> SharedTensor:
    """A tensor shared by all examples that needs no per-example gradient of its own (a frozen shared weight),
    followed so that the layers it reaches treat their input as shared."""
    return _wrap(t, ())


register_shared("timm.models.beit.Beit", "rel_pos_bias")  # use_shared_rel_pos_bias: one for all blocks
