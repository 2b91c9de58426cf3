"""An experiment's table in the paper's layout, from the result store alone, beside the published numbers.

Each cell of ``rows`` x ``columns`` (``conf/experiment/<name>.yaml``) gathers the grid points that set the
row's and the column's values (the row's win where both set a key; a row's ``ignore`` drops column keys,
e.g. a non-private row across epsilon columns). Points differing only by seed are one setting; a cell with
several settings (a tuned hyperparameter) shows the best mean, naming the chosen values, as the papers report
tuned results. Each cell is printed as ours (mean +- sample std over seeds, n), the paper's value (from
``conf/published``) and the difference; runs of other code versions are never mixed in (a cell with only
those shows its best such setting marked †), runs that did not complete are counted by status, and a cell
whose completed runs lack its metric (not computed offline, or by their code) says so.
"""

from __future__ import annotations

import json
import math
import textwrap
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from omegaconf import DictConfig, ListConfig, OmegaConf

from dpexp.results.experiments import Point, matches, published
from dpexp.results.store import Summary, summarize
from dpexp.training.record import COMPLETED, METRICS_FILE


@dataclass
class Cell:
    """One table cell: ``ours`` (the best setting's summary), the ``choice`` of tuned values that gave it,
    the paper's ``reported`` (mean, std or None), and statuses of the cell's other runs."""

    ours: Summary | None
    choice: dict[str, str]
    reported: tuple[float, float | None] | None
    statuses: dict[str, int] = field(default_factory=dict)
    points: int = 0  # grid points in the cell (0: the experiment does not run this cell at this scale)
    scale: float = 1.0  # factor from the record's metric to the table's unit (100 for percent)
    setting: str | None = None  # setting key of ``ours`` (the best setting's runs)
    spread: float | None = None  # the experiment's ``spread``: a std recorded within runs (pooled over seeds)
    lacking: int = 0  # completed runs in the cell whose records lack its metric (:attr:`Summary.lacking`)

    @property
    def mean(self) -> float | None:
        return None if self.ours is None or self.ours.mean is None else self.ours.mean * self.scale

    @property
    def std(self) -> float | None:
        if self.spread is not None:
            return self.spread * self.scale
        return None if self.ours is None or self.ours.std is None else self.ours.std * self.scale

    @property
    def stale(self) -> Summary | None:
        """The older code version's runs shown (marked †) where no current run exists
        (:attr:`Summary.latest_older`); None where a current run exists or no run at all."""
        if self.ours is None or self.ours.n:
            return None
        return self.ours.latest_older

    @property
    def stale_mean(self) -> float | None:
        """The mean of the older version shown (:attr:`stale`), in the table's unit."""
        older = self.stale
        return None if older is None or older.mean is None else older.mean * self.scale

    @property
    def difference(self) -> float | None:
        """Ours minus the paper's: of the current runs, else of the older version shown (:attr:`stale`)."""
        shown = self.mean if self.mean is not None else self.stale_mean
        return None if self.reported is None or shown is None else shown - self.reported[0]


def _reported(value: Any) -> tuple[float, float | None] | None:
    """A published entry: a number, [mean, std], or null ("-" in the paper)."""
    if value is None:
        return None
    if isinstance(value, ListConfig | list | tuple):
        return float(value[0]), float(value[1]) if len(value) > 1 else None
    return float(value), None


def pooled_std(means: Sequence[float], stds: Sequence[float]) -> float | None:
    """The (population) std of the union of equally sized groups from each group's mean and population std:
    ``sqrt(mean(std_i^2) + mean((mean_i - mean)^2))`` (the law of total variance); one group: its std."""
    if not means or len(means) != len(stds):
        return None
    grand = sum(means) / len(means)
    within = sum(s * s for s in stds) / len(stds)
    between = sum((m - grand) ** 2 for m in means) / len(means)
    return math.sqrt(within + between)


def cell_points(row: DictConfig, column: DictConfig, points: Sequence[Point]) -> list[Point]:
    """The points of a cell: the column's match (less the row's ``ignore``) updated by the row's."""
    ignore = set(row.get("ignore") or [])
    wanted = {k: v for k, v in (column.get("match") or {}).items() if k not in ignore}
    wanted.update(row.get("match") or {})
    return [point for point in points if matches(point.settings, wanted)]


