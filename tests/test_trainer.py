"""The trainer's building blocks: every clip backend accumulates micro-batches exactly and adds noise once per
logical step; run planning (steps, delta, sigma); learning-rate schedules; the digits task split."""

from __future__ import annotations

import copy
import itertools
import logging
import math

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch import nn

from dpexp.backends import build_backend, is_private
from dpexp.models.cnn import SmallCNN
from dpexp.privacy import accounting
from dpexp.tasks.digits import DigitsTask
from dpexp.training.loop import run_training
from dpexp.training.optim import lr_factor
from dpexp.training.plan import calibration_accountant, plan_run, resolve_delta
from tests.conftest import CONF_DIR, TINY_RUN, composed_group

CLIPS = sorted(path.stem for path in (CONF_DIR / "clip").glob("*.yaml"))
PRIVATE_CLIPS = [c for c in CLIPS if is_private(composed_group("clip", c))]
EXPECTED_B = 10


def _clip_cfg(name: str):
    cfg = composed_group("clip", name)
    if cfg.method == "dpexp":
        pytest.importorskip("dpexp.privacy.engine", reason="the dpexp engine is not available")
    return cfg


def _step(clip: str, model: nn.Module, batch, micro_batches, noise_multiplier: float) -> torch.Tensor:
    """Minus the flat parameter change of one SGD(lr=1) logical step through the clip config's backend."""
    model = copy.deepcopy(model)
    before = torch.cat([p.detach().flatten() for p in model.parameters()])
    backend = build_backend(
        _clip_cfg(clip),
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
        batch_size=EXPECTED_B,
        sample_size=100,
        noise_multiplier=noise_multiplier,
    )
    for index in micro_batches:
        x, y = batch["x"][index], batch["y"][index]
        backend.backward(F.cross_entropy(backend.model(x), y, reduction="none"))
    backend.step()
    backend.close()
    return before - torch.cat([p.detach().flatten() for p in model.parameters()])


@pytest.mark.filterwarnings("ignore:noise_multiplier=0")
@pytest.mark.parametrize("clip", CLIPS)
def test_micro_batches_give_the_update_of_one_physical_batch(clip):
    torch.manual_seed(0)
    model = SmallCNN((1, 6, 6), 3, channels=[4, 4], num_groups=2, activation="tanh").double()
    batch = {"x": torch.randn(12, 1, 6, 6, dtype=torch.float64), "y": torch.randint(0, 3, (12,))}
    whole = _step(clip, model, batch, [list(range(12))], noise_multiplier=0.0)
    split = _step(clip, model, batch, [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9], [10, 11]], noise_multiplier=0.0)
    assert whole.abs().sum() > 0
    torch.testing.assert_close(split, whole, rtol=1e-9, atol=1e-12)


def test_nonprivate_update_is_the_summed_gradient_over_expected_batch_size():
    torch.manual_seed(0)
    model = nn.Linear(5, 3).double()
    batch = {"x": torch.randn(12, 5, dtype=torch.float64), "y": torch.randint(0, 3, (12,))}
    loss = F.cross_entropy(model(batch["x"]), batch["y"], reduction="sum") / EXPECTED_B
    expected = torch.cat([g.flatten() for g in torch.autograd.grad(loss, list(model.parameters()))])
    got = _step("nonprivate", model, batch, [list(range(7)), list(range(7, 12))], noise_multiplier=0.0)
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("clip", PRIVATE_CLIPS)
def test_noise_is_added_once_per_logical_step(clip):
    """With zero gradients the update is the noise / B; its std must not grow with the number of micro-batches
    (noise per micro-batch would give sqrt(4) = 2 times the std with four micro-batches)."""
    model = nn.Linear(60, 60).double()
    nn.init.zeros_(model.weight)
    nn.init.zeros_(model.bias)
    batch = {"x": torch.zeros(8, 60, dtype=torch.float64), "y": torch.zeros(8, dtype=torch.long)}
    sigma = 3.0
    stds = []
    for micro in ([list(range(8))], [[0, 1], [2, 3], [4, 5], [6, 7]]):
        torch.manual_seed(1)
        # zero input: only the bias has a gradient, far below the noise; the weight update is pure noise / B
        update = _step(clip, model, batch, micro, noise_multiplier=sigma)
        stds.append(float(update[: 60 * 60].std()))
    assert abs(stds[1] / stds[0] - 1) < 0.08
    if "adaptive" not in clip:  # adaptive runs spend part of sigma on the clip counts (He et al. Prop. 3.1)
        cfg = _clip_cfg(clip)
        scale = 1.0
        if OmegaConf.select(cfg, "engine.coordinate") is not None:
            # AdaCliP releases b (S + z) / B + a; at the start b = sqrt(s) sqrt(d s) with s = sqrt(v_0), a = 0
            s = math.sqrt(float(cfg.engine.coordinate.initial_variance))
            scale = math.sqrt(s) * math.sqrt(60 * 61 * s)
        c = float(cfg.max_grad_norm)
        assert abs(stds[0] / (sigma * c * scale / EXPECTED_B) - 1) < 0.08


