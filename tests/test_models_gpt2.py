"""GPT-2 factory: offline tokenizer training, task checks, tied embeddings, LoRA, beam search."""

import copy

import pytest
import torch
from transformers import GPT2LMHeadModel

import dpexp.models.causal_lm as causal_lm_module
from dpexp.metrics.generation import beam_search
from dpexp.models.base import TaskInfo
from dpexp.models.causal_lm import EOS, PAD, train_byte_level_bpe
from dpexp.models.gpt2 import GPT2Factory
from dpexp.models.lora import apply_lora
from tests.generation_helpers import tiny_factory

CORPUS = [
    "name : The Mill | Type : pub",
    "The Mill is a pub near Café Rouge.",
    "Prices range from £20-25 at the riverside.",
    "Aromi serves Italian food in the city centre.",
] * 5


def generation_info(vocab_size: int = 300, lora: dict | None = None) -> TaskInfo:
    return TaskInfo(
        "e2e", "generation", vocab_size=vocab_size, pad_token_id=1, eos_token_id=0, max_length=64, lora=lora
    )


def test_trained_tokenizer_is_deterministic_and_lossless() -> None:
    first = train_byte_level_bpe(CORPUS, vocab_size=300, model_max_length=128)
    second = train_byte_level_bpe(list(CORPUS), vocab_size=300, model_max_length=128)
    assert first.backend_tokenizer.to_str() == second.backend_tokenizer.to_str()
    text = "Zürich´s café costs €30 — never seen characters"
    assert first.encode(text) == second.encode(text)
    assert first.decode(first.encode(text)) == text  # every byte is in the initial alphabet
    assert (first.eos_token, first.bos_token, first.pad_token) == (EOS, EOS, PAD)
    assert first.eos_token_id != first.pad_token_id
    assert first.model_max_length == 128
    assert len(first.encode("The Mill is a pub")) < len("The Mill is a pub")  # merges were learnt


def test_auto_tokenizer_falls_back_to_training_without_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    def not_cached(name: str, local_files_only: bool = False) -> None:
        assert local_files_only, "auto must never contact the hub"
        raise OSError(f"{name} not cached")

    monkeypatch.setattr(causal_lm_module, "hub_tokenizer", not_cached)
    tokenizer = tiny_factory(tokenizer="auto").tokenizer(corpus=CORPUS)
    assert tokenizer.pad_token == PAD and tokenizer.model_max_length == 128


def test_trained_tokenizer_needs_a_corpus() -> None:
    with pytest.raises(ValueError, match="corpus"):
        tiny_factory().tokenizer()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"pretrained": "openai-community/gpt2", "config": {"n_layer": 2}}, "not both"),
        ({"pretrained": None, "config": None}, "neither"),
        ({"pretrained": "openai-community/gpt2", "tokenizer": "trained"}, "own hub tokenizer"),
        ({"pretrained": None, "config": {"n_layers": 2}}, "n_layers"),
        ({"pretrained": None, "config": {"vocab_size": 5}}, "vocab_size"),
        ({"pretrained": None, "config": {"n_layer": 2}, "tokenizer": "sentencepiece"}, "tokenizer must be"),
    ],
)
def test_factory_rejects_bad_settings(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        GPT2Factory(**kwargs)


def test_build_random_gpt2_with_tied_embeddings() -> None:
    model = tiny_factory().build(generation_info())
    assert isinstance(model, GPT2LMHeadModel)
    assert model.lm_head.weight is model.transformer.wte.weight
    assert model.config.vocab_size == 300 and model.config.n_layer == 2
    assert model.generation_config.eos_token_id == 0 and model.generation_config.pad_token_id == 1


def test_build_rejects_other_task_kinds_and_long_sequences() -> None:
    with pytest.raises(ValueError, match="classification"):
        tiny_factory().build(TaskInfo("sst2", "classification", num_labels=2, vocab_size=300, pad_token_id=1))
    too_long = TaskInfo("e2e", "generation", vocab_size=300, pad_token_id=1, max_length=500, eos_token_id=0)
    with pytest.raises(ValueError, match="128 positions"):
        tiny_factory().build(too_long)
    with pytest.raises(ValueError, match="setup"):
        tiny_factory().build(TaskInfo("e2e", "generation", vocab_size=300, pad_token_id=1))


def test_lora_trains_only_adapters_and_starts_at_the_base_model() -> None:
    torch.manual_seed(0)
    base = tiny_factory().build(generation_info())
    wrapped = apply_lora(copy.deepcopy(base), rank=4, alpha=8)
    trainable = {name: p for name, p in wrapped.named_parameters() if p.requires_grad}
    assert trainable and all("lora_A" in name or "lora_B" in name for name in trainable)
    # c_attn of each of the 2 layers: A (4, 32) and B (96, 4).
    assert sum(p.numel() for p in trainable.values()) == 2 * (4 * 32 + 96 * 4)
    inner = wrapped.get_base_model()
    assert inner.lm_head.weight is inner.transformer.wte.weight  # still tied, and frozen
    assert not inner.transformer.wte.weight.requires_grad
    ids = torch.randint(2, 300, (2, 7))
    base.eval()  # no dropout
    wrapped.eval()
    with torch.no_grad():
        torch.testing.assert_close(wrapped(input_ids=ids).logits, base(input_ids=ids).logits)  # B = 0 at init


def test_lora_follows_the_task_unless_the_factory_sets_it() -> None:
    task_lora = {"rank": 4, "alpha": 4, "dropout": 0.0, "target_modules": ["c_attn"]}
    from_task = tiny_factory().build(generation_info(lora=task_lora))
    ranks = {p.shape[0] for n, p in from_task.named_parameters() if "lora_A" in n}
    assert ranks == {4}
    own = tiny_factory(lora={"rank": 2, "alpha": 2}).build(generation_info(lora=task_lora))
    assert {p.shape[0] for n, p in own.named_parameters() if "lora_A" in n} == {2}


def test_beam_search_batched_equals_one_by_one_and_stops_at_eos() -> None:
    torch.manual_seed(0)
    model = tiny_factory().build(generation_info())
    model.train()
    prompts = [[5, 6, 7, 8, 9, 0], [10, 0], [11, 12, 13, 0]]
    kwargs = {"pad_token_id": 1, "eos_token_id": 0, "num_beams": 3, "max_new_tokens": 6}
    batched = beam_search(model, prompts, batch_size=3, **kwargs)
    single = [beam_search(model, [p], batch_size=1, **kwargs)[0] for p in prompts]
    assert batched == single
    assert all(len(ids) <= 6 and 0 not in ids for ids in batched)
    assert model.training  # mode restored
    with pytest.raises(ValueError, match="at least one token"):
        beam_search(model, [[]], batch_size=1, **kwargs)
