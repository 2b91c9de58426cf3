"""Tokenisation of sentence(-pair) examples, plain or in an infilling template, with explicit truncation.

Two input formats, both built from the same pieces with the tokenizer's own special tokens:

* classification (Devlin et al. 2019): ``[CLS] s1 [SEP] (s2 [SEP])``, RoBERTa ``<s> s1 </s></s> s2 </s>``;
* text infilling (Li et al. 2022, sec. 3.2; templates of Gao et al. 2020): one sequence such as
  ``[CLS] s1 It was [MASK] . [SEP]``; the model scores label words at the mask position.

Sentences are cut longest-first until the whole input fits ``max_length`` tokens; template words, the mask and
special tokens are never cut. ``truncation="warn"`` cuts with one warning giving the count; ``"error"``
raises instead.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from tokenizers import Encoding, Tokenizer

TRUNCATION_MODES: tuple[str, ...] = ("warn", "error")
_PLACEHOLDER = re.compile(r"(\{s1\}|\{s2\}|\{mask\})")

Example = dict[str, Any]


@dataclass(frozen=True)
class Template:
    """An infilling template like ``"{s1} It was {mask} ."``: text, ``{s1}``/``{s2}`` and one ``{mask}``."""

    pieces: tuple[str, ...]

    @classmethod
    def parse(cls, text: str, num_sentences: int) -> Template:
        """Split ``text`` at its placeholders; each of the task's sentences and ``{mask}`` must occur once."""
        pieces = tuple(piece for piece in _PLACEHOLDER.split(text) if piece.strip())
        expected = ["{mask}"] + [f"{{s{k + 1}}}" for k in range(num_sentences)]
        counts = {slot: pieces.count(slot) for slot in ("{s1}", "{s2}", "{mask}")}
        if any(counts[slot] != 1 for slot in expected) or sum(counts.values()) != len(expected):
            raise ValueError(
                f"Template {text!r} must contain {', '.join(expected)} exactly once each "
                f"(a {num_sentences}-sentence task), e.g. '{{s1}} It was {{mask}} .'."
            )
        return cls(pieces)

    def prompt(self, word: str) -> str:
        """The template without its sentences, ``{mask}`` filled with ``word`` (``"It was great ."``): a
        public description of the label ``word`` stands for, whitespace collapsed."""
        sentences = ("{s1}", "{s2}")
        kept = (word if piece == "{mask}" else piece for piece in self.pieces if piece not in sentences)
        return " ".join(" ".join(kept).split())


