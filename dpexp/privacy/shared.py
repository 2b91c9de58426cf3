"""Layers whose output is shared by all examples and meets the batch later.

T5's ``relative_attention_bias`` is an ``nn.Embedding`` called on a (q, k) tensor of relative-position
buckets: its output S, shape (q, k, heads), has no example dimension. It becomes the bias (1, heads, q, k)
that every attention layer of the stack adds to its (B, heads, q, k) scores, so the gradient reaching S is
already summed over the examples, and clipping it would clip the batch, not an example.

The per-example gradient of S is taken where S meets the batch. Let X = f(S) be the tensor that a
broadcasting operation combines with per-example tensors (``scores + bias``, ``torch.where(mask, bias, m)``,
``scaled_dot_product_attention(..., attn_mask=bias)``), where f is the batch-free chain of operations from S
(permute, unsqueeze, ...). X is broadcast over dim 0 (leading size 1); the operation is given X expanded to
the size of that dimension in its result instead, which leaves its output unchanged, and the gradient of the
expansion, (B, ...), has example i's part ``dX_i`` in row i. Then ``dS_i = J_f^T dX_i``, one batched
vector-Jacobian product through f (``torch.autograd.grad(..., is_grads_batched=True)``), summed over every
place where S meets the batch (every attention layer), is example i's gradient of S. The layer's rule then
runs unchanged on its input expanded to the batch: ``dW_i = rule(x, dS_i)``.

How S and its batch-free descendants are followed: the layer's output is returned as a :class:`SharedTensor`
(a tensor subclass whose ``__torch_function__`` wraps the results of operations on it), for the training
forwards the engine records only. S meets the batch at a broadcasting operation where X (its shape padded
with leading 1s) has size 1 in dim 0 and the result does not, or another operand needs a gradient (an
activation; with a micro-batch of one the expansion is to size 1); other operations on X alone, or with
constants (a causal mask), keep it a SharedTensor. The batch size is never compared with anything here:
whether dim 0 of the expanded tensors is the example index is established by the engine's verification:
the size check of every use, the probe (row i of
every output gradient scales by its example's weight ``v_i``) and check 2 (``sum_i v_i g_i`` of every
parameter against autograd). On every backward, the per-example parts must also add up to the gradient
autograd delivers to S, so a use of S that this module did not see (an operation it does not split) is
refused, naming the operations.

Which layers produce shared outputs is declared by the type of the module that owns them
(:func:`register_shared`); :func:`check_uncovered` refuses known shared structures this does not cover
(DeBERTa-v2's relative embeddings).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from dpexp.privacy.precision import tolerance

_SHARED: dict[str, tuple[str, ...]] = {}  # qualified owner type -> attribute names of its shared layers


def _qualified_name(module_type: type) -> str:
    return f"{module_type.__module__}.{module_type.__qualname__}"


def register_shared(owner_type: type[nn.Module] | str, *attrs: str) -> None:
    """Declare that the submodules ``attrs`` of every module of ``owner_type`` (a class or its qualified
    name) are called on inputs without an example dimension, their outputs shared by all examples."""
    key = owner_type if isinstance(owner_type, str) else _qualified_name(owner_type)
    _SHARED[key] = (*_SHARED.get(key, ()), *attrs)


register_shared("transformers.models.t5.modeling_t5.T5Attention", "relative_attention_bias")
register_shared("transformers.models.mt5.modeling_mt5.MT5Attention", "relative_attention_bias")
register_shared("transformers.models.umt5.modeling_umt5.UMT5Attention", "relative_attention_bias")


def shared_modules(model: nn.Module) -> set[int]:
    """``id`` of every module of ``model`` declared shared by :func:`register_shared`."""
    found = set()
    for module in model.modules():
        for attr in _SHARED.get(_qualified_name(type(module)), ()):
            child = getattr(module, attr, None)
            if isinstance(child, nn.Module):
                found.add(id(child))
    return found


def check_uncovered(name: str, module: nn.Module) -> None:
    """Refuse shared tensors that are known to meet the batch in a way this module does not split, where
    they reach trainable parameters."""
    kind = _qualified_name(type(module))
    trainable = any(p.requires_grad for p in module.parameters())
    if (
        kind == "transformers.models.deberta_v2.modeling_deberta_v2.DebertaV2Encoder"
        and getattr(module, "relative_attention", False)
        and trainable
    ):
        raise ValueError(
            f"module {name!r} (DebertaV2Encoder, relative_attention=True): its relative position embeddings "
            "(rel_embeddings.weight, read outside the Embedding's forward, then LayerNorm) are shared by all "
            "examples and go through every layer's query_proj/key_proj, the same Linear layers that process "
            "the batch, before they meet the batch in the attention scores; the privacy engine cannot split "
            "their per-example gradients (not supported yet). Use a model without relative attention "
            "(config.relative_attention=False), e.g. RoBERTa or BERT."
        )


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
_MATMUL = {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.Tensor.__rmatmul__}


def _plain(value: Any) -> Any:
    return value.as_subclass(torch.Tensor) if isinstance(value, SharedTensor) else value


def _target_shape(func: Callable, args: tuple, kwargs: dict[str, Any]) -> torch.Size | None:
    """The shape a broadcasting operation gives its result (dims a shared operand may be expanded to), or
    None for an operation that is not split here."""
    tensors = [t for t in (*args, *kwargs.values()) if torch.is_tensor(t)]
    if func in _ELEMENTWISE:
        return torch.broadcast_shapes(*(t.shape for t in tensors))
    if func in _MATMUL and len(tensors) == 2 and min(t.dim() for t in tensors) >= 2:
        a, b = tensors
        return torch.Size((*torch.broadcast_shapes(a.shape[:-2], b.shape[:-2]), 1, 1))
    if func is F.scaled_dot_product_attention:
        query = args[0] if args else kwargs["query"]
        return torch.Size((*query.shape[:-1], 1))
    return None


class SharedOutput:
    """One call of a shared layer: its output S (``root``), the per-example parts of its gradient as the
    places where S meets the batch report them, and their delivery once autograd has S's whole gradient.

    ``deliver(per_example_input, dS)`` receives the layer's input expanded to the batch and ``dS`` of shape
    (B, *S.shape), whose row i is example i's gradient of S.
    """

    def __init__(
        self, name: str, output: torch.Tensor, root: torch.Tensor, x: torch.Tensor, deliver: Callable
    ) -> None:
        self.name, self.root, self.x, self._deliver = name, root, x, deliver
        self.meetings: list[str] = []  # operations where S met the batch (split)
        self.unsplit: list[str] = []  # operations combining S with tensors that need a gradient (not split)
        self._parts: torch.Tensor | None = None  # sum of dS_i over the meetings seen in this backward
        output.register_hook(self._total)  # not on root: the products through f stop at root

    def meet(self, x: torch.Tensor, size: int, op: str) -> torch.Tensor:
        """``x`` (a descendant of S, leading size 1) expanded to ``size`` in dim 0, its gradient hooked."""
        expanded = x.expand(size, *x.shape[1:])
        expanded.register_hook(lambda grad: self._part(x, grad))
        self.meetings.append(op)
        return expanded

    def _part(self, x: torch.Tensor, grad: torch.Tensor) -> None:
        """``dS_i = J_f^T dX_i`` for every example i at once: a batched vector-Jacobian product through the
        batch-free chain f from S to ``x``."""
        (part,) = torch.autograd.grad(
            x, self.root, grad.unsqueeze(1), retain_graph=True, is_grads_batched=True
        )
        self._parts = part if self._parts is None else self._parts + part

    def _total(self, grad: torch.Tensor) -> None:
        """S's whole gradient has arrived: every meeting of this backward has reported. The parts must add up
        to it; then the per-example gradients go to the engine."""
        parts, self._parts = self._parts, None
        if parts is None:
            raise _refusal(
                f"the output of layer {self.name!r} is shared by all examples but never met the batch in an "
                f"operation the engine splits per example (elementwise arithmetic, torch.where, matmul, "
                f"scaled_dot_product_attention with a bias broadcast over dim 0)"
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
        self._deliver(self.x.expand(parts.shape[0], *self.x.shape), parts)


def _refusal(message: str) -> Exception:
    from dpexp.privacy.verification import VerificationError  # verification imports capture, which imports us

    return VerificationError(message)


class SharedTensor(torch.Tensor):
    """A batch-free descendant of a shared layer's output. Operations on it return SharedTensors, except where
    it meets the batch: a broadcasting operation whose result has it broadcast over dim 0, and either the
    result's dim 0 is not 1 or another operand needs a gradient (a per-example activation). There it is
    expanded (:meth:`SharedOutput.meet`) and the result is a plain tensor. Any other operation combining it
    with a tensor that needs a gradient is recorded as not split and returns a plain tensor: the parts then
    miss that use, and :meth:`SharedOutput._total` refuses."""

    _source: SharedOutput

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        flat, spec = tree_flatten((args, kwargs or {}))
        shared = {i for i, a in enumerate(flat) if isinstance(a, SharedTensor)}
        if not shared:
            return super().__torch_function__(func, types, args, kwargs)
        source = flat[min(shared)]._source
        with torch._C.DisableTorchFunctionSubclass():
            flat = [_plain(a) for a in flat]
            others = [t for i, t in enumerate(flat) if torch.is_tensor(t) and i not in shared]
            met = _meet(source, func, flat, shared, others, spec)
            if met is not None:
                args, kwargs = tree_unflatten(met, spec)
                return func(*args, **kwargs)
            args, kwargs = tree_unflatten(flat, spec)
            out = func(*args, **kwargs)
        if any(t.requires_grad for t in others):  # combined with activations without a split: not shared
            source.unsplit.append(_op_name(func))
            return out
        return tree_map(lambda t: _wrap(t, source) if torch.is_tensor(t) else t, out)


def _op_name(func: Callable) -> str:
    return getattr(func, "__name__", repr(func))


def _wrap(t: torch.Tensor, source: SharedOutput) -> SharedTensor:
    shared = t.as_subclass(SharedTensor)
    shared._source = source
    return shared


def _meet(
    source: SharedOutput, func: Callable, flat: list, shared: set[int], others: list, spec: Any
) -> list | None:
    """The flattened arguments with the shared operands expanded where they meet the batch, or None."""
    args, kwargs = tree_unflatten(flat, spec)
    target = _target_shape(func, args, kwargs)
    if target is None or len(target) == 0:
        return None
    if target[0] == 1 and not any(t.requires_grad for t in others):
        return None  # still batch-free (a constant mask, or a micro-batch of one before the activations)
    out, met = list(flat), False
    for i in shared:
        value = flat[i]
        padded = value.reshape((1,) * (len(target) - value.dim()) + tuple(value.shape))
        if padded.shape[0] == 1:
            out[i], met = source.meet(padded, target[0], _op_name(func)), True
    return out if met else None


def share(name: str, output: torch.Tensor, x: torch.Tensor, deliver: Callable) -> SharedTensor:
    """Follow a shared layer's output (which needs a gradient) to where it meets the batch; returns the
    tensor the layer's caller receives instead (numerically the same)."""
    root = output.view_as(output)  # the chain f starts here; the whole gradient is taken at ``output``
    return _wrap(root, SharedOutput(name, output, root, x, deliver))
