"""Shared pieces of the generation-task tests: a tiny offline GPT-2 factory and small release-format files."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from dpexp.metrics.model_based import MODEL_METRICS
from dpexp.models.gpt2 import GPT2Factory

E2E_ROWS = [
    ("name[The Mill], eatType[pub], area[riverside]", "The Mill is a pub by the riverside."),
    ("name[The Mill], eatType[pub], area[riverside]", "By the riverside you can find The Mill pub."),
    ("name[Alimentum], priceRange[cheap], familyFriendly[yes]", "Alimentum is cheap and family friendly."),
    ("name[Aromi], food[Italian], near[Café Rouge]", "Aromi serves Italian food near Café Rouge."),
    ("name[Aromi], food[Italian], near[Café Rouge]", "Near Café Rouge, Aromi offers Italian dishes."),
    ("name[Aromi], food[Italian], near[Café Rouge]", "Italian food is served at Aromi, close to Café Rouge."),
]


def tiny_factory(**overrides: object) -> GPT2Factory:
    """A 2-layer, width-32 random GPT-2 with a small BPE tokenizer trained on the task's texts."""
    settings: dict[str, object] = {
        "pretrained": None,
        "config": {"n_layer": 2, "n_embd": 32, "n_head": 2, "n_positions": 128},
        "tokenizer": "trained",
        "tokenizer_vocab_size": 400,
    }
    settings.update(overrides)
    return GPT2Factory(**settings)


def write_e2e_csv(
    path: Path, rows: list[tuple[str, str]] = E2E_ROWS, header: tuple[str, str] = ("mr", "ref")
) -> Path:
    """An E2E release-format CSV (header ``mr,ref``, one reference per row)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(header)
        writer.writerows(rows)
    return path


def write_json(path: Path, records: object) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(records), encoding="utf-8")
    return path


# A stand-in for an evaluate metric: the word overlap of each (prediction, reference) pair under ``field``;
# ``lang`` is required, as BERTScore's is.
METRIC_SCRIPT = """
import datasets
import evaluate


class WordOverlap(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description="test", citation="", inputs_description="",
            features=datasets.Features(
                {"predictions": datasets.Value("string"), "references": datasets.Value("string")}
            ),
        )

    def _compute(self, predictions, references, KWARGS):
        overlap = [float(len(set(p.split()) & set(r.split()))) for p, r in zip(predictions, references)]
        return {"FIELD": overlap}
"""


def write_metric(folder: Path, name: str) -> str:
    """A local metric script standing in for ``name`` (its result field and keyword arguments)."""
    spec = MODEL_METRICS[name]
    kwargs = ", ".join(spec.kwargs) or "**unused"
    path = folder / f"fake_{name}" / f"fake_{name}.py"
    path.parent.mkdir(parents=True)
    path.write_text(METRIC_SCRIPT.replace("FIELD", spec.field).replace("KWARGS", kwargs), encoding="utf-8")
    return str(path.parent)
