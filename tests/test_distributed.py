"""Data-parallel private training (distributed=ddp) on two CPU processes with gloo: one logical step
equals the single-process update at noise 0 (engine, every clipping mode; and the trainer), the noise is
drawn once per step across ranks (its variance), the epsilon is the single-process one, and a rank that
fails or stalls ends its peers with a clear error instead of a hang."""

from __future__ import annotations

import copy
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from dpexp.backends import build_backend
from dpexp.config import ConfigError, _hydra_subdir, _run_dir
from dpexp.models.cnn import SmallCNN
from dpexp.privacy import PrivacyEngine
from dpexp.training.checkpoint import load_checkpoint
from dpexp.training.distributed import DataParallel, DistributedConfig, DistributedError, start_data_parallel
from dpexp.training.hooks import RunHooks
from dpexp.training.loop import run_training
from dpexp.training.resume import load_run_config
from dpexp.training.signals import RunInterrupted
from tests.conftest import REPO_ROOT, TIMING_FIELDS, TINY_RUN, composed
from tests.test_checkpoint import identical

WORLD = 2
JOIN_S = 180  # guards the test against a hang; no timing is asserted


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# What a rank needs imported, once, by the server its processes are forked from.
_PRELOAD = ["tests.test_distributed", "tests.test_fsdp", "tests.test_pipeline"]


def fresh_processes() -> mp.context.BaseContext:
    """Processes that start as a fresh interpreter would, minus the imports: forked from one server process
    (``forkserver``, started once per test process) that imported torch, dpexp and the test modules, instead
    of a new interpreter each (``spawn``: about 6 s of imports per process). Like spawn, a process inherits
    nothing of the test process' state; its environment is the server's, so a worker sets its own
    (:func:`_env`)."""
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(_PRELOAD)
    return context


def _spawn(worker: Callable[..., None], *args: Any, join_s: float = JOIN_S) -> list[int]:
    """Run ``worker(rank, port, *args)`` in WORLD fresh processes; their exit codes (each joined under a
    guard of ``join_s`` seconds against a hang, then killed if still alive)."""
    context = fresh_processes()
    port = _free_port()
    processes = [context.Process(target=worker, args=(rank, port, *args)) for rank in range(WORLD)]
    for process in processes:
        process.start()
    deadline = time.monotonic() + join_s
    for process in processes:
        process.join(max(deadline - time.monotonic(), 1))
    hung = [p for p in processes if p.is_alive()]
    for process in hung:
        process.kill()
        process.join()
    assert not hung, "a rank hung"
    return [p.exitcode for p in processes]


def _env(rank: int, port: int, world: int = WORLD) -> None:
    """torchrun's environment for ``rank`` of ``world`` (so that the trainer's checks and ``env://`` work)."""
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)


def _join_group(rank: int, port: int, timeout_s: float = 60.0) -> DataParallel:
    _env(rank, port)
    return DataParallel(DistributedConfig("ddp", "gloo", timeout_s, WORLD), torch.device("cpu"))


# ---------------------------------------------------------------------------------------------- engine
ENGINE_CASES = {
    "bk_flat": {"clipping": "flat", "strategy": "bk"},
    "ghost_flat": {"clipping": "flat", "strategy": "ghost"},
    "bk_per_layer": {"clipping": "per_layer", "strategy": "bk"},
    "groups": {"clipping": "groups", "groups": 2, "strategy": "bk", "noise_allocation": "equal_budget"},
    "adaptive_per_layer": {
        "clipping": "per_layer",
        "strategy": "bk",
        "adaptive": {
            "target_quantile": 0.5,
            "quantile_lr": 0.3,
            "budget_fraction": 0.1,
            "rescale_to_global": False,
        },
    },
    "instantiate_flat": {"clipping": "flat", "strategy": "instantiate"},
    "adaclip": {  # coordinate-wise (AdaCliP): its transform follows the released (summed) gradients
        "clipping": "per_layer",
        "strategy": "instantiate",
        "coordinate": {
            "beta1": 0.99,
            "beta2": 0.9,
            "variance_floor": 1e-12,
            "variance_ceiling": 1.0,
            "initial_variance": 1e-4,
        },
    },
}
STEPS = 2
N_EXAMPLES = 13  # odd: the ranks' shares differ in size


