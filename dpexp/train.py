"""Entry point: ``python -m dpexp.train [group=option ...] [key=value ...]`` (Hydra; ``-m`` for sweeps).

Every key is checked against the schema of :mod:`dpexp.config` before training: an unknown key (appended
with ``+`` or not), a value of the wrong type, an invalid choice or a config group's missing option
(``clip=foo``) fails at start-up in one line with the valid ones.

An error raised by the project's own checks (a ValueError, OSError, RuntimeError, ... raised in dpexp's code)
prints its one-line message, which names the key to change (in a sweep the other jobs still run); other
errors (bugs, a library failing) print their traceback, and so does every error with ``debug=true`` or
``DPEXP_DEBUG=1``. Either way the exit code is 1.
SIGTERM and SIGINT stop the run at a step boundary with a checkpoint; it exits with 128 + the signal's number
and ``resume=<run dir>`` continues it. In a sweep (``-m``) no further run starts once a signal has come: with
the basic launcher the sweep ends with the run it stopped; with a launcher whose jobs run in worker processes
(joblib's, ``hydra/launcher=local``) the launching process and the workers between runs only take note of the
signal, every run in progress (it gets the signal too, as the process group does) stops at its step boundary
and returns, the runs not yet started are skipped, and the sweep exits with 128 + the signal's number. A
signal to one worker's run alone (``kill <pid>``) stops that run the same way; that worker starts no further
run, and the other workers go on.
"""

from __future__ import annotations

import importlib
import math
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from dpexp.config import ConfigError, composition_refusals
from dpexp.privacy import accounting
from dpexp.runtime import debug_requested, is_project_error, one_line, process_code_version
from dpexp.training.loop import run_training
from dpexp.training.resume import resumed_config
from dpexp.training.signals import SIGNALS, RunInterrupted, announce

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"  # the repository's conf/ (editable install)
GROUPS = ("task", "model", "clip", "accountant", "noise", "optim")
APPROXIMATION_LABELS = {"clt_approximation": "CLT approximation"}  # epsilon kinds that are not upper bounds

REPORTED: list[str] = []  # the one-line messages of the runs of this process that failed by a project error
STOPPED: list[int] = []  # the signals this process took note of: no further run of its sweep starts
LAUNCHING: list[int] = []  # the id of the process that launches (cli ran there); never a launcher's worker's


def _note_signal(signum: int, _frame: object = None) -> None:
    """The handler of a sweep's launching process, and of its worker processes between jobs: remember the
    signal (the runs in progress get it themselves, as the process group does) instead of dying, which would
    make joblib abort its pool and kill the runs before they reach a step boundary."""
    if not STOPPED:
        announce(
            f"{signal.Signals(signum).name} received: the runs in progress stop at their next step boundary "
            "and no further run starts"
        )
    STOPPED.append(signum)


def _stop_job(signum: int, _frame: object = None) -> None:
    """A worker's handler while its job starts (the run's :class:`~dpexp.training.signals.InterruptGuard`
    takes over once the run has begun)."""
    raise RunInterrupted(signum)


