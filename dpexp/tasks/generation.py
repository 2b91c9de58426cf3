"""Shared base for conditional generation with a decoder-only LM or an encoder-decoder (table-to-text,
summarisation).

Every training example is one (source, target) pair, fed to the model as
``source + separator + " " + target + eos`` (the format of the code released with Li et al. 2022, after
Li & Liang 2021; the separator is GPT-2's ``<|endoftext|>`` token for E2E/DART and the text "TL;DR" for
SAMSum, He et al. 2023, app. C.2). The loss is the
next-token cross-entropy on the target tokens and the final eos only; per example it is the SUM over those
tokens (not the mean), the per-example loss whose gradient Li et al. clip. Source, separator and padding
positions carry label ``IGNORE`` (-100); padding is on the right and masked by ``attention_mask``.

With an encoder-decoder (a factory with ``encoder_decoder``, e.g. T5) the source plus eos goes to the encoder
and the target plus eos is the decoder's label sequence (padded with ``IGNORE``; the model shifts it right
behind its decoder start token); the per-example loss is again the sum of the target tokens'
cross-entropies, and generation continues from the decoder start token. Source and target together must
fit in ``max_length`` (the source is truncated first), as for a decoder-only LM.

Evaluation on the held-out split (``evaluate``):

- ``nll``: test-set per-token negative log-likelihood (He et al. 2023, Fig. 7), total target-token loss
  divided by the number of target tokens, over every (input, reference) pair of the evaluated inputs;
- beam-search generations for every distinct input (``dpexp.metrics.generation``), scored against all its
  references (``dpexp.metrics.text``; that module's docstring says how the numbers differ from the official
  E2E and GEM scripts), and by the model-based metrics asked for in ``model_metrics`` (BERTScore, BLEURT:
  ``dpexp.metrics.model_based``, loaded at :meth:`GenerationTask.setup`, before training).

Canaries (``canaries``, a task whose ``canary_fields`` says how a canary's prefix is formatted: E2E): the
secret-sharer test of Carlini et al. (2019) as Li et al. (2022, app. M) run it. Random (prefix, suffix)
pairs (:mod:`dpexp.tasks.canaries`) are appended to the *training* split only, each canary ``r`` times, after
the tokenizer is made (a tokenizer trained on the texts never sees them); the evaluated split is untouched.
Every evaluation then scores each canary's suffix and the candidate suffixes behind its prefix by
log-perplexity and records their exposure (:mod:`dpexp.metrics.exposure`): ``exposure`` and ``exposure_std``
(the skew-normal distribution model, Table 9's estimate) and ``exposure_rank`` (exact rank when the whole
space is enumerated, else the sampled rank), each also per repetition count as ``exposure_r<r>``. The run
record's ``canaries`` lists them (:meth:`GenerationTask.record_fields`).

``eval_max_inputs`` caps the number of distinct inputs evaluated (evenly spaced through the split, so the
subset is deterministic and not just the first tables of a sorted file) to keep offline runs fast.

Data come from the Hugging Face hub by default and from the original release files when ``data_root`` (the
folder holding ``<task name>/``) or ``data_dir`` (the task's own folder) is set. Subclasses say how to read
one split and how to score; the split names are ``train``, ``dev``, ``test`` and, for offline runs that only
have a dev set, ``dev_train`` / ``dev_eval``: a deterministic partition of the dev inputs by a hash of the
linearised source (``dev_eval_fraction`` of them in ``dev_eval``), so no input appears in both parts.
"""

from __future__ import annotations

import hashlib
import logging
from abc import abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from dpexp.metrics import exposure
from dpexp.metrics.generation import beam_search
from dpexp.metrics.model_based import check_model_metrics, load_model_metrics, model_metric_scores
from dpexp.metrics.text import corpus_bleu, rouge
from dpexp.models.base import ModelFactory, TaskInfo
from dpexp.tasks.base import Task
from dpexp.tasks.canaries import CanaryConfig, CanarySet, is_single_token, make_canaries, word_candidates

logger = logging.getLogger(__name__)

IGNORE = -100  # label of positions without loss (source, separator, padding)
DEV_PARTS = ("dev_train", "dev_eval")


@dataclass(frozen=True)
class SourceGroup:
    """One input (linearised table or prompt) with all its human references."""

    source: str
    references: tuple[str, ...]


