"""Learned positions that compute their own indices (OPT's from the attention mask, MVP's and TrOCR's from
the input's length, each offset by 2; Whisper's decoder's, indexing its table by the position ids) against
the brute-force oracle, with no module left to the fallback; OPT with position ids of its caller's own; and
the refusal of a forward that does not return one lookup of its table."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpexp.privacy.capture import unsupported_modules
from dpexp.privacy.rules.embedding import lookup_inputs
from tests.engine_models import _padded_text, lm_loss, opt, speech_batch, speech_loss, whisper
from tests.oracle import check_clipped_step

SETTINGS = [("bk", "flat", None), ("ghost", "per_layer", None), ("instantiate", "groups", 2)]


def _decoder(model_type: str) -> nn.Module:
    """A tiny float64 causal LM of MVP's or TrOCR's decoder (learned positions, offset 2); its cross-attention
    layers, which a causal LM without encoder states never calls, frozen."""
    import transformers

    sizes = {"vocab_size": 40, "d_model": 16, "decoder_layers": 2, "decoder_attention_heads": 2,
             "decoder_ffn_dim": 24, "max_position_embeddings": 16, "pad_token_id": 1, "dropout": 0.0,
             "attention_dropout": 0.0, "activation_dropout": 0.0, "use_cache": False}  # fmt: skip
    if model_type == "trocr":
        sizes |= {"hidden_size": 16, "use_learned_position_embeddings": True, "layernorm_embedding": True}
    config = transformers.AutoConfig.for_model(model_type, **sizes)
    model = transformers.AutoModelForCausalLM.from_config(config).double().eval()
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(".encoder_attn" not in name)
    return model


BUILDERS = {
    "opt": opt,
    "mvp": lambda: _decoder("mvp"),
    "trocr": lambda: _decoder("trocr"),
    "whisper": lambda: whisper(decoder_only=True),
}


@pytest.mark.parametrize("strategy,clipping,groups", SETTINGS)
@pytest.mark.parametrize("name", list(BUILDERS))
def test_learned_positions_match_oracle(name, strategy, clipping, groups):
    model = BUILDERS[name]()
    assert unsupported_modules(model) == {}
    batch = _padded_text(6, 10, 40, torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "noise_multiplier=0")
        warnings.filterwarnings("error", ".*torch.func fallback")
        check_clipped_step(
            model, lm_loss, batch, [[0, 1, 2], [3, 4, 5]], strategy, clipping, groups, rel=1e-8
        )


def test_opt_positions_passed_by_the_caller_are_the_ones_looked_up():
    """The rule reads the indices the module looks up, not a recomputation from the mask: position ids of
    the caller's own (every example shifted by its own amount) are exact too."""
    batch = _padded_text(6, 10, 40, torch.Generator().manual_seed(1))
    batch["position_ids"] = torch.arange(10).repeat(6, 1) + torch.arange(6)[:, None] % 3

    def loss(model: nn.Module, b: dict) -> torch.Tensor:
        out = model(
            input_ids=b["input_ids"], attention_mask=b["attention_mask"], position_ids=b["position_ids"]
        )
        labels = b["labels"][:, 1:]
        tokens = F.cross_entropy(out.logits[:, :-1].flatten(0, 1), labels.flatten(), reduction="none")
        return tokens.view(labels.shape).sum(1)

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "noise_multiplier=0")
        check_clipped_step(opt(), loss, batch, [[0, 1, 2], [3, 4, 5]], "bk", "per_layer", rel=1e-8)


def test_whisper_speech_to_text_matches_oracle():
    """The whole model on log-mel features (B, mels, frames): its encoder's sinusoidal positions are frozen,
    its decoder's learned ones looked up per example."""
    model = whisper()
    assert unsupported_modules(model) == {}
    batch = speech_batch(4, torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "noise_multiplier=0")
        warnings.filterwarnings("error", ".*torch.func fallback")
        check_clipped_step(model, speech_loss, batch, [[0, 1], [2, 3]], "bk", "per_layer", rel=1e-8)


class _Scaled(nn.Embedding):
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids + 2) * 2.0  # returns something else than its lookup


class _Twice(nn.Embedding):
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids) + super().forward(ids + 1)


class _Indexed(nn.Embedding):
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weight[ids + 1]


@pytest.mark.parametrize(
    "module,message",
    [
        (_Scaled(8, 3), "returns something else than its lookup"),
        (_Twice(8, 3), "makes 2 lookups"),
        (_Indexed(8, 3, padding_idx=0), "indexes its table, which has a padding_idx"),
    ],
)
def test_a_forward_that_is_not_one_lookup_is_refused(module, message):
    with pytest.raises(ValueError, match=message):
        lookup_inputs(module, (torch.randint(0, 5, (2, 3)),), {})


def test_the_indices_are_the_lookups_own():
    table = nn.Embedding(8, 3)
    ids = torch.randint(0, 5, (2, 3))
    (looked_up,) = lookup_inputs(_Plus2(8, 3), (ids,), {})
    assert torch.equal(looked_up, ids + 2) and lookup_inputs(table, (ids,), {})[0] is ids
    assert torch.equal(lookup_inputs(_Indexed(8, 3), (ids,), {})[0], ids + 1)


class _Plus2(nn.Embedding):
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids + 2)


@pytest.mark.filterwarnings("ignore:noise_multiplier=0")
def test_a_cpmant_bias_that_is_not_its_lookup_moved_is_refused_at_the_call(monkeypatch):
    """CPM-Ant's segment position bias (its rule: ``test_rules_decoder_modules.py``) returns its lookup moved
    to (B, heads, T, T); a forward that returns anything else is refused."""
    from transformers.models.cpmant.modeling_cpmant import CpmAntSegmentPositionEmbedding

    from dpexp.privacy import PrivacyEngine
    from tests.engine_models import cpmant

    forward = CpmAntSegmentPositionEmbedding.forward
    monkeypatch.setattr(CpmAntSegmentPositionEmbedding, "forward", lambda self, *a: 2 * forward(self, *a))
    model = cpmant()
    engine = PrivacyEngine(model, batch_size=6, sample_size=60, max_grad_norm=1.0, noise_multiplier=0.0)
    with pytest.raises(ValueError, match=r"CpmAntSegmentPositionEmbedding.*its lookup moved to \(B, heads"):
        engine.backward(lm_loss(model, _padded_text(6, 8, 40, torch.Generator().manual_seed(0))))
