"""nGPT's learnt scales by rule (``rules/ngpt.py``): Dory's decoder-layer rates, MLP and attention scaling
factors, with the gradients inside the call read off its graph. A tiny Dory whose recurrent layer is called
twice against the oracle (every strategy x clipping mode is in ``test_rules_decoder_modules.py``), under
sdpa, frozen scales, and the refusal of a forward the rule does not reproduce (of a graph without the reads:
``test_engine_graph_reads.py``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dpexp.privacy import PrivacyEngine
from dpexp.privacy.capture import unsupported_modules
from tests.engine_models import dory, lm_loss
from tests.oracle import check_clipped_step
from tests.test_rules_decoder_modules import MODELS, batch

pytestmark = pytest.mark.filterwarnings("ignore:noise_multiplier=0")

MICRO = [[0, 1, 2], [3, 4, 5]]


def test_needs_no_fallback():
    assert unsupported_modules(dory()) == {}


def test_rules_match_oracle_with_a_layer_called_in_two_loops():
    torch.manual_seed(0)
    check_clipped_step(dory(), lm_loss, batch(), MICRO, "bk", "per_layer", **MODELS["dory"][1])


def test_attention_under_sdpa_matches_oracle():
    """The scaled queries' product is found by the value it keeps, whatever attention function follows."""
    model = dory()
    model.config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    check_clipped_step(model, lm_loss, batch(), MICRO, "bk", "flat", **MODELS["dory"][1])


def test_partly_frozen_scales():
    model = dory()
    for layer in model.model.layers:
        layer.mlp.suv_up.requires_grad_(False)
        layer.lambda_2.requires_grad_(False)
        layer.self_attn.s_gate.requires_grad_(False)
    torch.manual_seed(0)
    check_clipped_step(model, lm_loss, batch(), MICRO, "ghost", "flat", **MODELS["dory"][1])


def _engine(model: nn.Module) -> PrivacyEngine:
    return PrivacyEngine(model, batch_size=6, sample_size=60, max_grad_norm=1.0, noise_multiplier=0.0)


def _mlp_forward(gate_factor: float, second_activation: bool):
    """Dory's MLP forward with its scaled gate times ``gate_factor``, its activation called once more."""

    def forward(self, hidden_states):
        gate = self.gate_proj(hidden_states) * (self.suv_gate * self.suv_scale * gate_factor)
        up = self.up_proj(hidden_states) * (self.suv_up * self.suv_scale)
        product = self.act_fn(gate) * up
        return self.down_proj(self.ffn_sub_norm(product + self.act_fn(up) if second_activation else product))

    return forward


def _layer_forward(self, hidden_states, attention_mask=None, position_embeddings=None, cache=None, **kwargs):
    """Dory's decoder layer with its first rate squared instead of taken absolute."""
    h = self.input_layernorm(hidden_states)
    a, _ = self.self_attn(h, attention_mask=attention_mask, position_embeddings=position_embeddings)
    h = h + (self.lambda_1 * self.lambda_scale).square() * (self.post_attention_layernorm(a) - h)
    h = self.pre_feedforward_layernorm(h)
    m = self.post_feedforward_layernorm(self.mlp(h))
    return h + (self.lambda_2 * self.lambda_scale).abs() * (m - h)


@pytest.mark.parametrize(
    "kind,forward,error,match",
    [
        # the rule recomputes the scaled gate from the kept values: another scale is not reproduced
        (
            "DoryMLP",
            _mlp_forward(2.0, False),
            RuntimeError,
            r"DoryMLP: .*scaled gate does not reproduce.*suv_gate",
        ),
        (
            "DoryDecoderLayer",
            _layer_forward,
            RuntimeError,
            r"DoryDecoderLayer: .*h1 does not reproduce.*lambda_1",
        ),
        # two calls of the activation: which one's input is the scaled gate is not known, nothing is read
        (
            "DoryMLP",
            _mlp_forward(1.0, True),
            ValueError,
            r"DoryMLP: the nGPT rule reads .*other than once.*suv_",
        ),
    ],
    ids=["mlp-scaled-otherwise", "layer-rate-otherwise", "activation-called-twice"],
)
def test_a_forward_the_rule_does_not_follow_is_refused(monkeypatch, kind, forward, error, match):
    from transformers.models.dory import modeling_dory

    model = dory()
    engine = _engine(model)
    monkeypatch.setattr(getattr(modeling_dory, kind), "forward", forward)
    with pytest.raises(error, match=match):
        engine.backward(lm_loss(model, batch()))


def test_an_output_gate_the_rule_does_not_reproduce_is_refused(monkeypatch):
    from transformers.models.dory import modeling_dory

    original = torch.sigmoid

    def shifted(x):  # the module's gate only: its sigmoid of the scaled gate states, moved
        return original(x + 0.1) if x.dim() == 3 and x.shape[-1] == 16 else original(x)

    model = dory()
    engine = _engine(model)
    monkeypatch.setattr(modeling_dory.torch, "sigmoid", shifted)
    loss = lm_loss(model, batch())
    monkeypatch.setattr(modeling_dory.torch, "sigmoid", original)
    with pytest.raises(RuntimeError, match=r"DoryAttention: .*output gate does not reproduce.*freeze sqk"):
        engine.backward(loss)


def test_another_own_parameter_is_refused_at_construction():
    model = dory()
    model.model.layers[0].mlp.extra = nn.Parameter(torch.zeros(3, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"DoryMLP: .*parameters \['extra'\].*freeze suv_gate and suv_up"):
        _engine(model)


def test_reproduction_holds_where_the_forward_gave_nan():
    """A text of padding only gives NaN in Dory's eager attention; the rules' check that they follow the
    forward compares the finite values and NaN where the forward has NaN (the sensitivity harness's padding
    neighbour), and still tells a different value apart."""
    from dpexp.privacy.rules.functional import reproduces

    recorded = torch.tensor([[1.0, 2.0], [float("nan"), float("nan")]])
    assert reproduces(recorded, recorded.clone())
    assert not reproduces(recorded, torch.tensor([[1.0, 2.5], [float("nan"), float("nan")]]))
    assert not reproduces(recorded, torch.tensor([[1.0, 2.0], [0.0, float("nan")]]))
