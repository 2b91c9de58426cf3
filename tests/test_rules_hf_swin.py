"""Hugging Face Swin's ``SwinAttention`` (the ``relative_position_bias_table`` of its
``SwinRelativePositionBias``, added to the scores of every window of every example inside the attention
function) and Swin V2's ``Swinv2SelfAttention`` (scaled cosine attention: a learnt per-head temperature
``logit_scale``, and a relative position bias computed by an MLP from a coordinate buffer shared by all
examples) against the brute-force oracle in every strategy x clipping mode (float64, sdpa, two
micro-batches): two-stage models whose first stage has 4 windows per example, plain and shifted (with the
shift mask), and whose second stage has one; eager Swin attention in float32, attention probabilities in
the loss; window-major rows refused by the probe; and the refusals of what the rules cannot read or
recompute."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
from torch import nn

from dpexp.privacy import PrivacyEngine
from dpexp.privacy.capture import unsupported_modules
from dpexp.privacy.verification import VerificationError
from tests.layer_models import HFSwinNet as SwinNet
from tests.layer_models import HFSwinSelfAttentionNet as SelfAttentionNet
from tests.layer_models import HFSwinv2Net as Swinv2Net
from tests.layer_models import hf_swin_batch as _batch
from tests.layer_models import hf_swin_loss as loss_fn
from tests.oracle import SETTINGS, check_clipped_step

pytestmark = pytest.mark.filterwarnings("ignore:noise_multiplier=0")

MICRO = [[0, 1, 2], [3, 4, 5]]
NETS = {"swin": SwinNet, "swinv2": Swinv2Net, "donut_swin": SelfAttentionNet}


@pytest.mark.parametrize("net", NETS)
def test_hf_swin_needs_no_fallback(net):
    model = NETS[net]()
    assert unsupported_modules(model) == {}
    assert model.backbone.encoder.layers[0].blocks[1].shift_size > 0  # a shifted, masked block


@pytest.mark.parametrize("strategy,clipping,groups", SETTINGS, ids=[f"{s}-{c}" for s, c, _ in SETTINGS])
@pytest.mark.parametrize("net", NETS)
def test_hf_swin_attention_matches_oracle(net, strategy, clipping, groups):
    torch.manual_seed(0)
    model = NETS[net]().double()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", ".*torch.func fallback")  # the attention must not take it
        check_clipped_step(model, loss_fn, _batch(), MICRO, strategy, clipping, groups)


@pytest.mark.parametrize("attentions", [False, True], ids=["output", "output_and_probabilities"])
@pytest.mark.parametrize("strategy", ["bk", "ghost", "instantiate"])
def test_eager_attention_matches_oracle(strategy, attentions):
    """Eager attention (its softmax in float32), in a float32 model; with ``attentions`` the attention
    probabilities it returns also reach the loss, and their gradient enters the scores' gradient."""
    torch.manual_seed(0)
    model = SwinNet("eager", attentions=attentions)
    batch = _batch(torch.float32)
    check_clipped_step(model, loss_fn, batch, MICRO, strategy, "per_layer", rel=1e-5, floor=1e-6)


@pytest.mark.parametrize("strategy", ["bk", "instantiate"])
@pytest.mark.parametrize("net", ["swinv2", "donut_swin"])
def test_probabilities_in_the_loss_match_oracle(net, strategy):
    torch.manual_seed(0)
    model = NETS[net](attentions=True).double()
    check_clipped_step(model, loss_fn, _batch(), MICRO, strategy, "per_layer")


@pytest.mark.parametrize("net", ["swinv2", "donut_swin"])
def test_float32_matches_oracle(net):
    torch.manual_seed(0)
    model = NETS[net]()
    check_clipped_step(model, loss_fn, _batch(torch.float32), MICRO, "bk", "flat", rel=1e-5, floor=1e-6)


def test_swinv2_frozen_temperature_and_bias_need_no_rule():
    """Frozen, the module owns nothing trainable; its projections keep their own rules."""
    model = Swinv2Net().double()
    for name, p in model.named_parameters():
        if "logit_scale" in name or "continuous_position_bias_mlp" in name:
            p.requires_grad_(False)
    check_clipped_step(model, loss_fn, _batch(), MICRO, "bk", "flat")


def _engine(model: nn.Module) -> PrivacyEngine:
    return PrivacyEngine(model, batch_size=6, sample_size=60, max_grad_norm=1.0, noise_multiplier=0.0)