def _handle_signals(handler: Any) -> dict[int, Any]:
    """Install ``handler`` for :data:`~dpexp.training.signals.SIGNALS` (in the main thread, where Python
    delivers signals); the handlers it replaced."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {signum: signal.signal(signum, handler) for signum in SIGNALS}


def _epsilon_text(name: str, value: float, kind: str) -> str:
    """``rdp=2.998`` for an upper bound, ``gdp≈2.535 (CLT approximation)`` for an approximation."""
    if kind == accounting.UPPER_BOUND:
        return f"{name}={value:.3f}"
    return f"{name}≈{value:.3f} ({APPROXIMATION_LABELS[kind]})"


def summary(record: dict[str, Any]) -> str:
    """A few lines for the terminal: task metrics, epsilon, throughput, peak memory, where metrics.json is."""
    metrics = ", ".join(f"{name}={record[name]:.4f}" for name in record.get("metric_names", []))
    epsilon, kinds = record.get("epsilon", {}), record.get("epsilon_kind", {})
    eps = (
        ", ".join(_epsilon_text(k, v, kinds[k]) for k, v in epsilon.items() if v is not None) or "non-private"
    )
    individual = record.get("individual")
    groups = ""
    if individual is not None:  # every privacy group's budget and spending (the run's epsilon is the largest)
        spent = record.get("epsilon_by_group", {}).get(record["accountant"]) or [math.nan] * len(
            individual["epsilons"]
        )
        groups = (
            f"individual privacy ({individual['variant']}): "
            + ", ".join(
                f"group {g}: epsilon {e:.3f} of {budget:g} (q={q:.4f}, scale={s:.3f})"
                for g, (e, budget, q, s) in enumerate(
                    zip(
                        spent,
                        individual["epsilons"],
                        individual["sample_rates"],
                        individual["scales"],
                        strict=True,
                    )
                )
            )
            + "\n"
        )
    return (
        f"{record['task']} / {record['model']} / {record['clip']}: {metrics}\n"
        f"epsilon ({eps}) at delta={record['delta']:.3g}, sigma={record['noise_multiplier']:.4f}, "
        f"{record['steps']} steps ({record['epochs']:.2f} epochs)\n"
        f"{groups}"
        f"throughput {record['throughput_examples_per_s']:.1f} examples/s, "
        f"peak memory {record['peak_memory_bytes'] / 2**20:.1f} MiB ({record['peak_memory_kind']}), "
        f"wall time {record['wall_time_s']:.1f} s"
    )


@hydra.main(version_base=None, config_path=str(CONF_DIR), config_name="config")
def main(cfg: DictConfig) -> None:
    """Hydra's task function: :func:`run_job` of this process' ``dpexp.train`` module. joblib's workers
    (``hydra/launcher=local``) receive this function pickled by value with a copy of the globals it names
    (cloudpickle cannot find it by name: ``dpexp.train.main`` is hydra.main's wrapper), so it names none of
    the module's state: a copied :data:`LAUNCHING` made each worker take itself for the launching process,
    and a signal to one run then ended its worker with SystemExit, and joblib killed the other runs
    mid-step, their records left saying running."""
    importlib.import_module("dpexp.train").run_job(cfg)


def run_job(cfg: DictConfig) -> None:
    """Run one configuration (or continue one: ``resume=<run dir>``) and print its summary. In a launcher's
    worker process a signal stops the job (before its run starts, or the run at a step boundary) and the
    job returns; between jobs the worker only takes note of it (:func:`_note_signal`) and starts no
    further run."""
    if _launching():
        _job(cfg)
        return
    try:
        _handle_signals(_stop_job)
        _job(cfg)
    except RunInterrupted as interrupt:
        STOPPED.append(interrupt.signum)  # returning lets the pool wait for the runs still finishing a step
    finally:
        _handle_signals(_note_signal)


def _job(cfg: DictConfig) -> None:
    debug = debug_requested(cfg.debug)
    # the run's own directory: the one it resumes, else Hydra's (a resume's Hydra directory holds only logs)
    output_dir = Path(cfg.resume if cfg.resume is not None else HydraConfig.get().runtime.output_dir)
    if STOPPED:
        print(f"not started, the sweep was interrupted: {output_dir}", file=sys.stderr)
        return
    try:
        record = _train(cfg)
    except RunInterrupted as interrupt:
        print(
            f"{interrupt}: the run is recorded as interrupted in {output_dir / 'metrics.json'}; continue it "
            f"with: python -m dpexp.train resume={output_dir}",
            file=sys.stderr,
        )
        if _launching():  # this process runs its jobs itself: the sweep ends here
            sys.exit(interrupt.exit_code)
        raise
    except Exception as error:
        if debug or not is_project_error(error):
            raise
        message = one_line(error)
        print(message, file=sys.stderr)
        REPORTED.append(message)
        return
    if int(os.environ.get("RANK", "0")) == 0:  # under torchrun (distributed=ddp) rank 0 speaks for the job
        print(summary(record))
        print(f"metrics: {output_dir}/metrics.json")


def _train(cfg: DictConfig) -> dict[str, Any]:
    """The run of ``cfg``, or the run it resumes."""
    hydra_cfg = HydraConfig.get()
    if cfg.get("audit") is not None:
        raise ConfigError(
            "audit keys are for python -m dpexp.audit; python -m dpexp.train trains without canaries"
        )
    if cfg.resume is not None:
        run_cfg = resumed_config(cfg.resume, cfg, hydra_cfg.overrides.task)
        return run_training(run_cfg, cfg.resume, resume=True)
    runtime = hydra_cfg.runtime
    choices = {group: runtime.choices[group] for group in GROUPS if group in runtime.choices}
    return run_training(cfg, runtime.output_dir, choices)


def cli() -> None:
    """``python -m dpexp.train``: :func:`main`, then exit code 1 if a run failed with a project error (Hydra
    would add its own traceback hint to an exception it reports), or 128 + the signal's number if a sweep
    (``-m``) was interrupted: while its launcher runs, this process only takes note of SIGTERM and SIGINT."""
    REPORTED.clear()
    STOPPED.clear()
    LAUNCHING[:] = [os.getpid()]
    process_code_version()  # the code this process runs: the files as it starts, before any job
    previous = _handle_signals(_note_signal) if {"-m", "--multirun"} & set(sys.argv[1:]) else {}
    try:
        with composition_refusals(exit_code=1):
            main()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if STOPPED:
        sys.exit(128 + STOPPED[0])
    if REPORTED:
        sys.exit(1)


def _launching() -> bool:
    """Whether this process launched the sweep (or the single run) itself; a worker a launcher forked has a
    copy of :data:`LAUNCHING`, but another process id."""
    return os.getpid() in LAUNCHING


if __name__ == "__main__":
    # The module by its name, not this __main__ copy, holds the state main() reaches (see there).
    importlib.import_module("dpexp.train").cli()
