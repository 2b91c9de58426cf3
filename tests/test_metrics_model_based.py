"""Model-based generation metrics (BERTScore, BLEURT) through ``evaluate``, tested with local metric scripts
(the hub is unreachable here): loading, the one-line refusals, best reference per input, mean over inputs."""

from __future__ import annotations

from pathlib import Path

import pytest

from dpexp.metrics.model_based import (
    MODEL_METRICS,
    check_model_metrics,
    load_model_metrics,
    model_metric_scores,
)
from tests.generation_helpers import write_metric

HYPOTHESES = ["a b c", "x y", "p"]
REFERENCES = [("a b", "a b c d", "z"), ("y",), ("q", "r")]


def test_each_input_keeps_its_best_reference_and_inputs_are_averaged(tmp_path: Path) -> None:
    paths = {name: write_metric(tmp_path, name) for name in MODEL_METRICS}
    modules = load_model_metrics(paths, "task.model_metrics")
    scores = model_metric_scores(modules, HYPOTHESES, REFERENCES)
    # best overlaps: 3 ("a b c d"), 1 ("y"), 0
    assert scores == pytest.approx(dict.fromkeys(MODEL_METRICS, (3 + 1 + 0) / 3))
    assert model_metric_scores({}, HYPOTHESES, REFERENCES) == {}


def test_unknown_names_and_bad_paths_are_refused_naming_the_key() -> None:
    with pytest.raises(ValueError, match=r"task.model_metrics: unknown model-based metric\(s\) \['meteor'\]"):
        check_model_metrics({"meteor": "meteor"}, "task.model_metrics")
    with pytest.raises(ValueError, match=r"task.model_metrics.bleurt: give the metric's evaluate path"):
        check_model_metrics({"bleurt": ""}, "task.model_metrics")
    assert check_model_metrics({}, "k") == {}


def test_a_metric_evaluate_cannot_load_is_refused_in_one_line(tmp_path: Path) -> None:
    missing = str(tmp_path / "nowhere" / "bertscore")
    with pytest.raises(ValueError, match=r"^task.model_metrics.bertscore: evaluate could not load") as error:
        load_model_metrics({"bertscore": missing}, "task.model_metrics")
    assert "\n" not in str(error.value) and "drop bertscore from task.model_metrics" in str(error.value)


def test_a_metric_returning_the_wrong_number_of_scores_is_refused() -> None:
    class Short:
        def compute(self, predictions, references, **kwargs):
            return {"scores": [0.0]}

    with pytest.raises(ValueError, match="bleurt returned 1 scores for 6 pairs"):
        model_metric_scores({"bleurt": Short()}, HYPOTHESES, REFERENCES)