def _custom_attention() -> str:
    """An attention implementation registered under another name (the same sdpa function): the rule cannot
    know what it computes."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    AttentionInterface.register("dpexp_test_attention", sdpa_attention_forward)
    return "dpexp_test_attention"


@pytest.mark.parametrize(
    "model,match",
    [
        (lambda: SwinNet("eager").double(), r"\(SwinAttention\): .*eager softmax in float32.*'sdpa'"),
        (
            lambda: SwinNet(attention_dropout=0.1).double(),
            r"\(SwinAttention\): .*attention dropout \(p=0.1\)",
        ),
        (
            lambda: SwinNet(_custom_attention()).double(),
            r"\(SwinAttention\): .*attention implementation 'dpexp_test_attention'",
        ),
        (
            lambda: Swinv2Net(attention_dropout=0.1).double(),
            r"\(Swinv2SelfAttention\): .*attention dropout \(p=0.1\)",
        ),
        (
            lambda: SelfAttentionNet(attention_dropout=0.1).double().train(),
            r"\(DonutSwinSelfAttention\): .*attention dropout \(p=0.1\)",
        ),
    ],
    ids=[
        "eager_float64",
        "attention_dropout",
        "other_implementation",
        "swinv2_attention_dropout",
        "donut_swin_attention_dropout",
    ],
)
def test_what_the_rule_cannot_recompute_is_refused(model, match):
    net = model()
    engine = _engine(net)
    with pytest.raises(ValueError, match=match):
        engine.backward(loss_fn(net, _batch()))


def _wrapped_output_projection(model: SwinNet) -> None:
    attention = model.backbone.encoder.layers[0].blocks[0].attention
    attention.o_proj = nn.Sequential(attention.o_proj)


def _wrapped_value(model: SelfAttentionNet) -> None:
    attention = model.backbone.encoder.layers[0].blocks[0].attention.self
    attention.value = nn.Sequential(attention.value)


def _other_bias_network(model: Swinv2Net) -> None:
    model.backbone.encoder.layers[0].blocks[0].attention.self.continuous_position_bias_mlp.append(nn.Tanh())


@pytest.mark.parametrize(
    "net,change,match",
    [
        (SwinNet, _wrapped_output_projection, r"SwinAttention: .*o_proj is a Sequential, not an nn.Linear"),
        (Swinv2Net, _other_bias_network, r"Swinv2SelfAttention: .*not Sequential\(Linear, ReLU, Linear\)"),
        (SelfAttentionNet, _wrapped_value, r"DonutSwinSelfAttention: .*not all nn.Linear.*leave them"),
    ],
    ids=["swin_wrapped_output_projection", "swinv2_other_bias_network", "donut_swin_wrapped_value"],
)
def test_what_the_rule_does_not_know_is_refused_at_construction(net, change, match):
    model = net().double()
    change(model)
    with pytest.raises(ValueError, match=match):
        _engine(model)


def _swin_attention() -> tuple[nn.Module, str]:
    from transformers import SwinConfig
    from transformers.models.swin.modeling_swin import SwinAttention

    config = SwinConfig(embed_dim=8, window_size=2, attention_probs_dropout_prob=0.0)
    config._attn_implementation = "sdpa"
    attention = SwinAttention(config, hidden_size=8, num_attention_heads=2, window_size=2)
    return attention, "relative_position_bias.relative_position_bias_table"


def _swinv2_attention() -> tuple[nn.Module, str]:
    from transformers import Swinv2Config
    from transformers.models.swinv2.modeling_swinv2 import Swinv2SelfAttention

    config = Swinv2Config(embed_dim=8, window_size=2, attention_probs_dropout_prob=0.0)
    return Swinv2SelfAttention(config, dim=8, num_heads=2, window_size=2), "logit_scale"


def _self_attention() -> tuple[nn.Module, str]:
    from transformers import DonutSwinConfig
    from transformers.models.donut.modeling_donut_swin import DonutSwinSelfAttention

    config = DonutSwinConfig(embed_dim=8, window_size=2, attention_probs_dropout_prob=0.0)
    return DonutSwinSelfAttention(config, dim=8, num_heads=2, window_size=2), "relative_position_bias_table"


class _WindowMajor(nn.Module):
    """Windows laid out window-major, (nW*B, N, C): row w*B + i is example i's window w. The rows cannot be
    folded per example as [i*nW, (i+1)*nW); the probe must find that, whatever the sizes (nW = B here)."""

    def __init__(self, attention: nn.Module) -> None:
        super().__init__()
        self.embed = nn.Linear(5, 8)
        self.attn = attention
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, nW, N, 5)
        h = self.embed(x)
        windows = self.attn(h.transpose(0, 1).reshape(-1, *h.shape[2:]))[0]
        return self.head(windows.view(h.shape[1], h.shape[0], *h.shape[2:]).mean((0, 2)))


@pytest.mark.parametrize(
    "attention", [_swin_attention, _swinv2_attention, _self_attention], ids=["swin", "swinv2", "donut_swin"]
)
def test_window_major_rows_are_refused(attention):
    module, own = attention()
    model = _WindowMajor(module).double()
    for name, p in model.named_parameters():  # only the attention's own: its rule's rows are the ones checked
        p.requires_grad_(name == f"attn.{own}")
    engine = PrivacyEngine(model, batch_size=3, sample_size=30, max_grad_norm=1.0, noise_multiplier=0.0)
    x = torch.randn(3, 3, 4, 5, dtype=torch.float64)
    loss = torch.nn.functional.cross_entropy(model(x), torch.arange(3), reduction="none")
    match = rf"layer 'attn' \({type(module).__name__}\): row 0 .* other examples"
    with pytest.raises(VerificationError, match=match):
        engine.backward(loss)


def test_a_swinv2_forward_that_calls_its_dropout_twice_is_refused(monkeypatch):
    """The V2 rule keeps the probabilities where they enter the attention dropout and Q, K, V off the query,
    key and value calls of the module's training call; a forward that calls one of them more than once
    leaves the rule no single value to read, and is refused."""
    model = Swinv2Net().double()
    attention = model.backbone.encoder.layers[0].blocks[0].attention.self
    forward = attention.forward

    @functools.wraps(forward)  # the same signature: the rule binds the call's arguments by name
    def dropout_twice(*args, **kwargs):
        attention.dropout(torch.zeros(1, dtype=torch.float64))
        return forward(*args, **kwargs)

    monkeypatch.setattr(attention, "forward", dropout_twice)
    with pytest.raises(
        RuntimeError, match=r"Swinv2SelfAttention: its call called its submodules .*'dropout': 2"
    ):
        _engine(model).backward(loss_fn(model, _batch()))
