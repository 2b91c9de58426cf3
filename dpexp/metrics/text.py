"""Corpus BLEU (sacrebleu), ROUGE (rouge-score) and the E2E challenge's five metrics, grouped references.

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

All scores are on a 0-100 scale, as the papers report them, except in :func:`e2e_metrics`, which follows Li
et al. (2022), Tables 2 and 7: BLEU and ROUGE-L in 0-100, NIST, METEOR (0-1) and CIDEr on their own scales.
The E2E challenge's script scores NIST with mteval and METEOR, ROUGE-L and CIDEr with the MS-COCO caption
code (pycocoevalcap); here NIST is NLTK's implementation of the same formula (n = 5) on sacrebleu's 13a
tokens, and METEOR, ROUGE-L (beta = 1.2) and CIDEr are pycocoevalcap's own, on lower-cased 13a tokens.
METEOR runs Meteor 1.5 in a Java process: without a Java runtime it is left out, and the caller says so.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence

import sacrebleu
from rouge_score import rouge_scorer
from sacrebleu.tokenizers.tokenizer_13a import Tokenizer13a

E2E_METRICS = ("bleu", "nist", "meteor", "rougeL", "cider")  # Li et al. (2022), Table 7's columns


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


def e2e_metrics(hypotheses: Sequence[str], references: Sequence[Sequence[str]]) -> dict[str, float]:
    """BLEU, NIST, METEOR, ROUGE-L and CIDEr (the E2E challenge's metrics, Li et al. 2022 Table 7), every
    hypothesis against all references of its input; METEOR only where Java runs (module docstring)."""
    from pycocoevalcap.cider.cider import Cider
    from pycocoevalcap.rouge.rouge import Rouge

    _check_aligned(hypotheses, references)
    gts = {i: [_tokens(r) for r in group] for i, group in enumerate(references)}
    res = {i: [_tokens(h)] for i, h in enumerate(hypotheses)}
    scores = {
        "bleu": corpus_bleu(hypotheses, references),
        "nist": nist(hypotheses, references),
        "rougeL": 100.0 * float(Rouge().compute_score(gts, res)[0]),
        "cider": float(Cider().compute_score(gts, res)[0]),
    }
    if java_available():
        from pycocoevalcap.meteor.meteor import Meteor

        scorer = Meteor()  # a Java process, ended when the scorer is collected
        scores["meteor"] = float(scorer.compute_score(gts, res)[0])
        del scorer
    return {name: scores[name] for name in E2E_METRICS if name in scores}
