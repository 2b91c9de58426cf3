"""Reading a layer's call off the autograd graph it built, instead of recomputing it.

A rule for a module whose parameters enter inside its forward (``nn.MultiheadAttention``'s input projection,
applied by ``F.multi_head_attention_forward``, not by a submodule) can recompute the forward from the
captured inputs and backpropagate the output gradient through it: as costly as the layer's own forward and
backward. The graph autograd builds for the call already holds both halves: the values its backward keeps
(the attention kernel's output, the context) and, at every node, the gradient of that node's output when the
backward pass reaches it. :class:`GraphReads` names what a rule takes from the graph: values read at the
call, and the nodes whose output gradients the capture waits for before it hands the call to the engine
(:class:`~dpexp.privacy.rules.CallLayout`'s ``graph``).

Nodes are found by what they hold, never by sizes: a matrix product is the input projection when the matrix
it keeps for the backward *is* the weight's transpose (the same storage, offset, shape and strides), and the
search stays inside the call (it stops at the nodes of the call's inputs). Where the graph lacks that
structure (no gradient inside the call, autocast's copies of the weights, a kernel that keeps other values,
a node found twice) the functions return None and the rule recomputes. What the graph gives is checked like
any rule's output: on a verified micro-batch the per-example gradients must add up to autograd's
(:mod:`dpexp.privacy.verification`, check 2). The saved tensors are read by the names autograd gives them
(``_saved_mat2``, ``_saved_self``, ``_saved_output``) and the nodes known by their class names: a torch
release that renamed them would leave nothing found, and the rules recomputing, never a wrong read.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch.autograd.graph import Node

_LIMIT = 256  # nodes a call's graph may hold before the search gives up (it left the call)
_PER_STEP = 16  # and per time step of a call that loops over time (a recurrence's scan)


@dataclass(frozen=True)
class GraphReads:
    """``values``: tensors read from the graph at the call (detached); ``nodes``: the nodes whose output
    gradients the rule also needs, by the key under which it gets each."""

    values: dict[str, torch.Tensor]
    nodes: dict[str, Node]


def call_nodes(
    output: torch.Tensor | tuple[torch.Tensor, ...], inputs: Iterable[torch.Tensor], steps: int = 0
) -> list[Node] | None:
    """The nodes of the graph between a call's ``output`` (a tensor, or a tuple of them: the nodes behind
    each) and its ``inputs`` (their nodes and the parameters' ``AccumulateGrad`` excluded); None when no
    output has a graph, when saved tensors pass through hooks (:func:`_saved_tensors_hooked`), or when the
    search passes :data:`_LIMIT` nodes, and :data:`_PER_STEP` more for each of the ``steps`` time steps a
    call that loops over time runs (it left the call through an input it was not given)."""
    outputs = output if isinstance(output, tuple) else (output,)
    roots = [t.grad_fn for t in outputs if torch.is_tensor(t) and t.grad_fn is not None]
    if not roots or _saved_tensors_hooked():
        return None
    # the nodes themselves are held (Python wraps a node only while referenced: a freed wrapper's id could
    # come back as another node's)
    stops = {id(node): node for node in (t.grad_fn for t in inputs) if node is not None}
    found: dict[int, Node] = {}
    limit = _LIMIT + _PER_STEP * steps
    frontier = roots
    while frontier:
        node = frontier.pop()
        if id(node) in found or id(node) in stops or _is_leaf(node):
            continue
        found[id(node)] = node
        if len(found) > limit:
            return None
        frontier.extend(n for n, _ in node.next_functions if n is not None)
    return list(found.values())


def _saved_tensors_hooked() -> bool:
    """Whether tensors saved now pass through hooks (activation checkpointing, offloading): reading them at
    the call would run the hooks' unpacking (a checkpoint's recomputation) early. Unknown: taken as yes."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top is None or top(False) is not None


def _is_leaf(node: Node) -> bool:
    return hasattr(node, "variable")  # AccumulateGrad: a leaf tensor's gradient sink


def saved(node: Node, name: str) -> torch.Tensor | None:
    """``node``'s saved tensor ``name`` (None: the node has none of that name, or autograd did not keep
    it because the backward does not need it)."""
    try:
        value = getattr(node, name, None)
    except RuntimeError:  # freed after a backward, or not unpackable
        return None
    return value if torch.is_tensor(value) else None


