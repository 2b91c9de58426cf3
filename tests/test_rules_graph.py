"""What :mod:`dpexp.privacy.rules.graph` finds in a call's autograd graph: ``nn.MultiheadAttention``'s packed
projection, whatever op ``F.linear`` recorded, the attention kernel's kept output, and nothing where the
structure is not there (a weight used twice, autocast's copies, a call without a graph); the helpers the
RG-LRU and delta-net rules added in stop 65 (a loop's steps, a weight kept itself, a product's other
operand)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpexp.privacy.rules.graph import (
    call_nodes,
    kept_as,
    kept_attention_output,
    kept_product_below,
    matmul_with,
    other_operand,
    product_with,
)


def _attention(batch_first: bool, trainable: bool, contiguous: bool = True):
    torch.manual_seed(0)
    attn = nn.MultiheadAttention(8, 2, batch_first=batch_first).requires_grad_(trainable)
    before = nn.Linear(8, 8)
    ids = torch.randn(5, 3, 8)
    x = before(ids if contiguous else ids.transpose(0, 1).contiguous().transpose(0, 1))
    out, _ = attn(x, x, x, need_weights=False)
    return attn, before, x, out


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("trainable", [True, False])
@pytest.mark.parametrize("contiguous", [True, False])
def test_the_packed_projection_is_found_and_its_gradient_is_autograds(batch_first, trainable, contiguous):
    """``mm``, ``addmm`` or ``bmm`` of an expanded weight, with the weights trainable or not: the one node
    keeping ``in_proj_weight.T``, whose output gradient is that of ``x @ W.T`` (L * B rows)."""
    attn, before, x, out = _attention(batch_first, trainable, contiguous)
    nodes = call_nodes(out, [x])
    node = matmul_with(nodes, attn.in_proj_weight)
    assert node is not None
    assert matmul_with(nodes, before.weight) is None  # the search stays inside the call
    got = []
    node.register_prehook(lambda grads: got.append(grads[0]))
    dout = torch.randn_like(out)
    out.backward(dout)
    # the same gradient by brute force: the projection recomputed with a zero added to its output
    q = (x if not batch_first else x.transpose(0, 1)).detach()
    zero = torch.zeros(*q.shape[:2], 24, requires_grad=True)
    proj = F.linear(q, attn.in_proj_weight.detach(), attn.in_proj_bias.detach()) + zero
    qh, kh, vh = (t.reshape(q.shape[0], q.shape[1] * 2, 4).transpose(0, 1) for t in proj.chunk(3, -1))
    ctx = F.scaled_dot_product_attention(qh, kh, vh).transpose(0, 1).reshape(q.shape)
    y = F.linear(ctx, attn.out_proj.weight.detach(), attn.out_proj.bias.detach())
    y.backward(dout if not batch_first else dout.transpose(0, 1))
    torch.testing.assert_close(got[0].reshape(zero.shape), zero.grad)


def test_the_kept_attention_output_is_the_context():
    """The attention kernel's output, through the output projection, is the layer's output."""
    attn, _, x, out = _attention(True, False)
    context = kept_attention_output(call_nodes(out, [x]))
    assert context is not None and not context.requires_grad
    batch, length, embed = x.shape
    y = attn.out_proj(context.transpose(1, 2).reshape(batch, length, embed))
    torch.testing.assert_close(y, out.detach())


@pytest.mark.parametrize("trainable", [True, False])
def test_the_kept_product_below_the_output_projection_is_the_context(trainable):
    """With the weights returned, the context is ``bmm(weights, v)``, reached from the output projection
    through views and a copy: the kept matrices multiply to it."""
    torch.manual_seed(0)
    attn = nn.MultiheadAttention(8, 2, batch_first=True).requires_grad_(trainable)
    x = nn.Linear(8, 8)(torch.randn(3, 5, 8))
    out, _ = attn(x, x, x)
    nodes = call_nodes(out, [x])
    weights, values = kept_product_below(matmul_with(nodes, attn.out_proj.weight), nodes)
    context = torch.bmm(weights, values).view(3, 2, 5, 4).transpose(1, 2).reshape(3, 5, 8)
    torch.testing.assert_close(attn.out_proj(context), out.detach())


def test_a_product_reached_through_another_operation_is_not_taken():
    """A scale between the product and the projection: the chain meets another operation, None."""
    a, b = torch.randn(2, 3, 4, requires_grad=True), torch.randn(2, 4, 5, requires_grad=True)
    weight = torch.randn(6, 5, requires_grad=True)
    y = F.linear((2.0 * torch.bmm(a, b)).reshape(6, 5), weight)
    nodes = call_nodes(y, [a, b])
    assert kept_product_below(matmul_with(nodes, weight), nodes) is None
    y = F.linear(torch.bmm(a, b).transpose(0, 1).reshape(6, 5), weight)
    nodes = call_nodes(y, [a, b])
    kept = kept_product_below(matmul_with(nodes, weight), nodes)
    assert kept is not None and kept[0] is not a and torch.equal(kept[0], a.detach())


def test_a_weight_used_twice_or_copied_is_not_found():
    """Two products with the weight: neither is taken. Under CPU autocast the product keeps a bf16 copy."""
    weight = torch.randn(4, 6, requires_grad=True)
    a, b = torch.randn(3, 6, requires_grad=True), torch.randn(3, 6, requires_grad=True)
    twice = F.linear(a, weight) + F.linear(b, weight)
    assert matmul_with(call_nodes(twice, [a, b]), weight) is None
    assert matmul_with(call_nodes(F.linear(a, weight), [a]), weight) is not None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        copied = F.linear(a, weight)
    assert matmul_with(call_nodes(copied, [a]), weight) is None


def test_autocasts_copy_of_a_weight_is_found_only_with_cast():
    """Under CPU bf16 autocast a product or convolution keeps the weight's bf16 copy: found with ``cast``
    (equal in value to the weight cast), never a float32 copy of the same dtype, another weight's copy, or
    one of two products with the weight."""
    weight = torch.randn(4, 6, requires_grad=True)
    a, b = torch.randn(3, 6, requires_grad=True), torch.randn(3, 6, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        copied = F.linear(a, weight)
        twice = F.linear(a, weight) + F.linear(b, weight)
        other = F.linear(a, weight + 1.0)
        conv_weight = torch.randn(6, 1, 3, requires_grad=True)
        conv = F.conv1d(a.T[None], conv_weight, groups=6)
    assert matmul_with(call_nodes(copied, [a]), weight) is None
    assert matmul_with(call_nodes(copied, [a]), weight, cast=True) is copied.grad_fn
    assert matmul_with(call_nodes(twice, [a, b]), weight, cast=True) is None
    assert matmul_with(call_nodes(other, [a]), weight, cast=True) is None
    assert matmul_with(call_nodes(F.linear(a, weight.clone()), [a]), weight, cast=True) is None
    nodes = call_nodes(conv, [a])
    assert kept_as(nodes, "ConvolutionBackward0", "_saved_weight", conv_weight) is None
    assert kept_as(nodes, "ConvolutionBackward0", "_saved_weight", conv_weight, cast=True) is conv.grad_fn


def test_no_graph_no_nodes():
    """An output without a graph (nothing requires a gradient) has no nodes; the search stops at the call's
    inputs, and gives up past its limit (it left the call through an input it was not given)."""
    assert call_nodes(torch.randn(3), []) is None
    h = torch.randn(3, requires_grad=True) * 1.0
    steps = []
    for _ in range(300):
        h = h + 1.0
        steps.append(h)
    assert len(call_nodes(h, [steps[99]])) == 200
    assert call_nodes(h, []) is None
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):  # as under a checkpoint
        assert call_nodes(h, [steps[99]]) is None


def test_a_loop_over_time_is_searched_with_its_steps():
    """A call that loops over T steps (a recurrence's scan) holds a few nodes a step: past the limit without
    ``steps``, found whole with them (16 more nodes allowed a step)."""
    x = torch.randn(2, 3, requires_grad=True)
    h = x * 1.0
    for _ in range(150):  # two nodes a step: 300 in all, past the 256 a call may hold
        h = h * 0.5 + 1.0
    assert call_nodes(h, [x]) is None
    assert len(call_nodes(h, [x], steps=150)) == 301


def test_a_block_diagonal_weight_is_found_by_what_its_product_keeps():
    """``kept_as``: the one ``baddbmm`` keeping the (H, n, m) weight itself (the RG-LRU's gates); not a
    copy of it, and none where two products keep it."""
    weight = torch.randn(2, 3, 4, requires_grad=True)
    bias = torch.zeros(2, 1, 4)
    rows = torch.randn(2, 5, 3, requires_grad=True)
    one = torch.baddbmm(bias, rows, weight)
    node = kept_as(call_nodes(one, [rows]), "BaddbmmBackward0", "_saved_batch2", weight)
    assert node is one.grad_fn
    copied = torch.baddbmm(bias, rows, weight.clone())
    assert kept_as(call_nodes(copied, [rows]), "BaddbmmBackward0", "_saved_batch2", weight) is None
    twice = torch.baddbmm(bias, rows, weight) + torch.baddbmm(bias, rows * 2, weight)
    assert kept_as(call_nodes(twice, [rows]), "BaddbmmBackward0", "_saved_batch2", weight) is None


@pytest.mark.parametrize("trainable", [True, False])
def test_the_other_operand_of_a_product_found_by_value(trainable):
    """``other_operand``: beside the factor a product was found by (by value: formed anew in the forward),
    the operand it multiplied, where autograd kept it (the factor needs a gradient), else None."""
    lam = torch.randn(4, requires_grad=trainable)
    gate = torch.randn(2, 3, 4, requires_grad=True)
    out = (-8.0 * gate) * F.softplus(lam)
    factor = F.softplus(lam).detach()
    node = product_with(call_nodes(out, [gate]), factor, by_value=True)
    assert node is not None
    other = other_operand(node, factor)
    if trainable:
        torch.testing.assert_close(other, -8.0 * gate.detach())
    else:
        assert other is None
