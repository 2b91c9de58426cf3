"""E2E task: release-format loading, reference grouping, label masking, truncation, evaluation."""

import csv
import logging
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from dpexp.tasks.e2e import E2ETask, linearize_mr
from dpexp.tasks.generation import IGNORE
from dpexp.training.loop import run_training
from tests.conftest import SHARED_DATA
from tests.generation_helpers import E2E_ROWS, tiny_factory, write_e2e_csv


@pytest.fixture
def e2e_root(tmp_path: Path) -> Path:
    """A data root with e2e/devset.csv and e2e/testset_w_refs.csv (no training file, as offline)."""
    write_e2e_csv(tmp_path / "e2e" / "devset.csv")
    write_e2e_csv(tmp_path / "e2e" / "testset_w_refs.csv", E2E_ROWS[::-1])
    return tmp_path


def make_task(root: Path, **kwargs: object) -> E2ETask:
    task = E2ETask(data_root=str(root), **{"max_new_tokens": 8, **kwargs})
    task.setup(tiny_factory())
    return task


def test_linearize_mr_uses_li_and_liang_field_names() -> None:
    mr = "name[The Mill], eatType[pub], priceRange[£20-25], familyFriendly[yes], near[Café Rouge]"
    assert (
        linearize_mr(mr)
        == "name : The Mill | Type : pub | price : £20-25 | family friendly : yes | near : Café Rouge"
    )
    with pytest.raises(ValueError, match="attribute\\[value\\]"):
        linearize_mr("name: The Mill")