def build_cells(
    spec: DictConfig,
    points: Sequence[Point],
    setting_keys: Mapping[Point, str],
    entries: Sequence[Mapping[str, Any]],
    source_hash: str,
) -> list[list[Cell]]:
    """The cells of the table, rows by columns."""
    reference = published(spec)
    factor = 100.0 if spec.get("percent") else 1.0
    table = []
    for row in spec.rows:
        cells = []
        for column in spec.columns:
            metric = row.get("metric") or column.get("metric") or spec.metric
            chosen = cell_points(row, column, points)
            settings: dict[str, list[Point]] = {}
            for point in chosen:
                settings.setdefault(setting_keys[point], []).append(point)
            summaries = {key: summarize(entries, key, metric, source_hash) for key in settings}
            statuses: dict[str, int] = {}
            for summary in summaries.values():
                for status, count in summary.statuses.items():
                    statuses[status] = statuses.get(status, 0) + count
            done = {key: s for key, s in summaries.items() if s.n}
            older = {key: s.latest_older for key, s in summaries.items() if s.older}  # where none is done
            ranked = {k: s.mean for k, s in done.items()} or {k: s.mean for k, s in older.items()}
            best = max(ranked, key=ranked.__getitem__) if ranked else next(iter(summaries), None)
            varying = _varying([p.settings for p in chosen])
            choice = {k: v for k, v in settings[best][0].settings.items() if k in varying} if ranked else {}
            spread = None
            if spec.get("spread") and best in done:  # e.g. "{metric}_std": the std over canaries in a run
                within = summarize(entries, best, spec.spread.format(metric=metric), source_hash)
                if within.seeds == done[best].seeds:
                    spread = pooled_std(done[best].values, within.values)
            path = spec.published.path.format(row=row.get("key", ""), column=column.get("key", ""))
            cells.append(
                Cell(
                    ours=summaries.get(best) if best else None,
                    choice=choice if len(settings) > 1 else {},
                    reported=_reported(OmegaConf.select(reference, path, default=None)),
                    statuses=statuses,
                    points=len(chosen),
                    scale=factor,
                    setting=best,
                    spread=spread,
                    lacking=sum(s.lacking for s in summaries.values()),
                )
            )
        table.append(cells)
    return table


def _varying(settings: Sequence[Mapping[str, str]]) -> set[str]:
    """Keys whose value differs among the settings (seed excluded: seeds are averaged)."""
    keys = {key for s in settings for key in s} - {"seed"}
    return {key for key in keys if len({s.get(key) for s in settings}) > 1}


# ------------------------------------------------------------------------------------- rendering
def _ours_text(cell: Cell, digits: int) -> str:
    if cell.points == 0:
        return "n/a"
    if cell.mean is not None:
        text = f"{cell.mean:.{digits}f}"
        text += f" ± {cell.std:.{digits}f}" if cell.std is not None else ""
        text += f" (n={cell.ours.n})"
    elif cell.stale_mean is not None:
        older = cell.stale
        text = f"{cell.stale_mean:.{digits}f}"
        text += f" ± {older.std * cell.scale:.{digits}f}" if older.std is not None else ""
        text += f"† (n={older.n})"
        others = sum(s.n for s in cell.ours.older.values()) - older.n
        text += f" (+{others} by other older code)" if others else ""
    elif cell.lacking:
        runs = "run lacks it" if cell.lacking == 1 else "runs lack it"
        text = f"not measured ({cell.lacking} completed {runs})"
    else:
        text = "not run"
    if cell.choice:
        text += " [" + ", ".join(f"{k}={v}" for k, v in cell.choice.items()) + "]"
    if cell.statuses:
        counts = sorted(cell.statuses.items())
        text += " (" + ", ".join(f"{n} {status.replace('_', ' ')}" for status, n in counts) + ")"
    return text


def _paper_text(cell: Cell, digits: int) -> str:
    if cell.reported is None:
        return "-"
    mean, std = cell.reported
    return f"{mean:.{digits}f}" + (f" ± {std:.{digits}f}" if std is not None else "")


