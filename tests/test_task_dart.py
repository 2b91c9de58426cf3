"""DART task: release and hub record formats, grouping, the deterministic offline dev partition."""

from pathlib import Path

import pytest

from dpexp.tasks.dart import DARTTask, linearize_tripleset, records_to_pairs
from dpexp.tasks.generation import in_dev_eval_part
from tests.conftest import SHARED_DATA
from tests.generation_helpers import tiny_factory, write_json, write_metric

RECORDS = [
    {
        "tripleset": [
            ["Mars Hill College", "JOINED", "1973"],
            ["Mars Hill College", "LOCATION", "Mars Hill"],
        ],
        "subtree_was_extended": True,
        "annotations": [
            {"source": "WikiSQL_decl_sents", "text": "A school from Mars Hill joined in 1973."},
            {"source": "webnlg", "text": "Mars Hill College, in Mars Hill, joined in 1973. "},
        ],
    },
    {
        "tripleset": [["[TABLECONTEXT]", "[TITLE]", "Berlin"], ["Berlin", "POPULATION", "3,500,000"]],
        "annotations": [{"source": "e2e", "text": "Berlin has 3,500,000 people."}],
    },
]


def test_linearize_tripleset() -> None:
    assert (
        linearize_tripleset(RECORDS[0]["tripleset"])
        == "Mars Hill College : JOINED : 1973 | Mars Hill College : LOCATION : Mars Hill"
    )
    with pytest.raises(ValueError, match="subject, relation, object"):
        linearize_tripleset([["only", "two"]])


def test_release_and_hub_formats_give_the_same_pairs() -> None:
    pairs = records_to_pairs(RECORDS, "test")
    assert pairs == [
        (
            "Mars Hill College : JOINED : 1973 | Mars Hill College : LOCATION : Mars Hill",
            "A school from Mars Hill joined in 1973.",
        ),
        (
            "Mars Hill College : JOINED : 1973 | Mars Hill College : LOCATION : Mars Hill",
            "Mars Hill College, in Mars Hill, joined in 1973.",
        ),
        (
            "[TABLECONTEXT] : [TITLE] : Berlin | Berlin : POPULATION : 3,500,000",
            "Berlin has 3,500,000 people.",
        ),
    ]
    hub_rows = [
        {
            **r,
            "annotations": {
                "source": [a["source"] for a in r["annotations"]],
                "text": [a["text"] for a in r["annotations"]],
            },
        }
        for r in RECORDS
    ]
    assert DARTTask().hub_pairs(hub_rows) == pairs


def test_missing_fields_name_the_record(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="record 1 needs fields 'tripleset' and 'annotations'"):
        records_to_pairs([RECORDS[0], {"tripleset": [["a", "b", "c"]]}], "x")
    with pytest.raises(ValueError, match="record 0: DART annotations"):
        records_to_pairs([{"tripleset": [["a", "b", "c"]], "annotations": [{"txt": "a"}]}], "x")
    write_json(tmp_path / "dart" / "dart-v1.1.1-full-dev.json", {"not": "a list"})
    with pytest.raises(ValueError, match="JSON list"):
        DARTTask(data_root=str(tmp_path)).setup(tiny_factory())  # offline: dev_train, dev_eval
    (tmp_path / "dart" / "dart-v1.1.1-full-dev.json").write_bytes(b'[{"tripleset": [["caf\xe9"]]}]')
    with pytest.raises(ValueError, match=r"full-dev\.json: not UTF-8 text"):
        DARTTask(data_root=str(tmp_path)).setup(tiny_factory())


def test_setup_groups_annotations_and_trains_on_all_pairs(tmp_path: Path) -> None:
    write_json(tmp_path / "dart" / "dart-v1.1.1-full-train.json", RECORDS)
    write_json(tmp_path / "dart" / "dart-v1.1.1-full-test.json", RECORDS)
    task = DARTTask(data_root=str(tmp_path), max_new_tokens=8)
    task.setup(tiny_factory())
    assert len(task.train_dataset) == 3
    assert [len(refs) for refs in task._eval_references] == [2, 1]


def test_evaluate_scores_table8s_metrics_and_the_asked_model_based_ones(tmp_path: Path) -> None:
    """Li et al. (2022), Table 8's offline columns always; BLEURT here through a local metric script (the hub
    is unreachable), scored on the same generations: every hypothesis against all its annotations."""
    import math

    import torch

    from dpexp.metrics.text import DART_METRICS, java_available

    write_json(tmp_path / "dart" / "dart-v1.1.1-full-train.json", RECORDS)
    write_json(tmp_path / "dart" / "dart-v1.1.1-full-test.json", RECORDS)
    bleurt = write_metric(tmp_path / "metrics", "bleurt")
    task = DARTTask(data_root=str(tmp_path), max_new_tokens=8, num_beams=2, model_metrics={"bleurt": bleurt})
    task.setup(tiny_factory())
    torch.manual_seed(0)
    metrics = task.evaluate(tiny_factory().build(task.info), batch_size=2)
    offline = set(DART_METRICS) if java_available() else set(DART_METRICS) - {"meteor"}
    assert set(metrics) == {*offline, "bleurt", "nll", "eval_inputs"}
    assert metrics["eval_inputs"] == 2 and all(math.isfinite(v) for v in metrics.values())


def test_a_model_based_metric_that_cannot_load_is_refused_at_setup(tmp_path: Path) -> None:
    write_json(tmp_path / "dart" / "dart-v1.1.1-full-train.json", RECORDS)
    write_json(tmp_path / "dart" / "dart-v1.1.1-full-test.json", RECORDS)
    with pytest.raises(ValueError, match="unknown model-based metric"):
        DARTTask(data_root=str(tmp_path), model_metrics={"bleu": "bleu"})
    task = DARTTask(data_root=str(tmp_path), model_metrics={"bertscore": str(tmp_path / "absent")})
    with pytest.raises(ValueError, match=r"^task.model_metrics.bertscore: evaluate could not load"):
        task.setup(tiny_factory())


@pytest.mark.skipif(
    not (SHARED_DATA / "dart" / "dart-v1.1.1-full-dev.json").exists(), reason="shared DART absent"
)
def test_offline_dev_partition_is_disjoint_deterministic_and_sized() -> None:
    task = DARTTask(data_root=str(SHARED_DATA))
    assert task._resolve_splits() == ("dev_train", "dev_eval")
    train = task._load_pairs("dev_train")
    evaluation = task._load_pairs("dev_eval")
    every = task._load_pairs("dev")
    train_sources, eval_sources = {s for s, _ in train}, {s for s, _ in evaluation}
    assert not train_sources & eval_sources
    assert len(train) + len(evaluation) == len(every)
    share = len(eval_sources) / len(train_sources | eval_sources)
    assert 0.15 < share < 0.25
    assert task._load_pairs("dev_eval") == evaluation
    assert all(in_dev_eval_part(s, 0.2) for s in eval_sources)
