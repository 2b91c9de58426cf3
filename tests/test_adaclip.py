"""Coordinate-wise adaptive clipping (AdaCliP; dpexp.privacy.coordinate): the released gradient against a
brute-force computation for every strategy x clipping mode, the transform's updates from released values
only, the sensitivity of the released sums in the standardised coordinates, the accounting (DP-SGD's at the
same sigma), checkpoints, refusals and a training run."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from dpexp.privacy import PrivacyEngine
from dpexp.privacy.coordinate import CoordinateConfig, group_scales, update_moments
from dpexp.privacy.noise import noise_stds
from dpexp.training.loop import run_training
from tests.conftest import TINY_RUN
from tests.engine_models import make_case
from tests.oracle import SETTINGS, per_example_grads, slice_batch
from tests.sensitivity import replaced, without
from tests.sensitivity_models import make_sensitivity_case

pytestmark = pytest.mark.filterwarnings("ignore:noise_multiplier=0")

CONFIG = CoordinateConfig(
    beta1=0.9, beta2=0.8, variance_floor=1e-8, variance_ceiling=10.0, initial_variance=1e-2
)


def _engine(model: nn.Module, size: int, clipping: str, groups, strategy: str, **kwargs) -> PrivacyEngine:
    defaults = {"max_grad_norm": 1.0, "noise_multiplier": 0.0}
    return PrivacyEngine(
        model, batch_size=size, sample_size=10 * size, clipping=clipping, groups=groups, strategy=strategy,
        coordinate=CONFIG, **{**defaults, **kwargs},
    )  # fmt: skip


def _random_state(engine: PrivacyEngine, seed: int = 0) -> dict:
    """A transform away from its start: signed means, variances spread over the clamp range and beyond."""
    gen = torch.Generator().manual_seed(seed)
    state = engine.state_dict()
    coordinate = state["coordinate"]
    for name, m in coordinate["mean"].items():
        coordinate["mean"][name] = 0.05 * torch.randn(m.shape, generator=gen, dtype=m.dtype)
        v = coordinate["variance"][name]
        coordinate["variance"][name] = 10 ** (torch.rand(v.shape, generator=gen, dtype=v.dtype) * 6 - 5)
    return state


def _standardised(grads, mean, scale):
    return [{n: (g[n] - mean[n]) / scale[n] for n in g} for g in grads]


def _norms(ws, groups) -> torch.Tensor:
    return torch.tensor(
        [[sum(float(w[n].pow(2).sum()) for n in g) ** 0.5 for g in groups] for w in ws], dtype=torch.float64
    )


def _expected(grads, groups, thresholds, mean, scale, size):
    """g_hat = b (1/B) sum_i clip_k(w_i) + a, by definition."""
    ws = _standardised(grads, mean, scale)
    norms = _norms(ws, groups)
    out = {}
    for k, group in enumerate(groups):
        for n in group:
            total = sum(w[n] * min(1.0, thresholds[k] / float(norms[i, k])) for i, w in enumerate(ws))
            out[n] = scale[n] * total / size + mean[n]
    return out


@pytest.mark.parametrize("case", ["mlp", "flattened", "wrn_block", "vit"])
@pytest.mark.parametrize("strategy,clipping,groups", SETTINGS, ids=[f"{s}-{c}" for s, c, _ in SETTINGS])
def test_released_gradient_matches_the_definition(case, strategy, clipping, groups):
    model, loss_fn, batch = make_case(case)
    size = next(iter(batch.values())).shape[0]
    grads = per_example_grads(model, loss_fn, batch)
    probe = _engine(copy.deepcopy(model), size, clipping, groups, strategy)
    state = _random_state(probe)
    probe.load_state_dict(state)
    mean = state["coordinate"]["mean"]
    scale = dict(probe._scale)
    norms = _norms(_standardised(grads, mean, scale), probe.groups)
    thresholds = norms.median(0).values.tolist()
    clipped = norms > torch.tensor(thresholds)
    assert clipped.any() and (~clipped).any()
    expected = _expected(grads, probe.groups, thresholds, mean, scale, size)

    engine = _engine(model, size, clipping, groups, strategy)
    engine.load_state_dict({**state, "thresholds": torch.tensor(thresholds, dtype=torch.float64)})
    optimizer = engine.attach(torch.optim.SGD(model.parameters(), lr=0.0))
    for index in ([0, 1, 2], [3, 4, 5]):
        engine.backward(loss_fn(model, slice_batch(batch, index)))
    optimizer.step()
    for name, p in engine.trainable_parameters().items():
        torch.testing.assert_close(p.grad, expected[name], rtol=1e-9, atol=1e-12, msg=name)


def test_transform_follows_released_gradients_only():
    """With noise, the next mean and variance are the formulas applied to the released g_hat (and the noise's
    known std b sigma C / B): nothing else about the data enters the transform."""
    model, loss_fn, batch = make_case("mlp")
    gen = torch.Generator().manual_seed(3)
    engine = _engine(model, 6, "per_layer", None, "bk", noise_multiplier=2.0, generator=gen)
    before = engine.state_dict()["coordinate"]
    scale = dict(engine._scale)
    dims = torch.tensor([sum(engine.trainable_parameters()[n].numel() for n in g) for g in engine.groups])
    sigma_c = noise_stds(engine.thresholds, dims.double(), 2.0, "global").tolist()  # sigma C, C = ||(C_k)||
    optimizer = engine.attach(torch.optim.SGD(model.parameters(), lr=0.0))
    engine.backward(loss_fn(model, batch))
    optimizer.step()
    released = {n: p.grad.clone() for n, p in engine.trainable_parameters().items()}
    noise_std = {n: scale[n] * sigma_c[k] / 6 for k, g in enumerate(engine.groups) for n in g}
    mean, variance = update_moments(before["mean"], before["variance"], released, noise_std, CONFIG)
    after = engine.state_dict()["coordinate"]
    for name in released:
        torch.testing.assert_close(after["mean"][name], mean[name])
        torch.testing.assert_close(after["variance"][name], variance[name])
        assert not torch.equal(after["mean"][name], before["mean"][name])
    for group in engine.groups:  # b_t is normalised within each group
        for name, b in zip(group, group_scales([variance[n] for n in group], CONFIG), strict=True):
            torch.testing.assert_close(engine._scale[name], b)


def test_group_scales_and_moments_formulas():
    v = [torch.tensor([4.0, 1e-20]), torch.tensor([[100.0]])]
    config = CoordinateConfig(variance_floor=1e-4, variance_ceiling=25.0, initial_variance=1e-3)
    s = [torch.tensor([2.0, 1e-2]), torch.tensor([[5.0]])]  # sqrt of v clamped to [1e-4, 25]
    total = 2.0 + 1e-2 + 5.0
    for got, want in zip(group_scales(v, config), s, strict=True):
        torch.testing.assert_close(got, want.sqrt() * math.sqrt(total))
    m, var = update_moments(
        {"w": torch.tensor([1.0])}, {"w": torch.tensor([2.0])}, {"w": torch.tensor([3.0])},
        {"w": torch.tensor([0.5])}, CoordinateConfig(beta1=0.5, beta2=0.25),
    )  # fmt: skip
    assert float(m["w"]) == pytest.approx(0.5 * 1 + 0.5 * 3)
    assert float(var["w"]) == pytest.approx(0.25 * 2 + 0.75 * ((3 - 1) ** 2 - 0.25))


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"beta1": 1.0}, r"coordinate.beta1 must be in \[0, 1\)"),
        ({"variance_floor": 0.0}, "0 < floor < ceiling"),
        ({"initial_variance": 100.0}, "initial_variance .* must lie in"),
    ],
)
def test_bad_hyperparameters_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CoordinateConfig(**kwargs)


@pytest.mark.parametrize(
    "kwargs,fix",
    [
        ({"adaptive": {"target_quantile": 0.5}}, "clip.engine.adaptive=null"),
        ({"clip_function": "automatic"}, "clip.engine.clip_function=standard"),
    ],
)
def test_combinations_without_a_meaning_are_refused(kwargs, fix):
    model, _, _ = make_case("mlp")
    with pytest.raises(ValueError, match=f"AdaCliP.*{fix}"):
        _engine(model, 6, "flat", None, "bk", **kwargs)


def test_tied_weights_are_refused():
    model, loss_fn, batch = make_case("gpt2")  # wte and lm_head tied
    engine = _engine(model, 6, "flat", None, "bk")
    with pytest.raises(ValueError, match=r"transformer\.wte\.weight.*used more than once.*AdaCliP"):
        engine.backward(loss_fn(model, batch))


SENSITIVITY = [
    ("mlp", "bk", "flat", None),
    ("flattened", "ghost", "per_layer", None),
    ("wrn_block", "instantiate", "groups", 2),
]


@pytest.mark.parametrize("name,strategy,clipping,groups", SENSITIVITY)
def test_released_sums_have_their_sensitivity(name, strategy, clipping, groups):
    """The released statistic is S_k = sum_i clip_k(w_i) in the standardised coordinates (read back from
    g_hat = b S / B + a): removing or replacing one example by an adversarial one moves it by at most C_k
    (2 C_k for a replacement), whatever the transform."""
    case = make_sensitivity_case(name)
    probe = _engine(copy.deepcopy(case.model), case.size, clipping, groups, strategy)
    state = _random_state(probe, seed=1)
    probe.load_state_dict(state)
    mean, scale = state["coordinate"]["mean"], dict(probe._scale)
    norms = _norms(
        _standardised(per_example_grads(case.model, case.loss_fn, case.batch), mean, scale), probe.groups
    )
    thresholds = norms.median(0).values.clamp_min(1e-3).tolist()
    state["thresholds"] = torch.tensor(thresholds, dtype=torch.float64)

    def release(batch) -> dict[str, torch.Tensor]:
        model = copy.deepcopy(case.model)
        engine = _engine(model, case.size, clipping, groups, strategy)
        engine.load_state_dict(state)
        optimizer = engine.attach(torch.optim.SGD(model.parameters(), lr=0.0))
        engine.backward(case.loss_fn(model, batch))
        optimizer.step()
        return {
            n: (p.grad - mean[n]) / scale[n] * case.size for n, p in engine.trainable_parameters().items()
        }

    def shifts(a, b) -> list[float]:
        return [
            sum(float((a[n] - b[n]).pow(2).sum()) for n in group) ** 0.5 / thresholds[k]
            for k, group in enumerate(probe.groups)
        ]

    full, removed = release(case.batch), release(without(case.batch, 1))
    assert max(shifts(full, removed)) <= 1 + 1e-6
    for kind in ("huge", "zero", "scaled_input", "max_loss"):
        if (kind == "scaled_input" and not case.float_inputs) or (
            kind == "max_loss" and not case.class_label
        ):
            continue
        other = release(replaced(case, kind, 1))
        assert max(shifts(removed, other)) <= 1 + 1e-6, kind
        assert max(shifts(full, other)) <= 2 + 1e-6, kind


def test_accounting_is_dp_sgd_at_the_same_sigma():
    model, loss_fn, batch = make_case("mlp")
    plain = PrivacyEngine(
        copy.deepcopy(model), batch_size=6, sample_size=600, max_grad_norm=1.0, noise_multiplier=1.3
    )
    engine = _engine(model, 6, "flat", None, "bk", noise_multiplier=1.3)
    engine.sample_size, engine.sample_rate = 600, 6 / 600
    for e in (plain, engine):
        optimizer = e.attach(torch.optim.SGD(e.model.parameters(), lr=0.1))
        for _ in range(3):
            e.backward(loss_fn(e.model, batch))
            optimizer.step()
    assert engine.get_epsilon(1e-5) == pytest.approx(plain.get_epsilon(1e-5), rel=1e-12)


def test_checkpoint_round_trip_restores_the_transform():
    """A resumed run continues with the transform it had (not the initial one), and a state with AdaCliP is
    refused by an engine without it."""
    model, loss_fn, batch = make_case("mlp")
    engine = _engine(model, 6, "flat", None, "bk", noise_multiplier=1.0, generator=torch.Generator())
    optimizer = engine.attach(torch.optim.SGD(model.parameters(), lr=0.1))
    engine.backward(loss_fn(model, batch))
    optimizer.step()
    state = engine.state_dict()
    fresh = _engine(make_case("mlp")[0], 6, "flat", None, "bk", generator=torch.Generator())
    assert not all(torch.equal(fresh._scale[n], engine._scale[n]) for n in engine._scale)
    fresh.load_state_dict(state)
    assert all(torch.equal(fresh._scale[n], engine._scale[n]) for n in engine._scale)
    plain = PrivacyEngine(
        make_case("mlp")[0], batch_size=6, sample_size=60, max_grad_norm=1.0, noise_multiplier=1.0,
        generator=torch.Generator(),
    )  # fmt: skip
    with pytest.raises(ValueError, match="disagree on coordinate-wise clipping"):
        plain.load_state_dict(state)


def test_training_with_adaclip_and_a_one_line_refusal(compose_config, tmp_path):
    record = run_training(compose_config([*TINY_RUN, "clip=adaclip"]), tmp_path / "ok")
    assert record["status"] == "completed" and math.isfinite(record["loss"])
    assert record["config"]["clip"]["engine"]["coordinate"]["beta1"] == 0.99
    bad = compose_config([*TINY_RUN, "clip=adaclip", "clip.engine.coordinate.beta2=1.0"])
    with pytest.raises(ValueError, match=r"coordinate.beta2 must be in \[0, 1\)"):
        run_training(bad, tmp_path / "bad")
