"""Hugging Face Swin's ``SwinAttention`` (the ``relative_position_bias_table`` of its
``SwinRelativePositionBias``, added to the scores of every window of every example inside the attention
function) against the brute-force oracle in every strategy x clipping mode (float64, sdpa, two
micro-batches): a two-stage Swin whose first stage has 4 windows per example, plain and shifted (with the
shift mask), and whose second stage has one; eager attention in float32, with its attention probabilities in
the loss; window-major rows refused by the probe; and the refusals of what the rule cannot recompute."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from dpexp.privacy import PrivacyEngine
from dpexp.privacy.capture import unsupported_modules
from dpexp.privacy.verification import VerificationError
from tests.layer_models import HFSwinNet as SwinNet
from tests.layer_models import hf_swin_loss as loss_fn
from tests.oracle import SETTINGS, check_clipped_step

pytestmark = pytest.mark.filterwarnings("ignore:noise_multiplier=0")

MICRO = [[0, 1, 2], [3, 4, 5]]


def _batch(dtype: torch.dtype = torch.float64) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {"x": torch.randn(6, 3, 16, 16, generator=gen, dtype=dtype), "y": torch.arange(6) % 3}


def test_hf_swin_needs_no_fallback():
    model = SwinNet()
    assert unsupported_modules(model) == {}
    assert model.backbone.encoder.layers[0].blocks[1].shift_size > 0  # a shifted, masked block


@pytest.mark.parametrize("strategy,clipping,groups", SETTINGS, ids=[f"{s}-{c}" for s, c, _ in SETTINGS])
def test_hf_swin_attention_matches_oracle(strategy, clipping, groups):
    torch.manual_seed(0)
    model = SwinNet().double()
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
        (lambda: SwinNet("eager").double(), r"eager softmax in float32.*attn_implementation='sdpa'"),
        (lambda: SwinNet(attention_dropout=0.1).double(), r"attention dropout \(p=0.1\).*"),
        (lambda: SwinNet(_custom_attention()).double(), r"attention implementation 'dpexp_test_attention'"),
    ],
    ids=["eager_float64", "attention_dropout", "other_implementation"],
)
def test_what_the_rule_cannot_recompute_is_refused(model, match):
    net = model()
    engine = _engine(net)
    with pytest.raises(ValueError, match=r"\(SwinAttention\): .*" + match):
        engine.backward(loss_fn(net, _batch()))


def test_wrapped_output_projection_is_refused():
    model = SwinNet().double()
    attention = model.backbone.encoder.layers[0].blocks[0].attention
    attention.o_proj = nn.Sequential(attention.o_proj)
    with pytest.raises(ValueError, match=r"SwinAttention: .*o_proj is a Sequential, not an nn.Linear"):
        _engine(model)


class _WindowMajor(nn.Module):
    """Windows laid out window-major, (nW*B, N, C): row w*B + i is example i's window w. The rows cannot be
    folded per example as [i*nW, (i+1)*nW); the probe must find that, whatever the sizes (nW = B here)."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import SwinConfig
        from transformers.models.swin.modeling_swin import SwinAttention

        config = SwinConfig(embed_dim=8, window_size=2, attention_probs_dropout_prob=0.0)
        config._attn_implementation = "sdpa"
        self.embed = nn.Linear(5, 8)
        self.attn = SwinAttention(config, hidden_size=8, num_attention_heads=2, window_size=2)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, nW, N, 5)
        h = self.embed(x)
        windows, _ = self.attn(h.transpose(0, 1).reshape(-1, *h.shape[2:]))
        return self.head(windows.view(h.shape[1], h.shape[0], *h.shape[2:]).mean((0, 2)))


def test_window_major_rows_are_refused():
    model = _WindowMajor().double()
    table = "attn.relative_position_bias.relative_position_bias_table"
    for name, p in model.named_parameters():  # only the table: its rule's rows are the ones checked
        p.requires_grad_(name == table)
    engine = PrivacyEngine(model, batch_size=3, sample_size=30, max_grad_norm=1.0, noise_multiplier=0.0)
    x = torch.randn(3, 3, 4, 5, dtype=torch.float64)
    loss = torch.nn.functional.cross_entropy(model(x), torch.arange(3), reduction="none")
    with pytest.raises(VerificationError, match=r"layer 'attn' \(SwinAttention\): row 0 .* other examples"):
        engine.backward(loss)
