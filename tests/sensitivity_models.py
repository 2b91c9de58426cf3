"""Data sets for the sensitivity tests: every model of ``tests/engine_models.CASES`` plus small models that
stress what the engine assumes about a network (float64, deterministic forward), and the recurrent and
attention models of ``tests/recurrent_models`` (three in the default run, the others in ``SLOW_CASES``).

A :class:`SensitivityCase` is a model, a per-example loss, a data set D of ``b`` examples (one micro-batch)
and what is needed to build adversarial examples: which inputs are floating point (to scale them), the
class-label key (to pick the label of largest loss), and the padding-only example of text models.

Every loss here is multiplied by the batch's ``weight`` column (1 for ordinary examples): an example of
weight -1e6 has a gradient -1e6 times its natural one (its logits' gradient scaled and reversed), one of
weight 0 has gradient exactly 0. Both are legitimate data points of a weighted loss (an adversary may pick
any example) and the worst cases for clipping.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from tests import engine_models, recurrent_models, timm_cnn_models
from tests.layer_models import (
    BagNet,
    BeitLayerNet,
    BeitNet,
    BilinearNet,
    Dinov2Net,
    HFSwinNet,
    HFSwinSelfAttentionNet,
    HFSwinv2Net,
    ProbeNet,
    ScaleNet,
    bag_batch,
    bag_loss,
    beit_embeddings_loss,
    beit_loss,
    dinov2_loss,
    hf_swin_loss,
    scale_loss,
    swin,
    timm_beit,
)
from tests.oracle import Batch, LossFn

Expect = Literal["private", "refuse_or_private"]


@dataclass
class SensitivityCase:
    """A model with its loss and data set D, and how to build adversarial neighbours of D.

    ``expect`` is the contract: ``"private"`` (the engine must run, and every released statistic must have
    its sensitivity), or ``"refuse_or_private"`` (the engine may instead refuse with an error naming one of
    ``offenders``, a module or parameter name).
    """

    name: str
    model: nn.Module
    loss_fn: LossFn
    batch: Batch
    float_inputs: tuple[str, ...] = ()  # inputs scaled by 1e6 for the "scaled_input" neighbour
    class_label: tuple[str, int] | None = None  # (key, number of classes) for the "max_loss" neighbour
    padding: dict[str, int] | None = None  # key -> fill value of a padding-only example
    # rounding allowed against the oracle, relative to C_k: wider than float64's where the model computes a
    # small gradient as a sum of large float32 terms (Doge's float32 softmax), which the oracle's autograd
    # and the engine's rule round differently; neighbours are compared at float64's
    oracle_slack: float | None = None
    expect: Expect = "private"
    offenders: tuple[str, ...] = field(default_factory=tuple)

    @property
    def size(self) -> int:
        return int(self.batch["weight"].shape[0])


def weighted(loss_fn: LossFn) -> LossFn:
    """``loss_fn`` times the per-example ``weight`` column of the batch."""

    def loss(model: nn.Module, batch: Batch) -> torch.Tensor:
        rest = {k: v for k, v in batch.items() if k != "weight"}
        return loss_fn(model, rest) * batch["weight"]

    return loss


def with_weight(batch: Batch) -> Batch:
    size = next(iter(batch.values())).shape[0]
    return {**batch, "weight": torch.ones(size, dtype=torch.float64)}


# ---------------------------------------------------------------------------------------------- models
class TimeMajorNet(nn.Module):
    """A recurrent-style cell applied time-major: (B, T, d) -> (T, B, d) -> Linear -> (B, T, d).

    The cell's input has the batch on dim 1, so a rule reading dim 0 as the batch sees T "examples", each
    mixing all B real ones (at T == B nothing in the shapes says so); the engine reads it time-major once
    its probe establishes that dim 1 holds the examples (a refusal before)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.recurrent = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x)).transpose(0, 1)  # (T, B, d)
        h = torch.tanh(self.recurrent(h)).transpose(0, 1)  # back to (B, T, d)
        return self.head(h.mean(1))