def _diff_text(cell: Cell, digits: int) -> str:
    if cell.difference is None:
        return "-"
    return f"{cell.difference:+.{digits}f}" + ("†" if cell.mean is None else "")


def cell_texts(cell: Cell, digits: int = 1) -> tuple[str, str, str]:
    """(ours, paper, difference) as printed."""
    return _ours_text(cell, digits), _paper_text(cell, digits), _diff_text(cell, digits)


def footer(spec: DictConfig, scale: str, cells: list[list[Cell]], source: Mapping[str, Any]) -> list[str]:
    """The lines under a table: the scale and its setup, how cells read, the code version."""
    stale = any(cell.stale is not None for row in cells for cell in row)
    dirty = " (uncommitted changes)" if source.get("dirty") else ""
    spread = (
        f"mean over seeds ± the std recorded within each run ({spec.spread.format(metric=spec.metric)}; "
        "population std, pooled over seeds)"
        if spec.get("spread")
        else "mean ± sample std over seeds"
    )
    lines = [
        f"Scale: {scale}. {spec.scales[scale].get('note', '')}".strip(),
        "",
        f"Cells: ours as {spread} (n runs) of completed runs of the current code, "
        "the paper's value and ours minus the paper's. Several settings in a cell (a tuned hyperparameter): "
        "the best mean, its values in brackets. Runs that did not complete are counted by status, never "
        "averaged. n/a: the experiment has no such run at this scale.",
        f"Code version: source {source.get('source_hash')}, commit {str(source.get('commit'))[:10]}{dirty}.",
    ]
    machines = Counter()
    for cell in (cell for row in cells for cell in row):
        shown = cell.ours if cell.ours is not None and cell.ours.n else cell.stale
        machines.update(shown.machines if shown is not None else {})
    if machines:  # the same code gives the same numbers only on the same kind of machine
        counted = [f"{label} ({n} run{'s' * (n > 1)})" for label, n in sorted(machines.items())]
        lines.append(f"Machines: {'; '.join(counted)}.")
    if stale:
        lines.append(
            "†: only runs of older code versions exist for this cell, not mixed with current runs nor with "
            "one another: the version with the most seeds (then the latest) is shown, the others counted; "
            "its difference to the paper is marked † too."
        )
    return lines


def markdown(spec: DictConfig, scale: str, cells: list[list[Cell]], source: Mapping[str, Any]) -> str:
    """The table in Markdown: one column group (ours, paper, Δ) per paper column."""
    header = ["Method"]
    for column in spec.columns:
        header += [f"{column.label} ours", f"{column.label} paper", f"{column.label} Δ"]
    lines = [f"# {spec.title} ({scale})", "", f"{spec.paper}.", ""]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row, row_cells in zip(spec.rows, cells, strict=True):
        texts = [text for cell in row_cells for text in cell_texts(cell, spec.get("digits", 1))]
        lines.append("| " + " | ".join([row.label, *texts]) + " |")
    return "\n".join([*lines, "", *footer(spec, scale, cells, source)]) + "\n"


LATEX_REPLACEMENTS = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "_": r"\_", "#": r"\#",
                      "ε": r"$\varepsilon$", "±": r"$\pm$", "†": r"$^\dagger$", "Δ": r"$\Delta$"}  # fmt: skip


def _latex(text: str) -> str:
    return "".join(LATEX_REPLACEMENTS.get(char, char) for char in str(text))


def latex(spec: DictConfig, scale: str, cells: list[list[Cell]], source: Mapping[str, Any]) -> str:
    """The table as a LaTeX ``table`` (booktabs), the scale and setup in its caption."""
    width = len(spec.columns)
    lines = [
        r"\begin{table}[t]",
        r"\centering",
        r"\begin{tabular}{l" + "rrr" * width + "}",
        r"\toprule",
        "Method & "
        + " & ".join(rf"\multicolumn{{3}}{{c}}{{{_latex(c.label)}}}" for c in spec.columns)
        + r" \\",
        " & " + " & ".join(["ours & paper & $\\Delta$"] * width) + r" \\",
        r"\midrule",
    ]
    for row, row_cells in zip(spec.rows, cells, strict=True):
        texts = [_latex(text) for cell in row_cells for text in cell_texts(cell, spec.get("digits", 1))]
        lines.append(" & ".join([_latex(row.label), *texts]) + r" \\")
    caption = " ".join(line for line in footer(spec, scale, cells, source) if line)
    lines += [
        r"\bottomrule",
        r"\end{tabular}",
        rf"\caption{{{_latex(spec.title)} ({scale}). {_latex(caption)}}}",
        r"\end{table}",
    ]
    return "\n".join(lines) + "\n"


