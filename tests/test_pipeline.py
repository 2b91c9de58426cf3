"""Per-device clipping on a two-stage pipeline (distributed=pipeline) on two CPU processes with gloo: at
noise 0 its steps equal single-process group-wise clipping with groups = stages (fixed and adaptive
thresholds), every stage draws its noise once per step (variance; independent across stages), the epsilon is
the single-process one, a failing stage ends its neighbour with a clear error, and a bad split is refused."""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hydra import compose, initialize_config_dir
from torch import nn

from dpexp.config import ConfigError
from dpexp.privacy import PrivacyEngine
from dpexp.privacy.adaptive import AdaptiveConfig
from dpexp.training.distributed import DistributedError, start_data_parallel
from dpexp.training.pipeline import PipelineStage, split_stages, stage_engine_kwargs, stage_generator
from tests.conftest import CONF_DIR
from tests.test_distributed import JOIN_S, WORLD, _env, _free_port, _spawn, error_of_a_failing_pair

ADAPTIVE = {"target_quantile": 0.5, "quantile_lr": 0.3, "budget_fraction": 0.1, "rescale_to_global": False}
CASES = {
    "fixed": {"noise_allocation": "equal_budget", "strategy": "bk"},
    "fixed_ghost": {
        "noise_allocation": "equal_budget",
        "strategy": "ghost",
        "thresholds": [50.0, 0.05],
    },  # 0: unclipped
    "adaptive": {"noise_allocation": "equal_budget", "strategy": "bk", "adaptive": ADAPTIVE},
}
C = 0.2  # small enough that most examples are clipped in both stages
STEPS, N, B = 3, 40, 8
SPLIT = [2]
NOISE_WIDTH = 256  # 4-5k coordinates per stage: their sample variance is within 3% (one s.d.)


def _model(width: int = 8) -> nn.Sequential:
    """Stages [0, 2) and [2, 5) at SPLIT; inputs of ``width`` features."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(width, 16), nn.Tanh(), nn.Linear(16, width), nn.Tanh(), nn.Linear(width, 3)
    )


def _data(width: int = 8) -> tuple[torch.Tensor, torch.Tensor, list[list[list[int]]]]:
    """Inputs, labels, and every step's two micro-batches (index lists of 4 and 3 examples)."""
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(N, width, generator=g), torch.randint(0, 3, (N,), generator=g)
    steps = [[list(range(s * 7, s * 7 + 4)), list(range(s * 7 + 4, s * 7 + 7))] for s in range(STEPS)]
    return x, y, steps


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out, y, reduction="none")


def _single_process(case: str, split: list[int]) -> tuple[list[nn.Sequential], list[torch.Tensor]]:
    """The reference: one engine, clipping=groups with groups = the stages' parameters; its stages after
    training and its thresholds after every step."""
    model, (x, y, steps) = _model(), _data()
    stages = split_stages(model, split)
    prefix = {id(p): n for n, p in model.named_parameters()}
    groups = [[prefix[id(p)] for p in stage.parameters()] for stage in stages]
    kwargs = dict(CASES[case])
    engine = PrivacyEngine(
        model,
        batch_size=B,
        sample_size=N,
        max_grad_norm=C,
        noise_multiplier=0.0,
        clipping="groups",
        groups=groups,
        **kwargs,
    )
    optimizer = engine.attach(torch.optim.SGD(model.parameters(), lr=0.5))
    thresholds = []
    for micro_batches in steps:
        for idx in micro_batches:
            engine.backward(_loss(model(x[idx]), y[idx]))
        optimizer.step()
        optimizer.zero_grad()
        thresholds.append(engine.thresholds.clone())
    return stages, thresholds


def _stage(
    rank: int, port: int, case: str, sigma: float, timeout_s: float = 60.0, width: int = 8, split=SPLIT
):
    _env(rank, port)
    os.environ["WORLD_SIZE"] = str(len(split) + 1)
    model = _model(width)
    module = split_stages(model, split)[rank]
    stage = PipelineStage(
        module,
        torch.optim.SGD(module.parameters(), lr=0.5 if sigma == 0 else 1.0),
        batch_size=B,
        sample_size=N,
        max_grad_norm=C,
        noise_multiplier=sigma,
        engine_kwargs=CASES[case],
        seed=7,
        timeout_s=timeout_s,
    )
    return model, module, stage


