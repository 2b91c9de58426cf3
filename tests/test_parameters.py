"""Config key ``parameters``: which parameters a run trains (dpexp/training/parameters.py), and that frozen
parameters stay out of clipping and noise while the released statistics keep their sensitivity."""

from __future__ import annotations

import json

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from dpexp.config import ConfigError
from dpexp.results.store import config_key
from dpexp.training.hooks import RunHooks
from dpexp.training.loop import run_training
from dpexp.training.parameters import select_trained
from dpexp.training.resume import resumed_config
from tests.conftest import TINY_RUN
from tests.oracle import SETTINGS
from tests.sensitivity import assert_refuses_or_private, check_case
from tests.sensitivity_models import make_sensitivity_case


def _mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 5), nn.ReLU(), nn.Linear(5, 3))


def _trained(model: nn.Module) -> list[str]:
    return [name for name, p in model.named_parameters() if p.requires_grad]


def test_train_patterns_then_freeze_patterns_select_the_trained_parameters():
    model = _mlp()
    selected = select_trained(model, ["0.*", "4.*"], ["4.bias"])
    assert _trained(model) == ["0.weight", "0.bias", "4.weight"]
    assert (selected.trained, selected.frozen) == (4 * 5 + 5 + 5 * 3, 5 * 5 + 5 + 3)
    assert selected.record() == {"parameters_trained": 40, "parameters_frozen": 33}

    everything = _mlp()
    assert select_trained(everything, None, []).frozen == 0 and len(_trained(everything)) == 6
    assert select_trained(_mlp(), None, ["*bias"]).trained == 20 + 25 + 15  # '*' crosses dots


def test_a_tied_parameter_is_matched_under_any_of_its_names_and_counted_once():
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(7, 4)
            self.body = nn.Linear(4, 4)
            self.head = nn.Linear(4, 7, bias=False)
            self.head.weight = self.embed.weight

    model = Tied()
    selected = select_trained(model, None, ["head.weight"])  # the name named_parameters() hides
    assert not model.embed.weight.requires_grad and _trained(model) == ["body.weight", "body.bias"]
    assert (selected.trained, selected.frozen) == (20, 28)
    kept = Tied()
    select_trained(kept, ["head.*", "body.*"], [])
    assert kept.embed.weight.requires_grad


def test_parameters_the_factory_froze_stay_frozen():
    model = _mlp()
    model[0].weight.requires_grad_(False)  # as LoRA's base
    selected = select_trained(model, ["*"], [])
    assert "0.weight" not in _trained(model) and selected.frozen == 20


def test_a_pattern_that_matches_nothing_and_an_empty_selection_are_refused():
    unmatched = r"parameters\.freeze: the pattern 'net\.\*' matches no parameter.*0\.weight"
    with pytest.raises(ConfigError, match=unmatched):
        select_trained(_mlp(), None, ["net.*"])
    with pytest.raises(ConfigError, match=r"parameters\.train: the pattern 'classifier'"):
        select_trained(_mlp(), ["0.*", "classifier"], [])
    with pytest.raises(ConfigError, match="leave no parameter of the model to train"):
        select_trained(_mlp(), ["0.*"], ["0.*"])


@pytest.mark.parametrize("strategy,clipping,groups", SETTINGS)
@pytest.mark.parametrize("name,frozen", [("mlp", "net.2.*"), ("roberta", "*word_embeddings*")])
def test_frozen_parameters_leave_the_release_private_and_exact(name, frozen, strategy, clipping, groups):
    """A frozen middle layer (its input gradient still flows) and a frozen input embedding: every released
    statistic equals the oracle's over the trained parameters and keeps its sensitivity."""
    case = make_sensitivity_case(name)
    select_trained(case.model, None, [frozen])
    kept = {n for n, p in case.model.named_parameters() if not p.requires_grad}
    outcome = check_case(case, strategy, clipping, groups)
    assert_refuses_or_private(outcome, case)
    assert not outcome.refusals
    assert kept and set(outcome.releases["D"].sums) == {n for n, _ in case.model.named_parameters()} - kept


class Snapshot(RunHooks):
    """The model's parameters when the backend is ready (before the first step) and when training ends."""

    def backend_ready(self, backend, sample_rate: float) -> None:
        self.before = {n: p.detach().clone() for n, p in backend.model.named_parameters()}

    def finished(self, model, task):
        self.after = {n: p.detach().clone() for n, p in model.named_parameters()}
        return {}


@pytest.mark.parametrize("clip", ["bk", "adaptive_perlayer"])
def test_a_private_run_leaves_frozen_parameters_exactly_unchanged(compose_config, tmp_path, clip):
    """Noise is added to trained parameters only: the frozen first convolution and its norm keep their
    initial values bit for bit, while every trained parameter moves; the record counts both."""
    cfg = compose_config([*TINY_RUN, f"clip={clip}", "parameters.freeze=['0.*','1.*']"])
    hooks = Snapshot()
    record = run_training(cfg, tmp_path, hooks=hooks)
    frozen = {n for n in hooks.before if n.split(".")[0] in {"0", "1"}}
    assert frozen == {"0.weight", "0.bias", "1.weight", "1.bias"}
    for name, before in hooks.before.items():
        moved = not torch.equal(before, hooks.after[name])
        assert moved == (name not in frozen), name
    total = sum(t.numel() for t in hooks.before.values())
    frozen_size = sum(hooks.before[n].numel() for n in frozen)
    assert (record["parameters_trained"], record["parameters_frozen"]) == (total - frozen_size, frozen_size)


def test_an_unmatched_pattern_fails_the_run_before_training(compose_config, tmp_path):
    cfg = compose_config([*TINY_RUN, "parameters.train=[conv.*]"])
    with pytest.raises(ConfigError, match=r"parameters\.train: the pattern 'conv\.\*' matches no parameter"):
        run_training(cfg, tmp_path)
    record = json.loads((tmp_path / "metrics.json").read_text())
    assert record["status"] == "failed" and record["steps_done"] == 0


def test_the_default_selection_keeps_older_records_keys(compose_config):
    """Records made before the key existed have no ``parameters``: the default selection hashes as they do,
    any other selection does not."""
    config = OmegaConf.to_container(compose_config(list(TINY_RUN)), resolve=True)
    older = {k: v for k, v in config.items() if k != "parameters"}
    assert config_key(config) == config_key(older)
    frozen = {**config, "parameters": {"train": None, "freeze": ["0.*"]}}
    assert config_key(frozen) != config_key(older)


def test_resuming_a_record_without_the_key_takes_its_default(compose_config, tmp_path):
    cfg = compose_config(list(TINY_RUN))
    recorded = OmegaConf.to_container(cfg, resolve=True)
    del recorded["parameters"]
    (tmp_path / "metrics.json").write_text(json.dumps({"config": recorded}))
    resumed = resumed_config(tmp_path, cfg, [f"resume={tmp_path}"])
    assert OmegaConf.to_container(resumed.parameters) == {"train": None, "freeze": []}
    assert resumed.task == cfg.task