def _save(figure: Any, path: Path) -> bool:
    """Lay out, write (as PNG) and close a matplotlib figure; True."""
    import matplotlib.pyplot as plt

    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return True


def epsilon_figure(spec: DictConfig, scale: str, cells: list[list[Cell]], path: Path) -> bool:
    """Metric against epsilon, one line per row (ours with std bars, the paper's dashed); a row without
    epsilon columns (non-private) as a horizontal line. A cell with only older code's runs (the table's †)
    is drawn as a hollow marker, labelled so, never joined to the current runs' line. False (nothing written)
    when the columns are not epsilons or no cell has a result of any code version."""
    epsilons = [(column.get("match") or {}).get("privacy.epsilon") for column in spec.columns]
    shown = any(c.mean is not None or c.stale_mean is not None for row in cells for c in row)
    if any(eps is None for eps in epsilons) or not shown:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(5.5, 4))
    xs = [float(eps) for eps in epsilons]
    for index, (row, row_cells) in enumerate(zip(spec.rows, cells, strict=True)):
        color = f"C{index}"
        means = [c.mean if c.mean is not None else math.nan for c in row_cells]
        stds = [c.std or 0.0 for c in row_cells]
        stale = [c.stale_mean if c.stale_mean is not None else math.nan for c in row_cells]
        ours, older = f"{row.label} (ours)", f"{row.label} (ours, † older code)"
        if "privacy.epsilon" in (row.get("ignore") or []):  # the same runs in every column
            if not math.isnan(means[0]):
                axes.axhline(means[0], color=color, linestyle=":", label=ours)
            elif not math.isnan(stale[0]):
                axes.axhline(stale[0], color=color, linestyle=":", alpha=0.5, label=older)
            continue
        if not all(math.isnan(m) for m in means):
            axes.errorbar(xs, means, yerr=stds, color=color, marker="o", capsize=3, label=ours)
        if not all(math.isnan(m) for m in stale):
            axes.scatter(xs, stale, marker="o", facecolors="none", edgecolors=color, label=older)
        reported = [c.reported[0] if c.reported else math.nan for c in row_cells]
        if not all(math.isnan(r) for r in reported):
            axes.plot(xs, reported, color=color, linestyle="--", marker="x", alpha=0.6)
    metric = spec.metric + (" (%)" if spec.get("percent") else "")
    axes.set(xlabel="ε", ylabel=metric, title=f"{spec.title.split(':')[0]} ({scale})", xticks=xs)
    axes.legend(fontsize=7, title="dashed: paper", title_fontsize=7)
    return _save(figure, path)


def load_history(run_dir: str) -> list[dict[str, Any]]:
    """The evaluation ``history`` of the record in ``run_dir`` (each entry: step, epoch, epsilon, metrics)."""
    return json.loads((Path(run_dir) / METRICS_FILE).read_text()).get("history", [])


CURVE_AXES = {"epsilon": "ε spent", "train_time_s": "training time (s)", "epoch": "epoch"}  # x: its label


@dataclass(frozen=True)
class RowHistory:
    """A table row's training histories: its last cell with current-code runs (its longest budget) and the
    evaluation histories of that cell's runs, each seed's first completed run."""

    index: int
    row: Any
    cells: list[Cell]
    last: Cell
    runs: list[list[dict[str, Any]]]
    run_dirs: list[str] = field(default_factory=list)  # the run directory of each of ``runs``


