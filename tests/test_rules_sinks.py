"""Attention sinks (one learnt logit per head in every query row's softmax, ``rules/sinks.py``) against the
brute-force oracle. GPT-OSS's: every strategy x clipping mode is in ``test_engine_oracle`` (the ``gpt_oss``
case: padding, two micro-batches, float64, a sliding-window and a full layer); here the rule alone (the
fallback must not be taken), the returned probabilities reaching the loss, float32, frozen sinks, and the
refusals of what the rule cannot run again. The other models that
carry sinks (Flint, MiMo-V2-Flash, HY-V4, Granite-SWA, Granite-MoE-SWA: the score column, a gate after it,
the ``sigmoid(logsumexp - sink)`` scale) under every strategy x clipping mode."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpexp.privacy import PrivacyEngine
from dpexp.privacy.capture import unsupported_modules
from tests.engine_models import SINKS_DECODERS, _padded_text, diffllama, doge, gpt_oss, lm_loss, sinks_decoder
from tests.oracle import check_clipped_step

pytestmark = pytest.mark.filterwarnings("ignore:noise_multiplier=0")

MICRO = [[0, 1, 2], [3, 4, 5]]
REL = 1e-6  # float64, but GPT-OSS's RMSNorms compute in float32


def _batch(batch_size: int = 6) -> dict[str, torch.Tensor]:
    return _padded_text(batch_size, 8, 40, torch.Generator().manual_seed(0))


def _attention_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The language-model loss plus a fixed weighting of every layer's returned attention probabilities."""
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], output_attentions=True)
    weights = torch.Generator().manual_seed(1)
    extra = sum(
        (a * torch.randn(a.shape[1:], generator=weights, dtype=a.dtype)).flatten(1).sum(1)
        for a in out.attentions
    )
    logits, labels = out.logits[:, :-1], batch["labels"][:, 1:]
    losses = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none", ignore_index=-100)
    return losses.view(labels.shape).sum(1) + extra


def test_gpt_oss_needs_no_fallback():
    assert unsupported_modules(gpt_oss()) == {}


@pytest.mark.parametrize(
    "strategy,clipping", [("bk", "flat"), ("ghost", "per_layer"), ("instantiate", "flat")]
)
def test_sinks_rule_matches_oracle_without_the_fallback(strategy, clipping):
    torch.manual_seed(0)
    model = gpt_oss()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", ".*torch.func fallback")  # the attention must not take it
        check_clipped_step(model, lm_loss, _batch(), MICRO, strategy, clipping, rel=REL)


@pytest.mark.parametrize("strategy", ["bk", "instantiate"])
def test_returned_probabilities_in_the_loss_match_oracle(strategy):
    """The probabilities the attention returns reach the loss: their gradient enters the sinks' too. They
    reach it through Hugging Face's output recorder, a forward hook installed at the first forward that asks
    for attentions (the oracle's, before the engine's hooks): the engine's hook runs first all the same, so
    the recorder keeps the outputs the engine passed through, and their gradient reaches the rule."""
    torch.manual_seed(0)
    model = gpt_oss()
    check_clipped_step(model, _attention_loss, _batch(), MICRO, strategy, "per_layer", rel=REL)


def test_float32_matches_oracle():
    torch.manual_seed(0)
    check_clipped_step(gpt_oss().float(), lm_loss, _batch(), MICRO, "bk", "flat", rel=1e-5, floor=1e-6)


def test_frozen_sinks_need_no_rule():
    model = gpt_oss()
    for layer in model.model.layers:
        layer.self_attn.sinks.requires_grad_(False)
    check_clipped_step(model, lm_loss, _batch(), MICRO, "bk", "flat", rel=REL)


@pytest.mark.parametrize("clipping", ["flat", "per_layer", "groups"])
@pytest.mark.parametrize("strategy", ["bk", "ghost", "instantiate"])
@pytest.mark.parametrize("architecture", list(SINKS_DECODERS))
def test_every_model_with_sinks_matches_oracle_without_the_fallback(architecture, strategy, clipping):
    torch.manual_seed(0)
    model = sinks_decoder(architecture)
    left = {name.rsplit(".", 1)[1] for name in unsupported_modules(model)}
    assert not {name for name in left if name.endswith("Attention")}, left  # HY-V4's hyper-connections stay
    groups = 2 if clipping == "groups" else None
    check_clipped_step(model, lm_loss, _batch(), MICRO, strategy, clipping, groups=groups, rel=REL)


def _engine(model: nn.Module) -> PrivacyEngine:
    return PrivacyEngine(model, batch_size=6, sample_size=60, max_grad_norm=1.0, noise_multiplier=0.0)


def _other_implementation(model: nn.Module) -> None:
    """The eager function registered under another name: the rule cannot know what it computes."""
    from transformers import AttentionInterface
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    AttentionInterface.register("dpexp_test_sinks", eager_attention_forward)
    model.config._attn_implementation = "dpexp_test_sinks"


def _dropout(model: nn.Module) -> None:
    model.train()
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.1


def _cache(model: nn.Module) -> None:
    model.config.use_cache = True


@pytest.mark.parametrize(
    "change,match",
    [
        (_other_implementation, r"\(GptOssAttention\): attention implementation 'dpexp_test_sinks'.*'eager'"),
        (_dropout, r"\(GptOssAttention\): applies attention dropout \(p=0.1\)"),
        (_cache, r"\(GptOssAttention\): was given a key/value cache.*use_cache=False"),
    ],
    ids=["other_implementation", "attention_dropout", "cache"],
)
def test_what_the_rule_cannot_run_again_is_refused_at_the_call(change, match):
    model = gpt_oss()
    engine = _engine(model)
    change(model)
    with pytest.raises(ValueError, match=match):
        engine.backward(lm_loss(model, _batch()))


@pytest.mark.parametrize(
    "build,match",
    [
        (gpt_oss, r"GptOssAttention: .*o_proj is a Sequential, not an nn.Linear"),
        (diffllama, r"DiffLlamaAttention: .*o_proj is a Sequential"),  # rules/differential.py's run
        (doge, r"DogeAttention: .*o_proj is a Sequential"),  # rules/dynamic_mask.py's run
    ],
    ids=["gpt_oss", "diffllama", "doge"],
)
def test_a_wrapped_output_projection_is_refused_at_construction(build, match):
    """The rules that run their module again in forward mode read the heads' gradient through o_proj."""
    model = build()
    attention = model.model.layers[0].self_attn
    attention.o_proj = nn.Sequential(attention.o_proj)
    with pytest.raises(ValueError, match=match):
        _engine(model)
