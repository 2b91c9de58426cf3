"""GLUE sentence(-pair) classification: SST-2, QNLI, QQP, MNLI (Wang et al. 2018).

The tasks of He et al. (2023, sec. 5.2, appendix A.2) and Li et al. (2022, sec. 5.1): fine-tune an encoder
with a classification head on the training set and report dev-set accuracy (MNLI: matched and mismatched).
With ``objective="infilling"`` the task is Li et al.'s text infilling (sec. 3.2, appendix N): fill the mask
of a template such as "<s1> It was [MASK] ." with one of the label words, a K-way softmax over the masked-LM
logits of the K label words at the mask position.

Data come from the Hugging Face hub (``nyu-mll/glue``) unless a local folder is given: ``path`` (the folder
holding the files) or ``data_root`` (the folder containing ``<name>/``, or the GLUE release's ``SST-2/``
etc.), with the files of the original GLUE release: ``train.tsv`` and ``dev.tsv`` (MNLI:
``dev_matched.tsv`` and ``dev_mismatched.tsv``), tab separated with a header row.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from dpexp.metrics.accuracy import accuracy
from dpexp.models.base import ModelFactory, TaskInfo
from dpexp.tasks.base import Task
from dpexp.tasks.files import text_file
from dpexp.tasks.subsets import check_split_options, training_indices
from dpexp.tasks.text_encoding import (
    TRUNCATION_MODES,
    Example,
    Template,
    collate_encoded,
    encode_examples,
    plain_tokenizer,
    single_token_id,
)

HUB_DATASET = "nyu-mll/glue"
OBJECTIVES: tuple[str, ...] = ("classification", "infilling")


@dataclass(frozen=True)
class EvalSplit:
    """A held-out split: the name of its accuracy metric, its hub split, its file in the GLUE release."""

    metric: str
    hub_split: str
    filename: str


@dataclass(frozen=True)
class GlueSpec:
    """Where one GLUE task's columns live, in the hub copy and in the original TSV release."""

    hub_columns: tuple[str, ...]  # text columns of nyu-mll/glue
    local_dirs: tuple[str, ...]  # folder names tried under data_root
    local_columns: tuple[str, ...]  # text columns of the original TSV files
    local_label: str
    label_names: tuple[str, ...]  # label id -> name, in the hub's order; TSV labels are names or ids
    eval_splits: tuple[EvalSplit, ...]
    template: str  # Li et al. (2022), appendix N, Table 10 (from Gao et al. 2020)
    label_words: tuple[str, ...]  # one per label id, same table


_DEV = (EvalSplit("accuracy", "validation", "dev.tsv"),)
SPECS: dict[str, GlueSpec] = {
    "sst2": GlueSpec(
        ("sentence",), ("sst2", "SST-2"), ("sentence",), "label", ("negative", "positive"), _DEV,
        "{s1} It was {mask} .", ("terrible", "great"),
    ),
    "qnli": GlueSpec(
        ("question", "sentence"), ("qnli", "QNLI"), ("question", "sentence"), "label",
        ("entailment", "not_entailment"), _DEV, "{s1} ? {mask} , {s2}", ("Yes", "No"),
    ),
    "qqp": GlueSpec(
        ("question1", "question2"), ("qqp", "QQP"), ("question1", "question2"), "is_duplicate",
        ("not_duplicate", "duplicate"), _DEV, "{s1} {mask} , {s2}", ("No", "Yes"),
    ),
    "mnli": GlueSpec(
        ("premise", "hypothesis"), ("mnli", "MNLI"), ("sentence1", "sentence2"), "gold_label",
        ("entailment", "neutral", "contradiction"),
        (
            EvalSplit("accuracy_matched", "validation_matched", "dev_matched.tsv"),
            EvalSplit("accuracy_mismatched", "validation_mismatched", "dev_mismatched.tsv"),
        ),
        "{s1} ? {mask} , {s2}", ("Yes", "Maybe", "No"),
    ),
}  # fmt: skip


