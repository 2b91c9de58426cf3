"""Sharded data parallel (FSDP2's ``fully_shard``, :mod:`dpexp.training.sharded`) on two CPU processes with
gloo, engine level: one logical step at noise 0 equals the single-process update (flat, per-layer,
group-wise and adaptive clipping; bk, ghost and instantiated norms), the noise is drawn once per step across
ranks (its variance) and each rank keeps its shard of it, the epsilon is the single-process one, a rank that
fails ends the job with an error instead of a hang, and a model resharded before the backward is refused.
Trainer level (``distributed=fsdp``): one run at noise 0 equals the single-process run (flat and per-layer
clipping), the epsilon and plan are the single-process ones, one record is written by rank 0, an interrupted
run resumes from its full-state checkpoint bit for bit, and what cannot run sharded is refused in one line."""

from __future__ import annotations

import copy
import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from dpexp.backends import build_backend
from dpexp.privacy import PrivacyEngine
from dpexp.training.distributed import start_data_parallel
from dpexp.training.hooks import RunHooks
from dpexp.training.loop import instantiate, run_training
from dpexp.training.resume import load_run_config
from dpexp.training.sharded import full_state, shard_model
from dpexp.training.signals import InterruptGuard, RunInterrupted
from tests.conftest import TINY_RUN, composed
from tests.test_distributed import (  # noqa: F401 (outside_torchrun: a fixture)
    ENGINE_CASES,
    N_EXAMPLES,
    RESUMED_RUN,
    WORLD,
    Wide,
    _env,
    _free_port,
    _join_group,
    _model_and_data,
    _SaveModel,
    _SignalAt,
    _spawn,
    _train,
    assert_resumed_as_uninterrupted,
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


# ---------------------------------------------------------------------------------------------- trainer
def test_fsdp_config_is_checked_before_training(outside_torchrun):  # noqa: F811
    """distributed=fsdp is a valid mode: outside torchrun, or with another world size, it is refused in one
    line with the fix, before any process group exists."""
    cfg = composed(["distributed=fsdp"])
    with pytest.raises(ValueError, match=r"distributed=fsdp runs one process per rank under torchrun: "):
        start_data_parallel(cfg.distributed, torch.device("cpu"))
    outside_torchrun.setenv("WORLD_SIZE", "2")
    outside_torchrun.setenv("MASTER_ADDR", "127.0.0.1")
    cfg = composed(["distributed=fsdp", "distributed.world_size=4"])
    with pytest.raises(ValueError, match=r"distributed.world_size=4 but torchrun started 2") as info:
        start_data_parallel(cfg.distributed, torch.device("cpu"))
    assert "\n" not in str(info.value) and not dist.is_initialized()


@pytest.mark.parametrize(
    ("clip", "message"),
    [
        ("opacus", r"runs in one process: data-parallel training \(distributed=ddp or fsdp\) needs a dpexp"),
        ("nonprivate", r"runs in one process: data-parallel training \(distributed=ddp or fsdp\) needs"),
        ("adaclip", r"does not combine with sharded parameters \(FSDP2\): set distributed=ddp, or "),
    ],
)
def test_what_fsdp_cannot_run_is_refused_in_one_line(clip, message):
    model = torch.nn.Linear(3, 2)
    with pytest.raises(ValueError, match=message) as info:
        build_backend(
            composed([f"clip={clip}"]).clip,
            model=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
            batch_size=2,
            sample_size=10,
            noise_multiplier=1.0,
            sharded=True,
        )
    assert "\n" not in str(info.value)


_START_UP_PROBE = """
import sys, tempfile
import torch, torch.distributed as dist
import dpexp.train
from dpexp.privacy.sharding import is_sharded
print(sorted(m for m in ("torch.distributed.tensor", "torch.distributed.fsdp") if m in sys.modules))
print(is_sharded(torch.zeros(2)), is_sharded(None))
from torch.distributed.tensor import DTensor
store = dist.FileStore(tempfile.mktemp(), 1)
dist.init_process_group("gloo", store=store, rank=0, world_size=1)
tensor = DTensor.from_local(torch.ones(4), dist.init_device_mesh("cpu", (1,)), run_check=False)
print(is_sharded(tensor), is_sharded(torch.nn.Parameter(tensor)), is_sharded(tensor.to_local()))
dist.destroy_process_group()
"""


def test_start_up_leaves_fsdp_unloaded_and_a_dtensor_is_still_seen():
    """Importing the trainer imports neither FSDP2 nor DTensor (about a second of every start-up): sharding
    does. Whether a tensor is sharded is read through the loaded module, so once anyone has imported it a
    DTensor (a parameter made of one too) is seen as sharded and its local tensor is not."""
    done = subprocess.run(
        [sys.executable, "-c", _START_UP_PROBE], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:3] == ["[]", "False False", "True True False"]


def test_sharded_ranks_stop_after_the_same_step():
    """The interrupt agreement of a sharded job: a rank that received no signal stops with the one another
    rank received; a signal nobody agreed on waits for the next step."""
    guard = InterruptGuard()
    with pytest.raises(RunInterrupted) as info, guard.step(lambda held: max(held, signal.SIGTERM)):
        pass
    assert info.value.signum == signal.SIGTERM and not info.value.mid_step
    with guard.step(lambda held: 0):
        guard._handle(signal.SIGINT, None)  # held, then not agreed on (received after the agreement)
    with pytest.raises(RunInterrupted) as info, guard.step(lambda held: held):
        pass
    assert info.value.signum == signal.SIGINT


class _SaveFullModel(RunHooks):
    """The trained model's full state (sharded parameters gathered: every rank calls it)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def finished(self, model, task):
        torch.save(full_state(model.state_dict()), self.path)
        return {}


FSDP_RUNS = {
    "flat": [*TINY_RUN, "clip=bk", "privacy.noise_multiplier=0", "batch_size=64"],
    "per_layer": [*TINY_RUN, "clip=perlayer", "privacy.noise_multiplier=0", "batch_size=64"],
    "calibrated": [*TINY_RUN, "clip=adaptive_perlayer", "batch_size=64"],
}


def _trainer_worker(rank: int, port: int, root: str, ports: list[int]) -> None:
    for name, run_port in zip(FSDP_RUNS, [port, *ports], strict=True):
        _env(rank, run_port)  # each run starts and ends its own process group
        cfg = composed([*FSDP_RUNS[name], "distributed=fsdp"])
        run_training(cfg, Path(root) / name / "fsdp", hooks=_SaveFullModel(f"{root}/{name}_rank{rank}.pt"))


@pytest.mark.slow  # three short runs on two processes and three in one: ~15 s idle, more when shared
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_fsdp_trainer_equals_one_process(tmp_path):
    """``run_training`` with distributed=fsdp on two ranks: at privacy.noise_multiplier=0 its model equals the
    single-process run's (float32, up to reduction order) for flat and per-layer clipping, the same on both
    ranks; only rank 0 writes metrics.json, whose plan and epsilon (all three accountants) equal the
    single-process run's, for a calibrated sigma with adaptive per-layer thresholds."""
    assert _spawn(_trainer_worker, str(tmp_path), [_free_port(), _free_port()]) == [0] * WORLD
    for name, overrides in FSDP_RUNS.items():
        single = run_training(
            composed(overrides), tmp_path / name / "one", hooks=_SaveModel(f"{tmp_path}/{name}_single.pt")
        )
        fsdp = json.loads((tmp_path / name / "fsdp" / "metrics.json").read_text())
        assert fsdp["status"] == "completed" and fsdp["config"]["distributed"]["name"] == "fsdp"
        assert [h["step"] for h in fsdp["history"]] == [3]  # one evaluation, recorded once
        for key in ("sample_size", "batch_size", "steps", "noise_multipliers", "examples_seen", "delta"):
            assert fsdp[key] == single[key], key
        if name == "calibrated":
            assert fsdp["epsilon"] == single["epsilon"] and math.isfinite(fsdp["epsilon"]["rdp"])
            continue
        assert fsdp["epsilon"]["rdp"] == "Infinity" and single["epsilon"]["rdp"] == math.inf
        ranks = [torch.load(tmp_path / f"{name}_rank{r}.pt") for r in range(WORLD)]
        want = torch.load(tmp_path / f"{name}_single.pt")
        assert sorted(ranks[0]) == sorted(want)
        for key, value in want.items():
            assert torch.equal(ranks[0][key], ranks[1][key]), key
            torch.testing.assert_close(ranks[0][key], value, rtol=1e-5, atol=1e-6, msg=f"{name}: {key}")
        assert fsdp["loss"] == pytest.approx(single["loss"], rel=1e-5)
        assert fsdp["accuracy"] == single["accuracy"]


SHARDED_RESUMED_RUN = [*RESUMED_RUN, "optim.momentum=0.9"]  # optimizer state sharded like the parameters


def _resume_worker(rank: int, port: int, root: str, ports: list[int]) -> None:
    cfg = composed([*SHARDED_RESUMED_RUN, "distributed=fsdp"])
    _env(rank, port)
    run_training(cfg, Path(root) / "whole")
    _env(rank, ports[0])
    with pytest.raises(RunInterrupted) as info:  # rank 0 alone is signalled: rank 1 stops with it
        run_training(cfg, Path(root) / "parts", hooks=_SignalAt(4) if rank == 0 else None)
    assert info.value.signum == signal.SIGTERM and not info.value.mid_step
    _env(rank, ports[1])
    run_training(load_run_config(Path(root) / "parts"), Path(root) / "parts", resume=True)


@pytest.mark.slow  # three short runs on two processes: ~12 s idle, more when shared
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_interrupted_fsdp_run_resumes_as_an_uninterrupted_one(tmp_path):
    """SIGTERM to rank 0 in step 4: both ranks stop at its end, gather the full state, rank 0 writes the
    checkpoint; ``resume`` on two ranks loads it into the sharded model and ends where the uninterrupted
    sharded run ends, bit for bit: record, model, optimizer, sampler, engine. The checkpoints hold the full
    (unsharded) state, with the keys and shapes of a single-process model."""
    assert _spawn(_resume_worker, str(tmp_path), [_free_port(), _free_port()]) == [0] * WORLD
    final = assert_resumed_as_uninterrupted(tmp_path)
    assert sorted(p.name for p in (tmp_path / "parts" / "checkpoints").iterdir()) == [
        "step_00000004.pt",
        "step_00000006.pt",
    ]
    assert final[0]["optimizer"]["state"][0]["momentum_buffer"].shape == final[0]["model"]["0.weight"].shape
    cfg = composed(SHARDED_RESUMED_RUN)
    task, factory = instantiate(cfg.task, "task"), instantiate(cfg.model, "model")
    task.setup(factory)
    factory.build(task.info).load_state_dict(final[0]["model"])  # strict: the keys and shapes of one process
