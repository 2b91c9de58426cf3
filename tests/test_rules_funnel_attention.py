"""Funnel Transformer's relative attention by rule (``rules/funnel_attention.py``): the gradient at its scores
read off the call's graph, its five own parameters in closed form. The two Funnel cases (relative shift and
factorized) are in ``test_engine_oracle`` (every strategy x clipping mode, padding, two micro-batches) and in
the sensitivity tests; here the rule alone (the fallback must not be taken), the class token not kept apart,
dropout in training, bf16 autocast, LoRA on the projections, frozen parameters, the module called without
token types against autograd one example at a time, and the refusals."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from dpexp.privacy import PrivacyEngine
from dpexp.privacy.capture import unsupported_modules
from tests.engine_models import funnel, make_case, segments_loss
from tests.oracle import check_clipped_step, engine_update, read_by_hand

pytestmark = pytest.mark.filterwarnings("ignore:noise_multiplier=0")

MICRO = [[0, 1, 2], [3, 4, 5]]
OWN = ("r_w_bias", "r_r_bias", "r_kernel", "r_s_bias", "seg_embed")


def _attentions(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if type(m).__name__ == "FunnelRelMultiheadAttention"]


@pytest.mark.parametrize("attention_type", ["relative_shift", "factorized"])
def test_funnel_needs_no_fallback(attention_type):
    assert unsupported_modules(funnel(attention_type)) == {}


@pytest.mark.parametrize("case", ["funnel", "funnel_factorized"])
@pytest.mark.parametrize(
    "strategy,clipping", [("bk", "per_layer"), ("ghost", "flat"), ("instantiate", "flat")]
)
@pytest.mark.parametrize("separate_cls", [True, False])
def test_rule_matches_oracle_without_the_fallback(case, strategy, clipping, separate_cls):
    model, loss, batch = make_case(case)
    model.config.separate_cls = separate_cls  # read at every call: no class-token mask
    with warnings.catch_warnings():
        warnings.filterwarnings("error", ".*torch.func fallback")
        check_clipped_step(model, loss, batch, MICRO, strategy, clipping)


@pytest.mark.parametrize("attention_type", ["relative_shift", "factorized"])
def test_training_with_dropout_adds_up_to_autograd(attention_type):
    """Dropout in training (the probabilities', the output's, the position encodings'): no oracle draws the
    same masks, but the engine's check of every micro-batch, the examples' gradients summed against
    autograd's for the same forward, must pass (it fails for a rule that misses the class-token mask)."""
    _, _, batch = make_case("funnel")
    model = funnel(attention_type, dropout=0.2).train()
    torch.manual_seed(0)
    delta, _ = engine_update(model, segments_loss, batch, MICRO, batch_size=6, max_grad_norm=1.0,
                             verify_every_step=True)  # fmt: skip
    assert all(delta[f"funnel.encoder.blocks.1.0.attention.{name}"].abs().max() > 0 for name in OWN)


@pytest.mark.parametrize("case", ["funnel", "funnel_factorized"])
def test_rule_matches_oracle_under_autocast(case):
    """CPU bf16 autocast: the scores' gradient read where autocast formed them (bf16), the kept projections
    in bf16; the whole update against the oracle under the same autocast, one example at a time, to 1e-2 of
    its norm (``tests/test_rules_autocast.py``'s bound)."""
    model, loss, batch = make_case(case)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", ".*torch.func fallback")
        check_clipped_step(model.float(), loss, batch, MICRO, "bk", "per_layer", rel=1e-2, autocast=True)


def test_lora_on_the_projections_matches_oracle():
    """LoRA (peft) on ``q_head`` and ``k_head``, the attention's own parameters trained beside it: the rule
    reads the wrapped projections' outputs, adapters included."""
    from peft import LoraConfig, get_peft_model

    model, loss, batch = make_case("funnel")
    config = LoraConfig(r=2, lora_alpha=4, target_modules=["q_head", "k_head"], init_lora_weights=False)
    model = get_peft_model(model, config).double().eval()
    for attention in _attentions(model):
        for name in OWN:
            getattr(attention, name).requires_grad_(True)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", ".*torch.func fallback")
        check_clipped_step(model, loss, batch, MICRO, "bk", "per_layer")


def test_some_parameters_frozen_match_oracle():
    model, loss, batch = make_case("funnel")
    first, second = _attentions(model)
    first.r_kernel.requires_grad_(False)
    second.seg_embed.requires_grad_(False)
    second.r_w_bias.requires_grad_(False)
    check_clipped_step(model, loss, batch, MICRO, "ghost", "per_layer")


@pytest.mark.parametrize("attention_type", ["relative_shift", "factorized"])
def test_without_token_types_matches_autograd_one_example_at_a_time(attention_type):
    """The module alone, called as the encoder calls it but with no token types (``token_type_mat``
    None): ``r_s_bias`` and ``seg_embed`` get zero for every example, the others autograd's. Pooled
    queries (the relative shift of 2) against the whole keys."""
    from dpexp.privacy.rules import rule_for

    model = funnel(attention_type)
    structure = model.funnel.encoder.attention_structure
    module = _attentions(model)[1]  # the second block's: queries pooled, keys not
    gen = torch.Generator().manual_seed(0)
    key = torch.randn(3, 9, 16, dtype=torch.float64, generator=gen)
    mask = torch.ones(3, 9, dtype=torch.float64)
    mask[0, 6:] = 0
    inputs = structure.init_attention_inputs(key, attention_mask=mask)
    structure.pooling_mult = 1
    query, inputs = structure.pre_attention_pooling(key, inputs)
    assert inputs[1] is None and query.shape[1] < key.shape[1]
    key.requires_grad_(True)
    kept = {"q": [], "k": []}
    module.q_head.register_forward_hook(lambda m, a, out: kept["q"].append(out))
    module.k_head.register_forward_hook(lambda m, a, out: kept["k"].append(out))
    for name in OWN:  # as the engine holds them: their gradients are its own
        getattr(module, name).requires_grad_(False)
    (out,) = module(query, key, key, inputs)
    args = rule_for(module).call.inputs(module, (query, key, key, inputs), {})
    dy = torch.randn(out.shape, dtype=torch.float64, generator=gen)
    reads = read_by_hand(module, args, out, [query, key, key], dy)
    kept_values = {name: values[:1] for name, values in kept.items()}
    grads = rule_for(module).per_example_grads(module, (*args, kept_values, reads), dy)
    for name in OWN:
        getattr(module, name).requires_grad_(True)
    for i in range(3):
        one = (*inputs[:2], inputs[2][i : i + 1], inputs[3])
        (single,) = module(query[i : i + 1], key[i : i + 1], key[i : i + 1], one)
        own = [getattr(module, name) for name in OWN]
        want = torch.autograd.grad(single, own, dy[i : i + 1], allow_unused=True)
        for name, expected in zip(OWN, want, strict=True):
            got = grads[name].instantiate()[i]
            expected = torch.zeros_like(got) if expected is None else expected
            torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12, msg=name)
    assert grads["seg_embed"].instantiate().abs().max() == 0


def test_returned_probabilities_are_refused_with_the_fix():
    model, _, batch = make_case("funnel")
    engine = PrivacyEngine(model, batch_size=6, sample_size=60, max_grad_norm=1.0, noise_multiplier=0.0)
    with pytest.raises(ValueError, match=r"FunnelRelMultiheadAttention: .*output_attentions=False"):
        inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "token_type_ids")}
        out = model(**inputs, output_attentions=True)
        out.logits.sum().backward()
    del engine


def test_another_own_parameter_is_refused_at_construction():
    model = funnel()
    _attentions(model)[0].extra = nn.Parameter(torch.zeros(3, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"FunnelRelMultiheadAttention: .*\['extra'\].*freeze r_w_bias"):
        PrivacyEngine(model, batch_size=6, sample_size=60, max_grad_norm=1.0, noise_multiplier=0.0)
