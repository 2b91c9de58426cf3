"""Individualized privacy in a run (privacy.individual): the config refused before training, the plan's
calibration, every group's epsilon in metrics.json under every accountant, the sampler's per-group rates and
the privacy groups the backend receives for every micro-batch."""

from __future__ import annotations

import pytest
import torch

from dpexp.backends.engine import EngineBackend
from dpexp.config import ConfigError
from dpexp.privacy import accounting
from dpexp.tasks.digits import DigitsTask
from dpexp.training.individual import check_individual, privacy_groups
from dpexp.training.loop import run_training
from dpexp.training.plan import plan_run
from tests.conftest import TINY_RUN

TABLE9 = ["privacy.individual.epsilons=[1.0,2.0,3.0]", "privacy.individual.fractions=[0.34,0.43,0.23]"]


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["privacy.individual.epsilons=[1.0]"], r"privacy.individual.epsilons is set but .*variant=none"),
        (["privacy.individual.variant=shared", *TABLE9], "variant must be none, sampling or scaling"),
        (["privacy.individual.variant=scaling", "privacy.individual.fractions=[1.0]"], "epsilons must list"),
        (
            [
                "privacy.individual.variant=scaling",
                "privacy.individual.epsilons=[1.0,-2.0]",
                "privacy.individual.fractions=[0.5,0.5]",
            ],
            "finite numbers > 0",
        ),
        (
            [
                "privacy.individual.variant=scaling",
                "privacy.individual.epsilons=[1.0,2.0]",
                "privacy.individual.fractions=[0.5,0.4]",
            ],
            "one share in",
        ),
        (["privacy.individual.variant=scaling", "privacy.individual.epsilons=[1.0,2.0]"], "either fractions"),
        (
            ["privacy.individual.variant=scaling", *TABLE9, "privacy.individual.column=label"],
            "either fractions",
        ),
        (["privacy.individual.variant=scaling", *TABLE9, "clip=opacus"], "needs a dpexp clip"),
        (["privacy.individual.variant=scaling", *TABLE9, "clip=nonprivate"], "needs a dpexp clip"),
        (["privacy.individual.variant=scaling", *TABLE9, "clip=adaptive_flat"], "adaptive thresholds"),
        (["privacy.individual.variant=sampling", *TABLE9, "clip=bk", "sampling=shuffle"], "sampling=poisson"),
        (
            ["privacy.individual.variant=sampling", *TABLE9, "clip=bk", "noise=time", "noise.initial=5"],
            "noise.initial=null",
        ),
    ],
)
def test_bad_individual_configs_are_refused_naming_the_key(compose_config, overrides, message):
    with pytest.raises(ConfigError, match=message):
        check_individual(compose_config(overrides))


def test_a_group_budget_that_cannot_be_met_is_refused_before_training(compose_config):
    cfg = compose_config(
        [*TINY_RUN, "clip=bk", "privacy.individual.variant=scaling", "privacy.individual.epsilons=[1e-7,2.0]",
         "privacy.individual.fractions=[0.5,0.5]", "privacy.delta=1e-10"]
    )  # fmt: skip
    groups = torch.arange(100) % 2
    with pytest.raises(
        ValueError, match=r"privacy.individual: privacy group 0 \(epsilon=1e-07\) cannot meet"
    ):
        plan_run(cfg, 100, privacy_groups=groups)


def test_column_groups_and_their_errors(compose_config):
    task = DigitsTask()
    task.setup(factory=None)
    cfg = compose_config(
        ["privacy.individual.variant=sampling", f"privacy.individual.epsilons={[1.0] * 10}",
         "privacy.individual.column=label"]
    )  # fmt: skip
    groups = privacy_groups(cfg, task, task.train_dataset)
    assert torch.equal(groups, task.train_dataset.tensors[1])
    cfg.privacy.individual.epsilons = [1.0, 2.0]
    with pytest.raises(ConfigError, match=r"column=label holds values in \[0, 9\].*in \[0, 2\)"):
        privacy_groups(cfg, task, task.train_dataset)
    cfg.privacy.individual.column = "age"
    with pytest.raises(ValueError, match="task digits has no column 'age'"):
        privacy_groups(cfg, task, task.train_dataset)


@pytest.mark.parametrize("variant", [pytest.param("sampling", marks=pytest.mark.slow), "scaling"])
def test_individual_run_reports_every_group_within_its_budget(compose_config, tmp_path, variant, monkeypatch):
    """A digits run (a column of label % 3 as the groups: the backend must receive every micro-batch's as its
    privacy groups) meets every group's budget under both upper bounds, at the plan's rates and scales."""
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    labels: list[torch.Tensor] = []
    per_example_loss, backward = DigitsTask.per_example_loss, EngineBackend.backward

    def loss_spy(self, model, batch):
        labels.append(batch["label"].clone())
        return per_example_loss(self, model, batch)

    def backward_spy(self, loss, privacy_groups=None):
        seen.append((labels[-1] % 3, privacy_groups.clone()))
        return backward(self, loss, privacy_groups)

    monkeypatch.setattr(DigitsTask, "per_example_loss", loss_spy)
    monkeypatch.setattr(EngineBackend, "backward", backward_spy)
    monkeypatch.setattr(DigitsTask, "column_value", lambda self, example, column: int(example[1]) % 3)
    epsilons = [1.0, 2.0, 3.0]
    cfg = compose_config(
        [*TINY_RUN, "clip=ghost", f"privacy.individual.variant={variant}",
         f"privacy.individual.epsilons={epsilons}", "privacy.individual.column=label3", "steps=20"]
    )  # fmt: skip
    record = run_training(cfg, tmp_path / variant)
    assert record["status"] == "completed"
    plan = record["individual"]
    assert plan["variant"] == variant and plan["epsilons"] == epsilons and sum(plan["group_sizes"]) == 1437
    for name in ("rdp", "prv"):
        spent = record["epsilon_by_group"][name]
        assert all(e <= budget * (1 + 1e-9) for e, budget in zip(spent, epsilons, strict=True)), (name, spent)
        assert record["epsilon"][name] == max(spent)
    assert record["epsilon_by_group"]["rdp"][0] >= 0.99 * epsilons[0]  # calibrated, not just below
    assert len(record["epsilon_by_group"]["gdp"]) == 3
    assert seen and all(torch.equal(want, got.cpu()) for want, got in seen)
    if variant == "sampling":
        assert plan["scales"] == [1.0] * 3 and plan["sample_rates"] == sorted(plan["sample_rates"])
        assert plan["sample_rates"][0] < 32 / 1437 < plan["sample_rates"][-1]
    else:
        assert len(set(plan["sample_rates"])) == 1 and plan["scales"] == sorted(plan["scales"])
        mean_scale = sum(n * s for n, s in zip(plan["group_sizes"], plan["scales"], strict=True)) / 1437
        assert mean_scale == pytest.approx(1.0)
        for g, budget in enumerate(epsilons):
            sigma_g = record["noise_multiplier"] / plan["scales"][g]
            assert accounting.get_epsilon(sigma_g, 32 / 1437, 20, record["delta"]) <= budget * (1 + 1e-9)
