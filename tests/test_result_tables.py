"""Tables in the paper's layout from store entries: ours beside the published value and the difference,
tuned cells showing the chosen values, older code flagged, unfinished runs counted; LaTeX and the figure."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from dpexp.results import tables
from dpexp.results.experiments import Point
from tests.test_reproduce import TINY_EXPERIMENT

SPEC = OmegaConf.create(TINY_EXPERIMENT)
SOURCE = {"source_hash": "new", "commit": "0123456789abc", "dirty": False}


def _point(**settings: str) -> Point:
    return Point("tiny", "offline", tuple(f"{k}={v}" for k, v in settings.items()), tuple(settings.items()))


POINTS = [
    _point(clip="bk", **{"privacy.epsilon": "3"}, seed="0"),
    _point(clip="bk", **{"privacy.epsilon": "3"}, seed="1"),
    _point(clip="nonprivate", **{"optim.lr": "0.1"}, seed="0"),
    _point(clip="nonprivate", **{"optim.lr": "0.5"}, seed="0"),
]
KEYS = {POINTS[0]: "dp", POINTS[1]: "dp", POINTS[2]: "np_small", POINTS[3]: "np_large"}


def _entry(
    setting: str,
    seed: int,
    accuracy: float | None,
    status: str = "completed",
    code: str = "new",
    started: str = "",
):
    return {
        "started_at": started,
        "run_dir": f"runs/{setting}-{seed}-{code}-{status}",
        "run_key": f"{setting}-{seed}",
        "setting_key": setting,
        "seed": seed,
        "status": status,
        "source_hash": code,
        "metrics": {"accuracy": accuracy},
    }


def test_cells_average_seeds_pick_the_tuned_setting_and_print_beside_the_paper(tmp_path: Path) -> None:
    entries = [
        _entry("dp", 0, 0.60),
        _entry("dp", 1, 0.64),
        _entry("dp", 1, None, status="failed"),
        _entry("np_small", 0, 0.70),
        _entry("np_large", 0, 0.80),
    ]
    cells = tables.build_cells(SPEC, POINTS, KEYS, entries, "new")
    flat, nonprivate = cells[0][0], cells[1][0]
    assert flat.mean == pytest.approx(62.0) and flat.std == pytest.approx(8**0.5)
    assert flat.reported == (63.1, 0.22)
    assert tables.cell_texts(flat) == ("62.0 ± 2.8 (n=2) (1 failed)", "63.1 ± 0.2", "-1.1")
    assert nonprivate.choice == {"optim.lr": "0.5"} and nonprivate.mean == pytest.approx(80.0)
    assert tables.cell_texts(nonprivate) == ("80.0 (n=1) [optim.lr=0.5]", "-", "-")
    text = tables.markdown(SPEC, "offline", cells, SOURCE)
    assert "| Method | ε = 3 ours | ε = 3 paper | ε = 3 Δ |" in text
    assert "| Flat clipping, fixed | 62.0 ± 2.8 (n=2) (1 failed) | 63.1 ± 0.2 | -1.1 |" in text
    assert "Scale: offline. three steps of the digits default" in text and "†" not in text
    latex = tables.latex(SPEC, "offline", cells, SOURCE)
    assert r"\multicolumn{3}{c}{$\varepsilon$ = 3}" in latex and r"62.0 $\pm$ 2.8" in latex
    assert tables.epsilon_figure(SPEC, "offline", cells, tmp_path / "f.png")
    assert (tmp_path / "f.png").read_bytes()[:4] == b"\x89PNG"


def test_runs_of_older_code_are_flagged_never_mixed() -> None:
    entries = [
        _entry("dp", 0, 0.50, code="old"),
        _entry("np_large", 0, 0.8),
        _entry("np_large", 0, 0.1, code="old"),
    ]
    cells = tables.build_cells(SPEC, POINTS, KEYS, entries, "new")
    assert cells[0][0].mean is None
    assert tables.cell_texts(cells[0][0]) == ("50.0† (n=1)", "63.1 ± 0.2", "-13.1†")  # Δ of the older runs
    assert cells[1][0].mean == pytest.approx(80.0)  # the old run of the same setting is not averaged in
    text = tables.markdown(SPEC, "offline", cells, SOURCE)
    assert "†: only runs of older code versions" in text and "difference to the paper is marked † too" in text


def test_the_footer_names_the_machines_of_the_runs_shown() -> None:
    """The same code gives the same numbers only on the same kind of machine: the footer counts the machines
    of the runs each cell shows (an older version's where it is shown), not those of runs it leaves out."""
    avx2 = {"cpu": "Xeon", "cpu_capability": "AVX2", "torch": "2.14.1", "gpu": None}
    avx512 = {**avx2, "cpu_capability": "AVX512"}
    entries = [
        {**_entry("dp", 0, 0.60), "machine": avx2},
        {**_entry("dp", 1, 0.64), "machine": avx512},
        {**_entry("np_small", 0, 0.70, code="old"), "machine": avx512},  # shown (†): no current run
        {**_entry("np_large", 0, 0.60, code="old"), "machine": avx2},  # not shown: np_small is better
        _entry("np_small", 1, 0.80, code="older"),  # another older version, not shown: no machine kept
    ]
    text = tables.markdown(SPEC, "offline", tables.build_cells(SPEC, POINTS, KEYS, entries, "new"), SOURCE)
    assert "Machines: Xeon (AVX2), torch 2.14.1 (1 run); Xeon (AVX512), torch 2.14.1 (2 runs)." in text
    text = tables.markdown(
        SPEC, "offline", tables.build_cells(SPEC, POINTS, KEYS, [_entry("dp", 0, 0.6)], "new"), SOURCE
    )
    assert "Machines: machine not recorded (1 run)." in text  # records written before they kept it


def test_older_code_versions_are_not_mixed_with_one_another() -> None:
    """A cell with only older runs shows one older version, the one with the most seeds, then the latest
    started; the others' runs are counted, never averaged in (and a seed run twice is not counted twice)."""
    entries = [
        _entry("dp", 0, 0.90, code="v1", started="2026-11-01T10:00:00+00:00"),
        _entry("dp", 1, 0.60, code="v2", started="2026-11-02T10:00:00+00:00"),
        _entry("dp", 0, 0.70, code="v2", started="2026-11-02T09:00:00+00:00"),
    ]
    cell = tables.build_cells(SPEC, POINTS, KEYS, entries, "new")[0][0]
    assert tables.cell_texts(cell)[0] == "65.0 ± 7.1† (n=2) (+1 by other older code)"  # v2's two seeds
    entries.append(_entry("dp", 1, 0.80, code="v1"))  # now both have two seeds: the latest started wins
    cell = tables.build_cells(SPEC, POINTS, KEYS, entries, "new")[0][0]
    assert tables.cell_texts(cell)[0] == "65.0 ± 7.1† (n=2) (+2 by other older code)"
    entries.append(_entry("dp", 1, 0.85, code="v1", started="2026-11-03T10:00:00+00:00"))  # seed 1 again
    cell = tables.build_cells(SPEC, POINTS, KEYS, entries, "new")[0][0]
    assert tables.cell_texts(cell)[0] == "65.0 ± 7.1† (n=2) (+2 by other older code)"  # v1: one per seed
    entries = [_entry("dp", 1, 0.50, code="v2"), _entry("dp", 0, 0.90, code="v1")]  # no start times
    cell = tables.build_cells(SPEC, POINTS, KEYS, entries, "new")[0][0]  # a tie: the first by run directory
    assert tables.cell_texts(cell)[0] == "90.0† (n=1) (+1 by other older code)"


def test_a_cell_with_only_older_runs_shows_its_best_setting_with_its_values() -> None:
    """With no current run, a tuned cell shows the best older setting, not whichever comes first."""
    entries = [_entry("np_small", 0, 0.44, code="old"), _entry("np_large", 0, 0.49, code="old")]
    cells = tables.build_cells(SPEC, POINTS, KEYS, entries, "new")
    assert tables.cell_texts(cells[1][0])[0] == "49.0† (n=1) [optim.lr=0.5]"
    entries.append(_entry("np_small", 0, 0.30))  # a current run wins over any older one
    cells = tables.build_cells(SPEC, POINTS, KEYS, entries, "new")
    assert tables.cell_texts(cells[1][0])[0] == "30.0 (n=1) [optim.lr=0.1]"


def test_the_epsilon_figure_marks_older_runs_and_never_joins_them_to_current_ones(monkeypatch) -> None:
    """A cell with only older code's runs (the table's †) is a hollow marker labelled so; a row of current
    runs keeps its line; neither is mistaken for the other."""
    drawn = []
    monkeypatch.setattr(tables, "_save", lambda figure, path: drawn.append(figure) or True)
    entries = [_entry("dp", 0, 0.50, code="old"), _entry("np_large", 0, 0.8)]
    cells = tables.build_cells(SPEC, POINTS, KEYS, entries, "new")
    assert tables.epsilon_figure(SPEC, "offline", cells, None)
    axes = drawn[-1].axes[0]
    labels = [text.get_text() for text in axes.get_legend().get_texts()]
    assert labels == ["Flat clipping, fixed (ours, † older code)", "Non-private (ours)"]
    (hollow,) = axes.collections  # the older runs' marker: no face, at their mean
    assert hollow.get_facecolors().size == 0 and list(hollow.get_offsets()[0]) == [3.0, 50.0]
    lines = [(line.get_linestyle(), float(line.get_ydata()[0])) for line in axes.lines]
    assert lines == [("--", 63.1), (":", 80.0)]  # the paper's (dashed) and the current non-private run
    entries = [_entry("dp", 0, 0.50, code="old"), _entry("dp", 0, 0.60)]  # a current run: no † marker
    cells = tables.build_cells(SPEC, POINTS, KEYS, entries, "new")
    assert tables.epsilon_figure(SPEC, "offline", cells, None)
    labels = [text.get_text() for text in drawn[-1].axes[0].get_legend().get_texts()]
    assert labels == ["Flat clipping, fixed (ours)"]


def test_a_cell_without_runs_says_so_and_no_figure_is_drawn(tmp_path: Path) -> None:
    cells = tables.build_cells(SPEC, POINTS, KEYS, [], "new")
    assert tables.cell_texts(cells[0][0]) == ("not run", "63.1 ± 0.2", "-")
    assert not tables.epsilon_figure(SPEC, "offline", cells, tmp_path / "f.png")


def test_a_cell_whose_completed_runs_lack_its_metric_says_so() -> None:
    """A metric the runs did not compute (a hub metric offline, one older code did not have) is "not
    measured", counted over the cell's settings and code versions (a rerun once), never "not run"."""
    entries = [_entry("dp", 0, None), _entry("dp", 0, None), _entry("dp", 1, None, code="old")]
    cell = tables.build_cells(SPEC, POINTS, KEYS, entries, "new")[0][0]
    assert tables.cell_texts(cell)[0] == "not measured (2 completed runs lack it)"
    entries = [_entry("np_small", 0, None), _entry("np_large", 0, None, status="failed")]
    cell = tables.build_cells(SPEC, POINTS, KEYS, entries, "new")[1][0]
    assert tables.cell_texts(cell)[0] == "not measured (1 completed run lacks it) (1 failed)"
    entries.append(_entry("np_large", 0, 0.7))  # a run with the metric is shown as usual
    cell = tables.build_cells(SPEC, POINTS, KEYS, entries, "new")[1][0]
    assert tables.cell_texts(cell)[0] == "70.0 (n=1) [optim.lr=0.5] (1 failed)"


def _histories(cells, entries, history=tables.load_history):
    return tables.current_histories(SPEC, cells, entries, "new", history)


def test_curves_draw_each_seeds_current_completed_run_of_the_best_setting(tmp_path: Path) -> None:
    entries = [
        _entry("dp", 0, 0.60),
        _entry("dp", 1, 0.64),
        _entry("dp", 1, None, status="failed"),
        _entry("dp", 2, 0.9, code="old"),
        _entry("np_small", 0, 0.70),
        _entry("np_large", 0, 0.80),
    ]
    cells = tables.build_cells(SPEC, POINTS, KEYS, entries, "new")
    read = []

    def history(run_dir: str) -> list[dict]:
        read.append(run_dir)
        if "np_" in run_dir:
            return [{"step": 3, "epsilon": None, "accuracy": 0.8}]
        return [{"step": 1, "epsilon": 1.0, "accuracy": 0.3}, {"step": 3, "epsilon": 3.0, "accuracy": 0.6}]

    assert tables.curve_figure(SPEC, "offline", _histories(cells, entries, history), tmp_path / "c.png")
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"
    # the private row: seeds 0 and 1, completed and current; the non-private row: the tuned lr only
    assert read == ["runs/dp-0-new-completed", "runs/dp-1-new-completed", "runs/np_large-0-new-completed"]


def test_no_curves_without_evaluations(tmp_path: Path) -> None:
    entries = [_entry("dp", 0, 0.60)]
    cells = tables.build_cells(SPEC, POINTS, KEYS, entries, "new")
    assert not tables.curve_figure(
        SPEC, "offline", _histories(cells, entries, lambda _: []), tmp_path / "c.png"
    )
    empty = tables.build_cells(SPEC, POINTS, KEYS, [], "new")
    assert not tables.curve_figure(SPEC, "offline", _histories(empty, []), tmp_path / "c.png")
    assert not (tmp_path / "c.png").exists()


def test_time_curves_draw_every_row_against_its_training_time(tmp_path: Path) -> None:
    """x="train_time_s": the non-private row is a curve too (it has a training time, not an epsilon)."""
    entries = [_entry("dp", 0, 0.60), _entry("np_large", 0, 0.80)]
    cells = tables.build_cells(SPEC, POINTS, KEYS, entries, "new")

    def timed(run_dir: str) -> list[dict]:
        return [{"step": 1, "epsilon": None, "train_time_s": 2.0, "accuracy": 0.5}]

    assert tables.curve_figure(
        SPEC, "offline", _histories(cells, entries, timed), tmp_path / "t.png", "train_time_s"
    )
    assert (tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"


def test_threshold_figure_draws_the_recorded_thresholds_of_each_rows_first_seed(tmp_path: Path) -> None:
    entries = [_entry("dp", 0, 0.60), _entry("dp", 1, 0.64), _entry("np_large", 0, 0.80)]
    cells = tables.build_cells(SPEC, POINTS, KEYS, entries, "new")
    read = []

    def history(run_dir: str) -> list[dict]:
        read.append(run_dir)
        if "np_" in run_dir:
            return [{"step": 3, "accuracy": 0.8}]
        return [
            {"step": s, "accuracy": 0.5, "thresholds": {"0 fc": 1.0 / s, "1 head": 0.5 * s}} for s in (1, 3)
        ]

    path = tmp_path / "th.png"
    assert tables.threshold_figure(SPEC, "offline", _histories(cells, entries, history), path)
    assert path.read_bytes()[:4] == b"\x89PNG"
    assert "runs/dp-0-new-completed" in read
    none = tmp_path / "none.png"
    assert not tables.threshold_figure(
        SPEC, "offline", _histories(cells, entries, lambda _: [{"step": 1}]), none
    )
    assert not none.exists()
    final_only = [{"step": 3, "accuracy": 0.5, "thresholds": {"0 fc": 1.0}}]  # evaluated once, at the end
    assert not tables.threshold_figure(
        SPEC, "offline", _histories(cells, entries, lambda _: final_only), none
    )
    assert not none.exists()


def _png_width(path: Path) -> int:
    return int.from_bytes(path.read_bytes()[16:20], "big")


def test_rows_reading_the_same_run_share_one_threshold_panel(tmp_path: Path) -> None:
    """A table with one row per metric (He et al. Table 5) reads each run in several rows: one panel each."""
    course = [{"step": s, "thresholds": {"0 fc": 1.0 / s}} for s in (1, 2, 3)]
    row = OmegaConf.create({"label": "BLEU, ε = 3"})

    def histories(*dirs: str) -> list[tables.RowHistory]:
        return [tables.RowHistory(i, row, [], None, [course], [d]) for i, d in enumerate(dirs)]

    shared, separate = tmp_path / "shared.png", tmp_path / "separate.png"
    assert tables.threshold_figure(SPEC, "offline", histories("runs/a", "runs/a"), shared)
    assert tables.threshold_figure(SPEC, "offline", histories("runs/a", "runs/b"), separate)
    assert _png_width(separate) > 1.8 * _png_width(shared)  # two panels against one


def test_a_row_without_noise_is_a_horizontal_line_against_epsilon_and_a_curve_against_epochs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run with noise multiplier 0 records epsilon "Infinity" at every evaluation (he2023_figure3's rows
    "no noise"): against epsilon it is its final value as a horizontal line, never points at an epsilon;
    against epochs it is a curve like every row, dashed."""
    entries = [_entry("dp", 0, 0.60), _entry("np_large", 0, 0.80)]
    cells = tables.build_cells(SPEC, POINTS, KEYS, entries, "new")

    def history(run_dir: str) -> list[dict]:
        epsilon = (lambda e: "Infinity") if "np_" in run_dir else (lambda e: e)
        return [{"step": s, "epoch": s / 2, "epsilon": epsilon(s), "accuracy": 0.2 * s} for s in (1, 2, 3)]

    drawn = []
    monkeypatch.setattr(tables, "_save", lambda figure, path: drawn.append(figure) or True)
    rows = _histories(cells, entries, history)
    assert tables.curve_figure(SPEC, "offline", rows, tmp_path / "c.png")
    lines = {line.get_label(): line for line in drawn[-1].axes[0].get_lines()}
    assert list(lines["Flat clipping, fixed (ours)"].get_xdata()) == [1.0, 2.0, 3.0]
    final = lines["Non-private (ours, final)"]  # the row's final value, a horizontal line
    assert list(final.get_ydata()) == [pytest.approx(80.0)] * 2 and "Non-private (ours)" not in lines
    assert tables.curve_figure(SPEC, "offline", rows, tmp_path / "e.png", x="epoch")
    lines = {line.get_label(): line for line in drawn[-1].axes[0].get_lines()}
    assert list(lines["Non-private (ours)"].get_xdata()) == [0.5, 1.0, 1.5]
    assert lines["Non-private (ours)"].get_linestyle() == "--"  # dashed: it spends no finite epsilon
    assert lines["Flat clipping, fixed (ours)"].get_linestyle() == "-"
    assert drawn[-1].axes[0].get_xlabel() == "epoch"
