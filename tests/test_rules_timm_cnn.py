"""timm CNN rules (LayerNorm2d, ConvNeXt layer scale, GroupNormAct, StdConv2d, ScaledStdConv2d) and Hugging
Face's (ConvNeXt's LayerNorm of either data format and layer scale, ConvNeXt V2's GRN, BiT's standardised
convolutions and GroupNorm with activation) and torchvision's (LayerNorm2d, ConvNeXt's layer scale, ViT's
class token and position embedding, Swin's shifted window attention) against the brute-force oracle: every
strategy x clipping mode on tiny ConvNeXt, EfficientNet, NF-ResNet, BiT, ViT and Swin models (slow),
representatives in the fast suite, and no module of these models on the torch.func fallback."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpexp.privacy import PrivacyEngine
from dpexp.privacy.capture import unsupported_modules
from tests.engine_models import classification_loss
from tests.oracle import check_clipped_step, clipped_mean, engine_update, group_norms, per_example_grads
from tests.timm_cnn_models import BUILDERS, make_timm_case

pytestmark = pytest.mark.filterwarnings("ignore:noise_multiplier=0")

SETTINGS = [
    (strategy, clipping, groups)
    for strategy in ("bk", "ghost", "instantiate")
    for clipping, groups in (("flat", None), ("per_layer", None), ("groups", 2))
]
FAST = {
    ("convnext", "bk", "per_layer"),
    ("efficientnet", "ghost", "flat"),
    ("convnext_conv_mlp", "instantiate", "groups"),
    ("convnextv2", "ghost", "per_layer"),
    ("convnextv2_conv_mlp", "bk", "flat"),
    ("nf_resnet", "bk", "flat"),
    ("nf_resnet", "ghost", "per_layer"),
    ("nf_resnet", "instantiate", "groups"),
    ("nfnet_skipinit", "bk", "per_layer"),
    ("nfnet_skipinit", "ghost", "flat"),
    ("nfnet_skipinit", "instantiate", "groups"),
    ("bit", "bk", "per_layer"),
    ("bit", "ghost", "flat"),
    ("std_conv_same", "bk", "per_layer"),
    ("std_conv_same", "instantiate", "flat"),
    ("hf_convnext", "bk", "per_layer"),
    ("hf_convnext", "ghost", "flat"),
    ("hf_convnext", "instantiate", "groups"),
    ("hf_convnextv2", "bk", "flat"),
    ("hf_convnextv2", "ghost", "per_layer"),
    ("hf_bit", "bk", "flat"),
    ("hf_bit", "ghost", "per_layer"),
    ("hf_bit", "instantiate", "groups"),
    ("tv_convnext", "bk", "per_layer"),
    ("tv_convnext", "ghost", "flat"),
    ("tv_vit", "bk", "flat"),
    ("tv_vit", "ghost", "per_layer"),
    ("tv_vit", "instantiate", "groups"),
    ("tv_swin", "bk", "per_layer"),
    ("tv_swin", "ghost", "flat"),
    ("tv_swin", "instantiate", "groups"),
    ("tv_swinv2", "bk", "flat"),
    ("tv_swinv2", "ghost", "per_layer"),
    ("tv_swinv2", "instantiate", "groups"),
}


def _check(name: str, strategy: str, clipping: str, groups: int | None) -> None:
    model, loss_fn, batch = make_timm_case(name)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", ".*torch.func fallback")  # a module on the fallback fails the test
        check_clipped_step(
            model, loss_fn, batch, [[0, 1, 2], [3, 4, 5]], strategy, clipping, groups, rel=1e-7
        )


@pytest.mark.parametrize(
    "name,strategy,clipping,groups",
    [
        pytest.param(n, s, c, g, marks=() if (n, s, c) in FAST else pytest.mark.slow, id=f"{n}-{s}-{c}")
        for n in BUILDERS
        for s, c, g in SETTINGS
    ],
)
def test_timm_cnn_matches_oracle(name, strategy, clipping, groups):
    _check(name, strategy, clipping, groups)


@pytest.mark.parametrize("name", ["tv_swin", "tv_swinv2"])
@pytest.mark.parametrize("read", [True, False], ids=["graph", "recomputed"])
def test_torchvision_swin_reads_its_graph_or_recomputes_exactly(name, read, monkeypatch):
    """In training mode the attention's probabilities, values and the gradients at ``qkv``'s output and the
    softmax's are read off the call's autograd graph, nothing of the attention computed again; where the
    graph lacks that structure (here: its search made to find nothing) the rule computes the attention
    again from the captured input. Both agree with the oracle, padded and shifted windows included."""
    from dpexp.privacy.rules import shifted_window

    calls = {"_read": 0, "_recomputed": 0}

    def counting(name: str):
        original = getattr(shifted_window, name)

        def counted(*args):
            calls[name] += 1
            return original(*args)

        return counted

    for name_ in calls:
        monkeypatch.setattr(shifted_window, name_, counting(name_))
    if not read:
        monkeypatch.setattr(shifted_window, "call_nodes", lambda *args: None)
    model, loss_fn, batch = make_timm_case(name)
    check_clipped_step(model.train(), loss_fn, batch, [[0, 1, 2], [3, 4, 5]], "bk", "flat", rel=1e-7)
    taken, other = ("_read", "_recomputed") if read else ("_recomputed", "_read")
    assert calls[taken] > 0 and calls[other] == 0


@pytest.mark.slow
@pytest.mark.parametrize("builder", ["swin_t", "swin_v2_t"])
def test_torchvision_swin_at_its_real_width_matches_oracle(builder):
    """torchvision's own ``swin_t`` / ``swin_v2_t`` (28M parameters, windows of 7 / 8) on 64x64 images: the
    stages' 16x16 to 2x2 maps padded to whole windows, the last ones smaller than a window (no shift), against
    the float64 oracle (stochastic depth off: the oracle cannot replay its masks)."""
    import torchvision.models

    torch.manual_seed(0)
    model = getattr(torchvision.models, builder)(num_classes=5)
    for module in model.modules():
        if hasattr(module, "stochastic_depth"):
            module.stochastic_depth.p = 0.0
    gen = torch.Generator().manual_seed(0)
    batch = {
        "x": torch.randn(4, 3, 64, 64, generator=gen, dtype=torch.float64),
        "y": torch.randint(0, 5, (4,), generator=gen),
    }
    with warnings.catch_warnings():
        warnings.filterwarnings("error", ".*torch.func fallback")
        check_clipped_step(
            model.double(), classification_loss, batch, [[0, 1], [2, 3]], "bk", "per_layer", rel=1e-6
        )


@pytest.mark.parametrize("name", ["tv_swin", "tv_swinv2"])
def test_torchvision_swin_dropout_in_training_is_refused(name):
    """``shifted_window_attention`` draws its dropout masks inside the function, where the rule cannot
    replay them: refused at the call in training, with the fix; allowed in evaluation mode."""
    model, loss_fn, batch = make_timm_case(name)
    for module in model.modules():
        if hasattr(module, "attention_dropout"):
            module.attention_dropout = 0.1
    model.train()
    with pytest.raises(ValueError, match=r"attention_dropout=0\.0 and dropout=0\.0"):
        engine_update(model, loss_fn, batch, [[0, 1, 2, 3, 4, 5]], batch_size=6, max_grad_norm=1.0)


def test_torchvision_swin_qkv_wrapped_is_refused():
    """The function reads ``qkv.weight`` itself: an adapter around ``qkv`` would never be called, so a
    wrapped ``qkv`` is refused when the engine is built."""
    model, _, _ = make_timm_case("tv_swin")
    attn = model.features[1][0].attn
    attn.qkv = nn.Sequential(attn.qkv)
    with pytest.raises(ValueError, match=r"qkv and proj are not both nn\.Linear"):
        PrivacyEngine(model, batch_size=6, sample_size=60, max_grad_norm=1.0, noise_multiplier=1.0)


@pytest.mark.parametrize("strategy", ["bk", "ghost"])
def test_skipinit_gains_at_their_zero_start_match_oracle(strategy):
    """At g = 0 (timm's start) the block's output shows nothing of its branch, and the branch's own
    gradients vanish: the gain's per-example gradient comes from the block rerun at g = 1 alone."""
    model, loss_fn, batch = make_timm_case("nfnet_skipinit")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("skipinit_gain"):
                p.zero_()
    check_clipped_step(model, loss_fn, batch, [[0, 1, 2], [3, 4, 5]], strategy, "flat", rel=1e-7)


def test_skipinit_blocks_with_drop_path_in_training_are_refused():
    """The rule reruns the block, which would draw other drop-path masks than the forward did."""
    from timm.layers import DropPath

    model, loss_fn, batch = make_timm_case("nfnet_skipinit")
    for module in model.modules():
        if hasattr(module, "skipinit_gain"):
            module.drop_path = DropPath(0.5)
    model.train()
    with pytest.raises(ValueError, match="drop-path in training"):
        engine_update(model, loss_fn, batch, [[0, 1, 2, 3, 4, 5]], batch_size=6, max_grad_norm=1.0)


@pytest.mark.parametrize("name", list(BUILDERS))
def test_every_module_has_a_rule(name):
    assert unsupported_modules(BUILDERS[name]()) == {}


@pytest.mark.parametrize("norm_mode", ["ghost", "instantiate"])
@pytest.mark.parametrize("name", ["nf_resnet", "bit"])
def test_standardised_convolutions_match_oracle_in_both_norm_forms(name, norm_mode):
    """The gain's gradient and the weight's norm share the recomputed responses (ghost form) or not
    (instantiated): both exact, per-layer clipping at the median norms."""
    model, loss_fn, batch = make_timm_case(name, batch_size=4)
    grads = per_example_grads(model, loss_fn, batch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        groups = PrivacyEngine(
            make_timm_case(name)[0], batch_size=2, sample_size=10, max_grad_norm=1.0, noise_multiplier=0.0,
            clipping="per_layer",
        ).groups  # fmt: skip
    thresholds = group_norms(grads, groups).median(0).values.tolist()
    expected = clipped_mean(grads, groups, thresholds, batch_size=4)
    delta, _ = engine_update(
        model, loss_fn, batch, [[0, 1], [2, 3]], batch_size=4, clipping="per_layer", thresholds=thresholds,
        max_grad_norm=1.0, norm_mode=norm_mode,
    )  # fmt: skip
    for param, want in expected.items():
        torch.testing.assert_close(delta[param], want, rtol=1e-7, atol=1e-12)


def test_group_norm_act_rule_covers_the_activation():
    """dy arrives after the activation: a rule that ignored act'(z) would be wrong where ReLU is off. A
    single GroupNormAct with ReLU and a large negative bias in half of the channels checks it."""
    from timm.layers import GroupNormAct

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(2, 4, 3), GroupNormAct(4, num_groups=2, act_layer=nn.ReLU), nn.Flatten(), nn.LazyLinear(2)
    )
    model(torch.zeros(1, 2, 5, 5))
    model = model.double()
    with torch.no_grad():
        model[1].bias.copy_(torch.tensor([0.3, -3.0, 0.1, -0.2]))
        model[1].weight.normal_(1.0, 0.3)
    batch = {"x": torch.randn(4, 2, 5, 5, dtype=torch.float64)}

    def loss(m, b):
        return F.softplus(m(b["x"])).sum(1)

    grads = per_example_grads(model, loss, batch)
    groups = [list(grads[0])]
    thresholds = group_norms(grads, groups).median(0).values.tolist()
    expected = clipped_mean(grads, groups, thresholds, batch_size=4)
    delta, _ = engine_update(
        model, loss, batch, [[0, 1, 2, 3]], batch_size=4, thresholds=thresholds, max_grad_norm=1.0
    )
    for param, want in expected.items():
        torch.testing.assert_close(delta[param], want, rtol=1e-9, atol=1e-12)


def test_layer_scale_refuses_a_vanishing_gamma():
    model, loss_fn, batch = make_timm_case("convnext", batch_size=2)
    with torch.no_grad():
        model.stages[0].blocks[0].gamma[3] = 0.0
    with pytest.raises(ValueError, match="layer-scale gamma is below"):
        engine_update(model, loss_fn, batch, [[0, 1]], batch_size=2, max_grad_norm=1.0)


def test_group_norm_act_refuses_a_random_drop_layer():
    from timm.layers import GroupNormAct

    model = nn.Sequential(nn.Conv2d(2, 4, 3), GroupNormAct(4, num_groups=2, drop_layer=nn.Dropout))
    with pytest.raises(ValueError, match=r"GroupNormAct.*drop layer Dropout"):
        PrivacyEngine(model, batch_size=2, sample_size=10, max_grad_norm=1.0, noise_multiplier=1.0)


def test_a_timm_standardised_convolution_with_another_padding_mode_is_refused():
    """timm's StdConv2d calls F.conv2d, which pads with zeros whatever padding_mode says."""
    from timm.layers import StdConv2d

    conv = StdConv2d(3, 4, 3, padding=1)
    conv.padding_mode = "reflect"  # not an argument of its constructor, but an attribute nn.Conv2d reads
    model = nn.Sequential(conv, nn.Flatten(), nn.Linear(64, 2))
    with pytest.raises(ValueError, match="pads with zeros whatever padding_mode says"):
        PrivacyEngine(model, batch_size=2, sample_size=10, max_grad_norm=1.0, noise_multiplier=1.0)


def test_a_bit_norm_with_an_activation_not_known_elementwise_is_refused():
    """BiT's norm rule applies its activation's derivative elementwise; a softmax over channels is not."""
    model = BUILDERS["hf_bit"]()
    norm = next(m for m in model.modules() if type(m).__name__ == "BitGroupNormActivation")
    norm.activation = nn.Softmax(dim=1)
    with pytest.raises(
        ValueError, match=r"BitGroupNormActivation.*activation Softmax is not one it knows.*freeze the norm"
    ):
        PrivacyEngine(model, batch_size=2, sample_size=10, max_grad_norm=1.0, noise_multiplier=1.0)