def _model_and_data() -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = SmallCNN((1, 6, 6), 3, channels=[4, 4], num_groups=2, activation="tanh").double()
    x = torch.randn(STEPS, N_EXAMPLES, 1, 6, 6, dtype=torch.float64)
    y = torch.randint(0, 3, (STEPS, N_EXAMPLES))
    return model, x, y


def _train(model, x, y, kwargs, indices, aggregation=None, sigma=0.0):
    """STEPS engine steps (SGD, lr 0.5) on the examples ``indices`` of every step; the engine."""
    engine = PrivacyEngine(
        model,
        batch_size=10,
        sample_size=100,
        max_grad_norm=0.3,  # small: most examples are clipped
        noise_multiplier=sigma,
        aggregation=aggregation,
        **kwargs,
    )
    optimizer = engine.attach(torch.optim.SGD(model.parameters(), lr=0.5))
    for step in range(STEPS):
        for micro in (indices[:4], indices[4:]):  # two micro-batches (the second possibly empty)
            if micro:
                engine.backward(F.cross_entropy(model(x[step][micro]), y[step][micro], reduction="none"))
        optimizer.step()
        optimizer.zero_grad()
    return engine


def _engine_worker(rank: int, port: int, cases: list[str]) -> None:
    parallel = _join_group(rank, port)
    model, x, y = _model_and_data()
    everyone = list(range(N_EXAMPLES))
    for case in cases:
        kwargs = ENGINE_CASES[case]
        single = copy.deepcopy(model)
        reference = _train(single, x, y, kwargs, everyone)  # one process, the whole batch
        ranked = copy.deepcopy(model)
        engine = _train(ranked, x, y, kwargs, parallel.share(everyone), aggregation=parallel)
        moved = sum(
            float((a - b).abs().sum()) for a, b in zip(single.parameters(), model.parameters(), strict=True)
        )
        assert moved > 0, case
        for (name, got), want in zip(ranked.named_parameters(), single.parameters(), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12, msg=f"{case}: {name}")
        torch.testing.assert_close(engine.thresholds, reference.thresholds, rtol=1e-12, atol=0)
        if "adaptive" in kwargs:
            assert not torch.equal(engine.thresholds, engine._initial_thresholds(None)), case
    parallel.close()


@pytest.mark.filterwarnings("ignore:noise_multiplier=0")
def test_ddp_steps_at_noise_zero_equal_the_single_process_steps():
    """Two ranks, each clipping its share (7 and 6 examples) of every logical batch, give the parameters
    (and adaptive thresholds) of one process clipping the whole batch: flat, per-layer, group-wise and
    adaptive clipping, bk, ghost and instantiated norms, two steps."""
    assert _spawn(_engine_worker, sorted(ENGINE_CASES)) == [0] * WORLD


