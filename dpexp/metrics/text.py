"""Corpus BLEU (sacrebleu), ROUGE (rouge-score), the E2E challenge's five metrics and Li et al.'s DART
metrics, grouped references.

The metrics are called directly from their packages (``evaluate.load`` would fetch metric scripts from the
hub at run time and fails offline). Every hypothesis is scored against *all* references of its input: the
E2E and DART test sets list several human references per table, one per row or annotation, and the tasks
group them by input before scoring.

How these numbers differ from the papers' official pipelines (Li et al. 2022, app. K):

- E2E: the official scripts (github.com/tuetschek/e2e-metrics) compute BLEU with the NIST mteval-v13a
  script and ROUGE-L with the MS-COCO caption code (an LCS F-score with recall weight beta = 1.2, on the
  coco tokenisation). Here BLEU is sacrebleu's ``corpus_bleu`` (13a tokenisation, exponential smoothing,
  case-sensitive) and ROUGE-L is rouge-score's F1 (beta = 1, lower-cased alphanumeric tokens, Porter stemmer),
  the maximum over references, averaged over inputs. The numbers are close to, not interchangeable with,
  the published ones.
- DART: the GEM metrics (github.com/GEM-benchmark/GEM-metrics) also use sacrebleu and rouge-score, but with
  their own text normalisation; numbers are close but not identical.
- SAMSum (He et al. 2023, Table 6): ROUGE-1/2/L F1 from rouge-score as here; whether the paper used
  stemming is not stated (we stem, the common choice for SAMSum).

All scores are on a 0-100 scale, as the papers report them, except METEOR (0-1), NIST and CIDEr, which keep
their own scales as Li et al. (2022) print them (Tables 2, 7 and 8).
The E2E challenge's script scores NIST with mteval and METEOR, ROUGE-L and CIDEr with the MS-COCO caption
code (pycocoevalcap); here NIST is NLTK's implementation of the same formula (n = 5) on sacrebleu's 13a
tokens, and METEOR, ROUGE-L (beta = 1.2) and CIDEr are pycocoevalcap's own, on lower-cased 13a tokens.
METEOR runs Meteor 1.5 in a Java process: without a Java runtime it is left out, and the caller says so.
:func:`dart_metrics` gives the columns of Li et al.'s DART table (Table 8) that run offline: METEOR as for
E2E, ROUGE-1, ROUGE-2 and ROUGE-L as :func:`rouge`, and BLEU; its BERTScore and BLEURT need scoring models
from the hub (:mod:`dpexp.metrics.model_based`).
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Sequence

import sacrebleu
from rouge_score import rouge_scorer
from sacrebleu.tokenizers.tokenizer_13a import Tokenizer13a

log = logging.getLogger(__name__)

E2E_METRICS = ("bleu", "nist", "meteor", "rougeL", "cider")  # Li et al. (2022), Table 7's columns
DART_METRICS = ("meteor", "rouge1", "rouge2", "rougeL", "bleu")  # Table 8's columns that need no hub model


def _check_aligned(hypotheses: Sequence[str], references: Sequence[Sequence[str]]) -> None:
    if len(hypotheses) != len(references):
        raise ValueError(
            f"got {len(hypotheses)} hypotheses but {len(references)} reference groups; "
            "pass one group of references per hypothesis"
        )
    if not hypotheses:
        raise ValueError("no hypotheses to score; the evaluation split is empty")
    for i, refs in enumerate(references):
        if isinstance(refs, str) or len(refs) == 0:
            raise ValueError(
                f"reference group {i} must be a non-empty list of strings, got {refs!r}; "
                "wrap a single reference in a list"
            )


def corpus_bleu(hypotheses: Sequence[str], references: Sequence[Sequence[str]]) -> float:
    """Corpus BLEU (0-100) of ``hypotheses[i]`` against all strings in ``references[i]``.

    sacrebleu expects reference *streams* (stream j holds the j-th reference of every input); inputs with
    fewer references than the longest group get ``None`` in the remaining streams, which sacrebleu skips
    (its variable-reference mode), so the n-gram counts use exactly each input's own references.
    """
    _check_aligned(hypotheses, references)
    num_streams = max(len(refs) for refs in references)
    streams = [[refs[j] if j < len(refs) else None for refs in references] for j in range(num_streams)]
    return float(sacrebleu.corpus_bleu(list(hypotheses), streams).score)


def rouge(
    hypotheses: Sequence[str],
    references: Sequence[Sequence[str]],
    rouge_types: Sequence[str] = ("rougeL",),
    use_stemmer: bool = True,
) -> dict[str, float]:
    """Mean ROUGE F1 (0-100) per type, each hypothesis scored against its best-matching reference.

    ``rouge_types`` are rouge-score names (``rouge1``, ``rouge2``, ``rougeL``); for every input the
    reference with the highest F1 is kept (rouge-score's ``score_multi``), then F1 is averaged over inputs.
    """
    _check_aligned(hypotheses, references)
    scorer = rouge_scorer.RougeScorer(list(rouge_types), use_stemmer=use_stemmer)
    totals = dict.fromkeys(rouge_types, 0.0)
    for hypothesis, refs in zip(hypotheses, references, strict=True):
        scores = scorer.score_multi(list(refs), hypothesis)
        for name in rouge_types:
            totals[name] += scores[name].fmeasure
    return {name: 100.0 * total / len(hypotheses) for name, total in totals.items()}


def _tokens(text: str) -> str:
    """Lower-cased 13a tokens, space-separated (the tokenisation of :func:`e2e_metrics`)."""
    return Tokenizer13a()(text.lower().strip())


def nist(hypotheses: Sequence[str], references: Sequence[Sequence[str]], n: int = 5) -> float:
    """Corpus NIST (Doddington 2002; n-grams up to ``n`` = 5, as mteval) of every hypothesis against all of
    its references, on lower-cased 13a tokens (NLTK's ``corpus_nist``)."""
    from nltk.translate.nist_score import corpus_nist

    _check_aligned(hypotheses, references)
    refs = [[_tokens(r).split() for r in group] for group in references]
    hyps = [_tokens(h).split() for h in hypotheses]
    # n-gram orders no hypothesis reaches add 0, as in mteval (NLTK would divide by zero for them)
    longest = min(n, max(len(h) for h in hyps))
    return float(corpus_nist(refs, hyps, n=longest)) if longest else 0.0


def java_available() -> bool:
    """Whether a Java runtime is on the PATH (METEOR needs one)."""
    return shutil.which("java") is not None


def meteor(hypotheses: Sequence[str], references: Sequence[Sequence[str]]) -> float | None:
    """METEOR 1.5 (0-1; pycocoevalcap's Java scorer) of every hypothesis against all of its references, on
    lower-cased 13a tokens; None without a Java runtime (:func:`java_available`)."""
    _check_aligned(hypotheses, references)
    if not java_available():
        log.warning("METEOR needs a Java runtime (java on the PATH): this evaluation leaves it out")
        return None
    from pycocoevalcap.meteor.meteor import Meteor

    gts, res = _coco_inputs(hypotheses, references)
    scorer = Meteor()  # a Java process, ended when the scorer is collected
    score = float(scorer.compute_score(gts, res)[0])
    del scorer
    return score


def _coco_inputs(
    hypotheses: Sequence[str], references: Sequence[Sequence[str]]
) -> tuple[dict[int, list[str]], dict[int, list[str]]]:
    """References and hypotheses as the MS-COCO caption scorers take them: {input: [tokenised texts]}."""
    gts = {i: [_tokens(r) for r in group] for i, group in enumerate(references)}
    return gts, {i: [_tokens(h)] for i, h in enumerate(hypotheses)}


def e2e_metrics(hypotheses: Sequence[str], references: Sequence[Sequence[str]]) -> dict[str, float]:
    """BLEU, NIST, METEOR, ROUGE-L and CIDEr (the E2E challenge's metrics, Li et al. 2022 Table 7), every
    hypothesis against all references of its input; METEOR only where Java runs (module docstring)."""
    from pycocoevalcap.cider.cider import Cider
    from pycocoevalcap.rouge.rouge import Rouge

    _check_aligned(hypotheses, references)
    gts, res = _coco_inputs(hypotheses, references)
    scores = {
        "bleu": corpus_bleu(hypotheses, references),
        "nist": nist(hypotheses, references),
        "meteor": meteor(hypotheses, references),
        "rougeL": 100.0 * float(Rouge().compute_score(gts, res)[0]),
        "cider": float(Cider().compute_score(gts, res)[0]),
    }
    return {name: scores[name] for name in E2E_METRICS if scores[name] is not None}


def dart_metrics(hypotheses: Sequence[str], references: Sequence[Sequence[str]]) -> dict[str, float]:
    """METEOR, ROUGE-1, ROUGE-2, ROUGE-L and BLEU (Li et al. 2022, Table 8's columns that need no hub
    model), every hypothesis against all annotations of its triple set; METEOR only where Java runs."""
    scores = {
        "meteor": meteor(hypotheses, references),
        **rouge(hypotheses, references, ("rouge1", "rouge2", "rougeL")),
        "bleu": corpus_bleu(hypotheses, references),
    }
    return {name: scores[name] for name in DART_METRICS if scores[name] is not None}
