"""SAMSum task on small generated files in the original release format (no offline copy exists)."""

from pathlib import Path

import pytest
import torch

from dpexp.tasks.generation import IGNORE
from dpexp.tasks.samsum import SAMSumTask
from tests.generation_helpers import tiny_factory, write_json

DIALOGUES = [
    {
        "id": "13818513",
        "summary": "Amanda baked cookies and will bring Jerry some tomorrow.",
        "dialogue": "Amanda: I baked  cookies. Do you want some?\r\nJerry: Sure!\r\n"
        "Amanda: I'll bring you tomorrow :-)",
    },
    {
        "id": "13728867",
        "summary": "Olivia and Olivier are voting for liberals in this election.",
        "dialogue": "Olivia: Who are you voting for in this election? \r\nOliver: Liberals as always.\r\n"
        "Olivia: Me too!!",
    },
    {
        "id": "13681000",
        "summary": "Tim will send Kim the report tonight.",
        "dialogue": "Kim: Where is the report?\r\nTim: I'll send it tonight.",
    },
]


@pytest.fixture
def samsum_root(tmp_path: Path) -> Path:
    write_json(tmp_path / "samsum" / "train.json", DIALOGUES)
    write_json(tmp_path / "samsum" / "test.json", DIALOGUES[:2])
    return tmp_path


def make_task(root: Path, **kwargs: object) -> SAMSumTask:
    task = SAMSumTask(data_root=str(root), **{"max_new_tokens": 6, **kwargs})
    task.setup(tiny_factory())
    return task


def test_instruction_format_and_loss_only_on_the_summary(samsum_root: Path) -> None:
    task = make_task(samsum_root)
    tok = task.tokenizer
    example = task.train_dataset[2]
    assert tok.decode(example["input_ids"]) == (
        "Summarize the following dialogue\nKim: Where is the report?\nTim: I'll send it tonight.\nTL;DR: "
        "Tim will send Kim the report tonight.<|endoftext|>"
    )
    labels = task.collate([example])["labels"][0]
    assert tok.decode(labels[labels != IGNORE]) == " Tim will send Kim the report tonight.<|endoftext|>"
    assert tok.decode(example["input_ids"][: example["prompt_length"]]).endswith("\nTL;DR:")
    assert task.info.lora["rank"] == 32 and task.num_beams == 4


def test_lora_model_from_the_task_request(samsum_root: Path) -> None:
    task = make_task(samsum_root)
    model = tiny_factory().build(task.info)
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in name for name in trainable)
    assert {p.shape[0] for n, p in model.named_parameters() if "lora_A" in n} == {32}
    batch = task.collate([task.train_dataset[i] for i in range(3)])
    loss = task.per_example_loss(model, batch)
    assert loss.shape == (3,)
    loss.sum().backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if "lora_B" in n)
    assert model.get_base_model().transformer.wte.weight.grad is None  # frozen tied embedding


def test_evaluate_reports_rouge_1_2_l(samsum_root: Path) -> None:
    task = make_task(samsum_root)
    torch.manual_seed(0)
    metrics = task.evaluate(tiny_factory().build(task.info), batch_size=4)
    assert set(metrics) == {"rouge1", "rouge2", "rougeL", "nll", "eval_inputs"}
    assert metrics["eval_inputs"] == 2
    assert all(0.0 <= metrics[k] <= 100.0 for k in ("rouge1", "rouge2", "rougeL"))


def test_full_fine_tuning_when_lora_is_off(samsum_root: Path) -> None:
    task = make_task(samsum_root, lora=None)
    model = tiny_factory().build(task.info)
    assert all(p.requires_grad for p in model.parameters())


def test_errors(tmp_path: Path, samsum_root: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"train\.json not found"):
        make_task(tmp_path / "empty")
    write_json(tmp_path / "bad" / "samsum" / "train.json", [{"id": "1", "dialogue": "A: hi"}])
    write_json(tmp_path / "bad" / "samsum" / "test.json", DIALOGUES)
    with pytest.raises(ValueError, match="record 0 needs fields 'dialogue' and 'summary'"):
        make_task(tmp_path / "bad")
    with pytest.raises(FileNotFoundError, match=r"val\.json not found"):
        make_task(samsum_root, eval_split="dev")