class Wide(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(100, 60)  # d = 6060
        self.b = torch.nn.Linear(60, 40)  # d = 2440

    def forward(self, x):
        return self.b(self.a(x))


NOISE_SIGMA, NOISE_CLIP = 1.5, 2.0


def _step_noise(parallel: DataParallel, rank: int, secure: bool) -> torch.Tensor:
    """The noise of one step of an 8500-parameter model on the ranks of ``parallel`` (checked equal on both),
    and that a rank whose model drifts is caught."""
    torch.manual_seed(0)  # the same model on both ranks; the noise comes from torch's global generator
    model = Wide()
    before = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
    engine = PrivacyEngine(
        model,
        batch_size=4,
        sample_size=100,
        max_grad_norm=NOISE_CLIP,
        noise_multiplier=NOISE_SIGMA,
        clipping="per_layer",
        secure_mode=secure,
        aggregation=parallel,
    )
    optimizer = engine.attach(torch.optim.SGD(model.parameters(), lr=1.0))
    optimizer.step()  # an empty logical batch on both ranks: the update is the noise / B
    after = torch.cat([p.detach().flatten() for p in model.parameters()])
    noise = (before - after) * engine.batch_size
    gathered = [torch.empty_like(noise) for _ in range(WORLD)]
    dist.all_gather(gathered, noise)
    assert torch.equal(gathered[0], gathered[1]), "the ranks applied different noise"
    parallel.check_same("the parameters", list(model.parameters()))
    if rank == 1:  # a rank whose model drifted: every rank refuses to go on
        with torch.no_grad():
            model.b.bias[0] += 1e-6
    with pytest.raises(DistributedError, match=r"the parameters differ across the 2 ranks"):
        parallel.check_same("the parameters", list(model.parameters()))
    return noise


class Layers(torch.nn.Sequential):
    def __init__(self) -> None:
        super().__init__(*[torch.nn.Linear(2, 2, bias=False) for _ in range(40)])  # K = 40 groups


def _count_noise(parallel: DataParallel) -> dict[str, Any]:
    """The released clip counts of 25 steps of adaptive per-layer clipping on empty batches (40 groups) on the
    ranks of ``parallel`` (checked to move their thresholds alike), and the count noise's std."""
    torch.manual_seed(0)
    model = Layers()
    config = {"target_quantile": 0.5, "quantile_lr": 0.01, "budget_fraction": 0.5, "rescale_to_global": False}
    engine = PrivacyEngine(
        model,
        batch_size=4,
        sample_size=100,
        max_grad_norm=1.0,
        noise_multiplier=2.0,
        clipping="per_layer",
        adaptive=config,
        aggregation=parallel,
    )
    optimizer = engine.attach(torch.optim.SGD(model.parameters(), lr=0.0))
    released = []
    for _ in range(25):  # empty logical batches: the released centred counts are the count noise alone
        before = engine.thresholds.clone()
        optimizer.step()
        # Algorithm 1, line 15: C' = C exp(-eta (b / B + 1/2 - 1/2)), so b = -B log(C' / C) / eta
        released.append(-engine.batch_size * (engine.thresholds / before).log() / config["quantile_lr"])
    counts = torch.cat(released)
    gathered = [torch.empty_like(engine.thresholds) for _ in range(WORLD)]
    dist.all_gather(gathered, engine.thresholds)
    assert torch.equal(gathered[0], gathered[1]), "the ranks moved their thresholds differently"
    return {"counts": counts, "std": engine.count_noise_multiplier}


def _noise_worker(rank: int, port: int, out: str) -> None:
    parallel = _join_group(rank, port)
    drawn = {secure: _step_noise(parallel, rank, secure) for secure in (False, True)}
    drawn["counts"] = _count_noise(parallel)
    if rank == 0:
        torch.save(drawn, out)
    parallel.close()


@pytest.fixture(scope="module")
def ddp_noise(tmp_path_factory) -> dict[Any, Any]:
    """The noise the tests below check, drawn by one pair of processes (a pair costs ~10 s to start)."""
    out = tmp_path_factory.mktemp("ddp_noise") / "noise.pt"
    assert _spawn(_noise_worker, str(out)) == [0] * WORLD
    return torch.load(out)


@pytest.mark.shard_together("ddp_noise")
@pytest.mark.parametrize("secure", [False, True])
def test_ddp_noise_is_drawn_once_per_step(ddp_noise, secure):
    """The noise of a step on two ranks has the single-process variance sigma^2 C^2 (8500 coordinates: the
    sample variance is within 3% of it with overwhelming probability), not twice it (one draw per rank), and
    every rank applies the same noise (and a rank whose model drifts is caught); also from the secure sampler,
    which no shared seed could replay."""
    noise = ddp_noise[secure]
    assert noise.numel() == 8500
    assert float(noise.var()) == pytest.approx((NOISE_SIGMA * NOISE_CLIP) ** 2, rel=0.1)
    assert abs(float(noise.mean())) < 0.1


@pytest.mark.shard_together("ddp_noise")
def test_ddp_adaptive_count_noise_is_drawn_once_per_step(ddp_noise):
    """The released clip counts of adaptive thresholds (He et al. Algorithm 1, line 10) on two ranks carry one
    draw of the count noise, std sigma_b (40 groups x 25 steps: the sample variance within 15% of sigma_b^2),
    not one per rank; both ranks move their thresholds identically."""
    saved = ddp_noise["counts"]
    assert saved["counts"].numel() == 40 * 25
    assert float(saved["counts"].var()) == pytest.approx(saved["std"] ** 2, rel=0.15)


# ---------------------------------------------------------------------------------------------- failures
def _failing_worker(rank: int, port: int, mode: str, out: str) -> None:
    parallel = _join_group(rank, port, timeout_s=5.0)
    model = torch.nn.Linear(3, 2)
    engine = PrivacyEngine(
        model, batch_size=2, sample_size=10, max_grad_norm=1.0, noise_multiplier=1.0, aggregation=parallel
    )
    optimizer = engine.attach(torch.optim.SGD(model.parameters(), lr=1.0))
    if rank == 1:
        if mode == "crash":
            os._exit(3)  # dies without a word, its connections closed by the kernel
        time.sleep(30)  # stalls beyond the timeout; killed by the test once rank 0 has given up
        os._exit(4)
    try:
        optimizer.step()
    except DistributedError as error:
        Path(out).write_text(str(error))
        os._exit(0)
    os._exit(5)  # the step completed without the other rank: wrong


def error_of_a_failing_pair(worker: Callable[..., None], mode: str, out: Path) -> str:
    """``worker(rank, port, mode, out)`` on two spawned processes whose second crashes or stalls (``mode``):
    the first must not hang but end (exit 0) within JOIN_S, having written its error to ``out``; returns
    that error."""
    context = fresh_processes()
    port = _free_port()
    processes = [context.Process(target=worker, args=(r, port, mode, str(out))) for r in range(WORLD)]
    for process in processes:
        process.start()
    processes[0].join(JOIN_S)
    alive = processes[0].is_alive()
    for process in processes:
        process.kill()
        process.join()
    assert not alive, "process 0 hung"
    assert processes[0].exitcode == 0
    return out.read_text()


@pytest.mark.parametrize("mode", ["crash", "stall"])
def test_a_failing_rank_ends_the_job_with_a_clear_error(tmp_path, mode):
    """Rank 1 crashes (or stalls) before the step's all-reduce: rank 0 does not hang but fails with a
    DistributedError naming the timeout key (distributed.timeout_s=5 here)."""
    message = error_of_a_failing_pair(_failing_worker, mode, tmp_path / "error.txt")
    assert "rank 0 of 2: summing the step's clipped sums failed" in message
    assert "distributed.timeout_s=5" in message and "\n" not in message


# ---------------------------------------------------------------------------------------------- trainer
class FailAt(RunHooks):
    """Rank 1 of a trainer run crashes (or stalls) before step ``step``: the other ranks must not hang."""

    def __init__(self, step: int, mode: str) -> None:
        self.step, self.mode = step, mode

    def before_step(self, step: int) -> None:
        if step == self.step:
            if self.mode == "crash":
                os._exit(3)
            time.sleep(30)  # killed by the test once rank 0 has given up
            os._exit(4)


def _failing_trainer_worker(rank: int, port: int, mode: str, out: str) -> None:
    distributed, failure = mode.split("-")
    _env(rank, port)
    cfg = composed([*TINY_RUN, "clip=bk", f"distributed={distributed}", "distributed.timeout_s=5"])
    try:
        run_training(cfg, Path(out).parent / "run", hooks=FailAt(2, failure) if rank == 1 else None)
    except DistributedError as error:
        Path(out).write_text(str(error))
        os._exit(0)
    os._exit(5)  # the run completed without rank 1, or failed with another error: wrong


@pytest.mark.parametrize(
    "mode",
    [
        "ddp-crash",
        "fsdp-crash",
        *(pytest.param(m, marks=pytest.mark.slow) for m in ("ddp-stall", "fsdp-stall")),  # ~20 s each
    ],
)
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_failing_rank_ends_the_trainer_job_with_a_clear_error(tmp_path, mode):
    """Rank 1 of a DDP or FSDP trainer run crashes (or stalls) before step 2: rank 0 does not hang but fails
    with a one-line DistributedError naming the timeout key, and records the run as failed with it."""
    message = error_of_a_failing_pair(_failing_trainer_worker, mode, tmp_path / "error.txt")
    assert message.startswith("rank 0 of 2: ") and "another rank failed" in message
    assert "distributed.timeout_s=5" in message and "\n" not in message
    record = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert record["status"] == "failed" and record["error"] == f"DistributedError: {message}"
    assert record["steps_done"] in (1, 2)


class _SaveModel(RunHooks):
    def __init__(self, path: str) -> None:
        self.path = path

    def finished(self, model, task):
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, self.path)
        return {}


