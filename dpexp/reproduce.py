"""Entry point: reproduce one published table, or regenerate every table from the stored results.

    python -m dpexp.reproduce experiment=he2023_table11b scale=offline [launcher=basic|local|slurm]
        [rows=<key>,...] [columns=<key>,...] [where=<key>=<value>,...] [runs=results/runs] [out=results]
        [dry_run=true]
        [logger=none|wandb]
        [hydra.launcher.<key>=<value> ...]
    python -m dpexp.reproduce tables [runs=results/runs] [out=results]

The first form runs the experiment's grid (``conf/experiment/<name>.yaml`` at ``scale``) as Hydra multiruns
of ``python -m dpexp.train``: a run already completed (same resolved config hash, same code version) is
skipped; an interrupted, failed or killed one of the same config and code is continued from its checkpoint
(``resume=<run dir>``); a diverged one, or one another process is running, is reported and left alone;
the rest are launched. ``dry_run=true`` prints that plan and writes nothing. ``rows=`` / ``columns=`` (the
table's row and column keys, comma-separated) run only the points of those cells, e.g. one row of a table
whose runs take hours; ``where=`` (``key=value`` pairs, comma-separated; a key named twice takes either
value) keeps only the points with those settings, e.g. ``where=optim.lr=1e-3,seed=1,seed=2``; the table is
rendered whole (cells not run say so). Runs go to
``<runs>/<experiment>/<scale>/<values>-<config hash>-<code hash>/``.
Then the store is re-indexed (``<out>/index.jsonl``) and the table rendered (``<out>/tables/<experiment>_
<scale>.md`` and ``.tex``, ``<out>/figures/<experiment>_<scale>_epsilon.png``; with ``curves``,
``_curves.png`` (against epsilon), ``_time.png``, ``_epochs.png``; with ``layer_norms``,
``_layer_norms.png``, He et al. 2023's Figure 2, a diagnostic outside the privacy guarantee). The second
form (``make tables``) re-indexes and renders the table of every experiment at scale offline and at every
scale that has a runs folder, from the records alone. Launchers: ``basic`` (Hydra's, one run after
another), ``local`` (hydra-joblib-launcher, parallel processes: ``conf/hydra/launcher/local.yaml``),
``slurm`` (hydra-submitit-launcher: ``conf/hydra/launcher/slurm.yaml``). ``logger=wandb`` mirrors every run to
Weights & Biases (offline unless configured) in one group, ``<experiment>-<scale>``. Bad input is refused in
one line naming the valid values (exit 2); exit 1 when some run of the grid did not complete. Ctrl-C,
SIGTERM or a hang-up reaches the runs in progress once (each stops at a step boundary with a checkpoint),
starts no further run, and exits with 128 + the signal's number; the same command continues the grid.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from dpexp.config import ConfigError
from dpexp.results import experiments, layer_norms, store, tables
from dpexp.runtime import code_version
from dpexp.training.record import COMPLETED, DIVERGED, FAILED, INTERRUPTED, RUNNING

LAUNCHERS = ("basic", "local", "slurm")  # Hydra's basic launcher; conf/hydra/launcher/{local,slurm}.yaml
LOGGERS = ("none", "wandb")  # wandb: every run of the experiment in one wandb group, <experiment>-<scale>
OPTIONS = {"experiment": None, "scale": None, "launcher": "basic", "runs": "results/runs", "out": "results",
           "dry_run": "false", "logger": "none", "rows": None, "columns": None, "where": None}  # fmt: skip
CURVE_FILES = {"epsilon": "curves", "train_time_s": "time", "epoch": "epochs"}  # curves' axis: file suffix
FORWARDED = {signal.SIGINT: signal.SIGINT, signal.SIGTERM: signal.SIGTERM, signal.SIGHUP: signal.SIGTERM}
RESUMABLE = (INTERRUPTED, FAILED, store.KILLED)
BLOCKING = (DIVERGED, RUNNING)  # RUNNING in the index: a process holds the run now


@dataclass
class RunPlan:
    """What a reproduce command does with each point of the grid."""

    skip: list[experiments.Point] = field(default_factory=list)  # completed by this code version
    resume: list[tuple[experiments.Point, str]] = field(default_factory=list)  # (point, run dir)
    launch: list[experiments.Point] = field(default_factory=list)
    blocked: list[tuple[experiments.Point, str]] = field(default_factory=list)  # (point, status)


def plan_runs(
    points: Sequence[experiments.Point],
    run_keys: Mapping[experiments.Point, str],
    entries: Sequence[Mapping[str, Any]],
    source_hash: str,
) -> RunPlan:
    """Sort the points by the records of the same config and code version (pure)."""
    plan = RunPlan()
    for point in points:
        runs = [e for e in store.find_runs(entries, run_keys[point]) if e["source_hash"] == source_hash]
        statuses = {e["status"] for e in runs}
        if COMPLETED in statuses:
            plan.skip.append(point)
        elif statuses & set(BLOCKING):
            plan.blocked.append((point, sorted(statuses & set(BLOCKING))[0]))
        elif runs:
            resumable = sorted(e["run_dir"] for e in runs if e["status"] in RESUMABLE)
            plan.resume.append((point, resumable[0]))
        else:
            plan.launch.append(point)
    return plan


def run_name(point: experiments.Point, run_key: str, source_hash: str) -> str:
    """The run directory's name: the swept values, the config hash and the code hash."""
    return f"{point.label}-{run_key[:8]}-{source_hash[:6]}"


