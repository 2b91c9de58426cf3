"""Convolution rules beyond plain 1-D/2-D ones: grouped and depthwise, 3-D, transposed, padding modes and
``padding="same"``; every strategy x clipping mode against the brute-force oracle."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpexp.layers import WSConv2d
from dpexp.privacy import PrivacyEngine
from dpexp.privacy.rules import conv as conv_rules
from dpexp.privacy.rules import rule_for
from dpexp.privacy.rules.conv import ConvWeightGrads
from dpexp.privacy.rules.ws_conv import Standardized
from tests.oracle import (
    SETTINGS,
    check_clipped_step,
    clipped_mean,
    engine_update,
    group_norms,
    per_example_grads,
)

pytestmark = pytest.mark.filterwarnings("ignore:noise_multiplier=0")


def _convs() -> dict[str, tuple[nn.Module, tuple[int, ...]]]:
    """name -> (convolution stack, input shape of one example)."""
    return {
        "grouped": (
            nn.Sequential(nn.Conv2d(4, 6, 3, groups=2, padding=1), nn.Tanh(), nn.Conv2d(6, 6, 1)),
            (4, 5, 5),
        ),
        "depthwise": (
            nn.Sequential(nn.Conv2d(4, 4, 3, groups=4, stride=2), nn.Tanh(), nn.Conv2d(4, 3, 1)),
            (4, 6, 6),
        ),
        "conv1d_grouped": (nn.Sequential(nn.Conv1d(4, 4, 3, groups=2, dilation=2)), (4, 9)),
        "conv3d": (
            nn.Sequential(nn.Conv3d(2, 3, 2, padding=1), nn.Tanh(), nn.Conv3d(3, 2, 2, groups=1)),
            (2, 3, 3, 3),
        ),
        "transposed1d": (nn.Sequential(nn.ConvTranspose1d(3, 4, 3, stride=2, output_padding=1)), (3, 5)),
        "transposed2d": (
            nn.Sequential(
                nn.ConvTranspose2d(4, 4, 3, stride=2, padding=1, groups=2), nn.Tanh(), nn.Conv2d(4, 2, 1)
            ),
            (4, 3, 3),
        ),
        "transposed3d": (nn.Sequential(nn.ConvTranspose3d(2, 2, 2)), (2, 2, 2, 2)),
        "same_padding": (nn.Sequential(nn.Conv2d(3, 4, 4, padding="same")), (3, 5, 5)),
        "reflect": (nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, padding_mode="reflect")), (3, 5, 5)),
        "circular_1d": (nn.Sequential(nn.Conv1d(3, 4, 3, padding=2, padding_mode="circular")), (3, 7)),
        **_ws_convs(),
    }


def _ws_convs() -> dict[str, tuple[nn.Module, tuple[int, ...]]]:
    """Weight-standardised convolutions whose ghost norm convolves the (padded) input with ``w_hat``."""
    return {
        "ws_reflect_strided": (
            nn.Sequential(WSConv2d(3, 4, 3, stride=2, padding=1, padding_mode="reflect"), nn.Tanh()),
            (3, 7, 7),
        ),
        "ws_same_dilated": (
            nn.Sequential(WSConv2d(3, 4, 3, padding="same", dilation=2, bias=False)),
            (3, 6, 6),
        ),
    }


class Head(nn.Module):
    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.body = body

    def forward(self, x):
        return self.body(x).flatten(1).tanh().sum(1)


CHUNKS = pytest.mark.parametrize("chunk", [32, 2, 0], ids=["whole", "in_chunks", "by_patches"])
"""Per-example gradients instantiated at once, or in chunks of 2 examples (3-example micro-batches: chunks of
2 and 1), whose norms, kept sums and selections read the chunks (``PerExampleGrad.instantiate_chunks``); pixel
Gram norms (:func:`~dpexp.privacy.rules.conv.patch_gram_norm_sq`) over the whole micro-batch, or one example
at a time; or (0) 1-D and 2-D convolutions instantiated as off the CPU, over unfolded patches
(:func:`~dpexp.privacy.rules.conv.patch_weight_grads`), one example a chunk."""


def _set_chunks(monkeypatch, chunk: int) -> None:
    monkeypatch.setattr(conv_rules, "INSTANTIATE_CHUNK", chunk or 2)
    monkeypatch.setitem(conv_rules.GRAM_VALUES, "cpu", 2**30 if chunk == 32 else 1)
    if chunk == 0:
        monkeypatch.setattr(conv_rules, "GROUPED_INSTANTIATION", frozenset())
        monkeypatch.setattr(conv_rules, "PATCH_VALUES", 1)  # one example a chunk


@CHUNKS
@pytest.mark.parametrize("name", list(_convs()))
@pytest.mark.parametrize("strategy", ["bk", "ghost", "instantiate"])
@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
def test_convolution_matches_oracle(name, strategy, clipping, chunk, monkeypatch):
    _set_chunks(monkeypatch, chunk)
    torch.manual_seed(0)
    body, shape = _convs()[name]
    assert all(rule_for(m) is not None for m in body if isinstance(m, nn.modules.conv._ConvNd))
    model = Head(body).double()
    batch = {"x": torch.randn(6, *shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)}

    def loss(m, b):
        return F.softplus(m(b["x"]))

    grads = per_example_grads(model, loss, batch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        groups = PrivacyEngine(
            Head(_convs()[name][0]), batch_size=2, sample_size=10, max_grad_norm=1.0, noise_multiplier=0.0,
            clipping=clipping,
        ).groups  # fmt: skip
    thresholds = group_norms(grads, groups).median(0).values.clamp_min(1e-6).tolist()
    expected = clipped_mean(grads, groups, thresholds, batch_size=6)
    delta, _ = engine_update(
        model, loss, batch, [[0, 1, 2], [3, 4, 5]], batch_size=6, strategy=strategy, clipping=clipping,
        thresholds=thresholds, max_grad_norm=1.0,
    )  # fmt: skip
    for param, want in expected.items():
        torch.testing.assert_close(delta[param], want, rtol=1e-7, atol=1e-10)


@CHUNKS
@pytest.mark.parametrize("norm_mode", ["ghost", "instantiate"])
@pytest.mark.parametrize("body", ["grouped_and_ungrouped", *_ws_convs()])
def test_forced_norm_modes_on_convolutions(norm_mode, body, chunk, monkeypatch):
    """Forcing the ghost norm on a convolution without a ghost form instantiates instead; both are exact,
    also for weight-standardised convolutions (strided, reflect- and same-padded, dilated)."""
    _set_chunks(monkeypatch, chunk)
    torch.manual_seed(0)
    if body == "grouped_and_ungrouped":
        body, shape = (
            nn.Sequential(nn.Conv2d(3, 4, 3, groups=1), nn.Tanh(), nn.Conv2d(4, 4, 3, groups=2)),
            (3, 7, 7),
        )
    else:
        body, shape = _ws_convs()[body]
    model = Head(body).double()
    batch = {"x": torch.randn(4, *shape, dtype=torch.float64)}

    def loss(m, b):
        return F.softplus(m(b["x"]))

    grads = per_example_grads(model, loss, batch)
    groups = [list(grads[0])]
    thresholds = group_norms(grads, groups).median(0).values.tolist()
    expected = clipped_mean(grads, groups, thresholds, batch_size=4)
    delta, _ = engine_update(
        model, loss, batch, [[0, 1, 2, 3]], batch_size=4, thresholds=thresholds, max_grad_norm=1.0,
        norm_mode=norm_mode,
    )  # fmt: skip
    for param, want in expected.items():
        torch.testing.assert_close(delta[param], want, rtol=1e-7, atol=1e-10)


def _geometries() -> dict[str, tuple[nn.Module, tuple[int, ...]]]:
    """name -> (ungrouped convolution, input shape of one example): the ghost forms' index arithmetic."""
    return {
        "plain": (nn.Conv2d(3, 4, 3, padding=1), (3, 6, 7)),
        "wide_zero_border": (nn.Conv2d(3, 4, (3, 2), padding=(3, 2), dilation=(1, 2)), (3, 5, 4)),
        "strided_reflect": (nn.Conv2d(3, 4, 3, stride=2, padding=1, padding_mode="reflect"), (3, 9, 8)),
        "stride_over_kernel": (nn.Conv2d(3, 4, 2, stride=3, padding=1), (3, 10, 9)),
        "pointwise_strided": (nn.Conv2d(3, 4, 1, stride=2), (3, 7, 7)),
        "rect_circular": (
            nn.Conv2d(3, 4, (3, 2), stride=(2, 3), dilation=(2, 1), padding=2, padding_mode="circular"),
            (3, 9, 10),
        ),
        "same_even": (nn.Conv2d(3, 4, 4, padding="same"), (3, 5, 6)),
        "same_dilated": (nn.Conv2d(3, 4, 3, padding="same", dilation=2, bias=False), (3, 7, 7)),
        "dilated_strided": (nn.Conv2d(3, 4, 5, stride=3, padding=1, dilation=2), (3, 12, 11)),
        # odd rows of the padded input are all padding: a phase component without pixels
        "padding_only_phase": (nn.Conv2d(3, 4, 3, stride=2, padding=2), (3, 1, 4)),
        "conv1d_strided_dilated": (nn.Conv1d(3, 4, 3, stride=2, padding=2, dilation=3), (3, 11)),
        "conv1d_circular": (nn.Conv1d(3, 4, 3, padding=2, padding_mode="circular"), (3, 7)),
        "conv1d_zero_padded": (nn.Conv1d(3, 4, 3, padding=1), (3, 7)),
        "ws_reflect_strided": (WSConv2d(3, 4, 3, stride=2, padding=1, padding_mode="reflect"), (3, 7, 7)),
        "ws_same_dilated": (WSConv2d(3, 4, 3, padding="same", dilation=2), (3, 6, 6)),
    }