def _run_step(stage: PipelineStage, x: torch.Tensor, y: torch.Tensor, micro_batches: list[list[int]]) -> None:
    for idx in micro_batches:
        if stage.first:
            stage.backward(len(idx), inputs=x[idx])
        elif stage.last:
            stage.backward(len(idx), loss_fn=lambda out, idx=idx: _loss(out, y[idx]))
        else:
            stage.backward(len(idx))
    stage.step()


def _equality_worker(rank: int, port: int, cases: list[str], split: list[int]) -> None:
    torch.set_num_threads(1)
    _env(rank, port)
    os.environ["WORLD_SIZE"] = str(len(split) + 1)
    dist.init_process_group("gloo")  # one group for all cases (the stages use it, and leave it open)
    for case in cases:
        _, module, stage = _stage(rank, port, case, 0.0, split=split)
        x, y, steps = _data()
        reference, thresholds = _single_process(case, split)
        ref_stage = reference[rank]
        for s, micro_batches in enumerate(steps):
            _run_step(stage, x, y, micro_batches)
            assert torch.allclose(stage.engine.thresholds[0], thresholds[s][rank].to(torch.float64)), case
        for p, q in zip(module.parameters(), ref_stage.parameters(), strict=True):
            assert torch.allclose(p, q, atol=1e-6, rtol=1e-5), (case, rank, (p - q).abs().max())
        if case == "adaptive":  # the thresholds moved: the test sees adaptation, not fixed values
            assert not torch.allclose(
                thresholds[-1][rank], torch.tensor(C / math.sqrt(2), dtype=torch.float64)
            )
        stage.close()
    dist.destroy_process_group()


@pytest.mark.slow
def test_pipeline_steps_at_noise_zero_equal_single_process_groupwise_clipping():
    """Each stage clips to its own (fixed or adaptive) threshold: after 3 steps, both stages' parameters and
    thresholds equal one process' group-wise clipping with groups = stages."""
    assert _spawn(_equality_worker, sorted(CASES), SPLIT) == [0] * WORLD


@pytest.mark.slow
def test_three_stages_equal_single_process_groupwise_clipping():
    """A middle stage receives activations and sends gradients both ways: three stages (fixed thresholds)
    equal one process' group-wise clipping with three groups."""
    context = mp.get_context("spawn")
    port = _free_port()
    processes = [
        context.Process(target=_equality_worker, args=(r, port, ["fixed"], [2, 4])) for r in range(3)
    ]
    for process in processes:
        process.start()
    for process in processes:
        process.join(JOIN_S)
    alive = [p.is_alive() for p in processes]
    for process in processes:
        process.kill()
        process.join()
    assert not any(alive), "a stage hung"
    assert [p.exitcode for p in processes] == [0, 0, 0]


def _noise_worker(rank: int, port: int, sigma: float, out: str) -> None:
    torch.set_num_threads(1)
    _, module, stage = _stage(rank, port, "fixed", sigma, width=NOISE_WIDTH)
    x, _, _ = _data(NOISE_WIDTH)
    before = torch.cat([p.detach().reshape(-1).clone() for p in module.parameters()])
    # a loss that does not depend on the output: every per-example gradient (and the one sent back) is 0
    micro = list(range(B))
    if stage.first:
        stage.backward(B, inputs=x[micro])
    else:
        stage.backward(B, loss_fn=lambda o: 0.0 * o.sum(1))
    stage.step()
    moved = torch.cat([p.detach().reshape(-1) for p in module.parameters()]) - before
    record = {
        "moved": moved,
        "threshold": stage.engine.thresholds[0].item(),
        "epsilon": stage.get_epsilon(1e-5),
    }
    torch.save(record, f"{out}.{rank}")
    stage.close()


