"""E2E NLG (Novikova et al. 2017): restaurant meaning representations to text, as in Li et al. (2022).

Each training example is one (MR, reference) row; an MR has several references, one per row. The MR
``name[The Mill], eatType[pub], priceRange[moderate]`` is linearised as in Li & Liang (2021), whose data Li
et al. use (their Table 11 shows it): ``name : The Mill | Type : pub | price : moderate``. Metrics: the E2E
challenge's BLEU, NIST, METEOR, ROUGE-L and CIDEr against all references of the MR (Li et al. 2022, Tables 2
and 7; :func:`dpexp.metrics.text.e2e_metrics`; METEOR needs a Java runtime, and is left out with a warning
without one), plus the test-set per-token NLL.

Local files (``data_root/e2e/``): the original release's ``trainset.csv``, ``devset.csv`` and
``testset_w_refs.csv`` (CSV with header ``mr,ref``). Offline copies hold only the dev and test files: then,
unless ``train_split`` is set, the dev set stands in as the training set and the test set is evaluated.
Hub: ``tuetschek/e2e_nlg`` (columns ``meaning_representation``, ``human_reference``).
"""

from __future__ import annotations

import csv
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any, ClassVar

from dpexp.metrics.text import e2e_metrics
from dpexp.tasks.files import text_file
from dpexp.tasks.generation import GenerationTask

_ATTRIBUTE = re.compile(r"\s*([^,\[\]]+?)\s*\[([^\]]*)\]\s*(?:,|$)")
_FIELD_NAMES = {"eatType": "Type", "priceRange": "price", "familyFriendly": "family friendly"}


def linearize_mr(mr: str) -> str:
    """``name[X], eatType[pub]`` -> ``name : X | Type : pub`` (Li & Liang 2021 field names)."""
    position, fields = 0, []
    while position < len(mr):
        match = _ATTRIBUTE.match(mr, position)
        if match is None:
            raise ValueError(
                f"cannot parse E2E meaning representation {mr!r} at character {position}; "
                "expected comma-separated attribute[value] items"
            )
        key, value = match.group(1), match.group(2).strip()
        fields.append(f"{_FIELD_NAMES.get(key, key)} : {value}")
        position = match.end()
    if not fields:
        raise ValueError(f"empty E2E meaning representation {mr!r}")
    return " | ".join(fields)


class E2ETask(GenerationTask):
    """E2E table-to-text; training pairs are (linearised MR, reference) rows."""

    name = "e2e"
    local_files: ClassVar[dict[str, str]] = {
        "train": "trainset.csv",
        "dev": "devset.csv",
        "test": "testset_w_refs.csv",
    }
    offline_splits: ClassVar[tuple[str, str] | None] = ("dev", "test")
    # canary prefixes "name : <word> | Type : <word> | area : <word>" (Li et al. 2022, app. M)
    canary_fields: ClassVar[tuple[str, ...] | None] = ("name", "Type", "area")

    def __init__(self, *, hub_name: str = "tuetschek/e2e_nlg", **kwargs: Any) -> None:
        super().__init__(hub_name=hub_name, **kwargs)

    def score(self, hypotheses: list[str], references: list[tuple[str, ...]]) -> dict[str, float]:
        """The E2E challenge's five metrics (Li et al. 2022, Table 7)."""
        return e2e_metrics(hypotheses, references)

    def read_local(self, path: Path) -> list[tuple[str, str]]:
        """(linearised MR, reference) rows of an E2E release CSV; a truncated or malformed file (an
        unterminated quote, a row without its reference, an MR cut short) is refused, naming the line."""
        with text_file(path) as handle:
            reader = csv.DictReader(handle, strict=True)
            if reader.fieldnames is None or not {"mr", "ref"} <= set(reader.fieldnames):
                raise ValueError(
                    f"{path}: expected a CSV header with columns 'mr' and 'ref' (the E2E release "
                    f"format), got {reader.fieldnames}"
                )
            pairs = []
            try:
                for row in reader:
                    pairs.append(self._pair(row))
            except csv.Error as error:  # raised reading the line after the last one counted
                raise _malformed(path, reader.line_num + 1, error) from error
            except ValueError as error:  # raised for the row just read
                raise _malformed(path, reader.line_num, error) from error
            return pairs

    @staticmethod
    def _pair(row: dict[str, str | None]) -> tuple[str, str]:
        if row["mr"] is None or row["ref"] is None:
            raise ValueError("a row without both 'mr' and 'ref'")
        return linearize_mr(row["mr"]), row["ref"].strip()

    def hub_pairs(self, rows: Iterable[dict[str, Any]]) -> list[tuple[str, str]]:
        pairs = []
        for row in rows:
            if "meaning_representation" not in row or "human_reference" not in row:
                raise ValueError(
                    f"hub data set {self.hub_name} rows need fields 'meaning_representation' and "
                    f"'human_reference', got {sorted(row)}"
                )
            pairs.append((linearize_mr(row["meaning_representation"]), row["human_reference"].strip()))
        return pairs


def _malformed(path: Path, line: int, error: Exception) -> ValueError:
    return ValueError(
        f"{path}, line {line}: {error}; is the file truncated? The E2E release files are CSV with a "
        "quoted 'mr' and 'ref' on every row."
    )
