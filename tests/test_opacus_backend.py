"""The Opacus baseline against the brute-force oracle: clipping, division by the expected B, micro-batches."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpexp.backends.opacus import OpacusBackend
from dpexp.models.cnn import SmallCNN
from tests.oracle import clipped_mean, group_norms, per_example_grads, slice_batch

BATCH = 12
EXPECTED_B = 10  # deliberately not the realised batch size: the sum must be divided by the expected B


def _model() -> nn.Module:
    torch.manual_seed(0)
    return SmallCNN((1, 6, 6), 3, channels=[4, 4], num_groups=2, activation="tanh").double()


def _batch() -> dict[str, torch.Tensor]:
    torch.manual_seed(1)
    return {"x": torch.randn(BATCH, 1, 6, 6, dtype=torch.float64), "y": torch.randint(0, 3, (BATCH,))}


def _loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(model(batch["x"]), batch["y"], reduction="none")


def _update(model, micro_batches, **backend_kwargs) -> dict[str, torch.Tensor]:
    """Minus the parameter change of one SGD(lr=1) logical step through the backend."""
    model = copy.deepcopy(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    backend = OpacusBackend(
        model, torch.optim.SGD(model.parameters(), lr=1.0), batch_size=EXPECTED_B, **backend_kwargs
    )
    batch = _batch()
    for index in micro_batches:
        backend.backward(_loss(backend.model, slice_batch(batch, index)))
    backend.step()
    backend.close()
    return {n: before[n] - p.detach() for n, p in model.named_parameters()}


MICRO_SPLITS = [[list(range(12))], [list(range(5)), list(range(5, 10)), [10, 11]]]


@pytest.mark.parametrize("micro", MICRO_SPLITS, ids=["one", "three"])
@pytest.mark.parametrize(("mode", "clipping"), [("hooks", "flat"), ("ghost", "flat"), ("hooks", "per_layer")])
def test_update_matches_oracle(mode, clipping, micro):
    model = _model()
    grads = per_example_grads(model, _loss, _batch())
    names = list(grads[0])
    # Opacus' per-layer clipping clips each parameter tensor separately
    groups = [names] if clipping == "flat" else [[n] for n in names]
    norms = group_norms(grads, groups)
    # thresholds chosen so that some examples are clipped and some are not
    total_norms = group_norms(grads, [names])[:, 0]
    max_grad_norm = float(total_norms.median())
    thresholds = [max_grad_norm / math.sqrt(len(groups))] * len(groups)
    clipped = norms > torch.tensor(thresholds)
    assert clipped.any() and not clipped.all()

    expected = clipped_mean(grads, groups, thresholds, EXPECTED_B)
    got = _update(
        model,
        micro,
        max_grad_norm=max_grad_norm,
        noise_multiplier=0.0,
        grad_sample_mode=mode,
        clipping=clipping,
    )
    for name in names:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(("mode", "clipping"), [("hooks", "flat"), ("ghost", "flat"), ("hooks", "per_layer")])
def test_empty_logical_batch_is_pure_noise(mode, clipping):
    model = nn.Linear(40, 50).double()
    sigma, c = 2.0, 0.5
    torch.manual_seed(3)
    update = _update(
        model, [], max_grad_norm=c, noise_multiplier=sigma, grad_sample_mode=mode, clipping=clipping
    )
    std = torch.cat([u.flatten() for u in update.values()]).std()
    assert abs(float(std) / (sigma * c / EXPECTED_B) - 1) < 0.06


def test_close_restores_a_plain_module():
    model = _model()
    backend = OpacusBackend(
        model,
        torch.optim.SGD(model.parameters(), lr=1.0),
        batch_size=4,
        max_grad_norm=1.0,
        noise_multiplier=0.0,
    )
    backend.backward(_loss(backend.model, slice_batch(_batch(), slice(0, 4))))
    backend.step()
    backend.close()
    assert not any(hasattr(p, "grad_sample") for p in model.parameters())
    assert not model._forward_hooks and not any(m._forward_hooks for m in model.modules())


def test_errors():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    common = {"batch_size": 4, "max_grad_norm": 1.0, "noise_multiplier": 1.0}
    with pytest.raises(ValueError, match="flat clipping only"):
        OpacusBackend(model, opt, grad_sample_mode="ghost", clipping="per_layer", **common)
    with pytest.raises(ValueError, match="hooks, ghost"):
        OpacusBackend(model, opt, grad_sample_mode="functorch", **common)
    with pytest.raises(ValueError, match="flat, per_layer"):
        OpacusBackend(model, opt, clipping="groups", **common)
    batchnorm = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    with pytest.raises(Exception, match="BatchNorm"):
        OpacusBackend(batchnorm, torch.optim.SGD(batchnorm.parameters(), lr=1.0), **common)
    backend = OpacusBackend(model, opt, **common)
    with pytest.raises(ValueError, match="per-example loss"):
        backend.backward(torch.zeros(()))


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize(("mode", "clipping"), [("hooks", "flat"), ("hooks", "per_layer")])
def test_gpt2_with_broadcast_position_ids_matches_oracle(mode, clipping):
    """GPT-2's position ids have batch size 1: without expansion Opacus would clip a batch-summed gradient."""
    from tests.engine_models import lm_loss, make_case

    model, _, batch = make_case("gpt2", batch_size=6)
    model.train()  # Opacus requires training mode; the test config has no dropout
    grads = per_example_grads(model, lm_loss, batch)
    names = list(grads[0])
    groups = [names] if clipping == "flat" else [[n] for n in names]
    max_grad_norm = float(group_norms(grads, [names])[:, 0].median())
    thresholds = [max_grad_norm / math.sqrt(len(groups))] * len(groups)
    expected = clipped_mean(grads, groups, thresholds, 6)

    model = copy.deepcopy(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    backend = OpacusBackend(
        model,
        torch.optim.SGD(model.parameters(), lr=1.0),
        batch_size=6,
        max_grad_norm=max_grad_norm,
        noise_multiplier=0.0,
        grad_sample_mode=mode,
        clipping=clipping,
    )
    for index in ([0, 1, 2], [3, 4, 5]):
        backend.backward(lm_loss(backend.model, slice_batch(batch, index)))
    backend.step()
    backend.close()
    for name in names:
        torch.testing.assert_close(
            before[name] - model.get_parameter(name).detach(), expected[name], rtol=1e-5, atol=1e-8
        )


@pytest.mark.filterwarnings("ignore")
def test_opacus_ghost_refuses_gpt2_tied_embeddings():
    """Opacus' own limitation, surfaced as an error (dpexp's engine handles the tie exactly)."""
    from tests.engine_models import lm_loss, make_case

    model, _, batch = make_case("gpt2", batch_size=4)
    backend = OpacusBackend(
        model.train(),
        torch.optim.SGD(model.parameters(), lr=1.0),
        batch_size=4,
        max_grad_norm=1.0,
        noise_multiplier=0.0,
        grad_sample_mode="ghost",
    )
    with pytest.raises(NotImplementedError, match="Parameter tying"):
        backend.backward(lm_loss(backend.model, batch))