def test_every_stage_draws_its_noise_once_per_step_and_epsilon_is_single_process(tmp_path):
    """Zero data gradient, one step at sigma, SGD lr 1: stage k's parameters move by z / B with
    ``z ~ N(0, (sigma sqrt(K) C_k)^2)`` per coordinate (equal budget for K = 2 groups): the sample variance
    is that within 12% (one draw; two would double it, none give 0), and the two stages' draws differ.
    Every stage's epsilon equals one process' group-wise clipping after the same step."""
    sigma, out = 1.5, str(tmp_path / "noise")
    assert _spawn(_noise_worker, sigma, out) == [0] * WORLD
    moved = [torch.load(f"{out}.{r}") for r in range(WORLD)]
    for r in range(WORLD):
        expected = (sigma * math.sqrt(WORLD) * moved[r]["threshold"] / B) ** 2
        variance = moved[r]["moved"].double().var().item()
        assert abs(variance / expected - 1) < 0.12, (r, variance, expected)
    n = min(m["moved"].numel() for m in moved)
    a, b = moved[0]["moved"][:n].double(), moved[1]["moved"][:n].double()
    assert abs(torch.corrcoef(torch.stack([a, b]))[0, 1].item()) < 0.2
    model, (x, _, _) = _model(NOISE_WIDTH), _data(NOISE_WIDTH)
    reference = PrivacyEngine(
        model,
        batch_size=B,
        sample_size=N,
        max_grad_norm=C,
        noise_multiplier=sigma,
        clipping="groups",
        groups=2,
        noise_allocation="equal_budget",
    )
    optimizer = reference.attach(torch.optim.SGD(model.parameters(), lr=1.0))
    reference.backward(0.0 * model(x[:B]).sum(1))
    optimizer.step()
    expected = reference.get_epsilon(1e-5)
    assert 0 < expected < math.inf
    for r in range(WORLD):
        assert moved[r]["epsilon"] == pytest.approx(expected, rel=1e-12)


def _failing_worker(rank: int, port: int, mode: str, out: str) -> None:
    torch.set_num_threads(1)
    _, _, stage = _stage(rank, port, "fixed", 1.0, timeout_s=5.0)
    x, y, steps = _data()
    if rank == 1:
        if mode == "crash":
            os._exit(3)  # the last stage dies before its first receive; the kernel closes its connections
        time.sleep(30)  # stalls beyond the timeout; killed by the test once stage 0 has given up
        os._exit(4)
    try:
        _run_step(stage, x, y, steps[0])
    except DistributedError as error:
        Path(out).write_text(str(error))
        os._exit(0)
    os._exit(5)  # the first stage stepped without the second: wrong


@pytest.mark.parametrize("mode", ["crash", "stall"])
def test_a_failing_stage_ends_the_job_with_a_clear_error(tmp_path, mode):
    """Stage 1 crashes (or stalls) before its first receive: stage 0 does not hang but fails with a
    DistributedError naming the timeout key (distributed.timeout_s=5 here)."""
    message = error_of_a_failing_pair(_failing_worker, mode, tmp_path / "error.txt")
    assert message.startswith("stage 0 of 2:") and "with stage 1 failed" in message
    assert "distributed.timeout_s=5" in message and "\n" not in message


# ---------------------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("split_at", [None, [], [0], [5], [3, 2], [2, 2], ["2"], [1, 2]])
def test_a_bad_stage_split_is_refused_in_one_line(split_at):
    with pytest.raises(ConfigError) as error:
        split_stages(_model(), split_at)
    assert "distributed.split_at=" in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize(
    "kwargs, key",
    [
        ({"noise_allocation": "global"}, "clip.engine.noise_allocation=global"),
        (
            {"noise_allocation": "equal_budget", "adaptive": {**ADAPTIVE, "rescale_to_global": True}},
            "rescale",
        ),
        ({"noise_allocation": "equal_budget", "thresholds": [1.0, 1.0, 1.0]}, "clip.engine.thresholds"),
        (
            {"noise_allocation": "equal_budget", "adaptive": AdaptiveConfig(rescale_to_global=True)},
            "rescale_to_global",
        ),
    ],
)
def test_engine_settings_a_stage_cannot_honour_are_refused(kwargs: dict[str, Any], key: str):
    with pytest.raises(ConfigError, match=key):
        stage_engine_kwargs(kwargs, 0, 2)


def test_stage_generators_differ():
    a, b = stage_generator(7, 0), stage_generator(7, 1)
    assert not torch.equal(torch.randn(8, generator=a), torch.randn(8, generator=b))


def _compose(overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return compose(config_name="config", overrides=overrides)


def test_trainer_refuses_pipeline():
    """The trainer does not run distributed=pipeline yet (PipelineStage is the API): refused in one line."""
    cfg = _compose(["distributed=pipeline"])
    assert cfg.distributed.split_at is None
    with pytest.raises(ConfigError, match="distributed=pipeline") as error:
        start_data_parallel(cfg.distributed, torch.device("cpu"))
    assert "\n" not in str(error.value)
