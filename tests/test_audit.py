"""One-run privacy auditing: the statistics against independent computations, the canaries, and the audit of
real runs, which must stay below the accountant's epsilon and catch deliberately broken mechanisms (broken
only here, by monkeypatching: there is no fault switch in the package)."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch
from scipy import stats

from dpexp.audit import run_audit, verdict
from dpexp.privacy import clipping as clipping_module
from dpexp.privacy import engine as engine_module
from dpexp.privacy.audit import DiracCanaries, correct_guesses, epsilon_lower_bound, p_value
from tests.conftest import SHARED_DATA

pytestmark = pytest.mark.filterwarnings("ignore:.*torch.func fallback", "ignore:sampling=shuffle")


# ------------------------------------------------------------------------------------------- statistics
def test_pure_dp_p_value_is_the_binomial_tail():
    for eps in (0.0, 0.5, 2.0):
        p = math.exp(eps) / (1 + math.exp(eps))
        assert p_value(1000, 100, 70, eps, 0.0) == pytest.approx(stats.binom.sf(69, 100, p), rel=1e-12)


def test_p_value_grows_with_epsilon_and_delta():
    """A larger epsilon or delta permits more correct guesses, so the same count is less surprising."""
    values = [p_value(1000, 100, 80, eps, 1e-5) for eps in (0.0, 0.5, 1.0, 2.0)]
    assert values == sorted(values) and values[0] < 1e-3 < values[-1]
    assert p_value(1000, 100, 80, 1.0, 1e-3) > p_value(1000, 100, 80, 1.0, 1e-6)


def test_lower_bound_is_monotone_and_zero_without_evidence():
    bounds = [epsilon_lower_bound(1000, 100, v, 1e-5) for v in (50, 70, 90, 100)]
    assert bounds[0] == 0.0 and bounds == sorted(bounds)
    assert epsilon_lower_bound(1000, 100, 90, 1e-3) < epsilon_lower_bound(1000, 100, 90, 1e-8)
    # at the bound the p-value is the confidence level; just above the bound it is not rejected
    bound = bounds[2]
    assert p_value(1000, 100, 90, bound, 1e-5) < 0.05 <= p_value(1000, 100, 90, bound + 1e-3, 1e-5)


def test_lower_bound_is_valid_and_tight_for_randomized_response():
    """Each canary's bit released through eps-DP randomized response: over many trials the 95% lower bound
    exceeds eps in at most about 5% of them, and with all m = r = 2000 guesses it comes close to eps."""
    eps, m = 2.0, 2000
    generator = torch.Generator().manual_seed(0)
    bounds = []
    for _ in range(60):
        truth = torch.rand(m, generator=generator) < 0.5
        flip = torch.rand(m, generator=generator) < 1 / (1 + math.exp(eps))
        released = truth ^ flip
        r, v = correct_guesses(released.double(), truth, int(released.sum()), int((~released).sum()))
        bounds.append(epsilon_lower_bound(m, r, v, 0.0))
    assert sum(b > eps for b in bounds) <= 8  # binomial(60, 0.05) exceeds 8 with probability < 1%
    assert sorted(bounds)[len(bounds) // 2] > 0.85 * eps


def test_correct_guesses_counts_top_and_bottom():
    scores = torch.tensor([5.0, 4.0, 3.0, 2.0, 1.0, 0.0])
    included = torch.tensor([True, False, True, False, False, True])
    assert correct_guesses(scores, included, 2, 0) == (2, 1)
    assert correct_guesses(scores, included, 1, 2) == (3, 2)  # top: right; bottom two: 4 right, 5 wrong


# ------------------------------------------------------------------------------------------- canaries
def test_dirac_canaries_are_distinct_coordinates_and_enter_as_one_batch():
    shapes = {"a.weight": torch.Size([4, 3]), "a.bias": torch.Size([4]), "b.weight": torch.Size([2, 4])}
    canaries = DiracCanaries.draw(shapes, 24, 5.0, torch.Generator().manual_seed(0))
    coordinates = set(zip(canaries.names, canaries.index.tolist(), strict=True))
    assert len(coordinates) == 24 == sum(s.numel() for s in shapes.values())
    params = {name: torch.zeros(shape) for name, shape in shapes.items()}
    grads = canaries.step_gradients(1.0, params, torch.Generator().manual_seed(1))  # q = 1: all included
    sizes = {g.batch_size for g in grads.values()}
    assert sizes == {int(canaries.included.sum())}
    total = {name: g.weighted_sum(torch.ones(g.batch_size)) for name, g in grads.items()}
    released = {name: total.get(name, torch.zeros(shape)) for name, shape in shapes.items()}
    assert torch.equal(canaries.read(released) > 0, canaries.included)


# ------------------------------------------------------------------------------------------- audits
@pytest.fixture
def audit_config():
    from hydra import compose, initialize_config_dir

    from tests.conftest import CONF_DIR

    def _compose(overrides):
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            return compose(config_name="audit", overrides=["progress=false", *overrides])

    return _compose


def _run(audit_config, tmp_path, overrides):
    result = run_audit(audit_config(overrides), tmp_path)
    return result, verdict(result)[1]


FAST = ["epochs=8", "privacy.epsilon=1.0", "eval_every=null", "audit.canaries=1000", "audit.guesses=100"]


def test_white_box_audit_of_the_digits_run_stays_below_epsilon(audit_config, tmp_path):
    result, violated = _run(audit_config, tmp_path, FAST)
    assert not violated and result["epsilon_lower_bound"] <= result["epsilon"]["rdp"]
    assert (tmp_path / "audit.json").exists() and result["tightness"] is not None


@pytest.mark.parametrize("broken", ["noise_divided_by_10", "one_layer_unclipped"])
def test_white_box_audit_catches_a_broken_mechanism(audit_config, tmp_path, monkeypatch, broken):
    if broken == "noise_divided_by_10":
        real = engine_module.noise_stds
        monkeypatch.setattr(engine_module, "noise_stds", lambda *a: real(*a) / 10)
    else:
        real = clipping_module.Clipper._clipping_factors

        def unclipped_output_layer(self, k, norm_sq, batch_size, scales=None):  # the last group: the Linear
            coef = real(self, k, norm_sq, batch_size, scales)
            return torch.ones_like(coef) if k == len(self.groups) - 1 else coef

        monkeypatch.setattr(clipping_module.Clipper, "_clipping_factors", unclipped_output_layer)
    result, violated = _run(audit_config, tmp_path, FAST)
    assert violated, result
    text, _ = verdict(result)
    assert "privacy audit FAILED" in text


def test_black_box_audit_of_the_digits_run_stays_below_epsilon(audit_config, tmp_path):
    result, violated = _run(audit_config, tmp_path, ["audit=black_box", *FAST, "audit.canaries=200"])
    assert not violated and result["variant"] == "black_box" and result["included"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("variant", ["white_box", "black_box"])
def test_digits_default_audits_never_exceed_epsilon(audit_config, tmp_path, seed, variant):
    result, violated = _run(
        audit_config, tmp_path, [f"audit={variant}", f"seed={seed}", f"audit.seed={seed}"]
    )
    assert not violated, result


@pytest.mark.slow
@pytest.mark.skipif(
    not (SHARED_DATA / "sst2" / "train.tsv").is_file(), reason="../shared/data/sst2 is absent"
)
@pytest.mark.parametrize("seed", [0, 1])
def test_small_transformer_audit_never_exceeds_epsilon(audit_config, tmp_path, seed):
    overrides = [
        "task=sst2", f"data.root={SHARED_DATA}", "task.subsample=2000", "model=roberta_tiny", "clip=bk",
        "optim=adam", "epochs=3", "batch_size=64", "physical_batch_size=64", f"seed={seed}",
        f"audit.seed={seed}",
    ]  # fmt: skip
    result, violated = _run(audit_config, tmp_path, overrides)
    assert not violated, result


def test_audit_command_runs_and_reports(tmp_path):
    """``python -m dpexp.audit`` end to end (Hydra's run directory, the summary, the exit status)."""
    command = [
        sys.executable, "-m", "dpexp.audit", "steps=3", "eval_every=null", "progress=false",
        "audit.canaries=50", "audit.guesses=10", f"hydra.run.dir={tmp_path}",
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "guesses right among 50 canaries" in done.stdout and (tmp_path / "audit.json").is_file()


def test_audit_refusal_is_one_line_with_exit_status_2(tmp_path):
    command = [
        sys.executable, "-m", "dpexp.audit", "steps=2", "progress=false", "audit.canaries=0",
        f"hydra.run.dir={tmp_path}",
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "audit.canaries=0" in lines[0] and "Traceback" not in done.stderr


@pytest.mark.parametrize("mode", ["ddp", "pipeline"])
def test_audit_refuses_distributed_training(audit_config, tmp_path, mode):
    """Every rank would insert the canaries into its own share: an audit runs in one process."""
    with pytest.raises(ValueError, match=rf"distributed={mode}: an audit runs in one process") as info:
        run_audit(audit_config([f"distributed={mode}"]), tmp_path)
    assert "\n" not in str(info.value) and not (tmp_path / "metrics.json").exists()