class FlatTimeMajorNet(nn.Module):
    """(B, T, d) -> (T, B, d) flattened to (T*B, d) -> Linear -> back: the middle layer's rows are
    time-major, so rows [i*T, (i+1)*T) of its input are not example i's (at T == B nothing says so)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 6)
        self.mix = nn.Linear(6, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x)).transpose(0, 1)  # (T, B, d)
        flat = torch.tanh(self.mix(h.reshape(-1, h.shape[-1])))  # (T*B, d)
        return self.head(flat.view(h.shape).transpose(0, 1).mean(1))


class PositionGate(nn.Module):
    """A module without a rule (torch.func fallback) given a (T, d) table shared by every example."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.gate = nn.Parameter(torch.linspace(0.5, 1.5, dim))

    def forward(self, h: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        return h + self.gate * table


class SharedTableNet(nn.Module):
    """(B, T, d) features plus a gated fixed position table of shape (T, d), then a linear head."""

    def __init__(self, length: int) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 6)
        self.position_gate = PositionGate(6)
        self.head = nn.Linear(6, 3)
        self.register_buffer("table", torch.randn(length, 6, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.position_gate(torch.tanh(self.inp(x)), self.table)
        return self.head(torch.tanh(h).mean(1))


class HandTiedLM(nn.Module):
    """Embedding -> Linear -> output layer ``F.linear(h, emb.weight)``: the table's second use is in the
    parent's forward, where no embedding or linear module sees it."""

    def __init__(self) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(12, 6, padding_idx=0)
        self.mix = nn.Linear(6, 6)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.linear(torch.tanh(self.mix(self.tok_emb(ids))), self.tok_emb.weight)


class FrozenPrefixCentredNet(nn.Module):
    """Token ids -> frozen embedding -> centring by the batch mean -> ``mixed_fc``: the mixing precedes every
    probed tensor (integer inputs, frozen prefix), so only the replay of check 4 sees it."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(12, 6).requires_grad_(False)
        self.mixed_fc = nn.Linear(6, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids).mean(1)
        return self.mixed_fc(h - h.mean(0, keepdim=True))


class DetachedBatchNormaliserNet(nn.Module):
    """``pre`` -> tanh -> divided by the detached batch mean of the row norms -> ``mixed_head``: mixing
    that no gradient shows."""

    def __init__(self) -> None:
        super().__init__()
        self.pre, self.mixed_head = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.pre(x))
        return self.mixed_head(h / h.norm(dim=1).mean().detach())


class FunctionalLinearNet(nn.Module):
    """``functional_fc`` is never called: its weight and bias are only read by ``F.linear`` in the parent's
    forward."""

    def __init__(self) -> None:
        super().__init__()
        self.functional_fc = nn.Linear(6, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fc = self.functional_fc
        return self.head(torch.tanh(F.linear(x, fc.weight, fc.bias)))


class InstanceNormNet(nn.Module):
    """Conv -> InstanceNorm2d(track_running_stats=True) -> head, in train mode: each example is normalised
    by its own statistics, but the running statistics (buffers, released with the model and never noised)
    average over the batch. ``affine``: the norm also has a weight and bias (no rule: the fallback)."""

    def __init__(self, affine: bool) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.stats_norm = nn.InstanceNorm2d(4, affine=affine, track_running_stats=True)
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.relu(self.stats_norm(self.conv(x))).mean((2, 3)))


class NormActConvNet(nn.Module):
    """Convolution -> norm -> activation -> head, for the rules of InstanceNorm (affine, no running
    statistics), PReLU, transposed and 3-D convolutions."""

    def __init__(self, conv: nn.Module, norm: nn.Module, act: nn.Module, channels: int) -> None:
        super().__init__()
        self.conv, self.norm, self.act, self.head = conv, norm, act, nn.Linear(channels, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.norm(self.conv(x)))
        return self.head(h.flatten(2).mean(2))


class HFViTLogits(nn.Module):
    """Hugging Face ViT classifier (its embeddings' class and position tokens by rule) returning logits;
    ``kind="clip"``: CLIP's vision tower and head instead (class embedding by rule, an unused post-LayerNorm);
    ``kind="pvt"``: PVT's two stages, each with its patch embeddings' position table (and a class token in the
    last) by the same rule."""

    def __init__(self, kind: str = "vit") -> None:
        super().__init__()
        from transformers import (
            CLIPConfig,
            CLIPForImageClassification,
            PvtConfig,
            PvtForImageClassification,
            ViTConfig,
            ViTForImageClassification,
        )

        sizes = {"image_size": 8, "patch_size": 4, "hidden_size": 8, "num_hidden_layers": 1,
                 "num_attention_heads": 2, "intermediate_size": 12}  # fmt: skip
        if kind == "clip":
            self.vit = CLIPForImageClassification(CLIPConfig(vision_config=sizes, num_labels=3))
            return
        if kind == "pvt":
            config = PvtConfig(
                image_size=8, num_encoder_blocks=2, depths=[1, 1], sequence_reduction_ratios=[2, 1],
                hidden_sizes=[8, 16], patch_sizes=[4, 2], strides=[4, 2], num_attention_heads=[1, 2],
                mlp_ratios=[2, 2], num_labels=3,
            )  # fmt: skip
            self.vit = PvtForImageClassification(config)
            return
        config = ViTConfig(
            **sizes, num_channels=3, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0
        )
        self.vit = ViTForImageClassification(config)
        with torch.no_grad():
            for token in (self.vit.vit.embeddings.cls_token, self.vit.vit.embeddings.position_embeddings):
                token.normal_(0.0, 0.1)  # HF starts them at 0 or near it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.vit(pixel_values=x).logits


def _layer_case(name: str) -> tuple[nn.Module, tuple[int, ...]]:
    """(model, input shape of one example) of the single-layer-family cases."""
    if name == "instance_norm_affine_prelu":
        conv, shape = nn.Conv2d(3, 4, 3), (3, 6, 6)
        return NormActConvNet(conv, nn.InstanceNorm2d(4, affine=True), nn.PReLU(4, init=0.1), 4), shape
    if name == "conv_transpose_grouped":
        conv = nn.ConvTranspose2d(4, 4, 3, stride=2, padding=1, groups=2)
        return NormActConvNet(conv, nn.GroupNorm(2, 4), nn.PReLU(), 4), (4, 3, 3)
    if name == "conv3d":
        return NormActConvNet(nn.Conv3d(2, 3, 2, padding=1), nn.Identity(), nn.Tanh(), 3), (2, 3, 3, 3)
    if name in ("hf_vit", "hf_clip", "hf_pvt"):
        return HFViTLogits(kind=name[3:]), (3, 8, 8)
    if name == "bilinear":
        return BilinearNet(), (3, 4)
    if name in ("siglip_probe", "siglip2_probe"):  # the probe queries every example's own tokens
        return ProbeNet("Siglip2" if name.startswith("siglip2") else "Siglip"), (5, 4)
    raise KeyError(name)


LAYER_CASES = (
    "instance_norm_affine_prelu",
    "conv_transpose_grouped",
    "conv3d",
    "hf_vit",
    "hf_clip",
    "hf_pvt",
    "bilinear",
    "siglip_probe",
    "siglip2_probe",
)


def llama(tied: bool) -> nn.Module:
    """Tiny random Llama: RMSNorm (no rule: fallback), rotary positions, grouped KV heads, no biases."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
        tie_word_embeddings=tied,
        pad_token_id=1,
    )
    model = LlamaForCausalLM(config)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    return model.double().eval()


def t5(layers: int = 1) -> nn.Module:
    """Tiny random T5 (encoder-decoder, tied embeddings): ``relative_attention_bias`` is an Embedding called
    on a (query_len, key_len) tensor of buckets, shared by every example and by the ``layers`` layers of its
    stack (dpexp.privacy.shared)."""
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(
        vocab_size=32,
        d_model=8,
        d_kv=4,
        d_ff=16,
        num_layers=layers,
        num_decoder_layers=layers,
        num_heads=2,
        relative_attention_num_buckets=8,
        dropout_rate=0.0,
        pad_token_id=0,
        decoder_start_token_id=0,
        use_cache=False,
    )
    return T5ForConditionalGeneration(config).double().eval()


def switch_transformers() -> nn.Module:
    """Tiny random Switch Transformer (T5 with top-1 mixtures of experts, Fedus et al. 2022): every layer of
    encoder and decoder sparse, 4 experts held as one module each, an expert capacity of 2 tokens per
    sequence (so that tokens are dropped), a T5 relative attention bias (shared by all examples). Its routers
    compute in float32 (``router_dtype`` allows no float64), the rest in float64."""
    from transformers import SwitchTransformersConfig, SwitchTransformersForConditionalGeneration

    config = SwitchTransformersConfig(
        vocab_size=32, d_model=8, d_kv=4, d_ff=16, num_layers=2, num_decoder_layers=2, num_heads=2,
        num_experts=4, expert_capacity=2, encoder_sparse_step=1, decoder_sparse_step=1,
        relative_attention_num_buckets=8, dropout_rate=0.0, router_jitter_noise=0.0, pad_token_id=0,
        decoder_start_token_id=0, use_cache=False,
    )  # fmt: skip
    torch.manual_seed(0)
    return SwitchTransformersForConditionalGeneration(config).double().eval()


def longt5(attention: str) -> nn.Module:
    """Tiny random LongT5 with ``local`` or ``transient-global`` encoder attention: its relative attention
    bias (and the transient-global side bias) is an Embedding on buckets shared by all examples, as T5's."""
    from transformers import LongT5Config, LongT5ForConditionalGeneration

    config = LongT5Config(
        vocab_size=32,
        d_model=8,
        d_kv=4,
        d_ff=16,
        num_layers=1,
        num_decoder_layers=1,
        num_heads=2,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=16,
        encoder_attention_type=attention,
        local_radius=2,
        global_block_size=2,
        dropout_rate=0.0,
        pad_token_id=0,
        decoder_start_token_id=0,
        use_cache=False,
    )
    return LongT5ForConditionalGeneration(config).double().eval()


def bart(family: str = "bart") -> nn.Module:
    """Tiny random BART: the decoder's learned positions looked up for ``arange(T)`` (batch size 1), added to
    every example (declared shared), the encoder's expanded to the batch; scaled word embeddings.
    ``family="blenderbot_small"``, ``"blenderbot"`` or ``"bigbird_pegasus"`` (its full attention): the same
    sizes, whose encoder's and decoder's positions are called on a shape (BigBird-Pegasus' decoder's on the
    ids) with position ids (T,) by keyword, or none (both declared shared)."""
    import transformers

    config_cls, model_cls = {
        "bart": ("BartConfig", "BartForConditionalGeneration"),
        "blenderbot_small": ("BlenderbotSmallConfig", "BlenderbotSmallForConditionalGeneration"),
        "blenderbot": ("BlenderbotConfig", "BlenderbotForConditionalGeneration"),
        "bigbird_pegasus": ("BigBirdPegasusConfig", "BigBirdPegasusForConditionalGeneration"),
    }[family]
    extra = {"attention_type": "original_full"} if family == "bigbird_pegasus" else {}
    config = getattr(transformers, config_cls)(
        vocab_size=32,
        d_model=8,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=16,
        decoder_ffn_dim=16,
        max_position_embeddings=16,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        scale_embedding=True,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
        decoder_start_token_id=2,
        use_cache=False,
        **extra,
    )
    return getattr(transformers, model_cls)(config).double().eval()


def mpnet() -> nn.Module:
    """Tiny random MPNet classifier: one relative attention bias for all layers, expanded to the batch
    (``expand((bsz, -1, q, k))``) and added to each layer's scores in place (``scores += bias``)."""
    from transformers import MPNetConfig, MPNetForSequenceClassification

    config = MPNetConfig(
        vocab_size=40,
        hidden_size=8,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=16,
        max_position_embeddings=24,
        relative_attention_num_buckets=32,  # the encoder buckets into 32 whatever the config says
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        pad_token_id=1,
        num_labels=2,
    )
    return MPNetForSequenceClassification(config).double().eval()


def longformer() -> nn.Module:
    """Tiny random Longformer classifier: sliding-window attention of 4 tokens plus global attention on the
    first token, both time-major inside, and ``query_global``'s 3-D output divided in place (which drops a
    hook on the view: the Linear's matmul result is hooked instead)."""
    from transformers import LongformerConfig, LongformerForSequenceClassification

    config = LongformerConfig(
        vocab_size=40,
        hidden_size=8,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=16,
        max_position_embeddings=24,
        attention_window=4,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        pad_token_id=1,
        num_labels=2,
    )
    return LongformerForSequenceClassification(config).double().eval()


def deberta_v2(
    share_att_key: bool, norm_rel_ebd: str = "layer_norm", pos_att_type=("p2c", "c2p")
) -> nn.Module:
    """Tiny random DeBERTa-v2 classifier (2 layers, relative attention). The relative embeddings
    ``encoder.rel_embeddings.weight`` are read directly, normalised by ``encoder.LayerNorm`` (norm_rel_ebd)
    and projected in every layer by its ``query_proj``/``key_proj`` (``share_att_key``, as real checkpoints)
    or ``pos_query_proj``/``pos_key_proj``: shared by all examples until they meet the batch
    (dpexp.privacy.shared). ``initializer_range`` 0.3 instead of 0.02, so that the shared path carries a
    sizeable part of every example's gradient."""
    from transformers import DebertaV2Config, DebertaV2ForSequenceClassification

    config = DebertaV2Config(
        vocab_size=32,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=37,
        max_position_embeddings=16,
        relative_attention=True,
        position_buckets=8,
        max_relative_positions=16,
        pos_att_type=list(pos_att_type),
        share_att_key=share_att_key,
        norm_rel_ebd=norm_rel_ebd,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        type_vocab_size=0,
        num_labels=2,
        pad_token_id=1,
        initializer_range=0.3,
    )
    return DebertaV2ForSequenceClassification(config).double().eval()


def bert_mean_pool() -> nn.Module:
    """The engine tests' BERT encoder without its pooler, under the masked-mean head (model.pooling=mean)."""
    from transformers import BertConfig, BertModel

    from dpexp.models.hf_encoder import MeanPoolClassifier

    encoder = engine_models._encoder(
        BertConfig, lambda config: BertModel(config, add_pooling_layer=False), num_labels=2
    )
    return MeanPoolClassifier(encoder, 2, dropout=0.0).double().eval()


TEXT_CLASSIFIERS = {  # model type -> what its tiny configuration needs beyond hf_text_classifier's sizes
    "mobilebert": {"num_attention_heads": 2, "embedding_size": 8, "true_hidden_size": 8,
                   "intra_bottleneck_size": 8},  # NoNorm in place of LayerNorm
    "convbert": {"num_attention_heads": 4, "embedding_size": 16, "conv_kernel_size": 3},  # its own bias
    "esmc": {"num_attention_heads": 2},  # ESM C's LayerNorm, cast back to its input's dtype
    "squeezebert": {"num_attention_heads": 2, "embedding_size": 16},  # its LayerNorm over the channels of NCW
}  # fmt: skip


def hf_text_classifier(architecture: str) -> nn.Module:
    """A tiny float64 Hugging Face sequence classifier of 2 labels from its model type
    (:data:`TEXT_CLASSIFIERS`), vocabulary 32 with padding id 1, its parameters drawn away from their starts
    (NoNorm's ones and zeros)."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    sizes = {"vocab_size": 32, "hidden_size": 16, "num_hidden_layers": 1, "intermediate_size": 24,
             "max_position_embeddings": 16, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0,
             "pad_token_id": 1, "num_labels": 2}  # fmt: skip
    config = AutoConfig.for_model(architecture, **sizes, **TEXT_CLASSIFIERS[architecture])
    model = AutoModelForSequenceClassification.from_config(config).double().eval()
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return model


def distilbert() -> nn.Module:
    from transformers import DistilBertConfig, DistilBertForSequenceClassification

    config = DistilBertConfig(
        vocab_size=32,
        dim=16,
        n_layers=1,
        n_heads=2,
        hidden_dim=24,
        max_position_embeddings=16,
        dropout=0.0,
        attention_dropout=0.0,
        seq_classif_dropout=0.0,
        num_labels=2,
        pad_token_id=1,
    )
    return DistilBertForSequenceClassification(config).double().eval()


# ---------------------------------------------------------------------------------------------- losses
def token_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    """Sum over positions of the cross-entropy of ``model(ids)`` against ``labels`` (0 ignored)."""
    logits = model(batch["ids"])
    losses = F.cross_entropy(
        logits.flatten(0, 1), batch["labels"].flatten(), reduction="none", ignore_index=0
    )
    return losses.view(batch["labels"].shape).sum(1)


def seq2seq_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    """Sum of the decoder's token losses per example (labels -100 ignored)."""
    logits = model(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"]
    ).logits
    losses = F.cross_entropy(
        logits.flatten(0, 1), batch["labels"].flatten(), reduction="none", ignore_index=-100
    )
    return losses.view(batch["labels"].shape).sum(1)


# ---------------------------------------------------------------------------------------------- cases
def _floats(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, dtype=torch.float64)


def _labels(gen: torch.Generator, size: int, classes: int) -> torch.Tensor:
    return torch.randint(0, classes, (size,), generator=gen)


LM_PADDING = {"input_ids": 1, "attention_mask": 0, "labels": -100}  # labels -100: no loss
PAIR_PADDING = {"input_ids": 1, "attention_mask": 0, "token_type_ids": 0}  # a text pair's (Funnel)

# engine_models cases: class-label key and classes, float inputs, padding-only example
_ENGINE_CASE_INPUTS: dict[str, dict] = {
    "mlp": {"float_inputs": ("x",), "class_label": ("y", 3)},
    "fallback": {"float_inputs": ("x",), "class_label": ("y", 3)},
    "fallback_inplace": {"float_inputs": ("x",), "class_label": ("y", 3)},
    "fallback_tuple": {"float_inputs": ("x",), "class_label": ("y", 3)},
    "scalar_gain": {"float_inputs": ("x",), "class_label": ("y", 3)},
    "vit": {"float_inputs": ("x",), "class_label": ("y", 3)},
    "vit_registers": {"float_inputs": ("x",), "class_label": ("y", 3)},
    "deit_distilled": {"float_inputs": ("x",), "class_label": ("y", 3)},
    "wrn_block": {"float_inputs": ("x",), "class_label": ("y", 4)},
    "sequence": {"padding": {"ids": 0}},
    "gpt2": {"padding": LM_PADDING},
    "gpt2_lora": {"padding": LM_PADDING},
    "flattened": {"padding": {"ids": 0}},
    "opt": {"padding": LM_PADDING},
    "falcon": {"padding": LM_PADDING},
    "gemma2": {"padding": LM_PADDING},
    "gemma4": {"padding": LM_PADDING},
    "llama4": {"padding": LM_PADDING},
    "glm": {"padding": LM_PADDING},
    "gpt_oss": {"padding": LM_PADDING},
    "causal_mixer": {"padding": {"ids": 0}},
    "mamba": {"padding": LM_PADDING},
    "mamba2": {"padding": LM_PADDING},
    "qwen3_5": {"padding": LM_PADDING},
    "lfm2": {"padding": LM_PADDING},
    "deberta": {"class_label": ("labels", 2), "padding": {"input_ids": 1, "attention_mask": 0}},
    "roberta": {"class_label": ("labels", 3), "padding": {"input_ids": 1, "attention_mask": 0}},
    "bert": {"class_label": ("labels", 2), "padding": {"input_ids": 1, "attention_mask": 0}},
    "roberta_infilling": {"class_label": ("labels", 2), "padding": {"input_ids": 1, "attention_mask": 0}},
    "bert_infilling": {"class_label": ("labels", 2), "padding": {"input_ids": 1, "attention_mask": 0}},
    "funnel": {"class_label": ("labels", 2), "padding": PAIR_PADDING},
    "funnel_factorized": {"class_label": ("labels", 2), "padding": PAIR_PADDING},
}

# the cases whose contract allows a refusal, and the names such a refusal must mention
REFUSABLE: dict[str, tuple[str, ...]] = {
    "flat_time_major_len_eq_batch": ("mix",),
    "flat_time_major_len_ne_batch": ("mix",),
    "shared_table_len_eq_batch": ("position_gate",),
    "shared_table_len_ne_batch": ("position_gate",),
    "hand_tied": ("tok_emb",),
    "functional_linear": ("functional_fc",),
    "instance_norm_running_stats": ("stats_norm",),
    "instance_norm_affine_running_stats": ("stats_norm",),
    "frozen_prefix_centred": ("mixed_fc",),
    "detached_batch_normaliser": ("mixed_head",),
    "mixtral_aux_loss": ("gate",),
}

NEW_CASES = [
    "llama_tied",
    "llama_untied",
    "distilbert",
    "bert_mean_pool",  # masked mean over tokens: padded positions must not reach the logits
    "t5_len_eq_batch",
    "t5_len_ne_batch",
    "switch_transformers",  # top-1 experts held as one module each, per-sequence capacity, a T5 bias
    "longt5_local",  # relative attention bias of local attention blocks, shared by all examples
    "longt5_transient_global",  # and the transient-global side bias
    "bart",  # the decoder's learned positions for arange(T), shared by all examples
    "blenderbot_small",  # learned positions called on a shape, position ids (T,) by keyword
    "bigbird_pegasus",  # the same, the decoder's called on the ids
    "mpnet",  # one relative attention bias, expanded to the batch, added to the scores in place
    "longformer",  # time-major projections, global attention on the first token, a query divided in place
    "time_major_len_eq_batch",
    "time_major_len_ne_batch",
    "flat_time_major_len_eq_batch",
    "flat_time_major_len_ne_batch",
    "shared_table_len_eq_batch",
    "shared_table_len_ne_batch",
    "hand_tied",
    "functional_linear",
    "instance_norm_running_stats",
    "instance_norm_affine_running_stats",
    "gru_time_major_initial_state",
    "transformer_encoder_time_major",  # nn.TransformerEncoderLayer(batch_first=False): (T, B, d) linears
    "lstm_cell_initial_state",  # a user loop over an LSTMCell: one use per step
    "mha_cross_kdim_bias_kv_zero_attn",
    "convnext",
    "convnextv2",
    "efficientnet_gn",
    "nf_resnet",  # timm ScaledStdConv2d: scaled weight standardisation with a learnable gain
    "nfnet_skipinit",  # timm NormFreeBlock's skipinit_gain: the block rerun with the gain raised by one
    "bit",  # timm StdConv2d: weight standardisation
    "hf_convnext",  # HF ConvNextLayerNorm (both data formats), ConvNextLayer's layer_scale_parameter
    "hf_convnextv2",  # HF ConvNextV2GRN: statistics over each example's own positions
    "hf_bit",  # HF WeightStandardizedConv2d with its DynamicPad2d, BitGroupNormActivation
    "hf_hiera",  # HF HieraEmbeddings: a position table added to the patch convolution, a tuple returned
    "tv_convnext",  # torchvision LayerNorm2d, CNBlock's layer_scale (C, 1, 1), its shortcut added in place
    "tv_vit",  # torchvision ViT: class_token, pos_embedding, nn.MultiheadAttention read off its graph
    "tv_swin",  # torchvision ShiftedWindowAttention: qkv/proj weights read by the function, padded, shifted
    "tv_swinv2",  # torchvision ShiftedWindowAttentionV2: temperature (one head clamped), cpb_mlp on a table
    "mobilebert",  # HF MobileBERT's NoNorm
    "convbert",  # HF ConvBERT's SeparableConv1D bias
    "esmc",  # HF ESM C's EsmcLayerNorm
    "squeezebert",  # HF SqueezeBERT's LayerNorm on (B, C, T) and its grouped 1x1 convolutions
    "embedding_bag_rows_weighted",
    "embedding_bag_offsets_mean_padding",
    "layer_scale_dinov2",
    "layer_scale_timm_flattened",
    "layer_scale_beit",  # HF BeitLayer's own lambda_1, lambda_2 (numbered taps of its drop_path)
    "dinov2_masked",  # HF Dinov2Embeddings: cls, position and mask tokens (bool_masked_pos)
    "dinov2_registers_masked",  # HF Dinov2WithRegistersEmbeddings: the same and register tokens
    "swin_windows",  # timm WindowAttention's relative position table: (B * windows) rows, shifted windows
    "beit_masked",  # HF BeitEmbeddings: cls, absolute position and mask tokens (bool_masked_pos)
    "hf_swin_windows",  # HF SwinAttention's relative position table, recomputed scores: (B * windows) rows
    "hf_swinv2_windows",  # HF Swinv2SelfAttention's temperature and bias MLP on a shared coordinate buffer
    "hf_swin_self_attention_windows",  # HF DonutSwinSelfAttention's own table (the older Swin form)
    "frozen_prefix_centred",  # examples mixed after a frozen prefix on token ids (check 4)
    "detached_batch_normaliser",  # examples mixed by a detached batch statistic (check 4)
    *LAYER_CASES,
    "deberta_v2_shared_key",  # relative embeddings through LayerNorm and query_proj/key_proj
    "deberta_v2_pos_proj",  # relative embeddings through pos_query_proj/pos_key_proj
    "beit_relative_shared",  # HF BEiT's relative position table read whole, one for all layers
    "timm_beit",  # timm BEiT: q/v biases, relative table and the qkv weight its attention reads; 2 scales
    "timm_beit_shared",  # the same, fused, with one relative position bias shared by all blocks
    "mixtral",  # MoE routers and 3-D expert weights on (B*T) flattened rows, folded with their routing
    "dbrx",  # experts stacked (E I, d), each expert's gathered rows passed with its slices to one mlp
    "dory",  # an LM head scaling its float32 logits per vocabulary entry, nGPT's scales read off the graph
    "gpt_neox_japanese",  # the last attention returns its dense_bias, which the decoder layer adds
    "deepseek_v4",  # a hash router (experts by token id), hyper-connections' weights read off the graph
    "hy_v4",  # hyper-connections without comb (their rule), attention sinks behind a gate
    "qwen2_moe",  # the same with a gated shared expert, scores not renormalised
    "mixtral_aux_loss",  # the router's load-balancing loss (output_router_logits) mixes the batch's routing
    "deepseek_v2",  # a softmax router in float32, group-limited top-k scaled
    "ernie4_5_moe",  # a float32 router (autocast off) choosing by a frozen bias in a child module
    "aria",  # transposed experts, a router softmaxing its top-k logits
    "deepseek_v3",  # a sigmoid router in float32, group-limited top-k with a load-balancing bias
    "gemma4_moe",  # a router with its own input scale and per-expert scales around a Linear child
    "granite_moe",  # a router that softmaxes its top-k logits
    "qwen3_5_moe",  # a router always renormalised, a gated shared expert
    "jamba",  # a router not renormalised beside a Mamba mixer (its selective-scan rule)
    "nemotron_h",  # experts without a gate behind a sigmoid router, beside a Mamba-2 mixer
    "falcon_h1",  # attention beside a Mamba-2 mixer with µP multipliers, gated without its norm
    "qwen3_next",  # a gated delta net with q, k, v, z and b, a interleaved per key head, beside MoE blocks
    "kimi_linear",  # the Kimi Delta Attention: its convolution's gradient read off the call's graph
    "zamba",  # Mamba's scan in heads, each with its own x_proj and dt_proj, beside a shared attention block
    "inkling",  # a normed embedding; a sigmoid router over routed and shared experts with a global scale
    "lfm2_moe",  # a short convolution, a sigmoid router choosing by scores plus its block's expert bias
    "laguna",  # soft-capped float32 router logits, sigmoid scores chosen with a frozen bias parameter
    "minimax_m2",  # sigmoid scores chosen by scores plus the bias its block passes to the router
    # attention sinks (rules/sinks.py) in their three forms: a score column, a gate after it, an output scale
    *(f"sinks_{architecture}" for architecture in engine_models.SINKS_DECODERS),
    "beam_gate",  # Beam's per-head bias on the attention's output gate
    "diffllama",  # differential attention: one lambda per layer from four vectors, taken in forward mode
    "cpmant",  # a segment position bias looked up per example, shared by every layer's attention
    "whisper",  # speech to text: the decoder's positions indexed by position ids repeated to the batch
    "longcat_flash",  # zero-computation (identity) experts beside the routed ones, a router reading a Linear
    "doge",  # a dynamic attention mask (forward mode) and residual scales read off the layer's graph
    "rwkv",  # token shift and the WKV recurrence run again with per-example copies of decay and bonus
    "recurrent_gemma",  # the RG-LRU's gates and decay read off its call's graph (a scan over time)
]
ALL_CASES = [*engine_models.CASES, *NEW_CASES]
# checked in the slow cross product only: the other recurrent and attention models
SLOW_CASES = [name for name in recurrent_models.MODELS if name not in NEW_CASES]


def _lm_loss_with_router_aux_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    """Each example's next-token loss plus the Switch load-balancing loss (Fedus et al. 2022, eq. 4; what
    ``output_router_logits=True`` adds to a Mixtral's loss), computed over the routing of the whole batch:
    every example's loss then depends on the others' tokens."""
    ids, mask = batch["input_ids"], batch["attention_mask"]
    out = model(input_ids=ids, attention_mask=mask, output_router_logits=True)
    logits, labels = out.logits[:, :-1], batch["labels"][:, 1:]
    losses = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none", ignore_index=-100)
    return losses.view(labels.shape).sum(1) + model.config.router_aux_loss_coef * out.aux_loss


def _new_case(name: str, size: int, gen: torch.Generator) -> tuple[nn.Module, LossFn, Batch, dict]:
    """Model, unweighted loss, batch and neighbour information of one of ``NEW_CASES``."""
    # sequence lengths: equal to the micro-batch size b where the case is about T == b, else b + 2
    length = size if name.endswith("len_eq_batch") else size + 2
    if name in (
        "mixtral",
        "qwen2_moe",
        "mixtral_aux_loss",
        "ernie4_5_moe",
        "aria",
        "deepseek_v2",
        "deepseek_v3",
        "gemma4_moe",
        "granite_moe",
        "qwen3_5_moe",
        "jamba",
        "nemotron_h",
        "falcon_h1",
        "qwen3_next",
        "kimi_linear",
        "zamba",
        "inkling",
        "lfm2_moe",
        "laguna",
        "minimax_m2",
        "dbrx",
        "dory",
        "gpt_neox_japanese",
        "deepseek_v4",
        "hy_v4",
        "longcat_flash",
    ):
        builders = {
            "dbrx": engine_models.dbrx,
            "dory": engine_models.dory,
            "gpt_neox_japanese": engine_models.gpt_neox_japanese,
            "deepseek_v4": lambda: engine_models.new_moe("deepseek_v4"),
            "hy_v4": lambda: engine_models.new_moe("hy_v4"),
            "longcat_flash": lambda: engine_models.new_moe("longcat_flash"),
            "qwen2_moe": engine_models.qwen2_moe,
            "deepseek_v2": engine_models.deepseek_v2,
            "ernie4_5_moe": engine_models.ernie4_5_moe,
            "aria": engine_models.aria,
            "deepseek_v3": engine_models.deepseek_v3,
            "gemma4_moe": engine_models.gemma4_moe,
            "granite_moe": engine_models.granite_moe,
            "qwen3_5_moe": engine_models.qwen3_5_moe,
            "jamba": engine_models.jamba,
            "nemotron_h": engine_models.nemotron_h,
            "falcon_h1": engine_models.falcon_h1,
            "qwen3_next": engine_models.qwen3_next,
            "kimi_linear": engine_models.kimi_linear,
            "zamba": engine_models.zamba,
            "inkling": engine_models.inkling,
            "lfm2_moe": engine_models.lfm2_moe,
            "laguna": lambda: engine_models.new_moe("laguna"),
            "minimax_m2": lambda: engine_models.new_moe("minimax_m2"),
        }
        model = builders.get(name, engine_models.mixtral)()
        batch = engine_models._padded_text(size, 8, 40, gen)
        loss = _lm_loss_with_router_aux_loss if name == "mixtral_aux_loss" else engine_models.lm_loss
        return model, loss, batch, {"padding": LM_PADDING}
    if name == "recurrent_gemma":
        batch = engine_models._padded_text(size, 8, 40, gen)
        return engine_models.recurrent_gemma(), engine_models.lm_loss, batch, {"padding": LM_PADDING}
    if name == "beam_gate":
        batch = engine_models._padded_text(size, 8, 40, gen)
        return engine_models.beam_attention(), engine_models.lm_loss, batch, {"padding": LM_PADDING}
    if name == "whisper":
        return engine_models.whisper(), engine_models.speech_loss, engine_models.speech_batch(size, gen), {}
    if name in ("diffllama", "cpmant", "doge", "rwkv"):
        model = {
            "diffllama": engine_models.diffllama,
            "cpmant": engine_models.cpmant,
            "doge": engine_models.doge,
            "rwkv": engine_models.rwkv,
        }[name]()
        batch = engine_models._padded_text(size, 8, 40, gen)
        # Doge's float32 softmax: A's gradient, a small sum of large terms (tests/test_rules_doge.py)
        slack = {"oracle_slack": 1e-5} if name == "doge" else {}
        return model, engine_models.lm_loss, batch, {"padding": LM_PADDING, **slack}
    if name.startswith("sinks_"):
        model = engine_models.sinks_decoder(name.removeprefix("sinks_"))
        batch = engine_models._padded_text(size, 8, 40, gen)
        return model, engine_models.lm_loss, batch, {"padding": LM_PADDING}
    if name.startswith("llama"):
        model = llama(tied=name == "llama_tied")
        return (
            model,
            engine_models.lm_loss,
            engine_models._padded_text(size, 8, 32, gen),
            {"padding": LM_PADDING},
        )
    if name in ("distilbert", "bert_mean_pool", *TEXT_CLASSIFIERS):
        batch = engine_models._padded_text(size, 8, 32, gen)
        batch["labels"] = _labels(gen, size, 2)
        info = {"class_label": ("labels", 2), "padding": {"input_ids": 1, "attention_mask": 0}}
        builders = {"distilbert": distilbert, "bert_mean_pool": bert_mean_pool}
        model = builders[name]() if name in builders else hf_text_classifier(name)
        return model, engine_models.seq_classification_loss, batch, info
    if name.startswith(("t5", "longt5", "bart", "blenderbot", "bigbird", "switch")):
        source = engine_models._padded_text(size, length, 32, gen)
        source["input_ids"] = source["input_ids"].masked_fill(source["attention_mask"] == 0, 0)
        target = torch.randint(2, 32, (size, length), generator=gen)
        target[:, -1] = -100  # a padded target position
        batch = {
            "input_ids": source["input_ids"],
            "attention_mask": source["attention_mask"],
            "labels": target,
        }
        if name in ("bart", "blenderbot_small", "bigbird_pegasus"):
            source_pad = {"input_ids": 1, "attention_mask": 0}
            batch["input_ids"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, 1)
            return bart(name), seq2seq_loss, batch, {"padding": source_pad}
        if name == "switch_transformers":
            model = switch_transformers()
        elif name.startswith("longt5"):
            model = longt5(name.removeprefix("longt5_").replace("_", "-"))
        else:
            model = t5()
        return model, seq2seq_loss, batch, {"padding": {"input_ids": 0, "attention_mask": 0}}
    if name == "mpnet":
        batch = engine_models._padded_text(size, 6, 32, gen)
        batch["labels"] = _labels(gen, size, 2)
        info = {"class_label": ("labels", 2), "padding": {"input_ids": 1, "attention_mask": 0}}
        return mpnet(), engine_models.seq_classification_loss, batch, info
    if name == "longformer":
        batch = engine_models._padded_text(size, 6, 32, gen)
        batch["labels"] = _labels(gen, size, 2)
        info = {"class_label": ("labels", 2), "padding": {"input_ids": 1, "attention_mask": 0}}
        return longformer(), engine_models.seq_classification_loss, batch, info
    if name.startswith("deberta_v2"):
        batch = engine_models._padded_text(size, 6, 32, gen)
        batch["labels"] = _labels(gen, size, 2)
        shared_key = name == "deberta_v2_shared_key"
        model = deberta_v2(shared_key, "layer_norm" if shared_key else "none")
        info = {"class_label": ("labels", 2), "padding": {"input_ids": 1, "attention_mask": 0}}
        return model, engine_models.seq_classification_loss, batch, info
    float_info = {"float_inputs": ("x",), "class_label": ("y", 3)}
    if name.startswith("flat_time_major"):
        batch = {"x": _floats(gen, size, length, 4), "y": _labels(gen, size, 3)}
        return FlatTimeMajorNet().double(), engine_models.classification_loss, batch, float_info
    if name.startswith("time_major"):
        batch = {"x": _floats(gen, size, length, 4), "y": _labels(gen, size, 3)}
        return TimeMajorNet().double(), engine_models.classification_loss, batch, float_info
    if name.startswith("shared_table"):
        batch = {"x": _floats(gen, size, length, 4), "y": _labels(gen, size, 3)}
        return SharedTableNet(length).double(), engine_models.classification_loss, batch, float_info
    if name == "hand_tied":
        ids = torch.randint(1, 12, (size, 7), generator=gen)
        ids[:, -2:] = 0
        labels = torch.randint(1, 12, (size, 7), generator=gen).masked_fill(ids == 0, 0)
        return HandTiedLM().double(), token_loss, {"ids": ids, "labels": labels}, {"padding": {"ids": 0}}
    if name == "frozen_prefix_centred":
        batch = {"ids": torch.randint(0, 12, (size, 6), generator=gen), "y": _labels(gen, size, 3)}
        return FrozenPrefixCentredNet().double(), scale_loss, batch, {"class_label": ("y", 3)}
    if name == "detached_batch_normaliser":
        batch = {"x": _floats(gen, size, 6), "y": _labels(gen, size, 3)}
        return DetachedBatchNormaliserNet().double(), engine_models.classification_loss, batch, float_info
    if name == "functional_linear":
        batch = {"x": _floats(gen, size, 6), "y": _labels(gen, size, 3)}
        return FunctionalLinearNet().double(), engine_models.classification_loss, batch, float_info
    if name in (
        "convnext",
        "convnextv2",
        "efficientnet_gn",
        "nf_resnet",
        "nfnet_skipinit",
        "bit",
    ) or name in (
        "hf_convnext",
        "hf_convnextv2",
        "hf_bit",
        "hf_hiera",
        "tv_convnext",
        "tv_vit",
        "tv_swin",
        "tv_swinv2",
    ):  # timm's, Hugging Face's and torchvision's CNNs (and Hiera, torchvision's ViT)
        builder = timm_cnn_models.BUILDERS["efficientnet" if name == "efficientnet_gn" else name]
        batch = {"x": _floats(gen, size, 3, 8, 8), "y": _labels(gen, size, 3)}
        return builder(), engine_models.classification_loss, batch, float_info
    if name.startswith("embedding_bag"):  # rows: (B, L) bags; offsets: one 1-D input, include_last_offset
        args = ("sum", "rows", True, None, False) if "rows" in name else ("mean", "offsets", False, 0, True)
        info = {"float_inputs": ("weights",), "class_label": ("y", 3), "padding": {"ids": 0, "lengths": 1}}
        return BagNet(*args).double(), bag_loss, bag_batch(size, int(gen.initial_seed())), info
    if name in LAYER_CASES:
        model, shape = _layer_case(name)
        batch = {"x": _floats(gen, size, *shape), "y": _labels(gen, size, 3)}
        return model.double(), engine_models.classification_loss, batch, float_info
    if name == "swin_windows":
        batch = {"x": _floats(gen, size, 3, 8, 8), "y": _labels(gen, size, 3)}
        return swin().double(), engine_models.classification_loss, batch, float_info
    if name == "hf_swin_windows":
        batch = {"x": _floats(gen, size, 3, 16, 16), "y": _labels(gen, size, 3)}
        return HFSwinNet().double(), hf_swin_loss, batch, float_info
    if name == "hf_swin_self_attention_windows":
        batch = {"x": _floats(gen, size, 3, 16, 16), "y": _labels(gen, size, 3)}
        return HFSwinSelfAttentionNet().double(), hf_swin_loss, batch, float_info
    if name == "hf_swinv2_windows":
        batch = {"x": _floats(gen, size, 3, 16, 16), "y": _labels(gen, size, 3)}
        return HFSwinv2Net().double(), hf_swin_loss, batch, float_info
    if name == "beit_masked":
        mask = torch.rand(size, 4, generator=gen) < 0.5
        mask[0] = False  # an example without masked patches
        batch = {"x": _floats(gen, size, 3, 8, 8), "mask": mask, "y": _labels(gen, size, 3)}
        return BeitNet().double(), beit_embeddings_loss, batch, float_info
    if name in ("timm_beit", "timm_beit_shared"):
        batch = {"x": _floats(gen, size, 3, 16, 16), "y": _labels(gen, size, 3)}
        model = timm_beit(fused=name.endswith("shared"), shared=name.endswith("shared"))
        return model.double(), engine_models.classification_loss, batch, float_info
    if name == "beit_relative_shared":
        batch = {"x": _floats(gen, size, 3, 8, 8), "y": _labels(gen, size, 3)}
        return BeitNet(relative="shared").double(), beit_embeddings_loss, batch, float_info
    if name in ("dinov2_masked", "dinov2_registers_masked"):
        mask = torch.rand(size, 4, generator=gen) < 0.5
        mask[0] = False  # an example without masked patches
        batch = {"x": _floats(gen, size, 3, 8, 8), "mask": mask, "y": _labels(gen, size, 3)}
        return Dinov2Net(registers=2 if "registers" in name else 0).double(), dinov2_loss, batch, float_info
    if name == "layer_scale_beit":
        batch = {"x": _floats(gen, size, 4, 5), "y": _labels(gen, size, 3)}
        return BeitLayerNet("beit").double(), beit_loss, batch, float_info
    if name.startswith("layer_scale"):  # channels-last layer scale, on (B, T, d) or flattened (B*T, d) rows
        ids = torch.randint(1, 11, (size, 6), generator=gen)
        ids[0, 4:] = 0
        batch = {"ids": ids, "y": _labels(gen, size, 3)}
        model = ScaleNet("dinov2" if "dinov2" in name else "timm", flatten="flattened" in name).double()
        info = {"class_label": ("y", 3), "padding": {"ids": 0}}
        return model, scale_loss, batch, info
    if name.startswith("instance_norm"):
        batch = {"x": _floats(gen, size, 3, 6, 6), "y": _labels(gen, size, 3)}
        model = InstanceNormNet(affine="affine" in name).double().train()
        return model, engine_models.classification_loss, batch, float_info
    raise KeyError(name)


def make_sensitivity_case(name: str, size: int = 5, seed: int = 0) -> SensitivityCase:
    """The named case with a data set D of ``size`` examples."""
    if name in engine_models.CASES:
        model, loss_fn, batch = engine_models.make_case(name, batch_size=size, seed=seed)
        info = _ENGINE_CASE_INPUTS[name]
    elif name in recurrent_models.MODELS:
        model, loss_fn, batch = recurrent_models.make_recurrent_case(name, batch_size=size, seed=seed)
        info = {"class_label": ("y", recurrent_models.CLASSES), "padding": {"ids": 0}}
    else:
        torch.manual_seed(seed)
        model, loss_fn, batch, info = _new_case(name, size, torch.Generator().manual_seed(seed))
    expect: Expect = "refuse_or_private" if name in REFUSABLE else "private"
    return SensitivityCase(
        name,
        model,
        weighted(loss_fn),
        with_weight(batch),
        expect=expect,
        offenders=REFUSABLE.get(name, ()),
        **info,
    )
