"""Canaries for the secret-sharer memorisation test (Carlini et al. 2019) on a table-to-text task, as Li et
al. 2022 (app. M, Table 9) build them on E2E.

Li et al.: "we first form a subvocabulary by randomly sampling V = 10 words in the original vocabulary of
GPT-2. Our canaries have prefixes of the form ``name : <word> | Type : <word> | area : <word>``, where
<word> is randomly sampled from the subvocabulary. The suffix which our model should learn to predict
consists of randomly sampled words with an average length of l = 5 [...] canary-corrupted datasets for
repetition values r in {1, 10, 100}."

Our reading, stated where the paper is silent:

- words are whole-word tokens of the run's own tokenizer (GPT-2's BPE at scale=paper; offline, gpt2_tiny's
  fixed public WordPiece vocabulary, which never saw the private data): tokens whose text is an ASCII
  alphabetic word of at least ``min_word_length`` letters that encodes back to that single token after a space
  (:func:`word_candidates`, :func:`is_single_token`); the sub-vocabulary is ``vocab_size`` of them drawn
  without replacement;
- a canary is one E2E-format training pair: the prefix is the source (the linearised meaning
  representation, ``<field> : <word>`` joined by ``" | "``), the suffix the target (the "reference"), so the
  loss, as for every pair, is on the suffix only. Prefix and suffix words are drawn uniformly with
  replacement; prefixes are distinct across canaries (each canary is scored against candidates behind its
  own prefix);
- the suffix has exactly ``suffix_length`` words (the paper's "average length l = 5" leaves the length
  distribution open; a fixed length makes the candidate space ``R`` the ``V^l`` suffixes of that length);
- ``count`` canaries per repetition value; with several values in one run each value gets its own
  ``count`` canaries (in the order given), each inserted ``r`` times. Runs that differ only in ``repetitions``
  (one value each) insert the same first ``count`` canaries, so the columns of Table 9 compare the same
  secrets;
- candidates: ``candidates`` suffixes drawn uniformly from ``R`` (with replacement, the same sample for every
  canary, behind each canary's own prefix), or, when ``V^l <= exact_up_to``, all of ``R`` (exact rank).

Everything is a function of ``seed`` and the tokenizer's vocabulary: the same config inserts the same
canaries.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

import numpy as np

WORD_MARKERS = ("Ġ", "▁")  # byte-level BPE's and SentencePiece's "a space before this token"


@dataclass(frozen=True)
class CanaryConfig:
    """``task.canaries`` (conf/task/e2e.yaml documents every key)."""

    count: int = 10
    repetitions: tuple[int, ...] = (1,)
    vocab_size: int = 10
    suffix_length: int = 5
    candidates: int = 1000
    exact_up_to: int = 0
    min_word_length: int = 3
    seed: int = 0

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> CanaryConfig:
        """From the config node; a ValueError naming an unknown key or an invalid value."""
        valid = [f.name for f in fields(cls)]
        unknown = sorted(set(values) - set(valid))
        if unknown:
            raise ValueError(f"canaries: unknown keys {unknown}; valid keys: {', '.join(valid)}")
        settings = dict(values)
        repetitions = settings.get("repetitions", cls.repetitions)
        if isinstance(repetitions, int | str):
            repetitions = [repetitions]
        settings["repetitions"] = tuple(int(r) for r in repetitions)
        config = cls(**{k: (v if k == "repetitions" else int(v)) for k, v in settings.items()})
        config.check()
        return config

    def check(self) -> None:
        positive = {
            "count": self.count,
            "vocab_size": self.vocab_size,
            "suffix_length": self.suffix_length,
            "min_word_length": self.min_word_length,
        }
        for key, value in positive.items():
            if value < 1:
                raise ValueError(f"canaries.{key} must be a positive integer, got {value}")
        if self.candidates < 3:
            raise ValueError(f"canaries.candidates must be >= 3 (a skew-normal fit), got {self.candidates}")
        if self.exact_up_to < 0:
            raise ValueError(f"canaries.exact_up_to must be >= 0 (0: never), got {self.exact_up_to}")
        if not self.repetitions or any(r < 1 for r in self.repetitions):
            raise ValueError(f"canaries.repetitions must be positive integers, got {list(self.repetitions)}")
        if len(set(self.repetitions)) != len(self.repetitions):
            raise ValueError(f"canaries.repetitions repeats a value: {list(self.repetitions)}")

    @property
    def space_size(self) -> int:
        """``|R| = V^l``, the number of possible suffixes."""
        return self.vocab_size**self.suffix_length

    @property
    def exact(self) -> bool:
        """Whether the whole candidate space is enumerated (exact rank)."""
        return self.space_size <= self.exact_up_to


@dataclass(frozen=True)
class Canary:
    """One canary: its prefix (the pair's source), secret suffix (target) and copies in the training set."""

    prefix: str
    suffix: str
    repetitions: int


@dataclass(frozen=True)
class CanarySet:
    """The canaries of a run, their sub-vocabulary and the candidate suffixes they are scored against."""

    config: CanaryConfig
    words: tuple[str, ...]
    canaries: tuple[Canary, ...]
    candidates: tuple[str, ...]  # sampled suffixes, or every suffix of R when config.exact

    def training_pairs(self) -> list[tuple[str, str]]:
        """Every copy of every canary as a (source, target) training pair, canary by canary."""
        return [(c.prefix, c.suffix) for c in self.canaries for _ in range(c.repetitions)]

    def record(self) -> dict[str, Any]:
        """What the run record keeps: the config, the sub-vocabulary, every canary with its copies."""
        return {
            "config": {**asdict(self.config), "repetitions": list(self.config.repetitions)},
            "sub_vocabulary": list(self.words),
            "space_size": self.config.space_size,
            "max_exposure": math.log2(self.config.space_size),
            "rank": "exact" if self.config.exact else "sampled",
            "candidates": len(self.candidates),
            "inserted": [
                {"prefix": c.prefix, "suffix": c.suffix, "copies": c.repetitions} for c in self.canaries
            ],
            "copies": sum(c.repetitions for c in self.canaries),
        }


def word_candidates(tokenizer: Any, min_length: int = 3) -> dict[str, int]:
    """Tokens of ``tokenizer`` that look like whole words, word -> token id: ASCII alphabetic words of
    ``min_length`` letters or more once a leading word marker (``Ġ`` of byte-level BPE, ``▁`` of
    SentencePiece) is removed; WordPiece's continuation pieces (``##ing``) are not alphabetic. Whether a
    candidate really is its own token after a space is :func:`is_single_token`'s question (asked only of the
    words drawn: encoding a whole vocabulary takes seconds)."""
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    out: dict[str, int] = {}
    for token, index in sorted(tokenizer.get_vocab().items(), key=lambda item: item[1]):
        word = token[1:] if token[:1] in WORD_MARKERS else token
        if index not in special and word.isascii() and word.isalpha() and len(word) >= min_length:
            out.setdefault(word, index)
    return out


def is_single_token(tokenizer: Any, word: str, index: int) -> bool:
    """Whether ``" " + word`` encodes to exactly the token ``index`` (so a canary has one token a word)."""
    return tokenizer(" " + word, add_special_tokens=False)["input_ids"] == [index]


def whole_words(tokenizer: Any, min_length: int = 3) -> list[str]:
    """Every whole-word token of ``tokenizer`` (:func:`word_candidates` that pass :func:`is_single_token`),
    sorted; slow on a large vocabulary (one encoding a token)."""
    candidates = word_candidates(tokenizer, min_length)
    return sorted(w for w, i in candidates.items() if is_single_token(tokenizer, w, i))


def e2e_prefix(fields_: Sequence[str], words: Sequence[str]) -> str:
    """``name : w1 | Type : w2 | area : w3``: a linearised E2E meaning representation (Li & Liang 2021)."""
    return " | ".join(f"{field} : {word}" for field, word in zip(fields_, words, strict=True))


def make_canaries(
    config: CanaryConfig,
    vocabulary: Sequence[str],
    fields_: Sequence[str],
    accept: Callable[[str], bool] | None = None,
) -> CanarySet:
    """Draw the sub-vocabulary from ``vocabulary`` (candidate words, in a random order from ``config.seed``,
    the first ``vocab_size`` that ``accept`` takes: e.g. :func:`is_single_token`), then the canaries and the
    candidate suffixes, all from ``config.seed``."""
    vocabulary = sorted(set(vocabulary))
    rng = np.random.default_rng(config.seed)
    chosen: list[str] = []
    for index in rng.permutation(len(vocabulary)):
        if len(chosen) == config.vocab_size:
            break
        if accept is None or accept(vocabulary[index]):
            chosen.append(str(vocabulary[index]))
    if len(chosen) < config.vocab_size:
        raise ValueError(
            f"canaries.vocab_size={config.vocab_size} but the tokenizer has only {len(chosen)} whole-word "
            f"tokens of {config.min_word_length}+ letters"
        )
    words = tuple(chosen)
    total = config.count * len(config.repetitions)
    if total > config.vocab_size ** len(fields_):
        raise ValueError(
            f"{total} canaries need distinct prefixes, but V^{len(fields_)} = "
            f"{config.vocab_size ** len(fields_)}; lower canaries.count or raise canaries.vocab_size"
        )
    canaries, prefixes = [], set()
    for index in range(total):
        while True:
            drawn = rng.integers(config.vocab_size, size=len(fields_))
            prefix = e2e_prefix(fields_, [words[i] for i in drawn])
            if prefix not in prefixes:
                break
        prefixes.add(prefix)
        suffix = " ".join(words[i] for i in rng.integers(config.vocab_size, size=config.suffix_length))
        canaries.append(Canary(prefix, suffix, config.repetitions[index // config.count]))
    if config.exact:
        candidates = tuple(" ".join(p) for p in itertools.product(words, repeat=config.suffix_length))
    else:
        draws = np.random.default_rng([config.seed, 1]).integers(  # apart: the same for any count
            config.vocab_size, size=(config.candidates, config.suffix_length)
        )
        candidates = tuple(" ".join(words[i] for i in row) for row in draws)
    return CanarySet(config, words, tuple(canaries), candidates)
