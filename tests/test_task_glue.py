"""GLUE tasks: local TSV loading (real SST-2 files and generated GLUE-format files), options and errors."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from dpexp.models.hf_encoder import HFEncoderFactory
from dpexp.models.wrn import WideResNetFactory
from dpexp.tasks.glue import GlueTask
from tests.encoder_configs import MINILM, TINY_ROBERTA

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
SST2 = DATA / "sst2"
needs_sst2 = pytest.mark.skipif(not (SST2 / "train.tsv").is_file(), reason="../shared/data/sst2 is absent")

WORDS = ["good", "bad", "movie", "plot", "great", "dull", "acting", "the", "a", "really"]


@pytest.fixture(scope="module")
def tiny() -> HFEncoderFactory:
    return HFEncoderFactory("roberta_tiny", tokenizer=MINILM, architecture=TINY_ROBERTA)


def sentence(rng: torch.Generator, words: int = 6) -> str:
    return " ".join(WORDS[i] for i in torch.randint(len(WORDS), (words,), generator=rng).tolist())


def write_tsv(file: Path, header: list[str], rows: list[list[str]]) -> None:
    file.parent.mkdir(parents=True, exist_ok=True)
    with file.open("w", encoding="utf-8", newline="") as handle:
        writer = csv.writer(handle, delimiter="\t", quoting=csv.QUOTE_NONE, lineterminator="\n")
        writer.writerow(header)
        writer.writerows(rows)


def write_sst2(folder: Path, n_train: int = 40, n_dev: int = 12, seed: int = 0) -> None:
    """SST-2 in the original GLUE format: header ``sentence<TAB>label``."""
    rng = torch.Generator().manual_seed(seed)
    for name, n in (("train.tsv", n_train), ("dev.tsv", n_dev)):
        write_tsv(folder / name, ["sentence", "label"], [[sentence(rng), str(i % 2)] for i in range(n)])


def write_mnli(folder: Path, n: int = 12) -> None:
    """MNLI in the original GLUE column layout (sentence1, sentence2, ..., gold_label)."""
    rng = torch.Generator().manual_seed(1)
    header = ["index", "promptID", "pairID", "genre", "sentence1", "sentence2", "label1", "gold_label"]
    labels = ["entailment", "neutral", "contradiction"]
    for name in ("train.tsv", "dev_matched.tsv", "dev_mismatched.tsv"):
        rows = [
            [str(i), "0", "0", "fiction", sentence(rng), sentence(rng, 4), labels[i % 3], labels[i % 3]]
            for i in range(n)
        ]
        write_tsv(folder / name, header, rows)


def read_rows(file: Path) -> list[dict[str, str]]:
    with file.open(encoding="utf-8", newline="") as handle:
        return list(csv.DictReader(handle, delimiter="\t", quoting=csv.QUOTE_NONE))


# ------------------------------------------------------------------------------------------- real data
@needs_sst2
def test_sst2_real_files_load_subsample_and_match_the_file() -> None:
    factory = HFEncoderFactory("minilm", weights=MINILM)
    task = GlueTask("sst2", data_root=str(DATA), subsample=64)
    task.setup(factory)
    assert len(task.train_dataset) == 64
    dev_rows = read_rows(SST2 / "dev.tsv")
    assert len(task.eval_sets["accuracy"]) == len(dev_rows) == 872
    tokenizer = factory.tokenizer()
    first = task.eval_sets["accuracy"][0]
    assert tokenizer.decode(first["input_ids"], skip_special_tokens=True) == tokenizer.decode(
        tokenizer(dev_rows[0]["sentence"])["input_ids"], skip_special_tokens=True
    )
    assert first["label"] == int(dev_rows[0]["label"])
    assert task.info.num_labels == 2 and task.info.vocab_size == len(tokenizer)
    batch = task.collate([task.train_dataset[i] for i in range(5)])
    assert set(batch) == {"input_ids", "attention_mask", "token_type_ids", "label"}
    assert batch["input_ids"].shape == batch["attention_mask"].shape
    assert (batch["input_ids"][:, 0] == tokenizer.cls_token_id).all()


@needs_sst2
def test_wrong_header_in_a_copy_of_the_real_file_fails_in_setup(
    tmp_path: Path, tiny: HFEncoderFactory
) -> None:
    lines = (SST2 / "dev.tsv").read_text(encoding="utf-8").splitlines(keepends=True)
    (tmp_path / "sst2").mkdir()
    (tmp_path / "sst2" / "train.tsv").write_text("text\tlabel\n" + "".join(lines[1:50]), encoding="utf-8")
    (tmp_path / "sst2" / "dev.tsv").write_text("".join(lines[:20]), encoding="utf-8")
    task = GlueTask("sst2", data_root=str(tmp_path))
    with pytest.raises(ValueError, match=r"train\.tsv: missing column\(s\) sentence") as error:
        task.setup(tiny)
    assert "text" in str(error.value)


# -------------------------------------------------------------------------------------- local formats
def test_missing_folder_and_missing_file_name_the_path(tmp_path: Path, tiny: HFEncoderFactory) -> None:
    with pytest.raises(FileNotFoundError, match=r"No sst2 folder under data\.root"):
        GlueTask("sst2", data_root=str(tmp_path)).setup(tiny)
    write_sst2(tmp_path / "sst2")
    (tmp_path / "sst2" / "dev.tsv").unlink()
    with pytest.raises(FileNotFoundError, match=r"dev\.tsv not found.*task.path"):
        GlueTask("sst2", data_root=str(tmp_path)).setup(tiny)


def test_glue_release_folder_name_and_explicit_path_are_accepted(
    tmp_path: Path, tiny: HFEncoderFactory
) -> None:
    write_sst2(tmp_path / "SST-2", n_train=10)
    task = GlueTask("sst2", data_root=str(tmp_path))
    task.setup(tiny)
    assert len(task.train_dataset) == 10
    task = GlueTask("sst2", path=str(tmp_path / "SST-2"), data_root="/nonexistent")
    task.setup(tiny)
    assert len(task.train_dataset) == 10


def test_bad_label_reports_file_and_line(tmp_path: Path, tiny: HFEncoderFactory) -> None:
    write_sst2(tmp_path / "sst2")
    write_tsv(tmp_path / "sst2" / "train.tsv", ["sentence", "label"], [["fine", "1"], ["odd", "maybe"]])
    with pytest.raises(ValueError, match=r"train\.tsv, line 3: label 'maybe'"):
        GlueTask("sst2", data_root=str(tmp_path)).setup(tiny)


def test_subsample_is_seeded_and_bounded(tmp_path: Path, tiny: HFEncoderFactory) -> None:
    write_sst2(tmp_path / "sst2", n_train=40)

    def ids(seed: int) -> list[list[int]]:
        task = GlueTask("sst2", data_root=str(tmp_path), subsample=8, data_seed=seed)
        task.setup(tiny)
        assert len(task.train_dataset) == 8
        return [task.train_dataset[i]["input_ids"] for i in range(8)]

    assert ids(0) == ids(0)
    assert ids(0) != ids(1)
    with pytest.raises(ValueError, match="subsample=41 exceeds the 40"):
        GlueTask("sst2", data_root=str(tmp_path), subsample=41).setup(tiny)


def test_tune_split_partitions_train_and_never_reads_the_dev_set(
    tmp_path: Path, tiny: HFEncoderFactory
) -> None:
    write_sst2(tmp_path / "sst2", n_train=50)

    def key(example: dict) -> tuple:
        return (*example["input_ids"], example["label"])

    full = GlueTask("sst2", data_root=str(tmp_path))
    full.setup(tiny)
    (tmp_path / "sst2" / "dev.tsv").unlink()
    task = GlueTask("sst2", data_root=str(tmp_path), split="tune")
    task.setup(tiny)
    train = [key(task.train_dataset[i]) for i in range(len(task.train_dataset))]
    held = [key(example) for example in task.eval_sets["accuracy"]]
    assert (len(train), len(held)) == (40, 10)
    assert sorted(train + held) == sorted(key(full.train_dataset[i]) for i in range(50))
    assert set(task.evaluate(tiny.build(task.info), 4)) == {"accuracy"}
    with pytest.raises(ValueError, match="empty part"):
        GlueTask("sst2", data_root=str(tmp_path), split="tune", tune_fraction=0.999).setup(tiny)


def test_truncation_warns_and_cuts_or_fails(tmp_path: Path, tiny: HFEncoderFactory) -> None:
    write_sst2(tmp_path / "sst2", n_train=6, n_dev=4)
    with pytest.raises(ValueError, match=r"longer than max_length=5 tokens.*truncation=warn"):
        GlueTask("sst2", data_root=str(tmp_path), max_length=5, truncation="error").setup(tiny)
    task = GlueTask("sst2", data_root=str(tmp_path), max_length=5)
    with pytest.warns(UserWarning) as caught:
        task.setup(tiny)
    messages = [str(warning.message) for warning in caught]
    assert any("6 of 6 sst2 training inputs are longer than max_length=5" in m for m in messages)
    assert any("4 of 4 sst2 validation inputs" in m for m in messages)
    assert all(len(task.train_dataset[i]["input_ids"]) == 5 for i in range(6))
    assert task.info.max_length == 5


def test_mnli_pairs_report_matched_and_mismatched_accuracy(tmp_path: Path, tiny: HFEncoderFactory) -> None:
    write_mnli(tmp_path / "mnli")
    task = GlueTask("mnli", data_root=str(tmp_path))
    task.setup(tiny)
    tokenizer = tiny.tokenizer()
    example = task.train_dataset[0]
    assert example["input_ids"].count(tokenizer.sep_token_id) == 2  # [CLS] s1 [SEP] s2 [SEP]
    assert set(example["token_type_ids"]) == {0, 1}
    assert [task.train_dataset[i]["label"] for i in range(3)] == [0, 1, 2]
    torch.manual_seed(0)
    model = tiny.build(task.info)
    metrics = task.evaluate(model, batch_size=5)
    assert set(metrics) == {"accuracy", "accuracy_matched", "accuracy_mismatched"}
    assert metrics["accuracy"] == metrics["accuracy_matched"]
    model.eval()
    with torch.no_grad():
        batch = task.collate(task.eval_sets["accuracy_mismatched"])
        expected = model(**{k: batch[k] for k in ("input_ids", "attention_mask", "token_type_ids")}).logits
        expected = float((expected.argmax(1) == batch["label"]).float().mean())
    assert metrics["accuracy_mismatched"] == pytest.approx(expected)


def test_per_example_loss_is_one_cross_entropy_per_example(tmp_path: Path, tiny: HFEncoderFactory) -> None:
    write_sst2(tmp_path / "sst2", n_train=6)
    task = GlueTask("sst2", data_root=str(tmp_path))
    task.setup(tiny)
    torch.manual_seed(0)
    model = tiny.build(task.info).eval()
    batch = task.collate([task.train_dataset[i] for i in range(6)])
    losses = task.per_example_loss(model, batch)
    assert losses.shape == (6,)
    single = task.per_example_loss(model, task.collate([task.train_dataset[2]]))
    assert losses[2].item() == pytest.approx(single.item(), abs=1e-5)  # padding does not change the loss


def test_infilling_template_keeps_mask_and_scores_label_words(tmp_path: Path, tiny: HFEncoderFactory) -> None:
    write_sst2(tmp_path / "sst2", n_train=6, n_dev=4)
    task = GlueTask("sst2", data_root=str(tmp_path), objective="infilling", max_length=9)
    with pytest.warns(UserWarning, match="cut longest-first"):
        task.setup(tiny)
    tokenizer = tiny.tokenizer()
    example = task.train_dataset[0]
    tokens = tokenizer.convert_ids_to_tokens(example["input_ids"])
    assert len(tokens) == 9 and tokens[-5:] == ["it", "was", "[MASK]", ".", "[SEP]"]
    assert example["input_ids"][example["mask_position"]] == tokenizer.mask_token_id
    assert task.label_word_ids == tokenizer.convert_tokens_to_ids(["terrible", "great"])
    torch.manual_seed(0)
    model = tiny.build(task.info).eval()
    batch = task.collate([task.train_dataset[i] for i in range(4)])
    losses = task.per_example_loss(model, batch)
    assert losses.shape == (4,)
    vocab = model(
        batch["input_ids"], batch["attention_mask"], batch["mask_position"], batch["token_type_ids"]
    )
    expected = F.cross_entropy(vocab[:, task.label_word_ids], batch["label"], reduction="none")
    torch.testing.assert_close(losses, expected)
    assert 0.0 <= task.evaluate(model, 2)["accuracy"] <= 1.0


def test_infilling_rejects_multi_token_label_words_and_bad_templates(
    tmp_path: Path, tiny: HFEncoderFactory
) -> None:
    write_sst2(tmp_path / "sst2", n_train=4, n_dev=2)
    task = GlueTask(
        "sst2", data_root=str(tmp_path), objective="infilling", label_words=["terrible", "xqzvkwj"]
    )
    with pytest.raises(ValueError, match=r"Label word 'xqzvkwj' is \d+ tokens"):
        task.setup(tiny)
    with pytest.raises(ValueError, match="must contain"):
        GlueTask("sst2", template="{s1} It was .")
    with pytest.raises(ValueError, match="must contain"):
        GlueTask("qnli", template="{s1} ? {mask}")
    with pytest.raises(ValueError, match="2 labels"):
        GlueTask("sst2", label_words=["bad"])


def test_invalid_options_and_model_mismatch(tmp_path: Path) -> None:
    for kwargs, message in [
        ({"name": "cola"}, "valid choices: sst2, qnli, qqp, mnli"),
        ({"name": "sst2", "split": "dev"}, "valid choices: full, tune"),
        ({"name": "sst2", "truncation": "cut"}, "valid choices: warn, error"),
        ({"name": "sst2", "objective": "lm"}, "valid choices: classification, infilling"),
    ]:
        with pytest.raises(ValueError, match=message):
            GlueTask(**kwargs)
    write_sst2(tmp_path / "sst2")
    with pytest.raises(ValueError, match="needs a text model with a tokenizer"):
        GlueTask("sst2", data_root=str(tmp_path)).setup(WideResNetFactory())


def test_hub_failure_explains_the_offline_fix(
    monkeypatch: pytest.MonkeyPatch, tiny: HFEncoderFactory
) -> None:
    import datasets

    def offline(*args, **kwargs):
        raise ConnectionError("no network")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(RuntimeError, match=r"nyu-mll/glue/qqp.*no network.*data.root"):
        GlueTask("qqp").setup(tiny)


@pytest.mark.parametrize("split", ["train.tsv", "dev.tsv"])
def test_a_header_only_split_is_refused_in_setup_naming_the_file(
    tmp_path: Path, tiny: HFEncoderFactory, split: str
) -> None:
    """Every split is read and checked before training (an empty dev set used to fail at the first
    evaluation, an empty training set as "batch_size must be in [1, N=0]")."""
    write_sst2(tmp_path / "sst2")
    write_tsv(tmp_path / "sst2" / split, ["sentence", "label"], [])
    with pytest.raises(ValueError, match=rf"{split}: no examples below the header row"):
        GlueTask("sst2", data_root=str(tmp_path)).setup(tiny)


def test_a_file_that_is_not_utf8_is_named(tmp_path: Path, tiny: HFEncoderFactory) -> None:
    write_sst2(tmp_path / "sst2")
    (tmp_path / "sst2" / "train.tsv").write_bytes("sentence\tlabel\ncaf\xe9 cr\xe8me\t1\n".encode("latin-1"))
    with pytest.raises(
        ValueError, match=r"train\.tsv: not UTF-8 text \(invalid continuation byte: byte 0xe9\)"
    ):
        GlueTask("sst2", data_root=str(tmp_path)).setup(tiny)


def test_label_prompts_are_the_template_without_its_sentences(tmp_path: Path, tiny: HFEncoderFactory) -> None:
    write_sst2(tmp_path / "sst2", n_train=6, n_dev=4)
    task = GlueTask("sst2", data_root=str(tmp_path))
    task.setup(tiny)
    assert task.info.label_prompts == ("It was terrible .", "It was great .")
    write_mnli(tmp_path / "mnli")
    pairs = GlueTask(
        "mnli", data_root=str(tmp_path), template="{s1} ? {mask} ,  {s2}", label_words=["a", "b", "c"]
    )
    pairs.setup(tiny)
    assert pairs.info.label_prompts == ("? a ,", "? b ,", "? c ,")


@needs_sst2
def test_minilm_started_at_the_label_prompts_classifies_sst2_before_any_training() -> None:
    """The head at the encoder's own embeddings of "It was terrible ." / "It was great ." (model.head_init=
    label_prompts) classifies SST-2 dev without a step of training: 71.2% over all 872 sentences (50% is
    chance; a random head is a coin with a bias), here 71% of the first 100 (deterministic: fixed weights,
    data and prompts)."""
    factory = HFEncoderFactory("minilm", weights=MINILM, pooling="mean", head_init="label_prompts")
    task = GlueTask("sst2", data_root=str(DATA), subsample=8)
    task.setup(factory)
    model = factory.build(task.info).eval()
    dev = task.eval_sets["accuracy"][:100]
    with torch.no_grad():
        batch = task.collate(dev)
        logits = model(batch["input_ids"], batch["attention_mask"], batch.get("token_type_ids")).logits
    accuracy = float((logits.argmax(1) == batch["label"]).float().mean())
    assert accuracy > 0.65