def group_pairs(pairs: Iterable[tuple[str, str]]) -> list[SourceGroup]:
    """Group (source, reference) pairs by identical source, in order of first appearance."""
    grouped: dict[str, list[str]] = {}
    for source, reference in pairs:
        grouped.setdefault(source, []).append(reference)
    return [SourceGroup(source, tuple(refs)) for source, refs in grouped.items()]


def in_dev_eval_part(source: str, fraction: float) -> bool:
    """Deterministic membership of an input in the ``dev_eval`` part (md5 of the source, 1e-4 resolution)."""
    bucket = int(hashlib.md5(source.encode("utf-8")).hexdigest(), 16) % 10_000
    return bucket < round(fraction * 10_000)


def target_token_losses(logits: torch.Tensor, labels: torch.Tensor, shift: bool = True) -> torch.Tensor:
    """Next-token cross-entropy per position, zero where the label is ``IGNORE``.

    ``logits`` (B, T, V) predict position t+1 from position t; ``labels`` (B, T). Returns (B, T-1), in float32
    or wider.
    ``shift=False`` (an encoder-decoder, whose decoder input is already shifted): position t predicts label
    t; returns (B, T).
    """
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # half precision: in float32
    shifted_logits = logits[:, :-1] if shift else logits
    shifted_labels = labels[:, 1:] if shift else labels
    losses = F.cross_entropy(
        shifted_logits.reshape(-1, shifted_logits.shape[-1]),
        shifted_labels.reshape(-1),
        ignore_index=IGNORE,
        reduction="none",
    )
    return losses.view(shifted_labels.shape)


class TokenizedExamples(Dataset):
    """Tokenised training pairs: ``input_ids`` (source + separator + target + eos) and the prompt length
    (source + separator; for an encoder-decoder: source + eos, the encoder's part)."""

    def __init__(self, input_ids: list[list[int]], prompt_lengths: list[int]) -> None:
        self.input_ids = input_ids
        self.prompt_lengths = prompt_lengths

    def __len__(self) -> int:
        return len(self.input_ids)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"input_ids": self.input_ids[index], "prompt_length": self.prompt_lengths[index]}