@pytest.mark.parametrize("clip", PRIVATE_CLIPS)
def test_empty_logical_batch_still_adds_noise(clip):
    model = nn.Linear(60, 60).double()
    torch.manual_seed(2)
    update = _step(clip, model, None, [], noise_multiplier=1.0)
    assert float(update.std()) > 0.05 / EXPECTED_B


def test_unknown_backend_lists_choices():
    with pytest.raises(ValueError, match=r"clip.method .jax.; valid choices: nonprivate, dpexp, opacus"):
        build_backend(
            {"method": "jax"},
            model=nn.Linear(2, 2),
            optimizer=torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=1.0),
            batch_size=2,
            sample_size=4,
            noise_multiplier=1.0,
        )


def test_plan_run_solves_sigma_for_the_target_epsilon(compose_config):
    cfg = compose_config(["batch_size=100", "epochs=3", "privacy.epsilon=2.0"])
    plan = plan_run(cfg, sample_size=1000)
    assert plan.sample_rate == 0.1 and plan.steps == 30 and plan.epochs == pytest.approx(3.0)
    assert plan.delta == 1 / 2000
    eps = accounting.get_epsilon(plan.noise_multiplier, 0.1, 30, plan.delta, accountant="rdp")
    assert eps == pytest.approx(2.0, rel=1e-2) and eps <= 2.0 + 1e-9

    gdp = ["batch_size=100", "epochs=3", "privacy.epsilon=2.0", "accountant=gdp"]
    with pytest.warns(UserWarning, match="epsilon may be underestimated"):
        gdp_plan = plan_run(compose_config([*gdp, "accountant.approximate_calibration=true"]), 1000)
    assert gdp_plan.noise_multiplier < plan.noise_multiplier  # the CLT is less conservative

    steps = plan_run(compose_config(["batch_size=100", "steps=7"]), 1000)
    assert steps.steps == 7 and steps.epochs == pytest.approx(0.7)

    nonprivate = plan_run(compose_config(["clip=nonprivate"]), 1000)
    assert nonprivate.noise_multiplier == 0.0 and nonprivate.target_epsilon is None


def test_gdp_calibration_needs_the_opt_in(compose_config):
    """accountant=gdp (the CLT approximation) calibrates sigma only if accountant.approximate_calibration."""
    with pytest.raises(ValueError, match=r"accountant=gdp .*approximate_calibration=true") as info:
        plan_run(compose_config(["accountant=gdp"]), 1000)
    assert "accountant=rdp or accountant=prv" in str(info.value) and "\n" not in str(info.value)
    opted_in = compose_config(["accountant=gdp", "accountant.approximate_calibration=true"])
    assert calibration_accountant(opted_in) == ("gdp", True)
    for accountant in ("rdp", "prv"):
        assert calibration_accountant(compose_config([f"accountant={accountant}"])) == (accountant, False)
    # a non-private run calibrates nothing: any accountant will do
    assert plan_run(compose_config(["clip=nonprivate", "accountant=gdp"]), 1000).noise_multiplier == 0.0


def test_accountant_keys_are_checked(compose_config):
    with pytest.raises(ValueError, match=r"Unknown accountant keys \['epsilon_error'\]"):
        calibration_accountant(compose_config(["+accountant.epsilon_error=0.1"]))
    with pytest.raises(ValueError, match="true or false, got 'maybe'"):
        calibration_accountant(compose_config(["accountant=gdp", "accountant.approximate_calibration=maybe"]))


def test_plan_run_errors(compose_config):
    with pytest.raises(ValueError, match="batch_size"):
        plan_run(compose_config(["batch_size=2000"]), 1000)
    with pytest.raises(ValueError, match="at least one step"):
        plan_run(compose_config(["steps=0"]), 1000)
    with pytest.raises(ValueError, match="physical_batch_size"):
        plan_run(compose_config(["physical_batch_size=0"]), 1000)