def plain_tokenizer(tokenizer: Any) -> Tokenizer:
    """A copy of the tokenizer's Rust ``tokenizers`` backend with padding and truncation switched off."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise TypeError(
            f"{type(tokenizer).__name__} has no fast (Rust `tokenizers`) backend; text tasks need one."
        )
    plain = Tokenizer.from_str(backend.to_str())
    plain.no_padding()
    plain.no_truncation()
    return plain


def single_token_id(backend: Tokenizer, word: str) -> int:
    """Id of ``word`` as it appears after a space (e.g. RoBERTa's "Ġgreat"); it must be one token."""
    ids = backend.encode(" " + word.strip(), add_special_tokens=False).ids
    if len(ids) != 1:
        raise ValueError(
            f"Label word {word!r} is {len(ids)} tokens for this tokenizer; infilling scores one token at the "
            "mask, so choose single-token label words (task.label_words)."
        )
    return ids[0]


def _fit_longest_first(lengths: list[int], budget: int) -> list[int]:
    """Shorten the longest entry one token at a time until ``sum(lengths) <= budget``."""
    lengths = list(lengths)
    while sum(lengths) > budget:
        longest = max(range(len(lengths)), key=lengths.__getitem__)
        lengths[longest] -= 1
    return lengths


def encode_examples(
    tokenizer: Any,
    sentences: Sequence[Sequence[str]],
    max_length: int,
    truncation: str,
    template: Template | None = None,
    what: str = "examples",
) -> list[Example]:
    """Encode example i from ``sentences[k][i]`` (k = 0, or 0 and 1 for pairs) into token ids.

    Returns one dict per example with ``input_ids``, ``token_type_ids`` (only if the tokenizer's model takes
    them) and, with a template, ``mask_position`` (index of the mask token). ``what`` names the data in
    messages.
    """
    if truncation not in TRUNCATION_MODES:
        raise ValueError(f"Unknown truncation {truncation!r}; valid choices: {', '.join(TRUNCATION_MODES)}.")
    backend = plain_tokenizer(tokenizer)
    columns = [list(column) for column in sentences]
    if template is None:
        encoded = [backend.encode_batch_fast(column, add_special_tokens=False) for column in columns]
        fixed: dict[int, Encoding] = {}
        special = backend.num_special_tokens_to_add(len(columns) == 2)
    else:
        encoded, fixed = _encode_template_pieces(backend, tokenizer, template, columns)
        special = backend.num_special_tokens_to_add(False)
    budget = max_length - special - sum(len(enc.ids) for enc in fixed.values())
    if budget < len(columns):
        raise ValueError(
            f"max_length={max_length} leaves no room for the sentences after {special} special tokens"
            + (" and the template words" if fixed else "")
            + "; raise task.max_length."
        )
    lengths = [[len(column[i].ids) for column in encoded] for i in range(len(columns[0]))]
    too_long = [sum(lens) for lens in lengths if sum(lens) > budget]
    if too_long:
        message = (
            f"{len(too_long)} of {len(lengths)} {what} are longer than max_length={max_length} tokens "
            f"(longest {max(too_long) + max_length - budget})"
        )
        if truncation == "error":
            raise ValueError(f"{message}; raise task.max_length or set task.truncation=warn to cut them.")
        warnings.warn(
            f"{message}; their sentences are cut longest-first (task.truncation=warn).", stacklevel=2
        )
    wants_type_ids = "token_type_ids" in getattr(tokenizer, "model_input_names", ())
    content_start = _content_start(backend)
    examples = []
    for i, lens in enumerate(lengths):
        parts = [column[i] for column in encoded]
        if sum(lens) > budget:
            for part, length in zip(parts, _fit_longest_first(lens, budget), strict=True):
                part.truncate(length)
        example: Example = {}
        if template is None:
            final = backend.post_process(
                parts[0], parts[1] if len(parts) == 2 else None, add_special_tokens=True
            )
        else:
            pieces = [
                parts[int(piece[2]) - 1] if piece in ("{s1}", "{s2}") else fixed[position]
                for position, piece in enumerate(template.pieces)
            ]
            mask_offset = sum(len(p.ids) for p in pieces[: template.pieces.index("{mask}")])
            final = backend.post_process(
                Encoding.merge(pieces, growing_offsets=True), None, add_special_tokens=True
            )
            example["mask_position"] = content_start + mask_offset
        example["input_ids"] = final.ids
        if wants_type_ids:
            example["token_type_ids"] = final.type_ids
        examples.append(example)
    return examples


def _encode_template_pieces(
    backend: Tokenizer, tokenizer: Any, template: Template, columns: list[list[str]]
) -> tuple[list[list[Encoding]], dict[int, Encoding]]:
    """Encodings of the sentences (per column) and of the fixed pieces (literal words and the mask), the
    latter keyed by their position in the template.

    Every piece but the first is preceded by a space, so that byte-level BPE (RoBERTa) sees word starts.
    """
    encoded: list[list[Encoding]] = [[] for _ in columns]
    fixed: dict[int, Encoding] = {}
    for position, piece in enumerate(template.pieces):
        space = " " if position else ""
        if piece in ("{s1}", "{s2}"):
            column = int(piece[2]) - 1
            encoded[column] = backend.encode_batch_fast(
                [space + text.strip() for text in columns[column]], add_special_tokens=False
            )
        elif piece == "{mask}":
            mask = backend.encode(tokenizer.mask_token or "", add_special_tokens=False)
            if tokenizer.mask_token is None or mask.ids != [tokenizer.mask_token_id]:
                raise ValueError(
                    f"{type(tokenizer).__name__} has no single mask token; infilling needs a masked LM."
                )
            fixed[position] = mask
        else:
            fixed[position] = backend.encode(space + piece.strip(), add_special_tokens=False)
    return encoded, fixed


def _content_start(backend: Tokenizer) -> int:
    """Number of special tokens the tokenizer puts before a single sequence (1 for [CLS] or <s>)."""
    probe = backend.encode("a", add_special_tokens=False)
    wrapped = backend.post_process(probe, None, add_special_tokens=True)
    return wrapped.ids.index(probe.ids[0])


def collate_encoded(examples: Sequence[Example], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-pad encoded examples into a batch: ``input_ids``/``attention_mask`` (B, T) plus the other fields.

    ``token_type_ids`` (B, T) are padded with 0; scalar fields (``label``, ``mask_position``) become (B,).
    """
    length = max(len(example["input_ids"]) for example in examples)
    batch = {
        "input_ids": torch.full((len(examples), length), pad_token_id, dtype=torch.long),
        "attention_mask": torch.zeros(len(examples), length, dtype=torch.long),
    }
    if "token_type_ids" in examples[0]:
        batch["token_type_ids"] = torch.zeros(len(examples), length, dtype=torch.long)
    for row, example in enumerate(examples):
        size = len(example["input_ids"])
        batch["input_ids"][row, :size] = torch.tensor(example["input_ids"])
        batch["attention_mask"][row, :size] = 1
        if "token_type_ids" in batch:
            batch["token_type_ids"][row, :size] = torch.tensor(example["token_type_ids"])
    for key in ("label", "mask_position"):
        if key in examples[0]:
            batch[key] = torch.tensor([example[key] for example in examples], dtype=torch.long)
    return batch
