"""``python -m dpexp.train`` as a user meets it (run in this process through :func:`dpexp.train.cli`): the
project's own refusals print one line naming the key, exit code 1, and leave a valid record; ``debug=true``
shows the traceback; every run gets a directory of its own and never overwrites another run's record."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hydra.errors import HydraException

from dpexp.config import ConfigError
from dpexp.train import cli
from dpexp.training.loop import run_training
from dpexp.training.signals import RunInterrupted
from tests.test_checkpoint import SignalAt

QUICK = ("steps=3", "progress=false", "eval_every=null", "batch_size=32")
QUIET = ("hydra/job_logging=none", "hydra/hydra_logging=none")


def run_cli(monkeypatch, capsys, *args: str) -> tuple[int, str]:
    """(exit code, stderr) of ``python -m dpexp.train *args``."""
    monkeypatch.setattr(sys, "argv", ["dpexp.train", *args, *QUIET])
    try:
        cli()
        code = 0
    except SystemExit as stop:
        code = stop.code
    return code, capsys.readouterr().err


def strict_json(path: Path) -> dict:
    def refuse(constant: str) -> None:
        raise AssertionError(f"{path} holds the non-JSON constant {constant}")

    return json.loads(path.read_text(), parse_constant=refuse)


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("+clip.max_grad_nrom=5", "clip.max_grad_nrom"),
        ("+optim.lrr=0.1", "optim.lrr"),
        ("+optim.schedule.warmup=0.5", "optim.schedule.warmup"),
    ],
)
def test_misspelt_keys_are_refused_from_the_command_line(monkeypatch, capsys, tmp_path, override, key):
    code, err = run_cli(monkeypatch, capsys, override, f"hydra.run.dir={tmp_path}")
    assert code == 1
    assert one_line(err).startswith(f"ConfigError: Unknown config key {key}; valid keys of")
    record = strict_json(tmp_path / "metrics.json")
    assert record["status"] == "failed" and key in record["error"]


@pytest.mark.parametrize("key", ["clip.max_grad_nrom", "clip.engine.strat", "learning_rate", "model.widht"])
def test_an_unknown_key_has_one_wording_with_or_without_plus(monkeypatch, capsys, tmp_path, key):
    """Hydra refuses ``key=1`` while it composes the config, dpexp's schema check refuses ``+key=1`` after:
    the same line either way."""
    lines = []
    for run, override in enumerate((f"{key}=1", f"+{key}=1")):
        code, err = run_cli(monkeypatch, capsys, override, f"hydra.run.dir={tmp_path / str(run)}")
        assert code == 1
        lines.append(one_line(err))
    assert lines[0] == lines[1]


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("clip.max_grad_nrom=5", "Unknown config key clip.max_grad_nrom; valid keys of clip: "),
        ("clip.engine.strat=bk", "Unknown config key clip.engine.strat; valid keys of clip.engine: clipping"),
        ("learning_rate=0.1", "Unknown config key learning_rate; valid top-level keys: task, model"),
        ("clip=fancy", "clip=fancy: no such option; the options of clip: adaclip, "),
        ("sampling=uniform", "sampling=uniform: Invalid value 'uniform', expected one of [poisson, shuffle]"),
        ("batch_size=many", "batch_size=many: Value 'many' of type 'str' could not be converted to Integer"),
        ("optim.lr=[1", "cannot parse the override 'optim.lr=[1'"),
        ("~clip.foo", "'clip.foo' does not exist"),
    ],
)
def test_hydras_refusals_print_one_line_naming_the_key(monkeypatch, capsys, tmp_path, override, message):
    """Refused while Hydra composes the config (no ``+`` for an unknown key, a missing option, a wrong
    type): one line, no run directory (no run began), and ``debug=true`` raises Hydra's own error."""
    code, err = run_cli(monkeypatch, capsys, override, f"hydra.run.dir={tmp_path / 'run'}")
    line = one_line(err)
    assert code == 1 and line.startswith("ConfigError: ") and message in line, line
    assert "+" not in line.split("(for the traceback")[0]  # no suggestion to append the key
    assert not (tmp_path / "run").exists()
    with pytest.raises(HydraException):  # python -m dpexp.train prints its traceback and exits with 1
        run_cli(monkeypatch, capsys, override, "debug=true", f"hydra.run.dir={tmp_path / 'run'}")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (("optim.lr=-0.1",), "ConfigError: optim.lr must be a finite number >= 0, got -0.1"),
        (("eval_every=0",), "ValueError: eval_every must be a number of steps >= 1, or null"),
        (("eval_every=-5",), "ValueError: eval_every must be a number of steps >= 1, or null"),
        (("privacy.epsilon=inf",), "ValueError: privacy.epsilon must be a finite number > 0, got inf"),
        (("privacy.epsilon=nan",), "ValueError: privacy.epsilon must be a finite number > 0, got nan"),
        (("checkpoint.keep=0",), "ConfigError: checkpoint.keep must be >= 1"),
        (("privacy.accounting_timeout_s=0",), "ConfigError: privacy.accounting_timeout_s must be a positive"),
        (("model=minilm",), "task digits is an image task; use an image model: model=small_cnn"),
        (("model=wrn16_4",), "task digits has 1-channel images: set one value per channel"),
        (("model=gpt2_tiny",), "task digits is an image classification task; use an image model"),
        (("model=llama_tiny",), "random llama is a language model for generation tasks (e2e, dart, samsum)"),
        (("model=convnext_atto",), "convnext_atto cannot run on 8x8 images (task digits)"),
        (
            ("model=efficientnet_b0", "model.norm_layer=null"),
            "efficientnet_b0 has BatchNorm layers (bn1, ...)",
        ),
        (
            ("task=cifar10", "model=convnext_atto", "model.image_size=[4]"),
            "image_size must be 'pretrained', null",
        ),
        (("task=cifar10", "model=efficientnet_b0", "model.pretrained=true"), "trained with BatchNorm"),
        (("task=cifar10", "model=convnext_atto", "model.norm_layer=batch"), "norm_layer must be null or"),
    ],
)
def test_invalid_values_print_one_line_naming_the_key(monkeypatch, capsys, tmp_path, overrides, message):
    code, err = run_cli(monkeypatch, capsys, *QUICK, *overrides, f"hydra.run.dir={tmp_path}")
    assert code == 1 and message in one_line(err)
    assert one_line(err).endswith("(for the traceback: debug=true or DPEXP_DEBUG=1)")
    record = strict_json(tmp_path / "metrics.json")
    assert record["status"] == "failed" and record["steps_done"] == 0


