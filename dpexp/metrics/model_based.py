"""Generation metrics that score with a trained model, through Hugging Face ``evaluate``: BERTScore (Zhang et
al. 2020) and BLEURT (Sellam et al. 2020), two of the columns of Li et al. (2022), Table 8 (DART).

Both need a scoring model from the hub (BERTScore's RoBERTa-large for English, a BLEURT checkpoint) and a
package of their own (``bert-score``; BLEURT's from its repository, github.com/google-research/bleurt), so
they are asked for explicitly (``task.model_metrics``, e.g. ``{bertscore: bertscore, bleurt: bleurt}``: each
metric's ``evaluate`` path, a hub name or a local metric script or folder) and loaded when the task is set up,
before training, where a missing package or an unreachable hub is refused in one line. Offline runs leave
them out; the tables then say that the runs lack them.

Several references per input (DART's annotations): every (hypothesis, reference) pair is scored, each
hypothesis keeps its best reference, and the score is the mean over inputs, as
:func:`~dpexp.metrics.text.rouge` does and as BERTScore does with several references.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ModelMetric:
    """How one ``evaluate`` metric is called: the result's per-pair field and keyword arguments."""

    field: str
    kwargs: Mapping[str, Any] = field(default_factory=dict)


MODEL_METRICS: dict[str, ModelMetric] = {
    "bertscore": ModelMetric("f1", {"lang": "en"}),  # F1 (0-1), the value Li et al. print
    "bleurt": ModelMetric("scores"),  # the checkpoint's raw score (about -1 to 1)
}


def check_model_metrics(paths: Mapping[str, str], key: str) -> dict[str, str]:
    """``paths`` (metric name -> ``evaluate`` path) as a dict, every name one of :data:`MODEL_METRICS`;
    ``key`` names the config key in errors."""
    unknown = sorted(set(paths) - set(MODEL_METRICS))
    if unknown:
        raise ValueError(
            f"{key}: unknown model-based metric(s) {unknown}; known: {sorted(MODEL_METRICS)} "
            "(each maps to its evaluate path, e.g. {bertscore: bertscore})"
        )
    bad = [name for name, path in paths.items() if not isinstance(path, str) or not path]
    if bad:
        raise ValueError(f"{key}.{bad[0]}: give the metric's evaluate path (a hub name or a local script)")
    return dict(paths)


def load_model_metrics(paths: Mapping[str, str], key: str) -> dict[str, Any]:
    """The ``evaluate`` modules of :func:`check_model_metrics`'s ``paths``; a metric that cannot be loaded
    (no hub, its package missing) is refused in one line naming ``key``."""
    paths = check_model_metrics(paths, key)
    if not paths:
        return {}
    import evaluate

    modules = {}
    for name, path in paths.items():
        try:
            modules[name] = evaluate.load(path)
        except Exception as error:  # evaluate's errors (no hub, missing package) state the cause
            cause = " ".join(str(error).split())
            raise ValueError(
                f"{key}.{name}: evaluate could not load {path!r} ({type(error).__name__}: {cause}); install "
                f"what it names, give a local metric script, or drop {name} from {key}"
            ) from error
    return modules


def model_metric_scores(
    modules: Mapping[str, Any], hypotheses: Sequence[str], references: Sequence[Sequence[str]]
) -> dict[str, float]:
    """Each loaded metric's mean over inputs of its best score against the input's references."""
    if len(hypotheses) != len(references) or not hypotheses:
        raise ValueError(f"got {len(hypotheses)} hypotheses for {len(references)} reference groups")
    owners = [i for i, group in enumerate(references) for _ in group]
    pairs_hyp = [hypotheses[i] for i in owners]
    pairs_ref = [ref for group in references for ref in group]
    scores = {}
    for name, module in modules.items():
        spec = MODEL_METRICS[name]
        result = module.compute(predictions=pairs_hyp, references=pairs_ref, **spec.kwargs)
        values = result[spec.field]
        if len(values) != len(pairs_hyp):
            raise ValueError(f"{name} returned {len(values)} scores for {len(pairs_hyp)} pairs")
        best = [float("-inf")] * len(hypotheses)
        for owner, value in zip(owners, values, strict=True):
            best[owner] = max(best[owner], float(value))
        scores[name] = sum(best) / len(best)
    return scores