def current_histories(
    spec: DictConfig,
    cells: list[list[Cell]],
    entries: Sequence[Mapping[str, Any]],
    source_hash: str,
    history: Callable[[str], list[dict[str, Any]]] = load_history,
) -> list[RowHistory]:
    """The :class:`RowHistory` of every row with a result, each run's record read once (``history``)."""
    out = []
    for index, (row, row_cells) in enumerate(zip(spec.rows, cells, strict=True)):
        done = [cell for cell in row_cells if cell.mean is not None]
        if not done:
            continue
        runs, run_dirs, seeds = [], [], set()
        for entry in sorted(entries, key=lambda e: e["run_dir"]):
            wanted = entry["setting_key"] == done[-1].setting and entry["source_hash"] == source_hash
            if wanted and entry["status"] == COMPLETED and entry["seed"] not in seeds:
                seeds.add(entry["seed"])
                runs.append(history(entry["run_dir"]))
                run_dirs.append(entry["run_dir"])
        out.append(RowHistory(index, row, row_cells, done[-1], runs, run_dirs))
    return out


def curve_figure(
    spec: DictConfig, scale: str, rows: Sequence[RowHistory], path: Path, x: str = "epsilon"
) -> bool:
    """Metric over training (``spec.curves``), one line per row and seed, from ``rows``
    (:func:`current_histories`). ``x="epsilon"``: against the epsilon spent, the paper's values as crosses
    at their columns' epsilon; a row that spends no finite epsilon (non-private, or noise multiplier 0:
    epsilon = inf) is a horizontal line at its final value, never a curve against epsilon;
    ``x="train_time_s"``: against the training time, every row a line (He et al. 2023's argument that
    adaptive per-layer clipping reaches flat clipping's accuracy sooner); ``x="epoch"``: against the epochs
    done, every row a line (He et al. 2023, Figure 3). False (nothing written) when no run has an
    evaluation."""
    curves = [
        (
            r.index,
            r.row,
            r.cells,
            r.last,
            [[h for h in run if h.get(spec.metric) is not None] for run in r.runs],
        )
        for r in rows
    ]
    if not any(points for *_, runs in curves for points in runs):
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    factor = 100.0 if spec.get("percent") else 1.0
    figure, axes = plt.subplots(figsize=(6, 4))
    for index, row, row_cells, last, runs in curves:
        color = f"C{index}"
        drawn = [kept for points in runs if (kept := [p for p in points if _finite(p.get(x))])]
        if not drawn:  # non-private against epsilon: nothing to draw against
            axes.axhline(last.mean, color=color, linestyle=":", label=f"{row.label} (ours, final)")
            continue
        private = any(_finite(p.get("epsilon")) for points in runs for p in points)
        label = f"{row.label}{_column_of(spec, row, row_cells, last)} (ours)"
        for number, points in enumerate(drawn):
            xs = [float(p[x]) for p in points]
            ys = [float(p[spec.metric]) * factor for p in points]
            axes.plot(
                xs,
                ys,
                color=color,
                marker=".",
                linestyle="-" if private else "--",  # dashed: a run that spends no finite epsilon
                label=label if number == 0 else None,
            )
        for column, cell in zip(spec.columns, row_cells, strict=True):
            epsilon = (column.get("match") or {}).get("privacy.epsilon")
            if x == "epsilon" and cell.reported is not None and epsilon is not None:
                axes.plot([float(epsilon)], [cell.reported[0]], color=color, marker="x", markersize=9)
    metric = spec.metric + (" (%)" if spec.get("percent") else "")
    axes.set(xlabel=CURVE_AXES[x], ylabel=metric, title=f"{spec.title.split(':')[0]} ({scale})")
    axes.legend(fontsize=7, **({"title": "x: paper", "title_fontsize": 7} if x == "epsilon" else {}))
    return _save(figure, path)


def _column_of(spec: DictConfig, row: Any, row_cells: Sequence[Cell], last: Cell) -> str:
    """``", <column label>"``: the column whose runs a row's curves show (its last with a result), when the
    row's runs differ by column (e.g. ``", ε = 8"``); empty when every column holds the same runs."""
    keys = {key for column in spec.columns for key in (column.get("match") or {})}
    if len(spec.columns) < 2 or keys <= set(row.get("ignore") or []):
        return ""
    return f", {spec.columns[next(i for i, cell in enumerate(row_cells) if cell is last)].label}"


