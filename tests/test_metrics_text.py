"""BLEU (sacrebleu) and ROUGE (rouge-score) against grouped references, versus hand-computed values."""

import math

import pytest

from dpexp.metrics.text import corpus_bleu, rouge


def test_identical_hypotheses_score_100() -> None:
    hyps = ["The Mill is a pub near the river .", "Aromi serves Italian food ."]
    refs = [(hyps[0],), (hyps[1], "Italian food is served at Aromi .")]
    assert corpus_bleu(hyps, refs) == pytest.approx(100.0)
    assert rouge(hyps, refs, ("rouge1", "rouge2", "rougeL")) == pytest.approx(
        {"rouge1": 100.0, "rouge2": 100.0, "rougeL": 100.0}
    )


def test_bleu_matches_hand_computed_value() -> None:
    # hypothesis vs reference: 1-gram 5/6, 2-gram 3/5, 3-gram 2/4, 4-gram 1/3 matches; equal lengths, BP = 1.
    expected = 100 * math.exp(sum(math.log(p) for p in (5 / 6, 3 / 5, 2 / 4, 1 / 3)) / 4)
    assert corpus_bleu(["the cat sat on the mat"], [("the cat sat on a mat",)]) == pytest.approx(
        expected, abs=1e-9
    )


def test_bleu_uses_each_inputs_own_references() -> None:
    # Each hypothesis equals one of its own references: every n-gram matches, closest length equal -> 100.
    hyps = ["a small pub by the river", "an italian place in the centre"]
    refs = [("a quiet place", "a small pub by the river"), ("an italian place in the centre",)]
    assert corpus_bleu(hyps, refs) == pytest.approx(100.0)
    # Swapping the groups scores each hypothesis against the other input's references: no longer perfect.
    assert corpus_bleu(hyps, [refs[1], refs[0]]) < 50.0


def test_rouge_l_hand_computed_and_best_reference() -> None:
    # LCS("the cat sat", "the cat was sitting") = 2: P = 2/3, R = 2/4, F = 4/7.
    assert rouge(["the cat sat"], [("the cat was sitting",)])["rougeL"] == pytest.approx(100 * 4 / 7)
    # With several references the best one counts.
    assert rouge(["the cat sat"], [("the cat was sitting", "the cat sat")])["rougeL"] == pytest.approx(100.0)


def test_rouge_1_and_2_hand_computed_and_averaged() -> None:
    scores = rouge(
        ["alpha beta gamma delta", "alpha beta"],
        [("alpha beta omega delta",), ("alpha beta",)],
        ("rouge1", "rouge2"),
    )
    # first pair: unigrams 3/4 (P = R), bigrams 1/3; second pair: perfect; then the mean over inputs.
    assert scores["rouge1"] == pytest.approx(100 * (3 / 4 + 1) / 2)
    assert scores["rouge2"] == pytest.approx(100 * (1 / 3 + 1) / 2)


@pytest.mark.parametrize(
    ("hyps", "refs", "message"),
    [
        (["a", "b"], [("a",)], "2 hypotheses but 1"),
        (["a"], ["a"], "non-empty list of strings"),
        (["a"], [()], "non-empty list of strings"),
        ([], [], "empty"),
    ],
)
def test_errors_are_clear(hyps: list, refs: list, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        corpus_bleu(hyps, refs)
    with pytest.raises(ValueError, match=message):
        rouge(hyps, refs)
