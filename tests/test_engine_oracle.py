"""Every backend x clipping mode equals the brute-force oracle (per-example gradients by a Python loop)."""

from __future__ import annotations

import copy

import pytest
import torch

from dpexp.privacy import PrivacyEngine
from tests.engine_models import CASES, make_case
from tests.oracle import clipped_mean, engine_update, group_norms, per_example_grads

BACKENDS = ["bk", "ghost", "instantiate"]
CLIPPINGS = [("flat", None), ("per_layer", None), ("groups", 2)]


def _groups_of(model, clipping, groups):
    engine = PrivacyEngine(copy.deepcopy(model), batch_size=2, sample_size=10, max_grad_norm=1.0,
                           noise_multiplier=0.0, clipping=clipping, groups=groups)
    return engine.groups


@pytest.mark.filterwarnings("ignore:noise_multiplier=0")
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("clipping,groups", CLIPPINGS)
def test_update_matches_oracle(case, backend, clipping, groups):
    model, loss_fn, batch = make_case(case)
    size = next(iter(batch.values())).shape[0]
    grads = per_example_grads(model, loss_fn, batch)
    partition = _groups_of(model, clipping, groups)
    norms = group_norms(grads, partition)
    thresholds = norms.median(0).values.tolist()  # about half of the examples clipped in every group
    clipped = norms > torch.tensor(thresholds)
    assert clipped.any() and (~clipped).any()

    expected = clipped_mean(grads, partition, thresholds, batch_size=size)
    micro = [[0, 1, 2], [3, 4, 5]] if size == 6 else [list(range(size))]
    delta, _ = engine_update(model, loss_fn, batch, micro, batch_size=size, clipping=clipping, groups=groups,
                             backend=backend, thresholds=thresholds, max_grad_norm=1.0)
    for name, want in expected.items():
        got = delta[name]
        err = (got - want).norm() / want.norm().clamp_min(1e-12)
        assert err < 1e-5, f"{case}/{backend}/{clipping}: {name} relative error {err:.2e}"
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    for name in frozen:
        assert torch.equal(delta[name], torch.zeros_like(delta[name])), f"frozen {name} changed"