TRAINER_RUNS = {
    "zero": [*TINY_RUN, "clip=bk", "privacy.noise_multiplier=0", "batch_size=64"],
    "calibrated": [*TINY_RUN, "clip=adaptive_perlayer", "batch_size=64"],
}


def _trainer_worker(rank: int, port: int, root: str, second_port: int) -> None:
    for name, overrides, run_port in zip(
        TRAINER_RUNS, TRAINER_RUNS.values(), (port, second_port), strict=True
    ):
        _env(rank, run_port)  # each run starts and ends its own process group
        cfg = composed([*overrides, "distributed=ddp"])
        run_training(cfg, Path(root) / name / "ddp", hooks=_SaveModel(f"{root}/{name}_rank{rank}.pt"))


@pytest.mark.slow  # four short training runs, two of them on two processes: about a minute
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_ddp_trainer_equals_one_process(tmp_path):
    """``run_training`` with distributed=ddp on two ranks: at privacy.noise_multiplier=0 its model equals
    the single-process run's (float32, up to reduction order) and is the same on both ranks; only rank 0
    writes metrics.json, whose plan and epsilon (all three accountants) equal the single-process run's, for
    a calibrated sigma with adaptive per-layer thresholds."""
    assert _spawn(_trainer_worker, str(tmp_path), _free_port()) == [0] * WORLD
    for name, overrides in TRAINER_RUNS.items():
        single = run_training(
            composed(overrides), tmp_path / name / "one", hooks=_SaveModel(f"{tmp_path}/{name}_single.pt")
        )
        ddp = json.loads((tmp_path / name / "ddp" / "metrics.json").read_text())
        assert ddp["status"] == "completed" and ddp["config"]["distributed"]["name"] == "ddp"
        for key in ("sample_size", "batch_size", "steps", "noise_multipliers", "examples_seen", "delta"):
            assert ddp[key] == single[key], key
        if name == "calibrated":
            assert ddp["epsilon"] == single["epsilon"] and math.isfinite(ddp["epsilon"]["rdp"])
        else:
            assert ddp["epsilon"]["rdp"] == "Infinity" and single["epsilon"]["rdp"] == math.inf
            ranks = [torch.load(tmp_path / f"{name}_rank{r}.pt") for r in range(WORLD)]
            want = torch.load(tmp_path / f"{name}_single.pt")
            for key, value in want.items():
                assert torch.equal(ranks[0][key], ranks[1][key]), key
                torch.testing.assert_close(ranks[0][key], value, rtol=1e-5, atol=1e-6, msg=key)
            assert ddp["loss"] == pytest.approx(single["loss"], rel=1e-5)


