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


# ---------------------------------------------------------------------------------------------- E2E metrics
E2E_HYPOTHESES = ["The Mill is a pub near the river.", "there is a cheap family restaurant in the centre"]
E2E_REFERENCES = [
    ["The Mill is a pub by the river.", "The Mill pub is near the river."],
    ["A cheap family restaurant is in the city centre.", "There is a cheap restaurant for families."],
]


@pytest.fixture(scope="module")
def e2e_scores() -> dict[str, float]:
    """e2e_metrics of the hypotheses above, computed once (its tests run in one shard: shard_together): each
    METEOR call starts a JVM (about 7 s)."""
    from dpexp.metrics.text import e2e_metrics

    return e2e_metrics(E2E_HYPOTHESES, E2E_REFERENCES)


@pytest.mark.shard_together("e2e_scores")
def test_e2e_metrics_has_the_five_columns_on_their_scales(e2e_scores: dict[str, float]):
    from dpexp.metrics.text import E2E_METRICS, java_available

    scores = e2e_scores
    want = E2E_METRICS if java_available() else tuple(m for m in E2E_METRICS if m != "meteor")
    assert tuple(scores) == want
    assert 0 < scores["bleu"] < 100 and 0 < scores["rougeL"] < 100
    assert scores["nist"] > 0 and scores["cider"] > 0
    if "meteor" in scores:
        assert 0 < scores["meteor"] < 1


@pytest.mark.shard_together("e2e_scores")
def test_e2e_metrics_score_a_copy_of_any_reference_as_perfect(e2e_scores: dict[str, float]):
    """Each hypothesis is scored against all of its references: copying the second one is perfect."""
    from dpexp.metrics.text import e2e_metrics

    copies = [refs[1] for refs in E2E_REFERENCES]
    scores = e2e_metrics(copies, E2E_REFERENCES)
    assert scores["bleu"] == pytest.approx(100.0) and scores["rougeL"] == pytest.approx(100.0)
    if "meteor" in scores:
        assert scores["meteor"] > 0.99
    assert all(e2e_scores[name] < scores[name] for name in e2e_scores)


def test_nist_rewards_informative_ngrams_and_matches_nltk():
    from nltk.translate.nist_score import corpus_nist

    from dpexp.metrics.text import nist

    refs = [["the cat sat on the mat", "a cat was sitting on the mat"]]
    assert nist(["the cat sat on the mat"], refs) > nist(["the the the the the the"], refs)
    tokens = [[r.split() for r in refs[0]]]
    assert nist(["The cat sat on the mat"], refs) == pytest.approx(corpus_nist(tokens, [tokens[0][0]], n=5))


def test_meteor_is_left_out_without_java_and_says_so(monkeypatch, caplog):
    from dpexp.metrics import text

    monkeypatch.setattr(text.shutil, "which", lambda name: None)
    with caplog.at_level("WARNING", logger=text.__name__):
        assert "meteor" not in text.e2e_metrics(E2E_HYPOTHESES, E2E_REFERENCES)
        assert "meteor" not in text.dart_metrics(E2E_HYPOTHESES, E2E_REFERENCES)
    assert caplog.text.count("METEOR needs a Java runtime") == 2


# --------------------------------------------------------------------------------------------- DART metrics
@pytest.fixture
def meteor_calls(monkeypatch) -> list[tuple[list[str], list[list[str]]]]:
    """The inputs of every METEOR call, which returns 0.5 instead of starting a JVM: the score itself is
    the E2E tests' (above), the same function; a DART test checks what is passed to it and where it goes."""
    from dpexp.metrics import text

    calls = []

    def meteor(hypotheses, references):
        calls.append((list(hypotheses), [list(group) for group in references]))
        return 0.5

    monkeypatch.setattr(text, "meteor", meteor)
    return calls


def test_dart_metrics_are_table8s_offline_columns_in_its_order(meteor_calls):
    """METEOR, ROUGE-1, ROUGE-2, ROUGE-L and BLEU (Li et al. 2022, Table 8): the ROUGE values are
    :func:`rouge`'s (best reference, mean over inputs), BLEU :func:`corpus_bleu`'s, METEOR the E2E one, of
    every hypothesis against all of its references."""
    from dpexp.metrics.text import DART_METRICS, dart_metrics

    scores = dart_metrics(E2E_HYPOTHESES, E2E_REFERENCES)
    assert tuple(scores) == DART_METRICS
    assert meteor_calls == [(E2E_HYPOTHESES, E2E_REFERENCES)] and scores["meteor"] == 0.5
    by_rouge = rouge(E2E_HYPOTHESES, E2E_REFERENCES, ("rouge1", "rouge2", "rougeL"))
    assert {k: scores[k] for k in by_rouge} == pytest.approx(by_rouge)
    assert scores["bleu"] == pytest.approx(corpus_bleu(E2E_HYPOTHESES, E2E_REFERENCES))
    assert 0 < scores["rouge2"] < scores["rouge1"] < 100


def test_dart_metrics_score_a_copy_of_any_reference_as_perfect(meteor_calls):
    from dpexp.metrics.text import dart_metrics

    copies = [refs[1] for refs in E2E_REFERENCES]
    scores = dart_metrics(copies, E2E_REFERENCES)
    assert {k: v for k, v in scores.items() if k != "meteor"} == pytest.approx(
        {"rouge1": 100.0, "rouge2": 100.0, "rougeL": 100.0, "bleu": 100.0}
    )
    with pytest.raises(ValueError, match="reference groups"):
        dart_metrics(copies, E2E_REFERENCES[:1])


def test_nist_of_short_or_empty_generations_is_defined():
    """An untrained model's generations may be empty or shorter than 5 tokens: orders no hypothesis reaches
    add nothing (mteval's convention), and all-empty output scores 0."""
    from dpexp.metrics.text import nist

    refs = [["the cat sat on the mat"], ["a dog"]]
    assert nist(["", ""], refs) == 0.0
    assert nist(["the cat", "dog"], refs) > 0