def selected_points(
    spec: Any, points: Sequence[experiments.Point], rows: str | None, columns: str | None
) -> list[experiments.Point]:
    """The points of the cells in the ``rows`` and ``columns`` named (comma-separated keys; None: all), in
    grid order; an unknown key is refused naming the valid ones."""
    chosen = []
    for part, wanted in (("rows", rows), ("columns", columns)):
        entries = list(spec[part])
        if wanted is None:
            chosen.append(entries)
            continue
        keys = [key.strip() for key in wanted.split(",") if key.strip()]
        valid = [str(entry.get("key")) for entry in entries]
        unknown = [key for key in keys if key not in valid]
        if unknown or not keys:
            raise ConfigError(f"{part}={wanted}: not a key of the table's {part}; valid: {', '.join(valid)}.")
        chosen.append([entry for entry in entries if str(entry.get("key")) in keys])
    cells = [set(tables.cell_points(row, column, points)) for row in chosen[0] for column in chosen[1]]
    selected = [point for point in points if any(point in cell for cell in cells)]
    if not selected:
        raise ConfigError(f"rows={rows} columns={columns} select no run of the grid: name cells with runs.")
    return selected


def filtered_points(points: Sequence[experiments.Point], where: str | None) -> list[experiments.Point]:
    """The ``points`` whose settings have every key of ``where`` (``key=value,...``; a key named twice: any of
    its values; numbers compared as numbers), in grid order; a key no point sets, or no match, is refused."""
    if where is None:
        return list(points)
    wanted: dict[str, list[str]] = {}
    for item in where.split(","):
        key, separator, value = item.strip().partition("=")
        if not separator or not key:
            raise ConfigError(f"where={where}: {item!r} is not key=value (e.g. where=optim.lr=1e-3,seed=0).")
        wanted.setdefault(key, []).append(value)
    known = sorted({key for point in points for key in point.settings})
    unknown = [key for key in wanted if key not in known]
    if unknown:
        raise ConfigError(
            f"where={where}: no run of the grid sets {', '.join(unknown)}; keys: {', '.join(known)}."
        )
    kept = [
        point
        for point in points
        if all(
            any(experiments.matches(point.settings, {k: v}) for v in values) for k, values in wanted.items()
        )
    ]
    if not kept:
        raise ConfigError(
            f"where={where} selects no run of the grid: the grid's values are in its experiment file."
        )
    return kept