# ---------------------------------------------------------------------------------------------- config
TORCHRUN_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")


@pytest.fixture
def outside_torchrun(monkeypatch):
    for name in TORCHRUN_ENV:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.mark.parametrize(
    ("overrides", "env", "message"),
    [
        (["distributed=ddp"], {}, r"distributed=ddp runs one process per rank under torchrun: torchrun"),
        ([], {"WORLD_SIZE": "2", "MASTER_ADDR": "x"}, r"torchrun started 2 processes but distributed=none"),
        (["distributed=ddp", "distributed.backend=mpi"], {}, r"distributed.backend=mpi: valid choices"),
        (["distributed=ddp", "distributed.timeout_s=0"], {}, r"distributed.timeout_s must be a positive"),
        (
            ["distributed=ddp", "distributed.world_size=4"],
            {"WORLD_SIZE": "2", "MASTER_ADDR": "x"},
            r"distributed.world_size=4 but torchrun started 2 processes",
        ),
        (
            ["distributed=ddp", "distributed.backend=nccl"],
            {"WORLD_SIZE": "2", "MASTER_ADDR": "x", "RANK": "0"},
            r"distributed.backend=nccl needs CUDA devices",
        ),
    ],
)
def test_distributed_config_is_refused_before_training(outside_torchrun, overrides, env, message):
    for name, value in env.items():
        outside_torchrun.setenv(name, value)
    cfg = composed(overrides)
    with pytest.raises(ValueError, match=message) as info:
        start_data_parallel(cfg.distributed, torch.device("cpu"))
    assert "\n" not in str(info.value) and not dist.is_initialized()