@pytest.mark.skipif(not (SHARED_DATA / "e2e" / "devset.csv").exists(), reason="shared E2E data absent")
def test_real_e2e_files_offline_split_and_grouping(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        task = make_task(SHARED_DATA)
    assert "training on split 'dev'" in caplog.text
    with (SHARED_DATA / "e2e" / "devset.csv").open(encoding="utf-8", newline="") as handle:
        assert len(task.train_dataset) == sum(1 for _ in csv.DictReader(handle))
    with (SHARED_DATA / "e2e" / "testset_w_refs.csv").open(encoding="utf-8", newline="") as handle:
        test_rows = list(csv.DictReader(handle))
    groups = dict(
        zip([task.tokenizer.decode(p[:-1]) for p in task._eval_prompts], task._eval_references, strict=True)
    )
    assert len(groups) == len({row["mr"] for row in test_rows}) == 630
    assert sum(len(refs) for refs in groups.values()) == len(test_rows)
    for row in test_rows[:50]:
        assert row["ref"].strip() in groups[linearize_mr(row["mr"])]
    assert task.info.kind == "generation" and task.info.vocab_size == len(task.tokenizer)


def test_reference_grouping_and_eval_cap(e2e_root: Path) -> None:
    task = make_task(e2e_root)
    assert len(task.train_dataset) == len(E2E_ROWS)
    assert [len(refs) for refs in task._eval_references] == [3, 1, 2]  # test file is the rows reversed
    capped = make_task(e2e_root, eval_max_inputs=2)
    assert len(capped._eval_prompts) == 2
    assert capped._eval_references == [task._eval_references[0], task._eval_references[1]]


def test_sequence_format_and_label_mask(e2e_root: Path) -> None:
    task = make_task(e2e_root)
    tok = task.tokenizer
    example = task.train_dataset[0]
    text = tok.decode(example["input_ids"])
    assert (
        text == "name : The Mill | Type : pub | area : riverside<|endoftext|>"
        " The Mill is a pub by the riverside.<|endoftext|>"
    )
    batch = task.collate([task.train_dataset[i] for i in range(3)])
    for row in range(3):
        n, start = len(task.train_dataset[row]["input_ids"]), task.train_dataset[row]["prompt_length"]
        labels, ids = batch["labels"][row], batch["input_ids"][row]
        assert (labels[:start] == IGNORE).all() and (labels[n:] == IGNORE).all()  # source, separator, padding
        assert torch.equal(labels[start:n], ids[start:n])  # target tokens and the final eos
        assert batch["attention_mask"][row].sum() == n
    assert (
        tok.decode(batch["labels"][0][batch["labels"][0] != IGNORE])
        == " The Mill is a pub by the riverside.<|endoftext|>"
    )


def test_per_example_loss_sums_target_tokens_only(e2e_root: Path) -> None:
    task = make_task(e2e_root)
    torch.manual_seed(0)
    model = tiny_factory().build(task.info)
    model.eval()
    examples = [task.train_dataset[i] for i in range(4)]
    batch = task.collate(examples)
    losses = task.per_example_loss(model, batch)
    assert losses.shape == (4,)
    # manual: sum over target positions of -log p(token | prefix), from the unpadded single sequence
    for row, example in enumerate(examples):
        ids = torch.tensor([example["input_ids"]])
        log_probs = F.log_softmax(model(input_ids=ids).logits[0, :-1].float(), dim=-1)
        targets = ids[0, 1:]
        positions = range(example["prompt_length"] - 1, len(example["input_ids"]) - 1)
        manual = -sum(log_probs[t, targets[t]] for t in positions)
        assert losses[row].item() == pytest.approx(manual.item(), rel=1e-5)
    # changing source tokens changes neither the loss mask nor which positions carry loss
    changed = dict(examples[0], input_ids=[5, 6, *examples[0]["input_ids"][2:]])
    new_batch = task.collate([changed])
    assert torch.equal(new_batch["labels"][0] != IGNORE, task.collate([examples[0]])["labels"][0] != IGNORE)


def test_overflow_truncates_source_first_or_fails(e2e_root: Path, caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(ValueError, match="exceed 16 tokens"):
        make_task(e2e_root, max_length=16, max_new_tokens=4, on_overflow="error")
    with caplog.at_level(logging.WARNING):
        task = make_task(e2e_root, max_length=16, max_new_tokens=4)
    assert "truncating the source first" in caplog.text
    assert max(len(ids) for ids in task.train_dataset.input_ids) <= 16
    assert all(ids[-1] == task.tokenizer.eos_token_id for ids in task.train_dataset.input_ids)
    assert all(len(p) + 4 <= 16 for p in task._eval_prompts)
    with pytest.raises(ValueError, match="exceeds the model's limit of 128"):
        make_task(e2e_root, max_length=500)


def test_file_and_header_errors(tmp_path: Path, e2e_root: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"devset\.csv not found"):
        make_task(e2e_root, data_dir=str(tmp_path / "missing"), train_split="dev")
    write_e2e_csv(tmp_path / "bad" / "e2e" / "devset.csv", header=("meaning", "ref"))
    write_e2e_csv(tmp_path / "bad" / "e2e" / "testset_w_refs.csv")
    with pytest.raises(ValueError, match="columns 'mr' and 'ref'"):
        make_task(tmp_path / "bad")
    with pytest.raises(ValueError, match="overlap"):
        make_task(e2e_root, train_split="dev", eval_split="dev")
    with pytest.raises(ValueError, match="no split 'validation'"):
        make_task(e2e_root, eval_split="validation")


def test_evaluate_generates_and_scores(e2e_root: Path) -> None:
    task = make_task(e2e_root, num_beams=2)
    torch.manual_seed(0)
    model = tiny_factory().build(task.info)
    metrics = task.evaluate(model, batch_size=2)
    from dpexp.metrics.text import E2E_METRICS, java_available

    five = set(E2E_METRICS) if java_available() else set(E2E_METRICS) - {"meteor"}
    assert set(metrics) == {*five, "nll", "eval_inputs"}
    assert metrics["eval_inputs"] == 3
    assert 0.0 <= metrics["bleu"] <= 100.0 and 0.0 <= metrics["rougeL"] <= 100.0
    # an untrained model is close to uniform over the vocabulary
    assert math.isfinite(metrics["nll"]) and abs(metrics["nll"] - math.log(len(task.tokenizer))) < 1.0


def test_a_few_nonprivate_steps_reduce_the_loss(e2e_root: Path) -> None:
    task = make_task(e2e_root)
    torch.manual_seed(0)
    model = tiny_factory().build(task.info)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    batch = task.collate([task.train_dataset[i] for i in range(len(task.train_dataset))])
    first = task.per_example_loss(model, batch).mean().item()
    for _ in range(10):
        optimizer.zero_grad()
        task.per_example_loss(model, batch).mean().backward()
        optimizer.step()
    assert task.per_example_loss(model, batch).mean().item() < 0.8 * first


def test_hub_path_maps_splits_and_columns(monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets

    calls = []

    def fake_load_dataset(name: str, revision: str | None, split: str) -> list[dict[str, str]]:
        calls.append((name, revision, split))
        return [{"meaning_representation": mr, "human_reference": ref} for mr, ref in E2E_ROWS]

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    task = E2ETask(hub_revision="refs/convert/parquet", eval_split="dev", max_new_tokens=8)
    task.setup(tiny_factory())
    assert calls == [
        ("tuetschek/e2e_nlg", "refs/convert/parquet", "train"),
        ("tuetschek/e2e_nlg", "refs/convert/parquet", "validation"),
    ]
    assert len(task.train_dataset) == len(E2E_ROWS)
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: [{"mr": "name[A]", "ref": "A."}])
    with pytest.raises(ValueError, match="'meaning_representation' and 'human_reference'"):
        E2ETask().setup(tiny_factory())


@pytest.mark.parametrize(
    "clip",
    [
        "nonprivate",
        "bk",
        "ghost",
        "perlayer",
        "adaptive_perlayer",
        "adaptive_flat",
        "groupwise",
        "opacus",
        "opacus_perlayer",  # opacus_ghost refuses GPT-2's tied embeddings (tested in test_opacus_backend)
    ],
)
def test_training_runs_with_every_clip_option(
    clip: str, e2e_root: Path, tmp_path: Path, compose_config, without_meteor
) -> None:
    overrides = [
        "task=e2e", "model=gpt2_tiny", f"data.root={e2e_root}", f"clip={clip}", "optim=adam", "steps=2",
        "batch_size=4", "physical_batch_size=2", "progress=false", "eval_every=null", "task.max_new_tokens=4",
        "model.config.n_layer=2", "model.config.n_embd=32", "model.config.n_head=2",
        "model.tokenizer=trained",
    ]  # fmt: skip
    record = run_training(compose_config(overrides), tmp_path / "run", {"task": "e2e", "clip": clip})
    assert record["status"] == "completed" and record["steps"] == 2
    assert {"bleu", "rougeL", "nll"} <= set(record) and math.isfinite(record["nll"])


def test_grouping_micro_batches_by_length_keeps_the_run(
    e2e_root: Path, tmp_path: Path, compose_config, without_meteor
) -> None:
    """Ordering a logical batch by length before splitting it changes only the padding: same examples, same
    clipped sum, so the same model (up to float summation order)."""
    overrides = [
        "task=e2e", "model=gpt2_tiny", f"data.root={e2e_root}", "clip=bk", "optim=adam", "steps=3",
        "batch_size=4", "physical_batch_size=1", "progress=false", "eval_every=null", "task.max_new_tokens=4",
        "task.eval_max_inputs=4", "model.config.n_layer=1", "model.config.n_embd=32", "model.config.n_head=2",
        "model.tokenizer=trained", "model.dropout=0.0",
    ]  # fmt: skip
    runs = {
        flag: run_training(compose_config([*overrides, f"group_by_length={flag}"]), tmp_path / str(flag))
        for flag in ("true", "false")
    }
    assert runs["true"]["examples_seen"] == runs["false"]["examples_seen"]
    assert runs["true"]["nll"] == pytest.approx(runs["false"]["nll"], rel=1e-4)


@pytest.mark.parametrize("cut", [0.5, 0.8])  # in the middle of a quoted MR, of a quoted reference
def test_a_truncated_csv_is_refused_naming_file_and_line(tmp_path: Path, e2e_root: Path, cut: float) -> None:
    source = (e2e_root / "e2e" / "devset.csv").read_text(encoding="utf-8")
    last = source.rstrip("\n").rsplit("\n", 1)[1]
    truncated = source[: len(source.rstrip("\n")) - len(last) + int(cut * len(last))]
    (e2e_root / "e2e" / "devset.csv").write_text(truncated, encoding="utf-8")
    lines = truncated.count("\n") + 1
    with pytest.raises(ValueError, match=rf"devset\.csv, line {lines}: .*is the file truncated\?"):
        make_task(e2e_root)


def test_a_row_without_its_reference_is_refused(e2e_root: Path) -> None:
    path = e2e_root / "e2e" / "devset.csv"
    path.write_text(
        path.read_text(encoding="utf-8") + '"name[Alimentum], area[city centre]"\n', encoding="utf-8"
    )
    with pytest.raises(ValueError, match=r"devset\.csv, line \d+: a row without both 'mr' and 'ref'"):
        make_task(e2e_root)


def test_a_csv_that_is_not_utf8_is_named(e2e_root: Path) -> None:
    (e2e_root / "e2e" / "devset.csv").write_bytes(b'mr,ref\n"name[Caf\xe9]","Nice."\n')
    with pytest.raises(ValueError, match=r"devset\.csv: not UTF-8 text"):
        make_task(e2e_root)


@pytest.mark.skipif(not (SHARED_DATA / "e2e" / "devset.csv").is_file(), reason="../shared/data/e2e is absent")
def test_the_release_files_pass_the_strict_reader() -> None:
    for name in ("devset.csv", "testset_w_refs.csv"):
        assert len(E2ETask().read_local(SHARED_DATA / "e2e" / name)) > 4000