def matmul_with(nodes: Iterable[Node], weight: torch.Tensor, cast: bool = False) -> Node | None:
    """The one matrix product ``a @ weight.T`` among ``nodes``, found by the matrix it keeps for its backward
    being ``weight.T`` itself (the same storage, offset, shape and strides), or ``weight.T`` broadcast over
    leading dimensions of stride 0: ``F.linear`` on a 3-D input records ``mm`` / ``addmm`` of the input
    flattened, or ``bmm`` with the weight expanded where the input is not contiguous. ``cast``: or autocast's
    copy of it (:func:`_the_one`). None if there is none or more than one. Its output gradient is that of
    ``a @ weight.T`` (plus a bias), ``a``'s leading dimensions flattened or not."""
    transposed = weight.t()
    return _the_one(nodes, None, "_saved_mat2", transposed, broadcast=True, cast=cast)


def kept_as(
    nodes: Iterable[Node], node_class: str, name: str, tensor: torch.Tensor, cast: bool = False
) -> Node | None:
    """The one node of class ``node_class`` among ``nodes`` that keeps ``tensor`` itself as its saved
    ``name`` (the same storage, offset, shape and strides: ``BaddbmmBackward0``'s ``_saved_batch2``, a
    block-diagonal weight (H, n, m) multiplying each head's rows), or with ``cast`` autocast's copy of it
    (:func:`_the_one`); None if there is none or more than one."""
    return _the_one(nodes, node_class, name, tensor, broadcast=False, cast=cast)


def _the_one(
    nodes: Iterable[Node],
    node_class: str | None,
    name: str,
    tensor: torch.Tensor,
    broadcast: bool,
    cast: bool = False,
) -> Node | None:
    """The one node (of class ``node_class``, any if None) whose saved ``name`` is ``tensor`` itself: the
    same dtype, storage, offset, shape and strides, or with ``broadcast`` those of ``tensor`` in its last
    dimensions and leading dimensions of stride 0 (``tensor`` expanded). With ``cast``, where no node keeps
    ``tensor`` itself, the one that keeps a copy of it in another floating dtype, equal in value to
    ``tensor`` cast to that dtype (autocast casts a parameter to its dtype before a product or convolution:
    the node keeps that copy, laid out as ``tensor``). None if none or several."""
    found = _matching(nodes, node_class, name, tensor, broadcast, copy=False)
    if not found and cast:
        found = _matching(nodes, node_class, name, tensor, broadcast, copy=True)
    return found[0] if len(found) == 1 else None


def _matching(
    nodes: Iterable[Node],
    node_class: str | None,
    name: str,
    tensor: torch.Tensor,
    broadcast: bool,
    copy: bool,
) -> list[Node]:
    """:func:`_the_one`'s candidates: nodes keeping ``tensor`` itself, or with ``copy`` a cast copy of it."""
    matches = []
    for node in nodes:
        if node_class is not None and type(node).__name__ != node_class:
            continue
        kept = saved(node, name)
        if kept is None:
            continue
        if copy:
            if kept.dtype == tensor.dtype or not kept.is_floating_point():
                continue
        elif kept.dtype != tensor.dtype or kept.data_ptr() != tensor.data_ptr():
            continue
        lead = kept.dim() - tensor.dim()
        if (lead > 0 and not broadcast) or lead < 0:
            continue
        if (
            kept.shape[lead:] == tensor.shape
            and kept.stride()[lead:] == tensor.stride()
            and all(stride == 0 for stride in kept.stride()[:lead])
            and (not copy or torch.equal(kept[(0,) * lead], tensor.to(kept.dtype)))
        ):
            matches.append(node)
    return matches


def product_with(nodes: Iterable[Node], factor: torch.Tensor, by_value: bool = False) -> Node | None:
    """The one elementwise product ``a * b`` (``MulBackward0``) among ``nodes`` that keeps ``factor`` as an
    operand for its backward (:func:`saved_operands`): ``factor`` itself (the same storage and shape: a
    parameter multiplying the stream), or with ``by_value`` a tensor equal to it (a factor the forward forms
    anew, as ``(c s)^2``). None if there is none or more than one. Its output gradient is that of the
    product."""
    matches = [
        node
        for node in nodes
        if any(t is not None and _same(t, factor, by_value) for t in saved_operands(node) or ())
    ]
    return matches[0] if len(matches) == 1 else None


def _same(kept: torch.Tensor, factor: torch.Tensor, by_value: bool) -> bool:
    if by_value:
        return torch.equal(kept, factor)
    return kept.data_ptr() == factor.data_ptr() and kept.shape == factor.shape


def saved_operands(node: Node) -> tuple[torch.Tensor | None, torch.Tensor | None] | None:
    """The two operands an elementwise product ``self * other`` (``MulBackward0``) keeps for its backward,
    detached (``other`` is kept where ``self`` needs a gradient, and the reverse); None for another node."""
    if type(node).__name__ != "MulBackward0":
        return None
    kept = (saved(node, "_saved_self"), saved(node, "_saved_other"))
    return tuple(None if t is None else t.detach() for t in kept)