def test_resolve_delta():
    assert resolve_delta(None, "1/2n", 500) == 1 / 1000
    assert resolve_delta(None, "1/n^1.1", 500) == pytest.approx(500**-1.1)
    assert resolve_delta(1e-5, "1/2n", 500) == 1e-5
    with pytest.raises(ValueError, match="delta"):
        resolve_delta(1.5, "1/2n", 500)
    with pytest.raises(ValueError, match="1/2n"):
        resolve_delta(None, "1/n", 500)


def test_lr_schedules():
    assert [lr_factor("constant", s, 10) for s in range(10)] == [1.0] * 10
    factors = [lr_factor("linear_warmup_decay", s, 10, warmup_fraction=0.2) for s in range(10)]
    assert factors[:2] == [0.5, 1.0]  # warm-up over round(0.2 * 10) = 2 steps
    assert factors[2:] == pytest.approx([(10 - s) / 8 for s in range(2, 10)])
    assert all(a >= b for a, b in itertools.pairwise(factors[1:]))
    with pytest.raises(ValueError, match="linear_warmup_decay"):
        lr_factor("cosine", 0, 10)


def test_digits_split_is_stratified_disjoint_and_fixed():
    task = DigitsTask(test_fraction=0.2, split_seed=0)
    task.setup(factory=None)
    train_x, train_y = task.train_dataset.tensors
    test_x, test_y = task.test_dataset.tensors
    assert len(train_y) + len(test_y) == 1797 and len(test_y) == math.ceil(0.2 * 1797)
    assert task.info.input_shape == tuple(train_x.shape[1:]) == (1, 8, 8)
    assert train_x.min() >= -1 and train_x.max() <= 1
    train_rows = {tuple(r) for r in train_x.flatten(1).tolist()}
    assert not any(tuple(r) in train_rows for r in test_x.flatten(1).tolist())
    share = torch.bincount(test_y, minlength=10) / torch.bincount(torch.cat([train_y, test_y]), minlength=10)
    assert (share - 0.2).abs().max() < 0.02
    again = DigitsTask(test_fraction=0.2, split_seed=0)
    again.setup(factory=None)
    assert torch.equal(again.test_dataset.tensors[1], test_y)


def test_physical_batch_size_does_not_change_the_run(compose_config, tmp_path):
    """The trainer's accumulation: same seed, same noise, micro-batches of 4 or one batch of 32."""
    base = [*TINY_RUN, "clip=opacus"]
    one = run_training(compose_config([*base, "physical_batch_size=64"]), tmp_path / "one")
    many = run_training(compose_config([*base, "physical_batch_size=4"]), tmp_path / "many")
    assert one["examples_seen"] == many["examples_seen"]
    assert many["loss"] == pytest.approx(one["loss"], rel=1e-4)
    assert many["accuracy"] == one["accuracy"]


def test_secure_mode_noise_ignores_the_seed(compose_config, tmp_path):
    """clip.engine.secure_mode=true trains, and its noise comes from the OS, not from ``seed``: the same
    config twice gives different models (test_train_e2e checks that it is otherwise reproducible)."""
    cfg = compose_config([*TINY_RUN, "clip.engine.secure_mode=true"])
    first = run_training(cfg, tmp_path / "a")
    second = run_training(cfg, tmp_path / "b")
    assert first["status"] == second["status"] == "completed"
    assert first["config"]["clip"]["engine"]["secure_mode"] is True
    assert first["loss"] != second["loss"]


def test_noise_multiplier_set_directly_skips_calibration(compose_config):
    """privacy.noise_multiplier fixes sigma (the schedule scale): no calibration, T as planned, no target."""
    base = ["batch_size=100", "steps=30"]

    def refuse(*_args, **_kwargs):
        raise AssertionError("sigma set directly must not be calibrated")

    plan = plan_run(compose_config([*base, "privacy.noise_multiplier=1.3"]), 1000, solve=refuse)
    assert plan.noise_multipliers == [1.3] * 30 and plan.target_epsilon is None and plan.steps == 30
    decay = plan_run(
        compose_config([*base, "privacy.noise_multiplier=2.0", "noise=exponential", "noise.rate=0.5"]), 1000
    )
    assert (
        decay.noise_multiplier == 2.0
        and decay.noise_multipliers[-1] < 2.0
        and len(decay.noise_multipliers) == 30
    )
    with pytest.warns(UserWarning, match=r"privacy.noise_multiplier=0: no noise"):
        zero = plan_run(compose_config([*base, "privacy.noise_multiplier=0"]), 1000, solve=refuse)
    assert zero.noise_multipliers == [0.0] * 30


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["privacy.noise_multiplier=-1"], r"privacy.noise_multiplier must be a finite sigma >= 0, or null"),
        (["privacy.noise_multiplier=inf"], r"privacy.noise_multiplier must be a finite sigma >= 0"),
        (["privacy.noise_multiplier=1", "clip=nonprivate"], r"clip=nonprivate adds none"),
        (["privacy.noise_multiplier=1", "noise.initial=2"], r"both fix sigma: set one"),
    ],
)
def test_noise_multiplier_set_directly_refuses_bad_values(compose_config, overrides, message):
    with pytest.raises(ValueError, match=message) as info:
        plan_run(compose_config(["steps=3", *overrides]), 1000)
    assert "\n" not in str(info.value)


