"""Hyper-connections' weights by rule (``rules/hyper_connections.py``): DeepSeek-V4's and GLM-5-Next's (pre,
post and the Sinkhorn-projected comb) and HY-V4's (pre and post) connections and final heads, with the
gradients at each group's scaled logits read off the call's graph. Tiny models against the oracle, the scales
and biases drawn (HY-V4's in every strategy x clipping mode in ``test_rules_decoder_modules.py``), frozen
parts, and the refusals of a forward the rule does not follow and of parameters it does not know (of a graph
without the reads: ``test_engine_graph_reads.py``)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from dpexp.privacy import PrivacyEngine
from dpexp.privacy.capture import unsupported_modules
from tests.engine_models import glm5_next, hyper_connected, lm_loss, new_moe
from tests.oracle import check_clipped_step, clipped_mean, engine_update, group_norms, per_example_grads
from tests.test_rules_decoder_modules import batch

pytestmark = pytest.mark.filterwarnings("ignore:noise_multiplier=0", "ignore:.*torch.func fallback")

MICRO = [[0, 1, 2], [3, 4, 5]]
TOLERANCE = {"rel": 1e-5}  # the modules compute in float32 in the float64 models


def test_no_hyper_connection_needs_the_fallback():
    assert unsupported_modules(new_moe("hy_v4")) == {}
    assert unsupported_modules(new_moe("deepseek_v4")) == {}  # its compressor too (rules/compressor.py)
    assert unsupported_modules(glm5_next()) == {}


def test_glm5_next_connections_match_oracle():
    """GLM-5-Next's connections (DeepSeek-V4's form, 2 streams) between a delta-attention and an MLA layer;
    its head is a plain mean."""
    torch.manual_seed(0)
    check_clipped_step(glm5_next().train(), lm_loss, batch(), MICRO, "ghost", "per_layer", **TOLERANCE)


@pytest.mark.parametrize(("name", "strategy", "clipping"), [("deepseek_v4", "bk", "per_layer"),
                         ("deepseek_v4", "ghost", "flat"), ("hy_v4", "bk", "per_layer")])  # fmt: skip
def test_drawn_weights_match_oracle(name, strategy, clipping):
    torch.manual_seed(0)
    check_clipped_step(hyper_connected(name), lm_loss, batch(), MICRO, strategy, clipping, **TOLERANCE)


@pytest.mark.parametrize("name", ["deepseek_v4", "hy_v4"])
def test_the_rule_is_exact_where_the_modules_compute_in_float64(monkeypatch, name):
    """With ``Tensor.float`` the identity the modules compute in the float64 model's precision: the rule's
    batched gradients then equal the oracle's to float64 rounding, so what the float32 tests allow is the
    modules' own float32 rounding (batched against one example at a time), not the rule's. The other
    parameters are frozen (some of them cast to float32 otherwise): the first connection's input then needs
    no gradient, and the capture anchors it so that its call builds the graph the rule reads."""
    monkeypatch.setattr(torch.Tensor, "float", lambda self, *args, **kwargs: self)
    model = hyper_connected(name).requires_grad_(False)
    for module in model.modules():
        if "Hyper" in type(module).__name__:
            module.requires_grad_(True)
    torch.manual_seed(0)
    check_clipped_step(model, lm_loss, batch(), MICRO, "bk", "per_layer", rel=1e-10, floor=1e-14)


def test_partly_frozen_weights_match_oracle():
    model = hyper_connected("deepseek_v4")
    for layer in model.model.layers:
        layer.attn_hc.scale.requires_grad_(False)
        layer.ffn_hc.fn.requires_grad_(False)
    model.model.hc_head.hc_base.requires_grad_(False)
    torch.manual_seed(0)
    check_clipped_step(model, lm_loss, batch(), MICRO, "bk", "per_layer", **TOLERANCE)


@pytest.mark.parametrize(("name", "strategy", "clipping"), [("deepseek_v4", "ghost", "flat"),
                         ("deepseek_v4", "bk", "per_layer"), ("hy_v4", "bk", "per_layer")])  # fmt: skip
def test_bfloat16_autocast_is_close_to_the_oracle_under_the_same_autocast(name, strategy, clipping):
    """DeepSeek-V4's projections run in autocast's bf16 (the rule recomputes them in the dtype recorded at the
    call: before, it recomputed them in float32 and refused the model as a forward it does not follow);
    HY-V4's turn autocast off (recomputed in float32 although autocast is on at the call). The oracle runs
    each example alone under the same autocast; what is left is bf16's rounding, batched against one example
    at a time (the update moves by 10-70% in the connections between bf16 and float32). Individual biases'
    entries differ by up to 7% (their examples' gradients cancel in the clipped mean): the connections'
    parameters are compared as a whole."""
    torch.manual_seed(0)
    model = hyper_connected(name).float()

    def autocast_loss(m, b):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return lm_loss(m, b).float()

    grads = per_example_grads(model, autocast_loss, batch())
    partition = _engine(copy.deepcopy(model), clipping=clipping).groups
    thresholds = group_norms(grads, partition).median(0).values.clamp_min(1e-12).tolist()  # unrouted: any
    expected = clipped_mean(grads, partition, thresholds, batch_size=6)
    delta, _ = engine_update(
        model, autocast_loss, batch(), MICRO, batch_size=6, strategy=strategy, clipping=clipping,
        thresholds=thresholds, max_grad_norm=1.0,
    )  # fmt: skip
    for names in (list(expected), [n for n in expected if "hc" in n]):  # all, the connections'
        got, want = (torch.cat([d[n].flatten() for n in names]) for d in (delta, expected))
        assert (got - want).norm() / want.norm() < 1e-2, f"{len(names)} parameters"


def _engine(model: nn.Module, **kwargs) -> PrivacyEngine:
    return PrivacyEngine(
        model, batch_size=6, sample_size=60, max_grad_norm=1.0, noise_multiplier=0.0, **kwargs
    )


def test_a_forward_the_rule_does_not_follow_is_refused(monkeypatch):
    """Connections and head whose weights take the sigmoid of their logits moved by 0.1: not the affine map
    of the mixes the rule's formulas differentiate."""
    from transformers.models.hy_v4 import modeling_hy_v4

    original = torch.sigmoid

    def shifted(x):  # the connections' pre and post logits only: (B, T, 4 streams)
        return original(x + 0.1) if x.dim() == 3 and x.shape[-1] == 4 else original(x)

    model = hyper_connected("hy_v4")
    engine = _engine(model)
    monkeypatch.setattr(modeling_hy_v4.torch, "sigmoid", shifted)
    loss = lm_loss(model, batch())
    monkeypatch.setattr(modeling_hy_v4.torch, "sigmoid", original)
    with pytest.raises(RuntimeError, match=r"HYV4Hyper\w+: .*group 0's sigmoid does not reproduce"):
        engine.backward(loss)


def test_another_own_parameter_is_refused_at_construction():
    model = new_moe("deepseek_v4")
    model.model.layers[0].attn_hc.extra = nn.Parameter(torch.zeros(3, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"DeepseekV4HyperConnection: .*\['extra'\].*freeze fn, base, scale"):
        _engine(model)


def test_weights_of_other_groups_are_refused_at_construction():
    """A projection with rows for groups the rule does not know (here one more stream's worth)."""
    model = new_moe("hy_v4")
    head = model.model.hc_head
    head.hc_fn = nn.Parameter(torch.zeros(head.hc_mult + 1, head.hc_fn.shape[1], dtype=torch.float64))
    with pytest.raises(ValueError, match=r"HYV4HyperHead: .*hc_fn \(5, 64\), .* do not fit .*\(4 projection"):
        _engine(model)