def other_operand(node: Node, factor: torch.Tensor) -> torch.Tensor | None:
    """The operand an elementwise product (``MulBackward0``) keeps beside ``factor`` (one it keeps equal to
    ``factor`` in shape and value: a product :func:`product_with` found by value), detached; None where it
    kept no other (autograd keeps it only where ``factor`` needs a gradient)."""
    others = [
        t
        for t in saved_operands(node) or ()
        if t is not None and not (t.shape == factor.shape and torch.equal(t, factor))
    ]
    return others[0] if len(others) == 1 else None


def produced_by(value: torch.Tensor) -> Node | None:
    """The node whose output ``value`` is (a value a rule keeps from the call): the gradient at ``value``
    arrives there as that node's output gradient. None where ``value`` has no graph, or is not its node's
    first output (the gradient read is the first)."""
    node = value.grad_fn if torch.is_tensor(value) else None
    return node if node is not None and value.output_nr == 0 else None


_COPIES = {  # nodes whose output is their one input's values, moved or copied
    "ViewBackward0",
    "UnsafeViewBackward0",
    "ReshapeAliasBackward0",
    "CloneBackward0",
    "TransposeBackward0",
    "PermuteBackward0",
}


_INPUT_EDGE = {"MmBackward0": 0, "AddmmBackward0": 1}  # mm(input, mat2), addmm(bias, input, mat2)


def kept_product_below(node: Node, nodes: list[Node]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The two matrices ``(a, b)`` that the ``bmm`` feeding the input of the matrix product ``node`` (of
    :func:`matmul_with`) through views and copies only keeps for its backward, detached: ``a @ b`` is that
    input, up to the moves. None if the chain meets another operation, or ``node`` is not a 2-D product."""
    edge = _INPUT_EDGE.get(type(node).__name__)
    return None if edge is None else _bmm_below(node.next_functions[edge][0], len(nodes), _COPIES)


def _bmm_below(
    current: Node | None, limit: int, passed: set[str]
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The two matrices kept by the first ``bmm`` reached from ``current`` along first inputs through nodes
    of the classes ``passed`` (views and copies of their one input; an operation's first operand), at most
    ``limit`` steps; detached. None if the chain meets another node first."""
    for _ in range(limit):
        if current is None:
            return None
        a, b = saved(current, "_saved_self"), saved(current, "_saved_mat2")
        if type(current).__name__ == "BmmBackward0" and a is not None and b is not None:
            return a.detach(), b.detach()
        name = type(current).__name__
        if name not in passed or (name in _COPIES and len(current.next_functions) != 1):
            return None
        current = current.next_functions[0][0]
    return None


def kept_attention_output(nodes: Iterable[Node]) -> torch.Tensor | None:
    """The output of the one fused attention kernel among ``nodes``
    (``scaled_dot_product_attention``'s flash / efficient / cuDNN kernels keep it for their backward:
    (N, heads, L, E_v)), detached; None if there is none or more than one."""
    outputs = [t for t in (saved(node, "_saved_output") for node in nodes) if t is not None]
    return outputs[0].detach() if len(outputs) == 1 else None


def kept_by(nodes: Iterable[Node], node_class: str, name: str) -> tuple[Node, torch.Tensor] | None:
    """The one node of class ``node_class`` among ``nodes`` and its saved tensor ``name``, detached
    (``SoftmaxBackward0``, ``_saved_result``: the probabilities); None if there is none, more than one, or
    it kept no such tensor."""
    found = [node for node in nodes if type(node).__name__ == node_class]
    kept = saved(found[0], name) if len(found) == 1 else None
    return None if kept is None else (found[0], kept.detach())


def kept_by_each(nodes: Iterable[Node], node_class: str, name: str) -> list[torch.Tensor]:
    """The saved tensor ``name`` of every node of class ``node_class`` among ``nodes`` that kept one,
    detached (``SigmoidBackward0``, ``_saved_result``: each sigmoid's output)."""
    kept = (saved(node, name) for node in nodes if type(node).__name__ == node_class)
    return [t.detach() for t in kept if t is not None]


_FIRST_OPERANDS = _COPIES | {"ExpandBackward0", "AddBackward0", "MulBackward0"}


def product_below(node: Node, nodes: list[Node]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The two matrices ``(a, b)`` kept by the ``bmm`` that ``node``'s input comes from, through views and
    copies and as the first operand of additions and products (``softmax(a @ b * s + bias + mask)``: the
    scores' product below their softmax), detached; None if the chain meets another operation."""
    first = node.next_functions[0][0] if node.next_functions else None
    return _bmm_below(first, len(nodes), _FIRST_OPERANDS)