@dataclass
class RawSplit:
    """Untokenised examples: ``sentences[k][i]`` is sentence k of example i, ``labels[i]`` its label id."""

    sentences: list[list[str]]
    labels: list[int]

    def select(self, indices: Any) -> RawSplit:
        return RawSplit(
            [[column[i] for i in indices] for column in self.sentences], [self.labels[i] for i in indices]
        )


class ExampleList(Dataset):
    """A list of encoded examples as a map-style data set."""

    def __init__(self, examples: list[Example]) -> None:
        self.examples = examples

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> Example:
        return self.examples[index]


class GlueTask(Task):
    """One GLUE task; batches hold ``input_ids``, ``attention_mask`` (B, T), [``token_type_ids``],
    ``label`` (B,) and, for infilling, ``mask_position`` (B,).

    Args:
        name: sst2 | qnli | qqp | mnli.
        data_root: folder containing ``<name>/`` (or the release's ``SST-2/`` ...); null loads from the hub.
        path: folder holding this task's TSV files (overrides ``data_root``).
        split: ``full`` (train on train, report dev accuracy) or ``tune`` (He et al. 2023, appendix A.2:
            train on a seeded 80% of train, report accuracy on the other 20%; the dev set is not loaded).
        tune_fraction: held-out share of the training set for ``split=tune``.
        subsample: keep this many (seeded) training examples, for quick offline runs; null keeps all.
        data_seed: seed of the tune split and the subsample (independent of the training seed).
        max_length: longest input in tokens (capped by the tokenizer's ``model_max_length``).
        truncation: ``warn`` (cut longer inputs, longest sentence first) or ``error``.
        objective: ``classification`` (head on the first token) or ``infilling`` (Li et al. 2022, sec. 3.2).
        template, label_words: infilling template with ``{s1}``, ``{s2}``, ``{mask}`` and one word per label;
            null uses Li et al. (2022), appendix N, Table 10. The template without its sentences, filled
            with each label word, is that label's prompt (``TaskInfo.label_prompts``: "It was great ."),
            where a classification head may start (``model.head_init=label_prompts``).
    """

    def __init__(
        self,
        name: str,
        data_root: str | None = None,
        path: str | None = None,
        split: str = "full",
        tune_fraction: float = 0.2,
        subsample: int | None = None,
        data_seed: int = 0,
        max_length: int = 256,
        truncation: str = "warn",
        objective: str = "classification",
        template: str | None = None,
        label_words: list[str] | None = None,
    ) -> None:
        if name not in SPECS:
            raise ValueError(f"Unknown GLUE task {name!r}; valid choices: {', '.join(SPECS)}.")
        check_split_options(split, tune_fraction, subsample)
        if truncation not in TRUNCATION_MODES:
            raise ValueError(
                f"Unknown truncation {truncation!r}; valid choices: {', '.join(TRUNCATION_MODES)}."
            )
        if objective not in OBJECTIVES:
            raise ValueError(f"Unknown objective {objective!r}; valid choices: {', '.join(OBJECTIVES)}.")
        self.name = name
        self.spec = SPECS[name]
        self.data_root = data_root
        self.path = path
        self.split = split
        self.tune_fraction = tune_fraction
        self.subsample = subsample
        self.data_seed = data_seed
        self.max_length = max_length
        self.truncation = truncation
        self.objective = objective
        self.template = Template.parse(template or self.spec.template, len(self.spec.local_columns))
        self.label_words = tuple(label_words or self.spec.label_words)
        if len(self.label_words) != len(self.spec.label_names):
            raise ValueError(
                f"{name} has {len(self.spec.label_names)} labels {self.spec.label_names}, "
                f"got {len(self.label_words)} label words {list(self.label_words)}."
            )
        self._train: ExampleList | None = None
        self._evals: dict[str, list[Example]] = {}
        self._info: TaskInfo | None = None
        self.label_word_ids: list[int] = []  # infilling: the token of each label's word
        self._pad_token_id = 0

    # ----------------------------------------------------------------------------------------------- data
    def setup(self, factory: ModelFactory) -> None:
        tokenizer = factory.tokenizer()
        if tokenizer is None:
            raise ValueError(
                f"Task {self.name} needs a text model with a tokenizer; {type(factory).__name__} has none: "
                "use a text encoder (model=roberta_base, roberta_large, minilm or roberta_tiny)."
            )
        source = self._local_dir()
        train = self._load(source, "train.tsv", "train")
        train_idx, heldout_idx = training_indices(
            len(train.labels), self.split, self.tune_fraction, self.subsample, self.data_seed
        )
        if heldout_idx is not None:
            raw_evals = {"accuracy": ("held-out", train.select(heldout_idx))}
        else:
            raw_evals = {
                s.metric: (s.hub_split, self._load(source, s.filename, s.hub_split))
                for s in self.spec.eval_splits
            }
        limit = min(self.max_length, getattr(tokenizer, "model_max_length", self.max_length))
        template = self.template if self.objective == "infilling" else None
        train_examples = self._encode(tokenizer, train.select(train_idx), limit, template, "training inputs")
        self._evals = {
            metric: self._encode(tokenizer, raw, limit, template, f"{split} inputs")
            for metric, (split, raw) in raw_evals.items()
        }
        self._train = ExampleList(train_examples)
        self._pad_token_id = tokenizer.pad_token_id
        if self.objective == "infilling":
            backend = plain_tokenizer(tokenizer)
            self.label_word_ids = [single_token_id(backend, word) for word in self.label_words]
        longest = max(len(e["input_ids"]) for part in (train_examples, *self._evals.values()) for e in part)
        self._info = TaskInfo(
            self.name,
            "classification",
            num_labels=len(self.spec.label_names),
            vocab_size=len(tokenizer),
            pad_token_id=tokenizer.pad_token_id,
            max_length=longest,
            objective=self.objective,
            label_prompts=tuple(self.template.prompt(word) for word in self.label_words),
        )

    def _encode(
        self, tokenizer: Any, raw: RawSplit, limit: int, template: Template | None, what: str
    ) -> list[Example]:
        examples = encode_examples(
            tokenizer, raw.sentences, limit, self.truncation, template, f"{self.name} {what}"
        )
        for example, label in zip(examples, raw.labels, strict=True):
            example["label"] = label
        return examples

    def _local_dir(self) -> Path | None:
        """The folder with the TSV files, or None to use the hub."""
        if self.path is not None:
            return Path(self.path)
        if self.data_root is None:
            return None
        candidates = [Path(self.data_root) / folder for folder in self.spec.local_dirs]
        found = [folder for folder in candidates if folder.is_dir()]
        if not found:
            raise FileNotFoundError(
                f"No {self.name} folder under data.root={self.data_root} (looked for "
                f"{', '.join(str(c) for c in candidates)}); put the GLUE files there, set task.path to the "
                "folder holding them, or set data.root=null to download from the Hugging Face hub."
            )
        return found[0]

    def _load(self, folder: Path | None, filename: str, hub_split: str) -> RawSplit:
        if folder is None:
            return self._load_hub(hub_split)
        file = folder / filename
        if not file.is_file():
            expected = ["train.tsv", *(s.filename for s in self.spec.eval_splits)]
            raise FileNotFoundError(
                f"{file} not found: task {self.name} reads the original GLUE files {', '.join(expected)} "
                f"from {folder}. Set task.path (or data.root) to the folder holding them, or data.root=null "
                "to download from the Hugging Face hub."
            )
        return read_glue_tsv(file, self.spec)

    def _load_hub(self, split: str) -> RawSplit:
        from datasets import load_dataset

        try:
            data = load_dataset(HUB_DATASET, self.name, split=split)
        except Exception as err:  # network, cache and hub errors all mean the same thing to the user
            raise RuntimeError(
                f"Could not load {HUB_DATASET}/{self.name} ({split}) from the Hugging Face hub: {err}. "
                f"Offline, set data.root to a folder containing {self.spec.local_dirs[0]}/train.tsv etc."
            ) from err
        return RawSplit([list(data[column]) for column in self.spec.hub_columns], list(data["label"]))

    # ------------------------------------------------------------------------------------- the contract
    @property
    def info(self) -> TaskInfo:
        if self._info is None:
            raise RuntimeError(f"{type(self).__name__}.setup() must be called first.")
        return self._info

    @property
    def train_dataset(self) -> Dataset:
        if self._train is None:
            raise RuntimeError(f"{type(self).__name__}.setup() must be called first.")
        return self._train

    def collate(self, examples: list[Example]) -> dict[str, torch.Tensor]:
        return collate_encoded(examples, self._pad_token_id)

    def example_length(self, example: Example) -> int:
        return len(example["input_ids"])

    def relabelled(self, example: Example, label: int) -> Example:
        return {**example, "label": label}

    def label_of(self, example: Example) -> int:
        return int(example["label"])

    def logits(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Class scores (B, K): the classification head, or the label words' masked-LM logits at the mask."""
        inputs = {
            key: batch[key] for key in ("input_ids", "attention_mask", "token_type_ids") if key in batch
        }
        if self.objective == "infilling":
            return model(**inputs, mask_positions=batch["mask_position"])[:, self.label_word_ids]
        return model(**inputs).logits

    def per_example_loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Cross entropy of each example, shape (B,)."""
        return F.cross_entropy(self.logits(model, batch), batch["label"], reduction="none")

    @property
    def eval_sets(self) -> dict[str, list[Example]]:
        """Encoded held-out examples by metric name: dev (``accuracy``; MNLI ``accuracy_matched`` and
        ``accuracy_mismatched``) or, for ``split=tune``, the held-out part of train (``accuracy``)."""
        return self._evals

    def evaluate(self, model: nn.Module, batch_size: int) -> dict[str, float]:
        """Accuracy on each held-out split; ``accuracy`` is the first one (MNLI: matched)."""
        metrics = {
            metric: accuracy(model, examples, self.collate, self.logits, batch_size)
            for metric, examples in self._evals.items()
        }
        metrics.setdefault("accuracy", next(iter(metrics.values())))
        return metrics


def read_glue_tsv(file: Path, spec: GlueSpec) -> RawSplit:
    """Read a tab-separated file of the original GLUE release (header row, no quoting, some examples)."""
    wanted = (*spec.local_columns, spec.local_label)
    sentences: list[list[str]] = [[] for _ in spec.local_columns]
    labels: list[int] = []
    with text_file(file) as handle:
        reader = csv.DictReader(handle, delimiter="\t", quoting=csv.QUOTE_NONE)
        header = reader.fieldnames or []
        missing = [column for column in wanted if column not in header]
        if missing:
            raise ValueError(
                f"{file}: missing column(s) {', '.join(missing)} in the header {header}; the original GLUE "
                f"file has a header row with the columns {', '.join(wanted)} (tab separated)."
            )
        for line, row in enumerate(reader, start=2):
            values = [row[column] for column in wanted]
            if any(value is None for value in values):
                raise ValueError(f"{file}, line {line}: fewer fields than the header's {len(header)}.")
            for column, value in zip(sentences, values, strict=False):
                column.append(value)
            labels.append(_label_id(values[-1], spec.label_names, file, line))
    if not labels:
        raise ValueError(
            f"{file}: no examples below the header row; every split the task reads needs at least one (is "
            "the file truncated?)."
        )
    return RawSplit(sentences, labels)


def _label_id(value: str, names: tuple[str, ...], file: Path, line: int) -> int:
    value = value.strip()
    if value in names:
        return names.index(value)
    if value.isdigit() and int(value) < len(names):
        return int(value)
    raise ValueError(
        f"{file}, line {line}: label {value!r} is neither a label id below {len(names)} nor one of {names}."
    )