def _finite(value: Any) -> bool:
    """Whether a recorded value is a finite number (records write inf as the string "Infinity")."""
    try:
        return value is not None and math.isfinite(float(value))
    except (TypeError, ValueError):
        return False


def threshold_figure(spec: DictConfig, scale: str, rows: Sequence[RowHistory], path: Path) -> bool:
    """The adaptive thresholds C_k of every clipping group over training (He et al. 2023, Algorithm 1; the
    records' ``thresholds``, released values), one panel per row of ``rows`` (:func:`current_histories`)
    with adaptive thresholds, from its first seed's run (rows reading the same run, e.g. one per metric,
    share the first one's panel); the y axis logarithmic. False (nothing written) when no run recorded
    thresholds at two evaluations or more: a single point is no course over training."""
    panels, drawn = [], set()
    for r in rows:
        points = [h for h in (r.runs[0] if r.runs else []) if h.get("thresholds")]
        if len(points) > 1 and r.run_dirs[0] not in drawn:
            panels.append((r.row, points))
            drawn.add(r.run_dirs[0])
    if not panels:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, grid = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.2), squeeze=False)
    for axes, (row, points) in zip(grid[0], panels, strict=True):
        steps = [p["step"] for p in points]
        groups = list(points[-1]["thresholds"])
        for group in groups:
            values = [p["thresholds"].get(group, float("nan")) for p in points]
            axes.plot(steps, values, linewidth=0.8, label=group)
        axes.set(xlabel="step", ylabel="threshold C_k", yscale="log", title=row.label)
        if len(groups) <= 12:  # a legend of more groups would hide the lines
            axes.legend(fontsize=6, title="group", title_fontsize=6)
    figure.suptitle(f"{spec.title.split(':')[0]} ({scale}): adaptive thresholds", fontsize=9)
    return _save(figure, path)


def layer_norm_figure(
    norms: Sequence[Any],
    panels: Sequence[str],
    layers: Sequence[str],
    examples: Sequence[str],
    path: Path,
    title: str,
    caption: str,
) -> bool:
    """Heatmaps of per-example, per-layer gradient norms (He et al. 2023, Figure 2), one panel per
    checkpoint: ``norms[j]`` has shape ``(len(examples), len(layers))`` (rows: examples, columns: layers from
    input to output) and is titled ``panels[j]``; one colour scale for all panels, from 0 to the largest
    norm, darker for larger norms (as the paper); ``caption`` is printed under the panels. False (nothing
    written) when there is no panel."""
    if not len(norms):
        return False
    arrays = [np.asarray(values, dtype=float) for values in norms]
    expected = (len(examples), len(layers))
    for panel, values in zip(panels, arrays, strict=True):
        if values.shape != expected:
            raise ValueError(f"{panel}: norms of shape {values.shape}, expected {expected}")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    top = max(float(np.nanmax(values)) for values in arrays) or 1.0
    width = max(2.2, 0.16 * len(layers) + 1.2)
    height = max(3.0, 0.13 * len(examples) + 1.8)
    figure, grid = plt.subplots(
        1,
        len(arrays) + 1,  # the last, narrow one holds the shared colour bar
        figsize=(width * len(arrays) + 1.2, height),
        squeeze=False,
        gridspec_kw={"width_ratios": [1.0] * len(arrays) + [0.06]},
    )
    for number, (axes, panel, values) in enumerate(zip(grid[0][:-1], panels, arrays, strict=True)):
        image = axes.imshow(values, cmap="Blues", vmin=0.0, vmax=top, aspect="auto", interpolation="nearest")
        axes.set_title(panel, fontsize=8)
        axes.set_xticks(range(len(layers)), layers, rotation=90, fontsize=6)
        axes.set_yticks(range(len(examples)), examples if number == 0 else [], fontsize=5)
        axes.set_xlabel("layer (input → output)", fontsize=7)
    grid[0][0].set_ylabel("training example (class)", fontsize=7)
    figure.colorbar(image, cax=grid[0][-1]).set_label("gradient norm", fontsize=7)
    lines = textwrap.wrap(caption, width=int(28 * figure.get_figwidth()))
    figure.suptitle("\n".join([title, *lines]), fontsize=7)
    return _save(figure, path)
