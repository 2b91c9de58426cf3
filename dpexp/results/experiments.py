"""Experiments: one ``conf/experiment/<paper>_<table>.yaml`` per published table, run at a ``scale``.

An experiment file holds the table's layout (``rows`` and ``columns`` as the paper prints them, the ``metric``
and where ``conf/published/<file>.yaml`` keeps the paper's numbers) and, per scale (``paper``: the papers'
data, models and sizes; ``offline``: ``../shared/data`` and small models), the trainer overrides common to
every run and one or more ``sweeps``, each a Hydra sweep in ``hydra.sweeper.params`` syntax (``key: a,b``,
``range(...)``, ``choice(...)``) with its own extra ``overrides``. A sweep's grid is the Cartesian product of
its params, as Hydra's basic sweeper forms it (Hydra's own override parser reads the values). An optional
``curves: true`` also draws each row's metric against the epsilon spent and against the training time, from
the runs' evaluation histories (:func:`dpexp.results.tables.curve_figure`), for tables that stand for a
paper's training curves; ``curves`` may instead list the x axes to draw, among :data:`CURVE_AXES` (He et al.
2023, Figure 3: ``[epoch, ...]``). An optional ``layer_norms`` (``row``: the key of the row whose runs keep
checkpoints with ``checkpoint.at_epochs``, ``examples``, ``seed``) draws the per-layer gradient norms of
that row's run at its kept checkpoints (He et al. 2023, Figure 2: :mod:`dpexp.results.layer_norms`). An
optional ``spread`` (e.g. ``"{metric}_std"``) names a record field holding a std measured within each run
(Li et al. 2022's Table 9: exposure's std over the canaries); the cells' ± is then that std (pooled over
seeds) instead of the std over seeds.

:func:`grid_points` enumerates the runs of an experiment at a scale (pure), :func:`compose_points` composes a
run's config exactly as ``python -m dpexp.train`` would, and :func:`point_config` writes the same run as a
config file (``+point=<name>``) so that one Hydra multirun, on any launcher, can run any subset of the grid.
"""

from __future__ import annotations

import copy
import itertools
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf

from dpexp.config import ConfigError

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"  # the repository's conf/ (editable install)
EXPERIMENT_DIR = CONF_DIR / "experiment"
PUBLISHED_DIR = CONF_DIR / "published"
SCALES = ("offline", "paper")
SPEC_KEYS = {
    "title",
    "paper",
    "published",
    "metric",
    "percent",
    "digits",
    "rows",
    "columns",
    "scales",
    "curves",
    "spread",
    "layer_norms",
}
SCALE_KEYS = {"note", "overrides", "sweeps"}
SWEEP_KEYS = {"params", "overrides"}
SEED_OVERRIDE = "seed="
ROW_KEYS = {"label", "key", "match", "ignore", "metric"}  # a row or a column of the table
CURVE_AXES = ("epsilon", "train_time_s", "epoch")  # the x axes of curves: [...]; curves: true = the first two
LAYER_NORM_KEYS = {"row", "examples", "seed"}


@dataclass(frozen=True)
class Point:
    """One run of an experiment's grid: its trainer ``overrides`` (Hydra syntax, in order) and the values
    they set (``values``: key -> value string, group choices included), which the table rows match."""

    experiment: str
    scale: str
    overrides: tuple[str, ...]
    values: tuple[tuple[str, str], ...]
    swept: tuple[str, ...] = ()  # the keys the point's sweep varies (they name its run directory)

    @property
    def settings(self) -> dict[str, str]:
        return dict(self.values)

    @property
    def label(self) -> str:
        """A readable directory-safe name of the swept values, e.g. ``clip-bk_privacy.epsilon-3_seed-0``."""
        text = "_".join(f"{key}-{value}" for key, value in self.values if key in self.swept)
        return re.sub(r"[^A-Za-z0-9._-]+", "", text)[:120] or "run"


def experiment_names() -> list[str]:
    return sorted(path.stem for path in EXPERIMENT_DIR.glob("*.yaml"))


def load_experiment(name: str) -> DictConfig:
    """``conf/experiment/<name>.yaml``, checked; a one-line error naming the valid experiments if absent."""
    path = EXPERIMENT_DIR / f"{name}.yaml"
    if not path.is_file():
        valid = ", ".join(experiment_names())
        raise ConfigError(f"experiment={name} does not exist; valid experiments: {valid}.")
    spec = OmegaConf.load(path)
    _check_keys(spec, SPEC_KEYS, f"experiment {name}")
    for part in ("rows", "columns"):
        for index, entry in enumerate(spec[part]):
            _check_keys(entry, ROW_KEYS, f"experiment {name}, {part}[{index}]")
    curve_axes(spec, name)
    if spec.get("layer_norms") is not None:
        _check_keys(spec.layer_norms, LAYER_NORM_KEYS, f"experiment {name}, layer_norms")
        if spec.layer_norms.get("row") not in [row.get("key") for row in spec.rows]:
            raise ConfigError(f"experiment {name}: layer_norms.row must be the key of one of its rows.")
    for scale, node in spec.scales.items():
        _check_keys(node, SCALE_KEYS, f"experiment {name}, scales.{scale}")
        for index, sweep in enumerate(node.sweeps):
            _check_keys(sweep, SWEEP_KEYS, f"experiment {name}, scales.{scale}.sweeps[{index}]")
    return spec


