"""Brute-force reference for the clipping engine: per-example gradients from a Python loop."""

from __future__ import annotations

import copy
from collections.abc import Callable
from functools import partial

import torch
from torch import nn

SETTINGS = [  # (strategy, clipping, groups): every strategy x clipping mode of the oracle tests
    (strategy, clipping, groups)
    for strategy in ("bk", "ghost", "instantiate")
    for clipping, groups in (("flat", None), ("per_layer", None), ("groups", 2))
]

Batch = dict[str, torch.Tensor]
LossFn = Callable[[nn.Module, Batch], torch.Tensor]  # per-example losses, shape (B,)


def slice_batch(batch: Batch, index: slice | list[int]) -> Batch:
    return {k: v[index] for k, v in batch.items()}


def per_example_grads(model: nn.Module, loss_fn: LossFn, batch: Batch) -> list[dict[str, torch.Tensor]]:
    """g_i for every example i, by running example i alone (the definition, no tricks)."""
    named = {n: p for n, p in model.named_parameters() if p.requires_grad}
    size = next(iter(batch.values())).shape[0]
    out = []
    for i in range(size):
        loss = loss_fn(model, slice_batch(batch, slice(i, i + 1))).sum()
        grads = torch.autograd.grad(loss, list(named.values()), allow_unused=True)
        out.append(
            {
                n: (torch.zeros_like(p) if g is None else g)
                for (n, p), g in zip(named.items(), grads, strict=True)
            }
        )
    return out


def group_norms(grads: list[dict[str, torch.Tensor]], groups: list[list[str]]) -> torch.Tensor:
    """||g_{i,k}|| for every example i and group k, shape (B, K)."""
    return torch.tensor(
        [[sum(float(g[n].pow(2).sum()) for n in group) ** 0.5 for group in groups] for g in grads],
        dtype=torch.float64,
    )


def clipped_mean(
    grads: list[dict[str, torch.Tensor]],
    groups: list[list[str]],
    thresholds: list[float],
    batch_size: int,
    automatic_stability: float | None = None,
    scales: list[float] | None = None,
) -> dict[str, torch.Tensor]:
    """(1/B) sum_i clip_i(g_i) with clip_i scaling group k of g_i by min(1, C_k / ||g_{i,k}||), or with
    ``automatic_stability`` gamma by C_k / (||g_{i,k}|| + gamma) (automatic clipping, AUTO-S); ``scales``:
    example i's bounds are s_i C_k (individualized privacy, scaling variant)."""
    norms = group_norms(grads, groups)
    total = {n: torch.zeros_like(t) for n, t in grads[0].items()}
    for i, g in enumerate(grads):
        for k, group in enumerate(groups):
            bound = thresholds[k] * (1.0 if scales is None else scales[i])
            if automatic_stability is not None:
                factor = bound / (float(norms[i, k]) + automatic_stability)
            else:
                factor = min(1.0, bound / float(norms[i, k])) if norms[i, k] > 0 else 1.0
            for n in group:
                total[n] += g[n] * factor
    return {n: t / batch_size for n, t in total.items()}


