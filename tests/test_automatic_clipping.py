"""Automatic clipping (AUTO-S, Bu et al.): c_i = C_k / (||g_{i,k}|| + gamma) in every strategy and clipping
mode, against the brute-force oracle, and one example moving the released sum by less than C_k per group."""

from __future__ import annotations

import pytest
import torch

from dpexp.privacy import PrivacyEngine
from dpexp.privacy.clipping import clipping_factors
from tests.engine_models import make_case
from tests.oracle import clipped_mean, engine_update, group_norms, per_example_grads, slice_batch
from tests.test_engine_oracle import _groups_of

pytestmark = pytest.mark.filterwarnings("ignore:noise_multiplier=0", "ignore:.*torch.func fallback")

GAMMA = 0.01


def test_factors_are_the_formula_and_bound_every_scaled_norm():
    norm = torch.tensor([0.0, 1e-3, 0.5, 2.0, 1e8], dtype=torch.float64)
    factors = clipping_factors(norm, 3.0, "automatic", GAMMA)
    assert torch.allclose(factors, 3.0 / (norm + GAMMA))
    assert bool((factors * norm < 3.0).all())
    assert torch.equal(clipping_factors(norm, 3.0), 3.0 / norm.clamp_min(3.0))
    with pytest.raises(ValueError, match="unknown clip function"):
        clipping_factors(norm, 3.0, "sigmoid")


@pytest.mark.parametrize("case", ["mlp", "wrn_block", "gpt2"])
@pytest.mark.parametrize("strategy", ["bk", "ghost", "instantiate"])
@pytest.mark.parametrize("clipping,groups", [("flat", None), ("per_layer", None), ("groups", 2)])
def test_automatic_clipping_matches_the_oracle(case, strategy, clipping, groups):
    model, loss_fn, batch = make_case(case)
    size = next(iter(batch.values())).shape[0]
    grads = per_example_grads(model, loss_fn, batch)
    partition = _groups_of(model, clipping, groups)
    thresholds = [0.5 + k for k in range(len(partition))]
    expected = clipped_mean(grads, partition, thresholds, size, automatic_stability=GAMMA)
    micro = [[0, 1, 2], [3, 4, 5]] if size == 6 else [list(range(size))]
    delta, _ = engine_update(
        model, loss_fn, batch, micro, batch_size=size, clipping=clipping, groups=groups, strategy=strategy,
        thresholds=thresholds, max_grad_norm=1.0, clip_function="automatic", automatic_stability=GAMMA,
    )  # fmt: skip
    for name, want in expected.items():
        err = (delta[name] - want).norm() / want.norm().clamp_min(1e-12)
        assert err < 1e-5, f"{case}/{strategy}/{clipping}: {name} relative error {err:.2e}"


@pytest.mark.parametrize("case", ["mlp", "gpt2"])
@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
def test_one_example_moves_each_group_sum_by_less_than_its_threshold(case, clipping):
    """Removing any example moves group k of the released sum by ||c_j g_{j,k}|| < C_k (noise 0)."""
    model, loss_fn, batch = make_case(case)
    size = next(iter(batch.values())).shape[0]
    partition = _groups_of(model, clipping, None)
    thresholds = [1.0] * len(partition)
    kwargs = {
        "clipping": clipping,
        "thresholds": thresholds,
        "max_grad_norm": 1.0,
        "clip_function": "automatic",
    }

    def released(data, n):
        delta, _ = engine_update(model, loss_fn, data, [list(range(n))], batch_size=1, **kwargs)
        return delta

    full = released(batch, size)
    for j in range(size):
        keep = [i for i in range(size) if i != j]
        smaller = released(slice_batch(batch, keep), size - 1)
        for k, group in enumerate(partition):
            shift = sum(float((full[n] - smaller[n]).pow(2).sum()) for n in group) ** 0.5
            assert shift < thresholds[k] * (1 + 1e-6), f"example {j}, group {k}: moved {shift:.4f}"
    norms = group_norms(per_example_grads(model, loss_fn, batch), partition)
    assert bool((norms > 0).any())


def test_automatic_clipping_refuses_adaptive_thresholds_and_a_bad_gamma():
    model, _, _ = make_case("mlp")
    common = {"batch_size": 2, "sample_size": 10, "max_grad_norm": 1.0, "noise_multiplier": 1.0}
    with pytest.raises(ValueError, match="adaptive thresholds have no quantile"):
        PrivacyEngine(model, **common, clip_function="automatic", adaptive={"target_quantile": 0.5})
    with pytest.raises(ValueError, match="automatic_stability must be > 0"):
        PrivacyEngine(model, **common, clip_function="automatic", automatic_stability=0.0)
    with pytest.raises(ValueError, match="unknown clip_function"):
        PrivacyEngine(model, **common, clip_function="auto")