def test_one_process_needs_no_process_group(outside_torchrun):
    assert start_data_parallel(composed([]).distributed, torch.device("cpu")) is None
    assert start_data_parallel(None, torch.device("cpu")) is None  # a run recorded before the group existed


def test_only_engine_clips_run_data_parallel():
    model = torch.nn.Linear(3, 2)
    for clip in ("opacus", "nonprivate"):
        with pytest.raises(ValueError, match=r"runs in one process: data-parallel training .* needs a dpexp"):
            build_backend(
                composed([f"clip={clip}"]).clip,
                model=model,
                optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
                batch_size=2,
                sample_size=10,
                noise_multiplier=1.0,
                aggregation=object(),
            )


def test_every_rank_shares_one_run_directory(outside_torchrun):
    """Under torchrun every rank composes its own config: the run directory is torchrun's run id, the same on
    every rank, and only rank 0 writes Hydra's .hydra files."""
    fresh = "outputs/runs/digits/bk/2026-01-01_00-00-00_abcdef"
    assert _run_dir(None, fresh) == fresh and _run_dir("old/run", fresh) == "old/run"
    outside_torchrun.setenv("TORCHELASTIC_RUN_ID", "b02ce877")
    assert _run_dir(None, fresh) == "outputs/runs/digits/bk/ddp_b02ce877"
    assert _hydra_subdir(None) == ".hydra"
    outside_torchrun.setenv("RANK", "1")
    assert _hydra_subdir(None) is None
    outside_torchrun.setenv("TORCHELASTIC_RUN_ID", "none")
    with pytest.raises(ConfigError, match="--standalone or --rdzv-id"):
        _run_dir(None, fresh)