def engine_update(
    model: nn.Module,
    loss_fn: LossFn,
    batch: Batch,
    micro_batches: list[list[int]],
    batch_size: int,
    privacy_groups: torch.Tensor | None = None,
    **engine_kwargs,
) -> tuple[dict[str, torch.Tensor], object]:
    """Parameter change of one SGD(lr=1) step under the engine with noise 0 (so it is minus the update);
    ``privacy_groups`` (B,): every example's privacy group, for an engine with individual privacy."""
    from dpexp.privacy import PrivacyEngine

    model = copy.deepcopy(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine = PrivacyEngine(
        model, batch_size=batch_size, sample_size=10 * batch_size, noise_multiplier=0.0, **engine_kwargs
    )
    optimizer = engine.attach(torch.optim.SGD(model.parameters(), lr=1.0))
    for index in micro_batches:
        groups = None if privacy_groups is None else privacy_groups[index]
        engine.backward(loss_fn(model, slice_batch(batch, index)), privacy_groups=groups)
    optimizer.step()
    attached = [n for n, p in model.named_parameters() if p.grad is not None and p.grad.requires_grad]
    assert not attached, f"released gradients carry an autograd graph: {attached}"
    optimizer.zero_grad()
    delta = {n: before[n] - p.detach() for n, p in model.named_parameters()}
    return delta, engine


def check_clipped_step(
    model: nn.Module,
    loss_fn: LossFn,
    batch: Batch,
    micro_batches: list[list[int]],
    strategy: str,
    clipping: str,
    groups: int | None = None,
    rel: float = 1e-9,
    floor: float = 1e-14,
    autocast: bool = False,
) -> None:
    """One engine step at the median group norms as thresholds (so clipped and unclipped examples both occur)
    equals the oracle's clipped mean, parameter by parameter, to ``rel`` relative error above an absolute
    ``floor`` (parameters whose true gradient vanishes, such as attention's key bias). With ``autocast``, a
    float32 ``model``'s loss runs under CPU bfloat16 autocast for the oracle (each example alone) and the
    engine alike, and the whole update is compared, to ``rel`` of its norm: what is left is bf16's rounding
    of a batched computation against one example's (the update itself moves by far more between bf16 and
    float32)."""
    from dpexp.privacy import PrivacyEngine

    loss_fn = under_bf16_autocast(loss_fn) if autocast else loss_fn
    size = sum(len(index) for index in micro_batches)
    partition = PrivacyEngine(
        copy.deepcopy(model), batch_size=size, sample_size=10 * size, max_grad_norm=1.0, noise_multiplier=0.0,
        clipping=clipping, groups=groups,
    ).groups  # fmt: skip
    pristine = copy.deepcopy(model)  # before any forward: a model may keep tensors of it (RecurrentGemma)
    grads = per_example_grads(model, loss_fn, batch)
    norms = group_norms(grads, partition)
    thresholds = norms.median(0).values.clamp_min(1e-12).tolist()  # a group without gradient: any bound
    clipped = norms > torch.tensor(thresholds)
    assert clipped.any() and (~clipped).any()
    expected = clipped_mean(grads, partition, thresholds, batch_size=size)
    delta, _ = engine_update(
        pristine, loss_fn, batch, micro_batches, batch_size=size, strategy=strategy, clipping=clipping,
        groups=groups, thresholds=thresholds, max_grad_norm=1.0,
    )  # fmt: skip
    if autocast:
        got, want = (torch.cat([d[n].flatten() for n in expected]) for d in (delta, expected))
        error = float((got - want).norm() / want.norm())
        assert error < rel, f"{strategy}/{clipping}: update error {error:.2e} of its norm"
        return
    for param, want in expected.items():
        diff = (delta[param] - want).norm()
        assert diff < rel * want.norm() + floor, f"{strategy}/{clipping}: {param} error {diff:.2e}"


def under_bf16_autocast(loss_fn: LossFn) -> LossFn:
    """``loss_fn`` run under CPU bfloat16 autocast, its losses returned in float32."""

    def autocast_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return loss_fn(model, batch).float()

    return autocast_loss


def read_by_hand(
    module: nn.Module, args: tuple, out: torch.Tensor, carriers: list[torch.Tensor], dy: torch.Tensor
) -> dict[str, torch.Tensor]:
    """What the capture hands a graph-reading rule for one call, taken by hand: the values its layout's
    ``graph`` reads off the call and the output gradient of each node it names, after backpropagating ``dy``
    from ``out`` (``carriers``: the call's inputs that carry the examples). Tests of a rule on a module alone,
    against autograd one example at a time, call the rule with these."""
    from dpexp.privacy.rules import rule_for

    graph = rule_for(module).call.graph(module, args, out, carriers)
    assert graph is not None, f"{type(module).__name__}: its layout found nothing to read in this call"
    seen: dict[str, torch.Tensor] = {}

    def keep(name: str, grad_outputs: tuple[torch.Tensor, ...]) -> None:
        seen[name] = grad_outputs[0]

    for name, node in graph.nodes.items():  # as the capture reads them: a pre-hook on each node
        node.register_prehook(partial(keep, name))
    out.backward(dy)
    assert seen.keys() == graph.nodes.keys(), "a node the layout names was not on the backward pass"
    return {**graph.values, **seen}
