"""Small models around one layer family, shared by its oracle test (``tests/test_rules_<family>.py``) and the
sensitivity tests: nn.EmbeddingBag bags, channels-last layer scale, BEiT's layer-owned layer scale, DINOv2's
and BEiT's embeddings, timm's and Hugging Face's Swin window attention."""

from __future__ import annotations

import importlib

import torch
import torch.nn.functional as F
from torch import nn


class BagNet(nn.Module):
    """Bags of token ids -> EmbeddingBag -> Linear; ``layout="offsets"`` flattens the padded (B, L) ids of
    each example into one 1-D input with offsets, as recommender models call it."""

    def __init__(self, mode: str, layout: str, weighted: bool, padding_idx: int | None, last: bool = False):
        super().__init__()
        self.layout, self.weighted = layout, weighted
        self.bag = nn.EmbeddingBag(13, 5, mode=mode, padding_idx=padding_idx, include_last_offset=last)
        self.head = nn.Linear(5, 3)

    def forward(self, ids: torch.Tensor, lengths: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        psw = weights if self.weighted else None
        if self.layout == "rows":
            return self.head(torch.tanh(self.bag(ids, per_sample_weights=psw)))
        keep = torch.arange(ids.shape[1])[None, :] < lengths[:, None]
        offsets = torch.cumsum(lengths, 0) - lengths
        if self.bag.include_last_offset:
            offsets = torch.cat([offsets, lengths.sum().reshape(1)])
        out = self.bag(ids[keep], offsets, per_sample_weights=None if psw is None else psw[keep])
        return self.head(torch.tanh(out))


def bag_batch(size: int = 6, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 13, (size, 7), generator=gen)
    ids[0, :3] = 0  # padding_idx entries
    lengths = torch.randint(1, 8, (size,), generator=gen)
    lengths[1] = 7
    weights = torch.rand(size, 7, generator=gen, dtype=torch.float64) + 0.5
    return {
        "ids": ids,
        "lengths": lengths,
        "weights": weights,
        "y": torch.randint(0, 3, (size,), generator=gen),
    }


def bag_loss(model: BagNet, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Per-example cross-entropy, shape (B,)."""
    logits = model(batch["ids"], batch["lengths"], batch["weights"])
    return F.cross_entropy(logits, batch["y"], reduction="none")


def _scale(kind: str, dim: int) -> nn.Module:
    if kind == "timm":
        from timm.layers import LayerScale

        return LayerScale(dim, init_values=0.5)
    from transformers import Dinov2Config
    from transformers.models.dinov2.modeling_dinov2 import Dinov2LayerScale
    from transformers.models.dinov3_vit.modeling_dinov3_vit import DINOv3ViTLayerScale

    layer = {"dinov2": Dinov2LayerScale, "dinov3": DINOv3ViTLayerScale}[kind]
    return layer(Dinov2Config(hidden_size=dim, layerscale_value=0.5))


class ScaleNet(nn.Module):
    """Embedding -> Linear -> layer scale (randomised away from its constant start) -> masked mean -> head;
    ``flatten``: the scale sees the (B*T, d) rows, as OPT's MLP does."""

    def __init__(self, kind: str, flatten: bool = False) -> None:
        super().__init__()
        self.flatten = flatten
        self.emb = nn.Embedding(11, 6, padding_idx=0)
        self.proj = nn.Linear(6, 6)
        self.scale = _scale(kind, 6)
        with torch.no_grad():
            next(self.scale.parameters()).uniform_(0.2, 1.5)
        self.head = nn.Linear(6, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.proj(self.emb(ids)))
        h = self.scale(h.flatten(0, 1)).view(h.shape) if self.flatten else self.scale(h)
        keep = (ids != 0).unsqueeze(-1).to(h.dtype)
        return self.head((h * keep).sum(1) / keep.sum(1).clamp_min(1))


def scale_loss(model: ScaleNet, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Per-example cross-entropy of a :class:`ScaleNet` on token ids, shape (B,)."""
    return F.cross_entropy(model(batch["ids"]), batch["y"], reduction="none")


class BeitLayerNet(nn.Module):
    """Linear patch embedding -> two BEiT (or data2vec-vision) layers with lambdas randomised away from their
    constant start -> mean over tokens -> head."""

    def __init__(self, kind: str, drop_path: float = 0.0) -> None:
        super().__init__()
        if kind == "beit":
            from transformers import BeitConfig as Config
            from transformers.models.beit.modeling_beit import BeitLayer as Layer
        else:
            from transformers import Data2VecVisionConfig as Config
            from transformers.models.data2vec.modeling_data2vec_vision import Data2VecVisionLayer as Layer
        config = Config(
            hidden_size=8, num_attention_heads=2, intermediate_size=12, layer_scale_init_value=0.1,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        )  # fmt: skip
        config._attn_implementation = "eager"  # set by from_pretrained / the model class otherwise
        self.embed = nn.Linear(5, 8)
        self.layers = nn.ModuleList([Layer(config, drop_path_rate=drop_path) for _ in range(2)])
        with torch.no_grad():
            for layer in self.layers:
                layer.lambda_1.uniform_(0.2, 1.5)
                layer.lambda_2.uniform_(-1.5, -0.2)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            out = layer(h)
            h = out[0] if isinstance(out, tuple) else out
        return self.head(h.mean(1))


def beit_loss(model: BeitLayerNet, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Per-example cross-entropy of a :class:`BeitLayerNet` on (B, T, 5) inputs, shape (B,)."""
    return F.cross_entropy(model(batch["x"]), batch["y"], reduction="none")


class Dinov2Net(nn.Module):
    """A two-layer DINOv2 on 8x8 images in 4x4 patches (a 2x2 grid), its pooled output -> head; with
    ``registers`` > 0, DINOv2 with that many register tokens (Darcet et al. 2024)."""

    def __init__(self, hidden_dropout: float = 0.0, registers: int = 0) -> None:
        super().__init__()
        import transformers

        family = "Dinov2WithRegisters" if registers else "Dinov2"
        config = getattr(transformers, f"{family}Config")(
            hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=24, image_size=8,
            patch_size=4, num_channels=3, layerscale_value=0.5, hidden_dropout_prob=hidden_dropout,
            **({"num_register_tokens": registers} if registers else {}),
        )  # fmt: skip
        self.backbone = getattr(transformers, f"{family}Model")(config)
        with torch.no_grad():  # away from their zero start, so that every token matters
            self.backbone.embeddings.cls_token.normal_()
            self.backbone.embeddings.mask_token.normal_()
            if registers:
                self.backbone.embeddings.register_tokens.normal_()
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.head(self.backbone(pixel_values=x, bool_masked_pos=mask).pooler_output)


def dinov2_loss(model: Dinov2Net, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Per-example cross-entropy on (B, 3, 8, 8) images ``x`` with the optional (B, 4) ``mask``; (B,)."""
    return F.cross_entropy(model(batch["x"], batch.get("mask")), batch["y"], reduction="none")


def swin() -> nn.Module:
    """timm Swin on 8x8 images in 2x2 patches, windows of 2x2 tokens: stage 1 has 4 windows per example (its
    second block shifted, with the shift mask), stage 2 one; relative position tables randomised; no drop-path
    (the oracle recomputes each example: a deterministic forward)."""
    import timm

    model = timm.create_model(
        "swin_tiny_patch4_window7_224", pretrained=False, img_size=8, patch_size=2, embed_dim=8,
        depths=(2, 2), num_heads=(2, 2), window_size=2, num_classes=3, drop_path_rate=0.0,
    )  # fmt: skip
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("relative_position_bias_table"):
                p.normal_()
    return model


def timm_beit(fused: bool = False, abs_pos: bool = False, shared: bool = False) -> nn.Module:
    """A two-block timm BEiT on 16 x 16 images of 8 x 8 patches (5 tokens) with layer scales and per-block
    relative position tables (BEiT-large's layout), or (``shared``) one table for all blocks
    (``Beit.rel_pos_bias``); biases, tokens and tables randomised away from their zero start; ``fused``:
    the attention's scores inside scaled_dot_product_attention."""
    from timm.models.beit import Beit

    torch.manual_seed(0)
    model = Beit(
        img_size=16, patch_size=8, num_classes=3, embed_dim=16, depth=2, num_heads=2, init_values=0.1,
        use_abs_pos_emb=abs_pos, use_rel_pos_bias=not shared, use_shared_rel_pos_bias=shared,
    )  # fmt: skip
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "bias" in name or "cls_token" in name or "pos_embed" in name:
                p.normal_(0.0, 0.3)
    for module in model.modules():
        if hasattr(module, "fused_attn"):
            module.fused_attn = fused
    return model


class BeitNet(nn.Module):
    """A two-layer Hugging Face BEiT (or data2vec-vision) on 8x8 images in 4x4 patches (a 2x2 grid), with the
    mask token and (``absolute``) the absolute position table, its pooled output -> head; its embeddings'
    parameters randomised away from their zero start, so that every token matters; no drop-path (the oracle
    recomputes each example: a deterministic forward). ``relative``: a relative position bias table per
    layer (``"layer"``) or one for all layers (``"shared"``), randomised too, with the attention
    implementation ``attention``."""

    def __init__(
        self,
        kind: str = "beit",
        absolute: bool = True,
        hidden_dropout: float = 0.0,
        relative: str | None = None,
        attention: str = "eager",
    ) -> None:
        super().__init__()
        if kind == "beit":
            from transformers import BeitConfig as Config
            from transformers import BeitModel as Model
        else:
            from transformers import Data2VecVisionConfig as Config
            from transformers import Data2VecVisionModel as Model
        config = Config(
            image_size=8, patch_size=4, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
            intermediate_size=24, use_mask_token=True, use_absolute_position_embeddings=absolute,
            layer_scale_init_value=0.5, hidden_dropout_prob=hidden_dropout, attention_probs_dropout_prob=0.0,
            drop_path_rate=0.0, use_mean_pooling=True, use_relative_position_bias=relative == "layer",
            use_shared_relative_position_bias=relative == "shared", attn_implementation=attention,
        )  # fmt: skip
        self.backbone = Model(config, add_pooling_layer=True)
        with torch.no_grad():
            for p in self.backbone.embeddings.parameters(recurse=False):
                p.normal_()
            for name, p in self.backbone.named_parameters():
                if name.endswith("relative_position_bias_table"):
                    p.normal_()
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.head(self.backbone(pixel_values=x, bool_masked_pos=mask).pooler_output)


def beit_embeddings_loss(model: BeitNet, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Per-example cross-entropy on (B, 3, H, W) images ``x``, optional (B, patches) ``mask``; shape (B,)."""
    return F.cross_entropy(model(batch["x"], batch.get("mask")), batch["y"], reduction="none")


# Hugging Face Swin and Swin V2 on 16x16 images in 4x4 patches, windows of 2x2 tokens, two stages
HF_SWIN_SHAPE = {
    "image_size": 16, "patch_size": 4, "num_channels": 3, "embed_dim": 8, "depths": [2, 2],
    "num_heads": [2, 2], "window_size": 2, "mlp_ratio": 2.0, "drop_path_rate": 0.0,
    "hidden_dropout_prob": 0.0,
}  # fmt: skip


def hf_swin_batch(dtype: torch.dtype = torch.float64) -> dict[str, torch.Tensor]:
    """Six (3, 16, 16) images with labels, for :class:`HFSwinNet` and :class:`HFSwinv2Net`."""
    gen = torch.Generator().manual_seed(0)
    return {"x": torch.randn(6, 3, 16, 16, generator=gen, dtype=dtype), "y": torch.arange(6) % 3}


class _HFSwinClassifier(nn.Module):
    """A Swin backbone's pooled output through a linear head; with ``attentions`` each stage's last
    (B * windows, heads, N, N) probabilities, folded per example, also enter the loss."""

    def __init__(self, backbone: nn.Module, attentions: bool) -> None:
        super().__init__()
        self.backbone, self.attentions, self.head = backbone, attentions, nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.backbone(pixel_values=x, output_attentions=self.attentions)
        logits = self.head(out.pooler_output)
        if self.attentions:
            term = sum(a.reshape(x.shape[0], -1).pow(2).sum(1, keepdim=True) for a in out.attentions)
            logits = logits + F.pad(term, (0, 2))  # on the first class only (a shift of all would cancel)
        return logits


def _randomise_tables(backbone: nn.Module) -> None:
    """Every relative position table of ``backbone`` drawn from N(0, 1) (they start at zero)."""
    with torch.no_grad():
        for name, p in backbone.named_parameters():
            if name.endswith("relative_position_bias_table"):
                p.normal_()


class HFSwinNet(_HFSwinClassifier):
    """Hugging Face Swin on 16x16 images in 4x4 patches, windows of 2x2 tokens: stage 1 (4x4 tokens) has 4
    windows per example, its second block shifted (with the shift mask); stage 2 (2x2 tokens) one window,
    unshifted; relative position tables randomised; no drop-path or dropout (a deterministic forward for the
    oracle). ``implementation``: the attention function ("sdpa", the default of the model classes, or
    "eager"); ``attentions``: eager's attention probabilities also enter the loss."""

    def __init__(
        self, implementation: str = "sdpa", attentions: bool = False, attention_dropout: float = 0.0
    ) -> None:
        from transformers import SwinConfig, SwinModel

        config = SwinConfig(**HF_SWIN_SHAPE, attention_probs_dropout_prob=attention_dropout)
        config._attn_implementation = implementation  # set by from_pretrained / the model classes otherwise
        super().__init__(SwinModel(config), attentions)
        _randomise_tables(self.backbone)


class HFSwinSelfAttentionNet(_HFSwinClassifier):
    """Hugging Face's older Swin attention form (``DonutSwinSelfAttention``, also MaskFormer-Swin's and CLAP's
    audio encoder's: the table owned by the self-attention, an eager softmax in the model's dtype) in
    Donut-Swin on the images and windows of :class:`HFSwinNet`; tables randomised, no dropout.
    ``attentions``: the probabilities also enter the loss."""

    def __init__(self, attentions: bool = False, attention_dropout: float = 0.0) -> None:
        from transformers import DonutSwinConfig, DonutSwinModel

        config = DonutSwinConfig(**HF_SWIN_SHAPE, attention_probs_dropout_prob=attention_dropout)
        super().__init__(DonutSwinModel(config), attentions)
        _randomise_tables(self.backbone)


def hf_swin_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Per-example cross-entropy on (B, 3, 16, 16) images, shape (B,)."""
    return F.cross_entropy(model(batch["x"]), batch["y"], reduction="none")


class HFSwinv2Net(_HFSwinClassifier):
    """Hugging Face Swin V2 on 16x16 images in 4x4 patches, windows of 2x2 tokens (as :class:`HFSwinNet`):
    stage 1 has 4 windows per example, its second block shifted (with the shift mask); stage 2 one window.
    Each attention's temperature ``logit_scale`` is randomised around its initial log(10), one head's above
    the clamp at log(100) (no gradient there); no drop-path or dropout. ``attentions``: the attention
    probabilities also enter the loss."""

    def __init__(self, attentions: bool = False, attention_dropout: float = 0.0) -> None:
        from transformers import Swinv2Config, Swinv2Model

        config = Swinv2Config(**HF_SWIN_SHAPE, attention_probs_dropout_prob=attention_dropout)
        super().__init__(Swinv2Model(config), attentions)
        with torch.no_grad():
            for name, p in self.backbone.named_parameters():
                if name.endswith("logit_scale"):
                    p.add_(torch.randn_like(p) * 0.5)
            self.backbone.encoder.layers[0].blocks[0].attention.self.logit_scale[0] = 5.0  # clamped at 4.6


def masked_image_batch(masked: bool, height: int = 8, width: int = 8) -> dict[str, torch.Tensor]:
    """Six float64 images (3, height, width) with labels and, if ``masked``, a patch mask for 4x4 patches
    (``bool_masked_pos``): examples 1 and 4 without masked patches, example 3 fully masked."""
    gen = torch.Generator().manual_seed(0)
    batch = {
        "x": torch.randn(6, 3, height, width, generator=gen, dtype=torch.float64),
        "y": torch.arange(6) % 3,
    }
    if masked:
        mask = torch.rand(6, (height // 4) * (width // 4), generator=gen) < 0.5
        mask[0, 0] = True
        mask[[1, 4]] = False
        mask[3] = True
        batch["mask"] = mask
    return batch


class BilinearNet(nn.Module):
    """One ``nn.Bilinear`` called twice: on (B, T, .) pairs of positions and on (B, .) pooled pairs."""

    def __init__(self) -> None:
        super().__init__()
        self.proj, self.pair, self.head = nn.Linear(4, 3), nn.Bilinear(3, 4, 5), nn.Linear(5, 3)

    def forward(self, x):  # x: (B, T, 4)
        h = torch.tanh(self.proj(x))
        return self.head(torch.tanh(self.pair(h, x)).mean(1) + self.pair(h.mean(1), x.mean(1)))


class ProbeNet(nn.Module):
    """Tokens (B, T, 4) -> Linear -> SigLIP's (or SigLIP 2's, with a padding mask of the last ``padded``
    tokens of every other example) attention-pooling head -> Linear: its learned probe queries the tokens."""

    def __init__(self, version: str) -> None:
        import transformers

        super().__init__()
        config = getattr(transformers, f"{version}VisionConfig")(
            hidden_size=8, num_attention_heads=2, intermediate_size=12
        )
        module = importlib.import_module(f"transformers.models.{version.lower()}.modeling_{version.lower()}")
        self.embed, self.head = nn.Linear(4, 8), nn.Linear(8, 3)
        self.pool = getattr(module, f"{version}MultiheadAttentionPoolingHead")(config)
        self.masked = version == "Siglip2"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = None
        if self.masked:
            mask = torch.ones(x.shape[:2], dtype=torch.long)
            mask[::2, -2:] = 0
        hidden = self.embed(x)
        return self.head(self.pool(hidden, mask) if self.masked else self.pool(hidden))