def curve_axes(spec: DictConfig, name: str = "") -> list[str]:
    """The x axes of the experiment's training-curve figures: none without ``curves``, epsilon spent and
    training time for ``curves: true``, else the axes it lists (refused unless among :data:`CURVE_AXES`)."""
    curves = spec.get("curves")
    if not curves:
        return []
    if curves is True:
        return list(CURVE_AXES[:2])
    axes = [curves] if isinstance(curves, str) else list(curves)
    unknown = [axis for axis in axes if axis not in CURVE_AXES]
    if unknown:
        raise ConfigError(
            f"experiment {name}: curves {unknown} are not axes; valid: true, or a list of "
            f"{', '.join(CURVE_AXES)}."
        )
    return axes


def _check_keys(node: DictConfig, valid: set[str], where: str) -> None:
    unknown = sorted(set(node) - valid)
    if unknown:
        raise ConfigError(f"{where}: unknown keys {unknown}; valid keys: {', '.join(sorted(valid))}.")


def check_scale(name: str, spec: DictConfig, scale: str) -> None:
    """Refuse a scale the experiment does not define, naming those it does."""
    if scale not in spec.scales:
        raise ConfigError(
            f"scale={scale} is not a scale of experiment {name}; valid scales: {', '.join(spec.scales)}."
        )


def _parse(override: str) -> tuple[str, list[str]]:
    """A Hydra override -> (key, its values as strings: several for a sweep)."""
    parsed = OverridesParser.create().parse_overrides([override])[0]
    if parsed.is_sweep_override():
        return parsed.key_or_group, list(parsed.sweep_string_iterator())
    return parsed.key_or_group, [parsed.get_value_element_as_str()]


def grid_points(name: str, spec: DictConfig, scale: str) -> list[Point]:
    """Every run of the experiment at ``scale``: per sweep, the product of its params' values (in the order
    the params are written, the last varying fastest, like Hydra's basic sweeper)."""
    check_scale(name, spec, scale)
    node = spec.scales[scale]
    common = list(node.get("overrides") or [])
    points = []
    for sweep in node.sweeps:
        fixed = common + list(sweep.get("overrides") or [])
        params = [_parse(f"{key}={value}") for key, value in (sweep.get("params") or {}).items()]
        for combination in itertools.product(*(values for _, values in params)):
            chosen = [(key, value) for (key, _), value in zip(params, combination, strict=True)]
            overrides = (*fixed, *(f"{key}={value}" for key, value in chosen))
            values = {}
            for override in fixed:
                key, (value,) = _parse(override)
                values[key] = value
            values.update(chosen)
            swept = tuple(key for key, _ in params)
            points.append(Point(name, scale, overrides, tuple(values.items()), swept))
    return points


def compose_points(points: Sequence[Point], extra: Sequence[str] = ()) -> list[DictConfig]:
    """The trainer config of each point (plus ``extra`` overrides), composed as ``python -m dpexp.train``
    composes it; a ConfigError naming the experiment and the point if one does not compose."""
    import dpexp.train  # noqa: F401  (registers the schema and the run-directory resolvers)

    configs, composed = [], {}
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        for point in points:
            # Runs that differ only by seed are composed once (Hydra takes ~0.5 s a composition); the
            # seed, a plain top-level int no other key interpolates, is then set as its override would.
            setting = tuple(o for o in point.overrides if not o.startswith(SEED_OVERRIDE))
            if setting not in composed:
                try:
                    composed[setting] = compose(config_name="config", overrides=[*point.overrides, *extra])
                except Exception as error:  # Hydra's errors (missing option, bad override) name the key
                    raise ConfigError(
                        f"experiment {point.experiment} (scale={point.scale}), run {point.label}: {error}"
                    ) from error
            cfg = copy.deepcopy(composed[setting])
            if "seed" in point.settings:
                cfg.seed = int(point.settings["seed"])
            configs.append(cfg)
    return configs


def resolved(cfg: DictConfig) -> dict[str, Any]:
    """The resolved config as the trainer records it in metrics.json (and the store keys it)."""
    return OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)


def point_config(point: Point, cfg: DictConfig) -> str:
    """``point`` as a config file for ``+point=<name>`` (package ``_global_``): its group choices as
    ``override`` defaults, every other key it sets with the value it has in ``cfg`` (its composed config),
    so that the run composes to the same config as :func:`compose_points`."""
    groups, values = [], OmegaConf.create({})
    for override in point.overrides:
        key, (value,) = _parse(override)
        if (CONF_DIR / key).is_dir():
            groups.append({f"override /{key}": value})
        else:
            OmegaConf.update(values, key, OmegaConf.select(cfg, key), force_add=True)
    body = {"defaults": [*groups, "_self_"], **OmegaConf.to_container(values)}
    return "# @package _global_\n" + yaml.safe_dump(body, sort_keys=False)


def published(spec: DictConfig) -> DictConfig:
    """``conf/published/<spec.published.file>.yaml``: the papers' setups and reported numbers."""
    path = PUBLISHED_DIR / f"{spec.published.file}.yaml"
    if not path.is_file():
        raise ConfigError(f"published.file={spec.published.file}: no {path}")
    return OmegaConf.load(path)


def matches(settings: Mapping[str, str], wanted: Mapping[str, Any]) -> bool:
    """Whether a point's ``settings`` have every ``wanted`` value (numbers compared as numbers: 3 == 3.0)."""
    return all(key in settings and _same(settings[key], value) for key, value in wanted.items())


def _same(a: Any, b: Any) -> bool:
    try:
        return float(a) == float(b)
    except (TypeError, ValueError):
        return str(a) == str(b)