@pytest.mark.parametrize("method", ["unfold", "pixels"])
@pytest.mark.parametrize("name", list(_geometries()))
def test_ghost_norms_match_instantiation(name, method, monkeypatch):
    """Both ghost forms (unfolded patches, pixel Grams) give the instantiated squared norms to float64
    precision, also under weight standardisation, whichever the cost model would pick."""
    module, shape = _geometries()[name]
    module = module.double()
    x = torch.randn(5, *shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    dy = torch.randn_like(module(x))
    grads = rule_for(module).per_example_grads(module, x, dy)["weight"]
    assert isinstance(grads, ConvWeightGrads | Standardized)
    want = grads.norm_sq("instantiate")
    monkeypatch.setattr(conv_rules, "norm_costs", _costs_favouring(method))
    torch.testing.assert_close(grads.norm_sq("auto"), want, rtol=1e-12, atol=0)


@pytest.mark.parametrize("name", list(_geometries()))
def test_unfolded_patches_are_f_unfold(name):
    """The patches read as windows of the padded input are ``F.unfold``'s, values and layout."""
    module, shape = _geometries()[name]
    x = torch.randn(3, *shape, generator=torch.Generator().manual_seed(0))
    image, (kernel, stride, padding, dilation) = conv_rules.as_image(module, x)
    want = F.unfold(image, kernel, dilation=dilation, padding=padding, stride=stride).transpose(1, 2)
    got = conv_rules.unfold_patches(module, x)
    assert torch.equal(got, want) and got.stride() == want.stride()


@pytest.mark.parametrize("groups", [1, 2, 4])
@pytest.mark.parametrize("name", list(_geometries()))
def test_weight_grads_over_patches_match_grouped_convolution(name, groups):
    """Per-example weight gradients as one batched product over unfolded patches (off the CPU) equal the
    batch-grouped convolution's (on CPU), grouped and depthwise too, in float64."""
    module, shape = _geometries()[name]
    module = copy.deepcopy(module)
    if groups > 1:  # the same geometry with 4 input and output channels in groups
        kwargs = {k: getattr(module, k) for k in ("stride", "padding", "dilation", "padding_mode")}
        module = type(module)(4, 4, module.kernel_size, groups=groups, **kwargs)
        shape = (4, *shape[1:])
    module = module.double()
    x = torch.randn(5, *shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    dy = torch.randn_like(module(x))
    want = ConvWeightGrads(module, x, dy)._instantiate(x, dy)
    torch.testing.assert_close(conv_rules.patch_weight_grads(module, x, dy), want, rtol=1e-12, atol=1e-12)


def _costs_favouring(method: str):
    return lambda *_: {m: 0.0 if m == method else 1e30 for m in ("instantiate", "unfold", "pixels")}


def _ghost_models() -> dict[str, tuple[nn.Module, tuple[int, ...]]]:
    return {
        "2d": (
            nn.Sequential(
                nn.Conv2d(3, 4, 3, stride=2, padding=1, padding_mode="reflect"),
                nn.Tanh(),
                WSConv2d(4, 4, 3, padding="same", dilation=2),
                nn.Tanh(),
                nn.Conv2d(4, 3, (3, 2), stride=(1, 2), padding=1, padding_mode="circular"),
            ),
            (3, 9, 9),
        ),
        "1d": (
            nn.Sequential(
                nn.Conv1d(3, 4, 3, padding=2, dilation=2, padding_mode="circular"),
                nn.Tanh(),
                nn.Conv1d(4, 2, 3, stride=2),
            ),
            (3, 9),
        ),
    }


@pytest.mark.parametrize("method", ["unfold", "pixels"])
@pytest.mark.parametrize("model_name", list(_ghost_models()))
@pytest.mark.parametrize("strategy,clipping,groups", SETTINGS, ids=[f"{s}-{c}" for s, c, _ in SETTINGS])
def test_ghost_forms_match_oracle(model_name, method, strategy, clipping, groups, monkeypatch):
    """Every strategy x clipping mode with every convolution's norm by one ghost form (where the cost model
    is consulted: instantiation stays where it is forced or the factors are released)."""
    monkeypatch.setattr(conv_rules, "norm_costs", _costs_favouring(method))
    used = []
    ghost_norm_sq = ConvWeightGrads.ghost_norm_sq
    monkeypatch.setattr(
        ConvWeightGrads, "ghost_norm_sq", lambda self, dy, m: used.append(m) or ghost_norm_sq(self, dy, m)
    )
    torch.manual_seed(0)
    body, shape = _ghost_models()[model_name]
    batch = {"x": torch.randn(6, *shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)}

    def loss(m, b):
        return F.softplus(m(b["x"]))

    check_clipped_step(Head(body).double(), loss, batch, [[0, 1, 2], [3, 4, 5]], strategy, clipping, groups)
    assert set(used) <= {method}
    if strategy == "ghost" or (strategy, clipping) == ("bk", "per_layer"):
        assert used  # no released or forced instantiation: the ghost form was exercised


@pytest.mark.parametrize("method", ["unfold", "pixels"])
@pytest.mark.parametrize("name", ["ws_reflect_strided", "ws_same_dilated"])
def test_weight_standardised_norm_reads_the_kept_output(name, method, monkeypatch):
    """The ghost forms of a weight-standardised convolution take ``<a_t, w_hat_r>`` from the layer's kept
    output (bias removed): the right output gives the instantiated norm, a wrong one a different norm (so
    it is read, not recomputed); an output of another dtype (autocast) is recomputed instead. The norm drops
    the output it read, and a second norm recomputes it."""
    module, shape = _geometries()[name]
    module = module.double()
    x = torch.randn(5, *shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    output = module(x).detach()
    dy = torch.randn_like(output)
    monkeypatch.setattr(conv_rules, "norm_costs", _costs_favouring(method))
    rule = rule_for(module)
    want = rule.per_example_grads(module, x, dy)["weight"].norm_sq("instantiate")
    for kept in (output, output.float() + 1.0):
        grads = rule.per_example_grads(module, x, dy, output=kept)["weight"]
        torch.testing.assert_close(grads.norm_sq(), want)
        assert grads.output is None  # dropped once read: not held while the group waits for its sum
        torch.testing.assert_close(grads.norm_sq(), want)  # a second norm recomputes it
    wrong = rule.per_example_grads(module, x, dy, output=output + 1.0)["weight"].norm_sq()
    assert not torch.allclose(wrong, want)
    assert rule.keep_output(module, x, output)  # kept where a ghost form is the cheapest ...
    assert not rule.keep_output(module, x, output.float())  # ... and only in the norm's precision
    monkeypatch.setattr(conv_rules, "norm_costs", _costs_favouring("instantiate"))
    assert not rule.keep_output(module, x, output)


def _ws_stack(inplace: bool) -> nn.Module:
    """Two weight-standardised convolutions (with and without bias); ``inplace``: a ReLU overwrites the
    first one's output after the call, so the engine must not use the kept copy."""
    return nn.Sequential(
        WSConv2d(3, 4, 3, padding=1, padding_mode="reflect"),
        nn.ReLU(inplace=inplace),
        WSConv2d(4, 3, 3, stride=2, padding=1, bias=False),
        nn.Tanh(),
    )


@pytest.mark.parametrize("inplace", [False, True], ids=["kept", "overwritten"])
@pytest.mark.parametrize("strategy,clipping,groups", SETTINGS, ids=[f"{s}-{c}" for s, c, _ in SETTINGS])
def test_kept_outputs_in_training_match_oracle(inplace, strategy, clipping, groups, monkeypatch):
    """Every strategy x clipping mode with the weight-standardised convolutions' norms by the pixel ghost form
    (so their outputs are kept from the forward pass): exact against the oracle. Where a ReLU overwrote an
    output in place the rule recomputes it; elsewhere it reads the kept one."""
    monkeypatch.setattr(conv_rules, "norm_costs", _costs_favouring("pixels"))
    read = []
    responses = Standardized._responses
    monkeypatch.setattr(
        Standardized,
        "_responses",
        lambda self, dtype: read.append(self.output is not None) or responses(self, dtype),
    )
    torch.manual_seed(0)
    batch = {"x": torch.randn(6, 3, 7, 7, generator=torch.Generator().manual_seed(1), dtype=torch.float64)}

    def loss(m, b):
        return F.softplus(m(b["x"]))

    check_clipped_step(
        Head(_ws_stack(inplace)).double(), loss, batch, [[0, 1, 2], [3, 4, 5]], strategy, clipping, groups
    )
    if strategy == "ghost" or (strategy, clipping) == ("bk", "per_layer"):
        assert read and any(read)  # the second convolution's output is always kept and read
        assert all(read) != inplace  # the overwritten one is recomputed


def test_convolution_norm_method_by_cost():
    """The cost model's choices on WRN-16-4's 3 x 3 layers at B = 64 (``scripts/conv_norm_bench.py`` and a
    training step): a stage-2 layer (128 channels at 16 x 16) takes the pixel Gram, also when its clipped
    sum follows at once (fused per-layer clipping: the weight-gradient convolution is cheaper than writing
    and keeping its 9.4M per-example values); a stage-1 layer (64 at 32 x 32) is instantiated and a stage-3
    one (256 at 8 x 8) takes the pixel Gram either way."""

    def method(channels: int, size: int, fused: bool) -> str:
        conv = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        x = torch.zeros(64, channels, size, size)
        grads = ConvWeightGrads(conv, x, torch.zeros_like(x))
        if fused:
            grads.retain()
        return grads.norm_method("auto")

    assert [method(128, 16, fused) for fused in (False, True)] == ["pixels", "pixels"]
    assert [method(64, 32, fused) for fused in (False, True)] == ["instantiate", "instantiate"]
    assert [method(256, 8, fused) for fused in (False, True)] == ["pixels", "pixels"]


def test_depthwise_convolutions_on_small_maps_are_instantiated_and_kept():
    """ConvNeXt-T's 7 x 7 depthwise layers at 32 x 32 inputs (B = 16): over 8 x 8, 4 x 4 and 2 x 2 maps the
    per-example gradients (C x 49 values) are instantiated for the norm, the grouped ghost form's small
    products costing more (``GROUP_PRODUCT_COST``), and kept for the clipped sum, which then needs no second
    weight-gradient convolution; over 1 x 1 maps (its 49 C values against one Gram entry per channel) the
    ghost form, not kept. An ungrouped WRN stage-2 layer (its norm by pixel Grams) is still not kept."""

    def choice(channels: int, size: int, groups: int, kernel: int = 7) -> tuple[str, bool]:
        conv = nn.Conv2d(channels, channels, kernel, padding=kernel // 2, groups=groups)
        x = torch.zeros(16 if groups > 1 else 64, channels, size, size)
        grads = ConvWeightGrads(conv, x, torch.zeros_like(x))
        return grads.norm_method("auto"), grads.held_extra_values() is not None

    assert choice(96, 8, 96) == ("instantiate", True)
    assert choice(192, 4, 192) == ("instantiate", True)
    assert choice(384, 2, 384) == ("instantiate", True)
    assert choice(768, 1, 768) == ("unfold", False)
    assert choice(128, 16, 1, kernel=3) == ("pixels", False)