class GenerationTask(Task):
    """A (source -> target) text generation task for causal LMs; subclasses read the data and score."""

    name = "generation"
    local_files: ClassVar[dict[str, str]] = {}  # split -> file name inside the task's data folder
    hub_splits: ClassVar[dict[str, str]] = {"train": "train", "dev": "validation", "test": "test"}
    offline_splits: ClassVar[tuple[str, str] | None] = None  # (train, eval) if no local train file
    canary_fields: ClassVar[tuple[str, ...] | None] = None  # fields of a canary's prefix; None: no canaries

    def __init__(
        self,
        *,
        hub_name: str,
        hub_revision: str | None = None,
        data_root: str | None = None,
        data_dir: str | None = None,
        train_split: str | None = None,
        eval_split: str | None = None,
        dev_eval_fraction: float = 0.2,
        max_length: int | None = None,
        on_overflow: Literal["truncate", "error"] = "truncate",
        eval_max_inputs: int | None = None,
        num_beams: int = 5,
        max_new_tokens: int = 100,
        max_eval_batch_size: int = 32,
        lora: dict[str, Any] | None = None,
        canaries: dict[str, Any] | None = None,
        model_metrics: Mapping[str, str] | None = None,
    ) -> None:
        if on_overflow not in ("truncate", "error"):
            raise ValueError(f"on_overflow must be 'truncate' or 'error', got {on_overflow!r}")
        if not 0.0 < dev_eval_fraction < 1.0:
            raise ValueError(f"dev_eval_fraction must be in (0, 1), got {dev_eval_fraction}")
        if eval_max_inputs is not None and eval_max_inputs < 1:
            raise ValueError(f"eval_max_inputs must be a positive integer or null, got {eval_max_inputs}")
        self.hub_name = hub_name
        self.hub_revision = hub_revision
        self.data_dir = Path(data_dir) if data_dir else (Path(data_root) / self.name if data_root else None)
        self.train_split = train_split
        self.eval_split = eval_split
        self.dev_eval_fraction = dev_eval_fraction
        self.max_length = max_length
        self.on_overflow = on_overflow
        self.eval_max_inputs = eval_max_inputs
        self.num_beams = num_beams
        self.max_new_tokens = max_new_tokens
        self.max_eval_batch_size = max_eval_batch_size
        self.lora = dict(lora) if lora else None
        self.model_metrics = check_model_metrics(model_metrics or {}, "task.model_metrics")
        self._model_metrics: dict[str, Any] = {}  # the loaded evaluate modules (setup)
        if canaries is not None and self.canary_fields is None:
            raise ValueError(f"task {self.name} has no canary format; canaries are implemented for task=e2e")
        self.canary_config = CanaryConfig.from_mapping(canaries) if canaries is not None else None
        self.canaries: CanarySet | None = None
        self._info: TaskInfo | None = None
        self._encoder_decoder = False  # set by setup from the factory
        self._tok: Any = None
        self._train: TokenizedExamples | None = None

    # ----- what subclasses provide -----------------------------------------------------------------------

    @abstractmethod
    def read_local(self, path: Path) -> list[tuple[str, str]]:
        """(source, target) pairs of one original release file; raise ValueError naming a bad field."""

    @abstractmethod
    def hub_pairs(self, rows: Iterable[dict[str, Any]]) -> list[tuple[str, str]]:
        """(source, target) pairs from the rows of the hub data set; raise ValueError naming a bad field."""

    def score(self, hypotheses: list[str], references: list[tuple[str, ...]]) -> dict[str, float]:
        """Task metrics of the generations against the grouped references: BLEU and ROUGE-L by default."""
        return {"bleu": corpus_bleu(hypotheses, references), **rouge(hypotheses, references, ("rougeL",))}

    def separator_ids(self, tokenizer: Any) -> list[int]:
        """Token ids between source and target; default the tokenizer's bos (``<|endoftext|>`` for GPT-2)."""
        if tokenizer.bos_token_id is None:
            raise ValueError(
                f"task {self.name} separates source and target by the tokenizer's bos token, "
                f"but {type(tokenizer).__name__} defines none"
            )
        return [tokenizer.bos_token_id]

    # ----- loading ---------------------------------------------------------------------------------------

    def _split_file(self, split: str) -> Path:
        assert self.data_dir is not None
        base = "dev" if split in DEV_PARTS else split
        if base not in self.local_files:
            raise ValueError(
                f"task {self.name} has no split {split!r}; valid: {sorted([*self.local_files, *DEV_PARTS])}"
            )
        return self.data_dir / self.local_files[base]

    def _resolve_splits(self) -> tuple[str, str]:
        train, evaluation = self.train_split, self.eval_split
        if train is None and self.data_dir is not None and not self._split_file("train").exists():
            if self.offline_splits is None:
                raise FileNotFoundError(
                    f"{self._split_file('train')} not found: task {self.name} needs its original training "
                    f"file there (from data_root={self.data_dir.parent} or task.data_dir), or set "
                    "data.root=null to load it from the Hugging Face hub"
                )
            train, fallback_eval = self.offline_splits
            evaluation = evaluation or fallback_eval
            logger.warning(
                "%s: %s has no training file; training on split %r and evaluating on %r (offline setup). "
                "Set task.train_split / task.eval_split to choose explicitly.",
                self.name,
                self.data_dir,
                train,
                evaluation,
            )
        train, evaluation = train or "train", evaluation or "test"
        dev_and_part = "dev" in (train, evaluation) and bool({train, evaluation} & set(DEV_PARTS))
        if train == evaluation or dev_and_part:
            raise ValueError(
                f"train_split={train!r} and eval_split={evaluation!r} overlap: the model would be evaluated "
                "on its training data; use e.g. dev_train with dev_eval, or train with test"
            )
        return train, evaluation

    def _load_pairs(self, split: str) -> list[tuple[str, str]]:
        if self.data_dir is not None:
            path = self._split_file(split)
            if not path.exists():
                raise FileNotFoundError(
                    f"{path} not found: task {self.name} reads split {split!r} from the original release "
                    f"file {path.name}; put it there, choose another split (task.train_split / eval_split), "
                    "or set data.root=null to load from the Hugging Face hub"
                )
            pairs = self.read_local(path)
        else:
            pairs = self._load_hub_pairs("dev" if split in DEV_PARTS else split)
        if split in DEV_PARTS:
            keep_eval = split == "dev_eval"
            pairs = [p for p in pairs if in_dev_eval_part(p[0], self.dev_eval_fraction) == keep_eval]
        if not pairs:
            raise ValueError(f"split {split!r} of task {self.name} is empty")
        return pairs

    def _load_hub_pairs(self, split: str) -> list[tuple[str, str]]:
        if split not in self.hub_splits:
            raise ValueError(
                f"task {self.name} has no split {split!r}; valid: {sorted([*self.hub_splits, *DEV_PARTS])}"
            )
        import datasets  # heavy import, only on the hub path

        rows = datasets.load_dataset(self.hub_name, revision=self.hub_revision, split=self.hub_splits[split])
        return self.hub_pairs(rows)

    # ----- tokenisation ----------------------------------------------------------------------------------

    def _tokenizer(self, factory: ModelFactory, corpus: list[str]) -> Any:
        tokenizer = factory.tokenizer(corpus=corpus)
        if tokenizer is None:
            raise ValueError(
                f"task {self.name} generates text and needs a language model with a tokenizer "
                f"(e.g. model=gpt2_tiny or model=gpt2), but {type(factory).__name__} provides none"
            )
        if tokenizer.eos_token_id is None or tokenizer.pad_token_id is None:
            raise ValueError(
                f"the tokenizer of {type(factory).__name__} needs eos and pad tokens for "
                f"task {self.name}; got eos={tokenizer.eos_token}, pad={tokenizer.pad_token}"
            )
        return tokenizer

    def _encode(self, texts: Sequence[str]) -> list[list[int]]:
        return self._tok(list(texts), add_special_tokens=False)["input_ids"] if texts else []

    def _fit(self, what: str, sources: list[list[int]], targets: list[list[int]], limit: int) -> None:
        """Shorten in place so that ``len(source) + len(sep) + len(target) <= limit`` (source first)."""
        sep = len(self._sep)
        lengths = [len(s) + sep + len(t) for s, t in zip(sources, targets, strict=True)]
        too_long = [i for i, length in enumerate(lengths) if length > limit]
        if not too_long:
            return
        longest = max(lengths)
        message = (
            f"{self.name}: {len(too_long)} {what} sequences exceed {limit} tokens (longest {longest}; "
            f"max_length={self._max_len}, model limit {self._tok.model_max_length})"
        )
        if self.on_overflow == "error":
            raise ValueError(f"{message}; set task.on_overflow=truncate or a larger task.max_length")
        logger.warning("%s; truncating the source first, then the target", message)
        for i in too_long:
            overflow = len(sources[i]) + sep + len(targets[i]) - limit
            cut = min(overflow, len(sources[i]))
            sources[i] = sources[i][: len(sources[i]) - cut]
            if overflow > cut:
                targets[i] = targets[i][: len(targets[i]) - (overflow - cut)]

    def _sources(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of sources; an encoder-decoder's end in eos (its separator is empty)."""
        eos = [self._tok.eos_token_id] if self._encoder_decoder else []
        return [[*ids, *eos] for ids in self._encode(texts)]

    def _tokenize_pairs(self, what: str, pairs: list[tuple[str, str]]) -> TokenizedExamples:
        sources = self._sources([source for source, _ in pairs])
        targets = [[*ids, self._tok.eos_token_id] for ids in self._encode([" " + t for _, t in pairs])]
        self._fit(what, sources, targets, self._max_len)
        return TokenizedExamples(
            [s + self._sep + t for s, t in zip(sources, targets, strict=True)],
            [len(s) + len(self._sep) for s in sources],
        )

    def _select_eval_groups(self, groups: list[SourceGroup]) -> list[SourceGroup]:
        if self.eval_max_inputs is None or self.eval_max_inputs >= len(groups):
            return groups
        k, n = self.eval_max_inputs, len(groups)
        return [groups[(i * n) // k] for i in range(k)]  # evenly spaced, deterministic

    # ----- Task interface --------------------------------------------------------------------------------

    def setup(self, factory: ModelFactory) -> None:
        self._model_metrics = load_model_metrics(self.model_metrics, "task.model_metrics")
        train_split, eval_split = self._resolve_splits()
        train_pairs = self._load_pairs(train_split)
        eval_groups = self._select_eval_groups(group_pairs(self._load_pairs(eval_split)))
        self._tok = self._tokenizer(factory, [text for pair in train_pairs for text in pair])
        if self.canary_config is not None:  # training split only, after the tokenizer is made
            assert self.canary_fields is not None
            words = word_candidates(self._tok, self.canary_config.min_word_length)
            self.canaries = make_canaries(
                self.canary_config,
                list(words),
                self.canary_fields,
                accept=lambda word: is_single_token(self._tok, word, words[word]),
            )
            train_pairs = [*train_pairs, *self.canaries.training_pairs()]
        self._encoder_decoder = factory.encoder_decoder
        self._sep = [] if self._encoder_decoder else self.separator_ids(self._tok)
        model_limit = int(self._tok.model_max_length)
        if self.max_length is not None and self.max_length > model_limit:
            raise ValueError(
                f"task.max_length={self.max_length} exceeds the model's limit of {model_limit} "
                "positions; lower it or pick a model with more positions"
            )
        self._max_len = self.max_length or model_limit
        if self.max_new_tokens + len(self._sep) >= self._max_len:
            raise ValueError(
                f"max_new_tokens={self.max_new_tokens} leaves no room for the source within "
                f"{self._max_len} positions; lower task.max_new_tokens"
            )
        self._train = self._tokenize_pairs(f"{train_split} (training)", train_pairs)
        eval_pairs = [(g.source, ref) for g in eval_groups for ref in g.references]
        self._eval_pairs = self._tokenize_pairs(f"{eval_split} (nll)", eval_pairs)
        prompts = self._sources([g.source for g in eval_groups])
        prompt_limit = self._max_len - self.max_new_tokens
        self._fit(f"{eval_split} (prompt)", prompts, [[] for _ in prompts], prompt_limit)
        self._eval_prompts = [p + self._sep for p in prompts]
        self._eval_references = [g.references for g in eval_groups]
        if self.canaries is not None:
            self._canary_examples = [
                self._tokenize_pairs(
                    "canary", [(c.prefix, c.suffix)] + [(c.prefix, s) for s in self.canaries.candidates]
                )
                for c in self.canaries.canaries
            ]
            self._check_canary_tokens()
        longest = max(
            max(map(len, self._train.input_ids)),
            max(map(len, self._eval_pairs.input_ids)),
            max(map(len, self._eval_prompts)) + self.max_new_tokens,
        )
        self._info = TaskInfo(
            self.name,
            "generation",
            vocab_size=len(self._tok),
            pad_token_id=self._tok.pad_token_id,
            eos_token_id=self._tok.eos_token_id,
            max_length=longest,
            lora=self.lora,
        )
        logger.info(
            "%s: %d training pairs (%s%s), %d evaluation inputs with %d references (%s)",
            self.name,
            len(self._train),
            train_split,
            f", {len(self.canaries.training_pairs())} of them canary copies" if self.canaries else "",
            len(eval_groups),
            len(eval_pairs),
            eval_split,
        )

    def _check_canary_tokens(self) -> None:
        """Every canary sequence has the suffix's words as its target tokens, one token a word."""
        assert self.canaries is not None
        expected = self.canaries.config.suffix_length + 1  # the words and eos
        for examples in self._canary_examples:
            for ids, prompt in zip(examples.input_ids, examples.prompt_lengths, strict=True):
                if len(ids) - prompt != expected:
                    raise ValueError(
                        f"a canary suffix encodes to {len(ids) - prompt - 1} tokens, not "
                        f"{expected - 1} (one per word): {self._tok.decode(ids[prompt:])!r}"
                    )

    def record_fields(self) -> dict[str, Any]:
        """The run record's ``canaries`` (config, sub-vocabulary, each canary and its copies), if any."""
        if self.canaries is None:
            return {}
        self._require_setup()
        return {"canaries": self.canaries.record()}

    def _require_setup(self) -> None:
        if self._info is None:
            raise RuntimeError(f"call setup(factory) on task {self.name} first")

    @property
    def info(self) -> TaskInfo:
        self._require_setup()
        return self._info

    @property
    def train_dataset(self) -> TokenizedExamples:
        self._require_setup()
        return self._train

    @property
    def tokenizer(self) -> Any:
        self._require_setup()
        return self._tok

    def example_length(self, example: dict[str, Any]) -> int:
        return len(example["input_ids"])

    def collate(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        """Right-pad to the longest example: ``input_ids``, ``attention_mask``, ``labels``, each (B, T); for
        an encoder-decoder the sources (B, S) and the target labels (B, T)."""
        self._require_setup()
        if self._encoder_decoder:
            return self._collate_encoder_decoder(examples)
        width = max(len(e["input_ids"]) for e in examples)
        input_ids = torch.full((len(examples), width), self._tok.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(examples), width), dtype=torch.long)
        labels = torch.full((len(examples), width), IGNORE, dtype=torch.long)
        for row, example in enumerate(examples):
            ids = torch.tensor(example["input_ids"], dtype=torch.long)
            input_ids[row, : len(ids)] = ids
            attention_mask[row, : len(ids)] = 1
            labels[row, example["prompt_length"] : len(ids)] = ids[example["prompt_length"] :]
        return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}

    def _collate_encoder_decoder(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        sources = [e["input_ids"][: e["prompt_length"]] for e in examples]
        targets = [e["input_ids"][e["prompt_length"] :] for e in examples]
        input_ids = torch.full((len(examples), max(map(len, sources))), self._tok.pad_token_id)
        attention_mask = torch.zeros_like(input_ids)
        labels = torch.full((len(examples), max(map(len, targets))), IGNORE)
        for row, (source, target) in enumerate(zip(sources, targets, strict=True)):
            input_ids[row, : len(source)] = torch.tensor(source)
            attention_mask[row, : len(source)] = 1
            labels[row, : len(target)] = torch.tensor(target)
        return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}

    def per_example_loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Sum of the target tokens' cross-entropy per example, shape (B,) (Li et al. 2022).

        No ``position_ids`` are passed: the model derives them (broadcast over the batch), which the privacy
        engine handles. An encoder-decoder gets its decoder input from the labels
        (``prepare_decoder_input_ids_from_labels``: shifted right behind the start token, -100 as padding).
        """
        return self._token_losses(model, batch)[0].sum(dim=1)

    def _token_losses(
        self, model: nn.Module, batch: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-position target losses and their labels, aligned (both (B, T'); IGNORE where no loss)."""
        if self._encoder_decoder:
            decoder_input_ids = model.prepare_decoder_input_ids_from_labels(labels=batch["labels"])
            output = model(
                input_ids=batch["input_ids"],
                attention_mask=batch["attention_mask"],
                decoder_input_ids=decoder_input_ids,
                use_cache=False,
            )
            return target_token_losses(output.logits, batch["labels"], shift=False), batch["labels"]
        output = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False)
        return target_token_losses(output.logits, batch["labels"]), batch["labels"][:, 1:]

    def _scored_positions(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """Target log-perplexities of a decoder-only batch with the output head applied only from the first
        target position on (Hugging Face's ``logits_to_keep``: the head over the whole vocabulary dominates a
        small model's forward, and a canary's prompt is most of its sequence); None where the model does
        not take ``logits_to_keep``. The model is called whole, so the privacy engine's hooks see an
        ordinary forward."""
        if self._encoder_decoder:
            return None
        labels = batch["labels"]
        width = labels.shape[1]
        first = int((labels != IGNORE).int().argmax(dim=1).min())  # earliest target position of the batch
        keep = width - first + 1  # logits from the position predicting it to the last
        try:
            output = model(
                input_ids=batch["input_ids"],
                attention_mask=batch["attention_mask"],
                use_cache=False,
                logits_to_keep=keep,
            )
        except TypeError:  # a model without logits_to_keep
            return None
        if output.logits.shape[1] != keep:
            return None
        window = labels[:, width - keep :]
        losses = target_token_losses(output.logits, window)
        scored = window[:, 1:]
        return (losses * ((scored != IGNORE) & (scored != self._tok.eos_token_id))).sum(dim=1)

    @torch.no_grad()
    def log_perplexities(self, model: nn.Module, examples: TokenizedExamples, batch_size: int) -> np.ndarray:
        """Each example's target log-perplexity ``-sum log p(token | prefix)`` (nats) over its target tokens,
        the final eos excluded (Carlini et al. 2019's ``Px`` of the secret); the model in eval mode. A
        decoder-only model is scored with its head on the target positions only (:meth:`_scored_positions`),
        once checked on the first batch against the full forward (else the full forward throughout)."""
        device = next(model.parameters()).device
        eos = self._tok.eos_token_id
        fast: bool | None = None
        out = []
        for start in range(0, len(examples), batch_size):
            batch = self.collate([examples[i] for i in range(start, min(start + batch_size, len(examples)))])
            batch = {k: v.to(device) for k, v in batch.items()}
            values = self._scored_positions(model, batch) if fast is not False else None
            if fast is None or values is None:
                losses, labels = self._token_losses(model, batch)
                full = (losses * ((labels != IGNORE) & (labels != eos))).sum(dim=1)
                fast = values is not None and torch.allclose(values, full, rtol=1e-4, atol=1e-3)
                values = full
            out.append(values.double().cpu())
        return torch.cat(out).numpy()

    def canary_metrics(self, model: nn.Module, batch_size: int) -> dict[str, float]:
        """Exposure of every canary against its candidates (:mod:`dpexp.metrics.exposure`): ``exposure``
        (skew-normal distribution model, Li et al. 2022's Table 9) and ``exposure_rank`` (exact rank if the
        whole space is enumerated, else the sampled rank), mean and std over the canaries of each
        repetition count (``_r<r>``) and over all; ``{}`` without canaries."""
        if self.canaries is None:
            return {}
        exact = self.canaries.config.exact
        model_based: dict[int, list[float]] = {}
        by_rank: dict[int, list[float]] = {}
        for canary, examples in zip(self.canaries.canaries, self._canary_examples, strict=True):
            values = self.log_perplexities(model, examples, batch_size)
            secret, others = float(values[0]), values[1:]
            if exact:  # R enumerated: drop the canary's own suffix from the others
                others = np.delete(others, self.canaries.candidates.index(canary.suffix))
                ranked = exposure.rank_exposure(secret, others)
            else:
                ranked = exposure.sampled_exposure(secret, others)
            model_based.setdefault(canary.repetitions, []).append(exposure.skewnorm_exposure(secret, others))
            by_rank.setdefault(canary.repetitions, []).append(ranked)
        return {
            **exposure.exposure_summary(model_based, "exposure"),
            **exposure.exposure_summary(by_rank, "exposure_rank"),
        }

    @torch.no_grad()
    def _nll(self, model: nn.Module, batch_size: int) -> float:
        device = next(model.parameters()).device
        total, count = 0.0, 0
        n = len(self._eval_pairs)
        for start in range(0, n, batch_size):
            batch = self.collate([self._eval_pairs[i] for i in range(start, min(start + batch_size, n))])
            batch = {k: v.to(device) for k, v in batch.items()}
            total += float(self.per_example_loss(model, batch).sum())
            labels = batch["labels"] if self._encoder_decoder else batch["labels"][:, 1:]
            count += int((labels != IGNORE).sum())
        return total / count

    def evaluate(self, model: nn.Module, batch_size: int) -> dict[str, float]:
        """Test-set per-token NLL, the canaries' exposure if the task has canaries
        (:meth:`canary_metrics`), then beam-search generations scored by :meth:`score`.

        Batches hold ``min(batch_size, max_eval_batch_size)`` inputs: a GPT-2 forward over 512 sequences
        would materialise (512, T, 50257) logits.
        """
        self._require_setup()
        batch_size = min(batch_size, self.max_eval_batch_size)
        was_training = model.training
        model.eval()
        try:
            nll = self._nll(model, batch_size)
            canaries = self.canary_metrics(model, batch_size)
        finally:
            model.train(was_training)
        generated = beam_search(
            model,
            self._eval_prompts,
            pad_token_id=self._tok.pad_token_id,
            eos_token_id=self._tok.eos_token_id,
            num_beams=self.num_beams,
            max_new_tokens=self.max_new_tokens,
            batch_size=batch_size,
        )
        hypotheses = [self._tok.decode(ids, skip_special_tokens=True).strip() for ids in generated]
        for hypothesis, refs in list(zip(hypotheses, self._eval_references, strict=True))[:2]:
            logger.info("%s sample: %r (reference: %r)", self.name, hypothesis, refs[0])
        references = list(self._eval_references)
        metrics = {
            **self.score(hypotheses, references),
            **model_metric_scores(self._model_metrics, hypotheses, references),
        }
        return {**metrics, "nll": nll, "eval_inputs": float(len(hypotheses)), **canaries}
