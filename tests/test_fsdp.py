"""Sharded data parallel (FSDP2's ``fully_shard``, :mod:`dpexp.training.sharded`) on two CPU processes with
gloo, engine level: one logical step at noise 0 equals the single-process update (flat, per-layer,
group-wise and adaptive clipping; bk, ghost and instantiated norms), the noise is drawn once per step across
ranks (its variance) and each rank keeps its shard of it, the epsilon is the single-process one, a rank that
fails ends the job with an error instead of a hang, and a model resharded before the backward is refused. The
trainer still refuses ``distributed=fsdp`` in one line (not wired yet)."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from dpexp.privacy import PrivacyEngine
from dpexp.training.distributed import FSDP_REFUSAL, start_data_parallel
from dpexp.training.sharded import shard_model
from tests.test_distributed import (  # noqa: F401 (outside_torchrun: a fixture)
    ENGINE_CASES,
    N_EXAMPLES,
    WORLD,
    Wide,
    _compose,
    _join_group,
    _model_and_data,
    _spawn,
    _train,
    outside_torchrun,
)

CASES = sorted(set(ENGINE_CASES) - {"adaclip"})  # coordinate-wise clipping is refused when sharded


def _equality_worker(rank: int, port: int, cases: list[str]) -> None:
    parallel = _join_group(rank, port)
    model, x, y = _model_and_data()
    everyone = list(range(N_EXAMPLES))
    for case in cases:
        kwargs = ENGINE_CASES[case]
        single = copy.deepcopy(model)
        reference = _train(single, x, y, kwargs, everyone)  # one process, the whole batch
        ranked = shard_model(copy.deepcopy(model))
        engine = _train(ranked, x, y, {**kwargs, "sharded": True}, parallel.share(everyone), parallel)
        assert (
            sum(
                float((a - b).abs().sum())
                for a, b in zip(single.parameters(), model.parameters(), strict=True)
            )
            > 0
        )
        for (name, got), want in zip(ranked.named_parameters(), single.parameters(), strict=True):
            assert isinstance(got, DTensor) and got.to_local().numel() < got.numel(), f"{case}: {name}"
            torch.testing.assert_close(got.full_tensor(), want, rtol=1e-9, atol=1e-12, msg=f"{case}: {name}")
        torch.testing.assert_close(engine.thresholds, reference.thresholds, rtol=1e-12, atol=0)
    parallel.close()


@pytest.mark.slow  # two spawned processes, seven cases: ~1 min on one shared core
@pytest.mark.filterwarnings("ignore")
def test_fsdp_steps_at_noise_zero_equal_the_single_process_steps():
    """Two ranks with sharded parameters, each clipping its share (7 and 6 examples) of every logical batch,
    give the parameters (and adaptive thresholds) of one process clipping the whole batch, two steps."""
    assert _spawn(_equality_worker, CASES) == [0] * WORLD


def _noise_worker(rank: int, port: int, sigma: float, out: str) -> None:
    parallel = _join_group(rank, port)
    torch.manual_seed(0)  # the same model on both ranks; rank 0's noise from torch's global generator
    model = Wide()
    before = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
    sharded = shard_model(model)
    kwargs = {"batch_size": 4, "sample_size": 100, "max_grad_norm": 2.0, "noise_multiplier": sigma}
    engine = PrivacyEngine(sharded, clipping="per_layer", aggregation=parallel, sharded=True, **kwargs)
    optimizer = engine.attach(torch.optim.SGD(sharded.parameters(), lr=1.0))
    optimizer.step()  # an empty logical batch on both ranks: the update is the noise / B
    after = torch.cat([p.full_tensor().flatten() for p in sharded.parameters()])
    noise = (before - after) * engine.batch_size
    single = PrivacyEngine(Wide(), clipping="per_layer", **kwargs)
    single.steps = engine.steps
    if rank == 0:
        torch.save({"noise": noise, "epsilons": [engine.get_epsilon(1e-5), single.get_epsilon(1e-5)]}, out)
    parallel.close()


@pytest.mark.slow  # two spawned processes: ~30 s on one shared core
@pytest.mark.filterwarnings("ignore")
def test_fsdp_noise_is_drawn_once_per_step_and_epsilon_is_the_single_process_one(tmp_path):
    """The noise of a step, assembled from the two ranks' shards, has the single-process variance
    sigma^2 C^2 (8500 coordinates), not twice it; the epsilon is that of one process after as many steps."""
    sigma, clip = 1.5, 2.0
    out = tmp_path / "noise.pt"
    assert _spawn(_noise_worker, sigma, str(out)) == [0] * WORLD
    saved = torch.load(out)
    assert float(saved["noise"].var()) == pytest.approx((sigma * clip) ** 2, rel=0.1)
    assert abs(float(saved["noise"].mean())) < 0.1
    epsilon, single = saved["epsilons"]
    assert 0 < epsilon < float("inf") and epsilon == single


def _failing_worker(rank: int, port: int, out: str) -> None:
    parallel = _join_group(rank, port, timeout_s=5.0)
    torch.manual_seed(0)
    model = shard_model(torch.nn.Sequential(torch.nn.Linear(3, 2)))
    engine = PrivacyEngine(
        model, batch_size=2, sample_size=10, max_grad_norm=1.0, noise_multiplier=1.0, aggregation=parallel
    )
    if rank == 1:
        os._exit(3)  # dies without a word, its connections closed by the kernel
    try:  # the forward's all-gather of the sharded parameters needs rank 1
        engine.backward(F.cross_entropy(model(torch.randn(2, 3)), torch.tensor([0, 1]), reduction="none"))
    except RuntimeError as error:
        Path(out).write_text(f"{type(error).__name__}: {error}")
        os._exit(0)
    os._exit(5)  # the step went on without the other rank: wrong


@pytest.mark.slow  # two spawned processes: ~20 s
@pytest.mark.filterwarnings("ignore")
def test_a_failing_rank_ends_the_sharded_job_with_an_error(tmp_path):
    out = tmp_path / "error.txt"
    assert _spawn(_failing_worker, str(out)) == [0, 3]
    assert out.read_text()


def _refusal_worker(rank: int, port: int, out: str) -> None:
    parallel = _join_group(rank, port)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Tanh(), torch.nn.Linear(2, 2))
    fully_shard(model[0])  # a child group reshards after its forward (FSDP2's default; the root does not)
    fully_shard(model)
    engine = PrivacyEngine(
        model, batch_size=2, sample_size=10, max_grad_norm=1.0, noise_multiplier=1.0, sharded=True
    )
    with pytest.raises(RuntimeError, match=r"reshard_after_forward=False"):
        engine.backward(F.cross_entropy(model(torch.randn(2, 3)), torch.tensor([0, 1]), reduction="none"))
    with pytest.raises(ValueError, match=r"sharded parameters \(FSDP2\)"):
        PrivacyEngine(
            model,
            batch_size=2,
            sample_size=10,
            max_grad_norm=1.0,
            noise_multiplier=1.0,
            strategy="instantiate",
            coordinate=ENGINE_CASES["adaclip"]["coordinate"],
            sharded=True,
        )
    Path(out, f"rank{rank}").write_text("refused")
    parallel.close()


@pytest.mark.slow  # two spawned processes: ~20 s
@pytest.mark.filterwarnings("ignore")
def test_the_engine_refuses_parameters_sharded_during_backward(tmp_path):
    """A model that reshards after its forward would leave the engine the sharded parameters to verify;
    refused with the fix, as is coordinate-wise clipping (its state is full-shape per parameter)."""
    assert _spawn(_refusal_worker, str(tmp_path)) == [0] * WORLD
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0", "rank1"]


def test_fsdp_is_refused_by_the_trainer_in_one_line(outside_torchrun):  # noqa: F811
    outside_torchrun.setenv("WORLD_SIZE", "2")
    outside_torchrun.setenv("MASTER_ADDR", "127.0.0.1")
    with pytest.raises(ValueError, match="distributed=fsdp is not available in the trainer yet") as info:
        start_data_parallel(_compose(["distributed=fsdp"]).distributed, torch.device("cpu"))
    assert str(info.value) == FSDP_REFUSAL and "\n" not in FSDP_REFUSAL and not dist.is_initialized()