def test_a_refusal_raised_as_a_type_error_is_the_projects_own():
    """The engine refuses a layer whose output it cannot capture with a TypeError (a layer returning an
    object); an entry point prints it in one line like any other refusal, and not a library's TypeError."""
    import torch
    from torch import nn

    from dpexp.privacy import PrivacyEngine
    from dpexp.runtime import is_project_error

    class Returns(nn.Module):  # a layer with parameters that returns neither a tensor nor tensors
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(3, 2)

        def forward(self, x):
            return {"y": self.linear(x)}

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = Returns()
            self.block.scale = nn.Parameter(torch.ones(2))  # the block's own parameter: it has no rule

        def forward(self, x):
            return self.block(x)["y"] * self.block.scale

    model = Model()
    engine = PrivacyEngine(model, batch_size=2, sample_size=4, max_grad_norm=1.0, noise_multiplier=0.0)
    with pytest.raises(TypeError, match="register a rule") as refusal:
        engine.backward(model(torch.randn(2, 3)).sum(1))
    assert is_project_error(refusal.value)
    with pytest.raises(TypeError) as library:
        torch.zeros("x")
    assert not is_project_error(library.value)


def test_debug_shows_the_traceback(monkeypatch, capsys, tmp_path):
    """The error leaves the entry point, which Python reports with its traceback and exit code 1."""
    with pytest.raises(ConfigError, match=r"optim\.lrr") as info:
        run_cli(monkeypatch, capsys, "+optim.lrr=0.1", "debug=true", f"hydra.run.dir={tmp_path / 'a'}")
    assert info.traceback[-1].path.name == "config.py"
    monkeypatch.setenv("DPEXP_DEBUG", "1")
    with pytest.raises(ConfigError, match=r"optim\.lrr"):
        run_cli(monkeypatch, capsys, "+optim.lrr=0.1", f"hydra.run.dir={tmp_path / 'b'}")


