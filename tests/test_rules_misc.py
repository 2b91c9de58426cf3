"""Rules for InstanceNorm (affine), PReLU, xIELU, nn.Bilinear (called on positions and on pooled pairs),
Hugging Face ViT's class and position tokens (and ViT-MSN's, I-JEPA's, LayoutLMv3's), CLIP's class embedding,
PoolFormer's layer scales and GroupNorm subclass, MobileBERT's NoNorm, ConvBERT's separable convolution
bias, ESM C's LayerNorm and SigLIP's (and SigLIP 2's) attention-pooling probe against the brute-force
oracle, for every strategy x flat/per-layer clipping; no fallback left on these models."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpexp.privacy import PrivacyEngine
from tests.layer_models import BilinearNet, ProbeNet
from tests.oracle import clipped_mean, engine_update, group_norms, per_example_grads

pytestmark = pytest.mark.filterwarnings("ignore:noise_multiplier=0")


class ConvNet(nn.Module):
    def __init__(self, norm: nn.Module, act: nn.Module) -> None:
        super().__init__()
        self.conv, self.norm, self.act, self.head = nn.Conv2d(3, 4, 3), norm, act, nn.Linear(4, 3)

    def forward(self, x):
        return self.head(self.act(self.norm(self.conv(x))).mean((2, 3)))


def _xielu() -> nn.Module:
    """Hugging Face's xIELU (Apertus' MLP activation), its two parameters away from their initial values."""
    from transformers.activations import XIELUActivation

    act = XIELUActivation(alpha_p_init=0.6, alpha_n_init=0.9, dtype=torch.float64)
    assert act._xielu_cuda_obj is None  # the Python form, which the rule reproduces
    return act


class LayoutNet(nn.Module):
    """A tiny LayoutLMv3 classifier on 8x8 documents: 4x4 image patches after a class token, with position
    embeddings (the model's own ``cls_token`` and ``pos_embed``), and five words whose ids come from the
    image and whose boxes are fixed."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import LayoutLMv3Config, LayoutLMv3ForSequenceClassification

        config = LayoutLMv3Config(
            vocab_size=32, hidden_size=12, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16,
            input_size=8, patch_size=4, num_channels=3, coordinate_size=2, shape_size=2,
            max_position_embeddings=40, max_2d_position_embeddings=64, num_labels=3, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0, rel_pos_bins=8, max_rel_pos=16, rel_2d_pos_bins=8,
            max_rel_2d_pos=32,
        )  # fmt: skip
        self.model = LayoutLMv3ForSequenceClassification(config)
        self.register_buffer("bbox", torch.tensor([[0, 0, 8, 8], [1, 1, 4, 4], [2, 2, 6, 6], [0, 4, 4, 8]]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids = (x[:, 0, 0, :4].abs() * 10).long() % 30 + 2
        bbox = self.bbox.expand(x.shape[0], -1, -1)
        return self.model(input_ids=ids, bbox=bbox, pixel_values=x).logits


def _cases() -> dict:
    def vision(norm, act):
        batch = {"x": torch.randn(6, 3, 6, 6, dtype=torch.float64), "y": torch.randint(0, 3, (6,))}
        return ConvNet(norm, act), batch

    def hf_vit():
        from transformers import ViTConfig, ViTForImageClassification

        config = ViTConfig(
            image_size=8, patch_size=4, num_channels=3, hidden_size=8, num_hidden_layers=1,
            num_attention_heads=2, intermediate_size=12, num_labels=3, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )  # fmt: skip
        model = ViTForImageClassification(config)
        batch = {"x": torch.randn(6, 3, 8, 8, dtype=torch.float64), "y": torch.randint(0, 3, (6,))}
        return model, batch

    def hf_clip():  # its post_layernorm is unused by the classification head
        from transformers import CLIPConfig, CLIPForImageClassification

        vision = {"image_size": 8, "patch_size": 4, "hidden_size": 8, "num_hidden_layers": 1,
                  "num_attention_heads": 2, "intermediate_size": 12}  # fmt: skip
        model = CLIPForImageClassification(CLIPConfig(vision_config=vision, num_labels=3))
        batch = {"x": torch.randn(6, 3, 8, 8, dtype=torch.float64), "y": torch.randint(0, 3, (6,))}
        return model, batch

    def hf_image(architecture: str, **config):
        """A tiny Hugging Face image classifier from its model type: ViT-MSN (ViT's embeddings, copied),
        I-JEPA (position embeddings, no class token), PoolFormer (a GroupNorm subclass that only sets its
        groups, and two layer scales per block)."""
        from transformers import AutoConfig, AutoModelForImageClassification

        config = AutoConfig.for_model(architecture, num_channels=3, num_labels=3, **config)
        batch = {"x": torch.randn(6, 3, 8, 8, dtype=torch.float64), "y": torch.randint(0, 3, (6,))}
        return AutoModelForImageClassification.from_config(config), batch

    def tokens():
        return {"x": torch.randn(6, 5, 4, dtype=torch.float64), "y": torch.randint(0, 3, (6,))}

    def hf_text(architecture: str):
        """MobileBERT (NoNorm in place of LayerNorm), ConvBERT (a separable convolution's own bias after its
        depthwise and pointwise convolutions), ESM C (its LayerNorm subclass), SqueezeBERT (a LayerNorm over
        the channels of (B, C, T)): the sensitivity tests' tiny classifiers."""
        from tests.sensitivity_models import hf_text_classifier

        batch = {"x": torch.randint(2, 32, (6, 8)), "y": torch.randint(0, 2, (6,))}
        return hf_text_classifier(architecture), batch

    vit_sizes = {"image_size": 8, "patch_size": 4, "hidden_size": 8, "num_hidden_layers": 1,
                 "num_attention_heads": 2, "intermediate_size": 12, "hidden_dropout_prob": 0.0,
                 "attention_probs_dropout_prob": 0.0}  # fmt: skip
    poolformer_sizes = {"num_encoder_blocks": 2, "depths": [1, 1], "hidden_sizes": [8, 16], "mlp_ratio": 2.0,
                        "patch_sizes": [3, 3], "strides": [2, 2], "padding": [1, 1],
                        "layer_scale_init_value": 0.3}  # fmt: skip

    pvt_sizes = {"image_size": 8, "num_encoder_blocks": 2, "depths": [1, 1], "hidden_sizes": [8, 16],
                 "sequence_reduction_ratios": [2, 1], "patch_sizes": [4, 2], "strides": [4, 2],
                 "num_attention_heads": [1, 2], "mlp_ratios": [2, 2]}  # fmt: skip

    return {
        "hf_vit_msn": lambda: hf_image("vit_msn", **vit_sizes),
        "hf_pvt": lambda: hf_image("pvt", **pvt_sizes),  # two stages' position tables, a class token
        "hf_ijepa": lambda: hf_image("ijepa", **vit_sizes),
        "hf_poolformer": lambda: hf_image("poolformer", **poolformer_sizes),
        "hf_siglip_probe": lambda: (ProbeNet("Siglip"), tokens()),
        "hf_siglip2_probe": lambda: (ProbeNet("Siglip2"), tokens()),
        "hf_mobilebert": lambda: hf_text("mobilebert"),
        "hf_convbert": lambda: hf_text("convbert"),
        "hf_esmc": lambda: hf_text("esmc"),
        "hf_squeezebert": lambda: hf_text("squeezebert"),
        "instance_norm": lambda: vision(nn.InstanceNorm2d(4, affine=True), nn.Tanh()),
        "prelu_shared": lambda: vision(nn.GroupNorm(2, 4), nn.PReLU()),
        "prelu_per_channel": lambda: vision(nn.GroupNorm(2, 4), nn.PReLU(4, init=0.1)),
        "xielu": lambda: vision(nn.GroupNorm(2, 4), _xielu()),
        "bilinear": lambda: (
            BilinearNet(),
            {"x": torch.randn(6, 3, 4, dtype=torch.float64), "y": torch.arange(6) % 3},
        ),
        "hf_vit": hf_vit,
        "hf_clip": hf_clip,
        "hf_layoutlmv3": lambda: (
            LayoutNet(),
            {"x": torch.randn(6, 3, 8, 8, dtype=torch.float64), "y": torch.randint(0, 3, (6,))},
        ),
    }


def _loss(model, batch):
    out = model(batch["x"])
    logits = out.logits if hasattr(out, "logits") else out
    return F.cross_entropy(logits, batch["y"], reduction="none")


@pytest.mark.parametrize("name", list(_cases()))
@pytest.mark.parametrize("strategy", ["bk", "ghost", "instantiate"])
@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
def test_rule_matches_oracle(name, strategy, clipping, recwarn):
    torch.manual_seed(0)
    model, batch = _cases()[name]()
    model = model.double().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))  # away from identity initialisations
    grads = per_example_grads(model, _loss, batch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        engine = PrivacyEngine(
            model, batch_size=2, sample_size=10, max_grad_norm=1.0, noise_multiplier=0.0, clipping=clipping
        )
    groups = engine.groups
    engine.detach()
    assert not [w for w in recwarn if "fallback" in str(w.message)]
    thresholds = group_norms(grads, groups).median(0).values.clamp_min(1e-3).tolist()  # unused layers: 0
    expected = clipped_mean(grads, groups, thresholds, batch_size=6)
    delta, _ = engine_update(
        model, _loss, batch, [[0, 1, 2], [3, 4, 5]], batch_size=6, strategy=strategy, clipping=clipping,
        thresholds=thresholds, max_grad_norm=1.0,
    )  # fmt: skip
    for param, want in expected.items():
        torch.testing.assert_close(delta[param], want, rtol=1e-7, atol=1e-10)


@pytest.mark.parametrize(
    "name,module",
    [("hf_siglip_probe", "pool"), ("hf_convbert", "SeparableConv1D"), ("hf_mobilebert", "NoNorm")],
)
def test_a_parameter_the_rule_does_not_know_is_refused_naming_it(name, module):
    """A module the rules above cover, given one more trainable parameter of its own, is refused with the
    parameter's name: by the rule's check as the engine is built, or (NoNorm's rule, which checks nothing) at
    the first backward, by the engine's rule that no trainable parameter is left without its gradient."""
    model, batch = _cases()[name]()
    model = model.double()
    target = next(m for m in model.modules() if type(m).__name__ == module) if module[0].isupper() else None
    target = target if target is not None else model.get_submodule(module)
    target.extra = nn.Parameter(torch.ones(2, dtype=torch.float64))
    with pytest.raises((ValueError, RuntimeError), match=r"'extra'"):
        engine = PrivacyEngine(model, batch_size=6, sample_size=60, max_grad_norm=1.0, noise_multiplier=0.0)
        engine.backward(_loss(model, batch))


def test_hf_vit_trainable_mask_token_is_refused():
    from transformers import ViTConfig
    from transformers.models.vit.modeling_vit import ViTEmbeddings

    embeddings = ViTEmbeddings(ViTConfig(image_size=8, patch_size=4, hidden_size=8), use_mask_token=True)
    with pytest.raises(ValueError, match="mask token"):
        PrivacyEngine(embeddings, batch_size=2, sample_size=10, max_grad_norm=1.0, noise_multiplier=1.0)


def test_unbatched_bilinear_is_refused():
    model = nn.Sequential()
    model.pair = nn.Bilinear(3, 4, 2)
    engine = PrivacyEngine(model, batch_size=2, sample_size=10, max_grad_norm=1.0, noise_multiplier=1.0)
    with pytest.raises(
        ValueError, match=r"layer 'pair' \(Bilinear\): got unbatched inputs.*pass \(B, \.\.\."
    ):
        engine.backward(model.pair(torch.randn(3), torch.randn(4)).sum().reshape(1))


def test_deberta_takes_rules_for_its_layer_norms_and_attentions_own_biases():
    """DeBERTa (v1): its float32 LayerNorm has a rule, and so (since stop 48) has its attention, which owns
    ``q_bias`` and ``v_bias``; nothing is left to the fallback (exact: the ``deberta`` oracle case)."""
    from dpexp.privacy.capture import unsupported_modules
    from dpexp.privacy.rules import norm, projection_bias, rule_for
    from tests.engine_models import deberta

    model = deberta()
    assert rule_for(model.deberta.embeddings.LayerNorm).per_example_grads is norm.deberta_layer_norm_grads
    attention = model.deberta.encoder.layer[0].attention.self
    assert rule_for(attention).per_example_grads is projection_bias.projection_bias_grads
    assert unsupported_modules(model) == {}


def xlstm(use_bias: bool) -> nn.Module:
    """Tiny random xLSTM (Hugging Face): its RMSNorms and its multi-head LayerNorm (each head's features
    normalised, then one affine over all heads), with biases where ``use_bias``."""
    from transformers import xLSTMConfig, xLSTMForCausalLM

    config = xLSTMConfig(
        vocab_size=40,
        hidden_size=16,
        num_hidden_layers=2,
        num_heads=2,
        use_bias=use_bias,
        pad_token_id=1,
        use_cache=False,
    )
    return xLSTMForCausalLM(config).double()


@pytest.mark.parametrize(
    "use_bias,strategy,clipping",
    [(False, "bk", "flat"), (True, "ghost", "flat"), (True, "instantiate", "flat")],
)
def test_xlstm_norms_match_oracle_without_the_fallback(use_bias, strategy, clipping):
    from dpexp.privacy.capture import unsupported_modules
    from tests.engine_models import _padded_text, lm_loss
    from tests.oracle import check_clipped_step

    torch.manual_seed(0)
    model = xlstm(use_bias)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))  # away from the ones and zeros they start at
    assert unsupported_modules(model) == {}
    assert any(name.endswith("norm.bias") for name, _ in model.named_parameters()) == use_bias
    batch = _padded_text(6, 10, 40, torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "noise_multiplier=0")
        check_clipped_step(model, lm_loss, batch, [[0, 1, 2], [3, 4, 5]], strategy, clipping, rel=1e-7)