def parse_arguments(argv: Sequence[str]) -> tuple[dict[str, str], list[str]]:
    """``key=value`` arguments -> (options, Hydra overrides passed to the multirun: ``hydra.*``)."""
    options, passthrough = dict(OPTIONS), []
    for argument in argv:
        key, separator, value = argument.partition("=")
        if not separator:
            raise ConfigError(f"argument {argument!r} is not key=value; valid keys: {', '.join(OPTIONS)}.")
        if key.startswith("hydra."):
            passthrough.append(argument)
        elif key in OPTIONS:
            options[key] = value
        else:
            raise ConfigError(f"unknown key {key}; valid keys: {', '.join(OPTIONS)} (and hydra.* overrides).")
    if options["launcher"] not in LAUNCHERS:
        raise ConfigError(f"launcher={options['launcher']} is not a launcher; valid: {', '.join(LAUNCHERS)}.")
    if options["logger"] not in LOGGERS:
        raise ConfigError(f"logger={options['logger']} is not a logger; valid: {', '.join(LOGGERS)}.")
    if options["dry_run"] not in ("true", "false"):
        raise ConfigError(f"dry_run={options['dry_run']}: valid values: true, false.")
    return options, passthrough


class GridInterrupted(Exception):
    """A signal stopped the grid while a multirun ran (``signum``: the first one received)."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(signal.Signals(signum).name)


def _multirun(overrides: Sequence[str]) -> int:
    """``python -m dpexp.train -m <overrides>`` in this directory; its exit status.

    The multirun runs in a process group of its own, and every SIGINT, SIGTERM or SIGHUP (as SIGTERM) this
    process receives meanwhile is passed on to that group exactly once: Ctrl-C, ``kill`` of this process
    and a hang-up all reach the training as one signal, which stops each run at a step boundary with a
    checkpoint (a second one stops it at once, as for ``dpexp.train`` itself). Were the multirun in this
    process' group, Ctrl-C would reach it directly and again passed on; left to Python's defaults, SIGTERM
    would end this process and orphan the runs, and Ctrl-C would kill them before they checkpoint. With
    ``launcher=local`` joblib's processes get it too, and take note of it (:mod:`dpexp.train`; the pool
    no larger than the multirun: :func:`pool_size`). Raises :exc:`GridInterrupted` once the multirun has
    ended, if a signal came."""
    child = subprocess.Popen([sys.executable, "-m", "dpexp.train", "-m", *overrides], process_group=0)
    received: list[int] = []

    def forward(signum: int, _frame: object) -> None:
        received.append(signum)
        with contextlib.suppress(ProcessLookupError):  # the multirun has just ended
            os.killpg(child.pid, FORWARDED[signal.Signals(signum)])

    previous = {signum: signal.signal(signum, forward) for signum in FORWARDED}
    try:
        code = child.wait()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if received:
        raise GridInterrupted(received[0])
    return code


POOL_SIZE = "hydra.launcher.n_jobs"


def pool_size(overrides: Sequence[str], launcher: str, jobs: int) -> list[str]:
    """``overrides`` with a launcher's process pool (``launcher=local``: ``n_jobs`` in its config, or as
    overridden) no larger than the multirun's ``jobs``. A pool process that never gets a job has not taken
    over SIGTERM and SIGINT from Python's defaults (:func:`dpexp.train.run_job` does, at its first job), so a
    signal to the sweep would end it, and joblib would abort the pool and kill the runs before they reach
    their step boundary."""
    given = [o for o in overrides if o.startswith(f"{POOL_SIZE}=")]
    config = experiments.CONF_DIR / "hydra" / "launcher" / f"{launcher}.yaml"
    if given:
        size = int(given[-1].split("=", 1)[1])
    else:
        size = OmegaConf.load(config).get("n_jobs") if config.is_file() else None
    if size is None or size <= jobs:
        return list(overrides)
    return [f"{POOL_SIZE}={jobs}", *(o for o in overrides if o not in given)]


def execute(
    plan: RunPlan,
    configs: Mapping[experiments.Point, Any],
    run_keys: Mapping[experiments.Point, str],
    sweep_dir: Path,
    source_hash: str,
    launcher: str,
    passthrough: Sequence[str],
    logging: Sequence[str] = (),
) -> None:
    """Launch the plan's new runs (one multirun over ``+point=...`` configs written under ``sweep_dir/
    .points``) and continue its resumable ones (one multirun over ``resume=...``); a signal during the first
    (:exc:`GridInterrupted`) starts no second."""
    launch = [*([f"hydra/launcher={launcher}"] if launcher != "basic" else []), *passthrough, *logging]
    if plan.launch:
        point_dir = sweep_dir / ".points" / "point"
        point_dir.mkdir(parents=True, exist_ok=True)
        names = []
        for point in plan.launch:
            name = run_name(point, run_keys[point], source_hash)
            (point_dir / f"{name}.yaml").write_text(experiments.point_config(point, configs[point]))
            names.append(name)
        _multirun(
            [
                "+point=" + ",".join(names),
                f"hydra.searchpath=[file://{point_dir.parent.resolve()}]",
                f"hydra.sweep.dir={sweep_dir.resolve()}",
                "hydra.sweep.subdir=${hydra:runtime.choices.point}",
                *pool_size(launch, launcher, len(names)),
            ]
        )
    if plan.resume:
        dirs = ",".join(f"'{Path(run_dir).resolve()}'" for _, run_dir in plan.resume)
        # each job's output directory is the run it resumes (the subdir, an absolute path, replaces the
        # sweep dir): its log continues the run's own train.log, not a .resume/<n>/ log that every resume
        # shares; no .hydra/ is written over the run's own
        sweep = [f"hydra.sweep.dir={(sweep_dir / '.resume').resolve()}", "hydra.sweep.subdir=${resume}"]
        resumes = pool_size(launch, launcher, len(plan.resume))
        _multirun([f"resume={dirs}", *sweep, "hydra.output_subdir=null", *resumes])


def index(runs: Path, out: Path | None) -> list[dict[str, Any]]:
    """Every record under ``runs``, re-indexed into ``out/index.jsonl`` (``out`` None: read only, as a dry
    run, which writes nothing)."""
    entries = store.scan(runs) if runs.is_dir() else []
    if out is not None:
        store.write_index(entries, out / store.INDEX_FILE)
    return entries


def render(
    name: str, scale: str, entries: Sequence[Mapping[str, Any]], out: Path, source: Mapping[str, Any]
) -> list[Path]:
    """Write the experiment's table (Markdown, LaTeX) and figures at ``scale``; the files written. A figure
    that the records no longer give (its runs now older code, or gone) is removed, not left from an earlier
    render: the folder holds what the store draws."""
    spec = experiments.load_experiment(name)
    points = experiments.grid_points(name, spec, scale)
    configs = experiments.compose_points(points)
    setting_keys = {
        p: store.config_key(experiments.resolved(c), with_seed=False)
        for p, c in zip(points, configs, strict=True)
    }
    cells = tables.build_cells(spec, points, setting_keys, entries, source["source_hash"])
    stem = f"{name}_{scale}"
    written = [out / "tables" / f"{stem}.md", out / "tables" / f"{stem}.tex"]
    written[0].parent.mkdir(parents=True, exist_ok=True)
    written[0].write_text(tables.markdown(spec, scale, cells, source))
    written[1].write_text(tables.latex(spec, scale, cells, source))
    rows = tables.current_histories(spec, cells, entries, source["source_hash"])
    figures = {  # file suffix: draw(path) -> whether it drew
        "epsilon": partial(tables.epsilon_figure, spec, scale, cells),
        "thresholds": partial(tables.threshold_figure, spec, scale, rows),
    }
    for axis in experiments.curve_axes(spec, name):
        figures[CURVE_FILES[axis]] = partial(tables.curve_figure, spec, scale, rows, x=axis)
    if spec.get("layer_norms") is not None:  # He et al. 2023, Figure 2 (a diagnostic, not private)
        figures["layer_norms"] = partial(layer_norms.figure, spec, scale, rows)
    for suffix, draw in figures.items():
        path = out / "figures" / f"{stem}_{suffix}.png"
        if draw(path):
            written.append(path)
        else:
            path.unlink(missing_ok=True)
    return written


def reproduce(options: Mapping[str, str], passthrough: Sequence[str]) -> int:
    """Run one experiment at one scale and render its table (dry_run: print the plan, write nothing); the
    exit status."""
    name, scale = options["experiment"], options["scale"]
    if name is None or scale is None:
        raise ConfigError(
            f"experiment=<name> scale=<scale> are required; experiments: "
            f"{', '.join(experiments.experiment_names())}; scales: {', '.join(experiments.SCALES)}."
        )
    spec = experiments.load_experiment(name)
    points = experiments.grid_points(name, spec, scale)
    points = selected_points(spec, points, options["rows"], options["columns"])
    points = filtered_points(points, options["where"])
    configs = dict(zip(points, experiments.compose_points(points), strict=True))
    run_keys = {p: store.config_key(experiments.resolved(c)) for p, c in configs.items()}
    runs, out = Path(options["runs"]), Path(options["out"])
    source = code_version()
    dry_run = options["dry_run"] == "true"
    plan = plan_runs(points, run_keys, index(runs, None if dry_run else out), source["source_hash"])
    chosen = (
        ""
        if options["rows"] is None and options["columns"] is None and options["where"] is None
        else " selected"
    )
    print(
        f"{name} (scale={scale}): {len(points)}{chosen} runs: {len(plan.skip)} complete (skipped), "
        f"{len(plan.resume)} to resume, {len(plan.launch)} to launch, {len(plan.blocked)} left alone"
    )
    for point, status in plan.blocked:
        print(f"  {point.label}: {status}; left alone", file=sys.stderr)
    if dry_run:
        for point in plan.launch:
            print("  launch: " + " ".join(point.overrides))
        for _, run_dir in plan.resume:
            print(f"  resume: {run_dir}")
        return 0
    logging = [] if options["logger"] == "none" else ["logger=wandb", f"wandb.group={name}-{scale}"]
    try:
        execute(
            plan,
            configs,
            run_keys,
            runs / name / scale,
            source["source_hash"],
            options["launcher"],
            passthrough,
            logging,
        )
    except GridInterrupted as interrupt:
        print(
            f"{interrupt} received: the runs in progress were stopped as dpexp.train stops on it (at a step "
            f"boundary, with a checkpoint) and no further run was started; the same command continues the "
            f"grid ({runs / name / scale}).",
            file=sys.stderr,
        )
        return 128 + interrupt.signum
    entries = index(runs, out)
    for path in render(name, scale, entries, out, source):
        print(f"wrote {path}")
    after = plan_runs(points, run_keys, entries, source["source_hash"])
    missing = len(points) - len(after.skip)
    if missing:
        print(
            f"{missing} of {len(points)} runs did not complete (see {out / store.INDEX_FILE})",
            file=sys.stderr,
        )
    return 1 if missing else 0


def regenerate(options: Mapping[str, str]) -> int:
    """``make tables``: re-index and render every experiment at every scale that has a runs folder, and
    at scale offline always (its published numbers beside what the store holds, if anything)."""
    runs, out = Path(options["runs"]), Path(options["out"])
    entries, source = index(runs, out), code_version()
    for name in experiments.experiment_names():
        for scale in experiments.load_experiment(name).scales:
            if scale == "offline" or (runs / name / scale).is_dir():
                for path in render(name, scale, entries, out, source):
                    print(f"wrote {path}")
    print(f"indexed {len(entries)} run records into {out / store.INDEX_FILE}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv[:1] == ["tables"]:
            options, passthrough = parse_arguments(argv[1:])
            return regenerate(options)
        options, passthrough = parse_arguments(argv)
        return reproduce(options, passthrough)
    except ConfigError as error:
        print(f"{error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
