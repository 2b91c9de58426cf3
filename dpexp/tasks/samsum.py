"""SAMSum dialogue summarisation (Gliwa et al. 2019) with LoRA GPT-2 (He et al. 2023, sec. 5.3, app. C.2).

He et al. "augmented the training and test sets by prepending the inputs with the instruction 'Summarize
the following dialogue' and the outputs with the delimiter 'TL;DR'": the prompt is
``instruction + newline + dialogue`` and the separator the text ``newline + "TL;DR:"``; the summary follows
and carries the loss. They fine-tune with LoRA of rank 32 (requested from the model factory through
``TaskInfo.lora``, set ``task.lora=null`` for full fine-tuning), decode by beam search with beam 4
and report ROUGE-1/2/L (Table 6). Each dialogue has one reference summary.

Local files (``data_root/samsum/``): the original release's ``train.json``, ``val.json``, ``test.json``,
each a JSON list of ``{"id", "summary", "dialogue"}`` (turns separated by CRLF, normalised to newlines).
No offline copy exists; tests use small generated files of this format. Hub: ``Samsung/samsum``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any, ClassVar

from dpexp.metrics.text import rouge
from dpexp.tasks.files import read_text
from dpexp.tasks.generation import GenerationTask

_FIELDS = ("dialogue", "summary")
PAPER_LORA = {
    "rank": 32,
    "alpha": 32,
    "dropout": 0.0,
    "target_modules": ["c_attn"],
}  # app. C.2; see models/lora


class SAMSumTask(GenerationTask):
    """Instruction-formatted dialogue -> summary pairs; ROUGE-1/2/L against the single reference."""

    name = "samsum"
    local_files: ClassVar[dict[str, str]] = {"train": "train.json", "dev": "val.json", "test": "test.json"}

    def __init__(
        self,
        *,
        hub_name: str = "Samsung/samsum",
        instruction: str = "Summarize the following dialogue",
        delimiter: str = "TL;DR:",
        num_beams: int = 4,
        lora: dict[str, Any] | None = PAPER_LORA,
        **kwargs: Any,
    ) -> None:
        super().__init__(hub_name=hub_name, num_beams=num_beams, lora=lora, **kwargs)
        self.instruction = instruction
        self.delimiter = delimiter

    def _pairs(self, records: Iterable[Any], where: str) -> list[tuple[str, str]]:
        pairs = []
        for index, record in enumerate(records):
            if not isinstance(record, dict) or any(field not in record for field in _FIELDS):
                found = sorted(record) if isinstance(record, dict) else type(record).__name__
                raise ValueError(
                    f"{where}: record {index} needs fields 'dialogue' and 'summary' (SAMSum "
                    f"release format {{id, summary, dialogue}}), got {found}"
                )
            dialogue = "\n".join(line.strip() for line in record["dialogue"].splitlines())
            pairs.append((f"{self.instruction}\n{dialogue}", record["summary"].strip()))
        return pairs

    def separator_ids(self, tokenizer: Any) -> list[int]:
        """The tokens of ``newline + delimiter`` ("TL;DR:"), between dialogue and summary."""
        return tokenizer("\n" + self.delimiter, add_special_tokens=False)["input_ids"]

    def read_local(self, path: Path) -> list[tuple[str, str]]:
        try:
            records = json.loads(read_text(path))
        except json.JSONDecodeError as error:
            raise ValueError(
                f"{path}: not valid JSON ({error}); expected the SAMSum release format"
            ) from error
        if not isinstance(records, list):
            raise ValueError(f"{path}: expected a JSON list of SAMSum records, got {type(records).__name__}")
        return self._pairs(records, str(path))

    def hub_pairs(self, rows: Iterable[dict[str, Any]]) -> list[tuple[str, str]]:
        return self._pairs(rows, f"hub data set {self.hub_name}")

    def score(self, hypotheses: list[str], references: list[tuple[str, ...]]) -> dict[str, float]:
        return rouge(hypotheses, references, ("rouge1", "rouge2", "rougeL"))
