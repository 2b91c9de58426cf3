"""DART (Nan et al. 2021): open-domain RDF triple sets to text, as in Li et al. (2022) and He et al. (2023).

A triple set ``[[s1, r1, o1], [s2, r2, o2]]`` is linearised as in Li & Liang (2021):
``s1 : r1 : o1 | s2 : r2 : o2``. Each annotation of a triple set is one training pair; evaluation groups
all annotations of the same (linearised) triple set as its references. Metrics: the columns of Li et al.
(2022), Table 8 that run offline, METEOR, ROUGE-1, ROUGE-2, ROUGE-L and BLEU
(:func:`dpexp.metrics.text.dart_metrics`; He et al. 2023, Table 5, prints BLEU and ROUGE-L), its BERTScore
and BLEURT where ``model_metrics`` asks for them (hub models), and the test-set per-token NLL.

Local files (``data_root/dart/``): ``dart-v1.1.1-full-{train,dev,test}.json`` from the original release,
a JSON list of records with ``tripleset`` and ``annotations`` (list of ``{source, text}``). Offline copies
hold only the dev file: then, unless ``train_split`` / ``eval_split`` are set, training uses ``dev_train``
and evaluation ``dev_eval``, a deterministic partition of the dev triple sets by a hash of their
linearisation (``dev_eval_fraction`` of them held out; see :mod:`dpexp.tasks.generation`).
Hub: ``Yale-LILY/dart`` (annotations as ``{"source": [...], "text": [...]}``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any, ClassVar

from dpexp.metrics.text import dart_metrics
from dpexp.tasks.files import read_text
from dpexp.tasks.generation import GenerationTask


def linearize_tripleset(tripleset: list[list[str]]) -> str:
    """``[[s, r, o], ...]`` -> ``s : r : o | ...`` (Li & Liang 2021)."""
    if not tripleset or any(len(triple) != 3 for triple in tripleset):
        raise ValueError(
            f"a DART tripleset is a non-empty list of [subject, relation, object], got {tripleset!r}"
        )
    return " | ".join(" : ".join(str(part).strip() for part in triple) for triple in tripleset)


def _annotation_texts(annotations: Any) -> list[str]:
    """Texts of a record's annotations: a list of {source, text} (release) or {text: [...]} (hub)."""
    if isinstance(annotations, dict) and "text" in annotations:
        return list(annotations["text"])
    if isinstance(annotations, list) and all(isinstance(a, dict) and "text" in a for a in annotations):
        return [a["text"] for a in annotations]
    raise ValueError(f"DART annotations must be a list of {{'source', 'text'}} objects, got {annotations!r}")


def records_to_pairs(records: Iterable[Any], where: str) -> list[tuple[str, str]]:
    """(linearised triple set, annotation) pairs of DART records; ``where`` names the source in errors."""
    pairs = []
    for index, record in enumerate(records):
        if not isinstance(record, dict) or "tripleset" not in record or "annotations" not in record:
            found = sorted(record) if isinstance(record, dict) else type(record).__name__
            raise ValueError(
                f"{where}: record {index} needs fields 'tripleset' and 'annotations', got {found}"
            )
        try:
            source = linearize_tripleset(record["tripleset"])
            texts = _annotation_texts(record["annotations"])
        except ValueError as error:
            raise ValueError(f"{where}: record {index}: {error}") from error
        pairs.extend((source, text.strip()) for text in texts)
    return pairs


class DARTTask(GenerationTask):
    """DART table-to-text; training pairs are (linearised triple set, annotation)."""

    name = "dart"
    local_files: ClassVar[dict[str, str]] = {
        "train": "dart-v1.1.1-full-train.json",
        "dev": "dart-v1.1.1-full-dev.json",
        "test": "dart-v1.1.1-full-test.json",
    }
    offline_splits: ClassVar[tuple[str, str] | None] = ("dev_train", "dev_eval")

    def __init__(self, *, hub_name: str = "Yale-LILY/dart", **kwargs: Any) -> None:
        super().__init__(hub_name=hub_name, **kwargs)

    def score(self, hypotheses: list[str], references: list[tuple[str, ...]]) -> dict[str, float]:
        """Li et al. (2022), Table 8's metrics that need no hub model (:func:`dart_metrics`)."""
        return dart_metrics(hypotheses, references)

    def read_local(self, path: Path) -> list[tuple[str, str]]:
        try:
            records = json.loads(read_text(path))
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}: not valid JSON ({error}); expected the DART release format") from error
        if not isinstance(records, list):
            raise ValueError(f"{path}: expected a JSON list of DART records, got {type(records).__name__}")
        return records_to_pairs(records, str(path))

    def hub_pairs(self, rows: Iterable[dict[str, Any]]) -> list[tuple[str, str]]:
        return records_to_pairs(rows, f"hub data set {self.hub_name}")