def test_run_with_noise_multiplier_set_directly_reports_its_epsilon(compose_config, tmp_path):
    """The record keeps the sigma given and the epsilon the accountants make of it; at sigma 0, inf."""
    record = run_training(
        compose_config([*TINY_RUN, "clip=bk", "privacy.noise_multiplier=2.0"]), tmp_path / "a"
    )
    assert record["status"] == "completed" and record["target_epsilon"] is None
    assert record["noise_multipliers"] == [2.0] * 3
    expected = accounting.get_epsilon(2.0, record["sample_rate"], 3, record["delta"], accountant="rdp")
    assert record["epsilon"]["rdp"] == pytest.approx(expected, rel=1e-12) and 0 < expected < math.inf
    with pytest.warns(UserWarning, match="no privacy"):
        zero = run_training(
            compose_config([*TINY_RUN, "clip=bk", "privacy.noise_multiplier=0"]), tmp_path / "b"
        )
    assert zero["status"] == "completed" and zero["epsilon"]["rdp"] == math.inf


def test_adaptive_runs_record_their_released_thresholds_at_every_evaluation(compose_config, tmp_path):
    """clip=adaptive_perlayer: each evaluation keeps the thresholds C_k, one per layer, labelled by index and
    module, as the engine holds them after that step; a fixed-threshold run records none."""
    record = run_training(
        compose_config([*TINY_RUN, "clip=adaptive_perlayer", "eval_every=1", "steps=2"]), tmp_path / "a"
    )
    first, last = (entry["thresholds"] for entry in (record["history"][0], record["history"][-1]))
    assert list(first) == list(last) and next(iter(first)).startswith("0 ")
    assert len(first) > 2 and [label.split()[0] for label in first] == [str(k) for k in range(len(first))]
    assert first != last  # moved by the noised counts of step 2
    fixed = run_training(compose_config([*TINY_RUN, "clip=perlayer", "eval_every=1"]), tmp_path / "f")
    assert all("thresholds" not in entry for entry in fixed["history"])


def test_a_run_without_a_progress_bar_logs_progress_and_evaluations(compose_config, tmp_path, caplog):
    """progress=false (every run of a sweep): the log (train.log) has the loss and epsilon every log_every
    steps and each evaluation's metrics, the numbers the record holds; with the bar, only the evaluations."""
    caplog.set_level(logging.INFO, logger="dpexp.training.loop")
    overrides = [*TINY_RUN, "clip=bk", "steps=4", "log_every=2", "eval_every=2"]
    record = run_training(compose_config(overrides), tmp_path / "a")
    lines = [r.getMessage() for r in caplog.records if r.name == "dpexp.training.loop"]
    progress = [line for line in lines if line.startswith("step ")]
    assert [line.split(":")[0] for line in progress] == ["step 2/4", "step 4/4"]
    assert f"epsilon {record['history'][-1]['epsilon']:.4g}" in progress[-1]
    evaluations = [line for line in lines if line.startswith("evaluation at step")]
    assert len(evaluations) == len(record["history"]) == 2
    name = record["metric_names"][0]
    assert f"{name} {record['history'][-1][name]:.4g}" in evaluations[-1]
    caplog.clear()
    run_training(compose_config([*overrides, "progress=true"]), tmp_path / "b")
    lines = [r.getMessage() for r in caplog.records if r.name == "dpexp.training.loop"]
    assert not any(line.startswith("step ") for line in lines)
    assert sum(line.startswith("evaluation at step") for line in lines) == 2


def test_engine_backend_releases_the_engines_adaptive_thresholds():
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    backend = build_backend(
        {"method": "dpexp", "max_grad_norm": 1.0, "engine": {"clipping": "per_layer", "adaptive": {}}},
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        batch_size=4,
        sample_size=40,
        noise_multiplier=1.0,
    )
    released = backend.released()["thresholds"]
    assert list(released) == ["0 0", "1 2"]
    assert list(released.values()) == backend.engine.thresholds.tolist()