def assert_torchrun_cli_writes_one_record(tmp_path: Path, distributed: list[str], clip: str) -> None:
    """``torchrun --nproc-per-node=2 -m dpexp.train <distributed> clip=<clip>`` on the tiny run: one run
    directory, one completed record (rank 0's), the epsilon and sigma of one process, the summary printed
    once."""
    torchrun = Path(sys.executable).parent / "torchrun"
    command = [str(torchrun), "--standalone", "--nproc-per-node=2", "-m", "dpexp.train", *distributed]
    command += [*TINY_RUN, f"clip={clip}", f"output.root={tmp_path}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}
    done = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=JOIN_S)
    assert done.returncode == 0, done.stderr[-3000:]
    records = list(tmp_path.glob(f"runs/digits/{clip}/ddp_*/metrics.json"))
    assert len(records) == 1
    record = json.loads(records[0].read_text())
    assert record["status"] == "completed" and record["steps_done"] == 3
    assert done.stdout.count("metrics: ") == 1
    single = run_training(composed([*TINY_RUN, f"clip={clip}"]), tmp_path / "one")
    assert record["epsilon"] == single["epsilon"] and record["noise_multiplier"] == single["noise_multiplier"]


@pytest.mark.slow  # torchrun starts two interpreters that train: about a minute on a busy machine
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_torchrun_cli_writes_one_record(tmp_path, mode):
    """``torchrun ... -m dpexp.train distributed=ddp`` (or fsdp) writes one record as one process would."""
    assert_torchrun_cli_writes_one_record(tmp_path, [f"distributed={mode}"], "bk")


class _SignalAt(RunHooks):
    """SIGTERM to this rank in the middle of step ``step``: the run stops at that step's end."""

    def __init__(self, step: int) -> None:
        self.step = step

    def before_step(self, step: int) -> None:
        if step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


RESUMED_RUN = ["steps=6", "eval_every=2", "checkpoint.every=3", "progress=false", "batch_size=32", "clip=bk"]


def _resume_worker(rank: int, port: int, root: str, ports: list[int]) -> None:
    cfg = composed([*RESUMED_RUN, "distributed=ddp"])
    _env(rank, port)
    run_training(cfg, Path(root) / "whole")
    _env(rank, ports[0])
    with pytest.raises(RunInterrupted):
        run_training(cfg, Path(root) / "parts", hooks=_SignalAt(4))
    _env(rank, ports[1])
    run_training(load_run_config(Path(root) / "parts"), Path(root) / "parts", resume=True)


def assert_resumed_as_uninterrupted(root: Path) -> list[dict]:
    """The run ``root/parts``, interrupted after step 4 and resumed, ends as the uninterrupted ``root/whole``
    does: the record (timings aside; evaluations at steps 2, 4, 6) and the final checkpoint's model,
    optimizer, backend and sampler, bit for bit; returns both final checkpoints."""
    whole, parts = (json.loads((root / d / "metrics.json").read_text()) for d in ("whole", "parts"))
    assert parts["resumes"] == [{"from_step": 4, "recorded_steps": 4, "accounted_again": 0}]
    for key in set(whole) - TIMING_FIELDS - {"history"}:
        assert parts[key] == whole[key], key
    assert [h["step"] for h in parts["history"]] == [2, 4, 6]
    assert [h["accuracy"] for h in parts["history"]] == [h["accuracy"] for h in whole["history"]]
    final = [load_checkpoint(root / d / "checkpoints" / "step_00000006.pt") for d in ("whole", "parts")]
    for part in ("model", "optimizer", "backend", "sampler"):
        assert identical(final[0][part], final[1][part]), part
    return final


@pytest.mark.slow  # three short runs on two processes
def test_interrupted_ddp_run_resumes_as_an_uninterrupted_one(tmp_path):
    """Both ranks stop at the end of step 4 (SIGTERM), rank 0 writes the checkpoint, and ``resume`` on two
    ranks ends where the uninterrupted data-parallel run ends: record, model, optimizer, sampler, engine."""
    assert _spawn(_resume_worker, str(tmp_path), [_free_port(), _free_port()]) == [0] * WORLD
    assert_resumed_as_uninterrupted(tmp_path)
    assert not list((tmp_path / "parts").glob("checkpoints/*rank*"))