def test_a_diverging_run_stops_at_the_first_non_finite_loss(monkeypatch, capsys, tmp_path):
    code, err = run_cli(monkeypatch, capsys, *QUICK, "steps=20", "optim.lr=1e30", f"hydra.run.dir={tmp_path}")
    assert code == 1
    assert re.fullmatch(
        r"TrainingDiverged: the training loss of step (\d+) is nan \(optim\.lr=1e\+30\); lower optim\.lr .*",
        one_line(err),
    )
    record = strict_json(tmp_path / "metrics.json")
    done = record["steps_done"]
    assert record["status"] == "diverged" and 1 <= done < 20 and f"step {done} " in record["error"]
    assert record["train_loss"] == "NaN" and record["steps_accounted"] == done
    assert all(isinstance(record["epsilon"][name], float) for name in ("rdp", "prv", "gdp"))


def test_every_run_gets_a_directory_of_its_own(monkeypatch, capsys, tmp_path):
    for _ in range(2):  # two runs in the same second, whatever the timestamp says
        run_cli(monkeypatch, capsys, "+optim.lrr=0.1", f"output.root={tmp_path}")
    runs = sorted((tmp_path / "runs" / "digits" / "adaptive_perlayer").iterdir())
    assert len(runs) == 2 and all((run / "metrics.json").is_file() for run in runs)
    assert all(re.fullmatch(r"\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d_[0-9a-f]{6}", run.name) for run in runs)
    for _ in range(2):  # the random token alone separates them
        run_cli(
            monkeypatch,
            capsys,
            "+optim.lrr=0.1",
            f"hydra.run.dir={tmp_path}/same_second_" + "${dpexp.token:}",
        )
    assert len(list(tmp_path.glob("same_second_*/metrics.json"))) == 2


def test_a_record_is_never_overwritten(monkeypatch, capsys, tmp_path):
    run_cli(monkeypatch, capsys, *QUICK, f"hydra.run.dir={tmp_path}")
    first = (tmp_path / "metrics.json").read_text()
    code, err = run_cli(monkeypatch, capsys, *QUICK, "seed=1", f"hydra.run.dir={tmp_path}")
    assert code == 1 and one_line(err).startswith(
        f"RunDirectoryError: {tmp_path} already holds another run's"
    )
    assert f"resume={tmp_path}" in err and (tmp_path / "metrics.json").read_text() == first


def test_a_resumed_run_prints_the_record_it_continued(monkeypatch, capsys, tmp_path, compose_config):
    """``resume=<run dir>`` finishes the run in its own directory and says so; Hydra's directory of the
    resuming command holds only its logs."""
    run = tmp_path / "run"
    with pytest.raises(RunInterrupted):
        run_training(compose_config([*QUICK, "checkpoint.every=1"]), run, hooks=SignalAt(2))
    monkeypatch.setattr(
        sys, "argv", ["dpexp.train", f"resume={run}", f"hydra.run.dir={tmp_path / 'logs'}", *QUIET]
    )
    cli()
    assert f"metrics: {run}/metrics.json" in capsys.readouterr().out
    assert strict_json(run / "metrics.json")["status"] == "completed"
    assert not (tmp_path / "logs" / "metrics.json").exists()


@pytest.mark.parametrize(
    ("entry_point", "override", "code", "message"),
    [
        ("dpexp.audit", "audit.canary=3", 2, "Unknown config key audit.canary; valid keys of audit: "),
        ("dpexp.bench", "bench_suite=nope", 1, "bench_suite=nope: no such option; the options of"),
        (  # a suite's model entries are free-form: an optional key they lack is added with +
            "dpexp.bench",
            "bench_suite.models.wrn16_4.methods=[bk]",
            1,
            "Unknown config key bench_suite.models.wrn16_4.methods; valid keys of "
            "bench_suite.models.wrn16_4: spec, optimizer, batch_sizes. "
            "To add a key this entry does not have yet: +bench_suite.models.wrn16_4.methods=...",
        ),
    ],
)
def test_the_other_entry_points_refuse_in_one_line(entry_point, override, code, message):
    done = subprocess.run(
        [sys.executable, "-m", entry_point, override, *QUIET], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == code and message in one_line(done.stderr), done.stderr
