"""Small float64 models and per-example losses on which every clipping path is checked against the oracle."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dpexp.layers import WSConv2d
from dpexp.privacy.rules import register_reads

Batch = dict[str, torch.Tensor]


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))
        self.net[2].bias.requires_grad_(False)  # a frozen parameter inside a trained layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class WRNBlockNet(nn.Module):
    """A WRN-style residual block: weight-standardised convs, GroupNorm, a 1x1 shortcut, a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = WSConv2d(3, 8, 3, padding=1)
        self.norm1 = nn.GroupNorm(2, 8)
        self.conv1 = WSConv2d(8, 8, 3, stride=2, padding=1)
        self.norm2 = nn.GroupNorm(4, 8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1, bias=False)
        self.shortcut = nn.Conv2d(8, 8, 1, stride=2)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        h = self.conv1(F.relu(self.norm1(x)))
        h = self.conv2(F.relu(self.norm2(h)))
        return self.head((h + self.shortcut(x)).mean((2, 3)))


class SequenceNet(nn.Module):
    """Embedding (with padding_idx) -> Conv1d -> LayerNorm -> Linear, the embedding tied to the output."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 6, padding_idx=0)
        self.conv = nn.Conv1d(6, 6, 3, padding=1)
        self.norm = nn.LayerNorm(6)
        self.out = nn.Linear(6, 11, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.conv(self.embed(ids).transpose(1, 2)).transpose(1, 2)
        return self.out(self.norm(torch.tanh(h)))


def classification_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    return F.cross_entropy(model(batch["x"]), batch["y"], reduction="none")


def sequence_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    logits = model(batch["ids"])
    losses = F.cross_entropy(logits.flatten(0, 1), batch["ids"].flatten(), reduction="none", ignore_index=0)
    return losses.view(batch["ids"].shape).sum(1)


def lm_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    """Sum of next-token losses per example; padded positions (label -100) excluded."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
    labels = batch["labels"][:, 1:]
    losses = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none", ignore_index=-100)
    return losses.view(labels.shape).sum(1)


def seq_classification_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return F.cross_entropy(logits, batch["labels"], reduction="none")


def _padded_text(batch_size: int, length: int, vocab: int, generator: torch.Generator) -> Batch:
    ids = torch.randint(3, vocab, (batch_size, length), generator=generator)
    lengths = torch.randint(length // 2, length + 1, (batch_size,), generator=generator)
    mask = (torch.arange(length)[None, :] < lengths[:, None]).long()
    ids = ids.masked_fill(mask == 0, 1)
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


class FlattenedMLPNet(nn.Module):
    """Embedding -> (B, T, d) flattened to (B*T, d) -> LayerNorm -> Linear -> back to (B, T, d) -> Linear, as
    OPT's decoder layers run their MLP: the middle layers see b*T rows, example i's in [i*T, (i+1)*T)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 6, padding_idx=0)
        self.norm = nn.LayerNorm(6)
        self.fc = nn.Linear(6, 6)
        self.out = nn.Linear(6, 11)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        flat = self.fc(self.norm(h.reshape(-1, h.shape[-1])))
        return self.out(torch.tanh(flat).view(h.shape) + h)


def opt() -> nn.Module:
    """Tiny random Hugging Face OPT (its decoder layers flatten (B, T, d) to (B*T, d) before fc1/fc2)."""
    from transformers import OPTConfig, OPTForCausalLM

    config = OPTConfig(
        vocab_size=40,
        hidden_size=16,
        word_embed_proj_dim=16,
        ffn_dim=24,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=16,
        dropout=0.0,
        attention_dropout=0.0,
        layerdrop=0.0,
        pad_token_id=1,
    )
    return OPTForCausalLM(config).double().eval()


def gpt2(lora: bool = False) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=40,
        n_positions=16,
        n_embd=16,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        tie_word_embeddings=True,
    )
    model = GPT2LMHeadModel(config)
    assert model.lm_head.weight is model.transformer.wte.weight
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(
            model,
            LoraConfig(
                r=4,
                lora_alpha=8,
                target_modules=["c_attn"],
                lora_dropout=0.0,
                fan_in_fan_out=True,
                init_lora_weights=False,
            ),
        )
    return model.double().eval()


def _encoder(config_cls, model_cls, num_labels: int) -> nn.Module:
    config = config_cls(
        vocab_size=40,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=24,
        max_position_embeddings=24,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        num_labels=num_labels,
        pad_token_id=1,
    )
    return model_cls(config).double().eval()


def deberta() -> nn.Module:
    """Tiny random DeBERTa (v1) with relative attention, c2p and p2c: its attention owns the biases
    ``q_bias``, ``v_bias`` (a rule reads their gradients at its ``in_proj``'s output); the relative
    embeddings are read whole and projected in every layer by ``pos_proj``/``pos_q_proj`` (shared by all
    examples until they meet the batch), the p2c projection scaled in place."""
    from transformers import DebertaConfig, DebertaForSequenceClassification

    config = DebertaConfig(
        vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=24,
        max_position_embeddings=24, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=2,
        pad_token_id=1, relative_attention=True, max_relative_positions=8, pos_att_type=["c2p", "p2c"],
        initializer_range=0.3,
    )  # fmt: skip
    model = DebertaForSequenceClassification(config).double().eval()
    with torch.no_grad():
        for layer in model.deberta.encoder.layer:
            layer.attention.self.q_bias.normal_(0.0, 0.3)
            layer.attention.self.v_bias.normal_(0.0, 0.3)
    return model


def funnel(attention_type: str = "relative_shift", dropout: float = 0.0) -> nn.Module:
    """Tiny random Funnel Transformer (Dai et al. 2020) classifier: two blocks of one layer with the sequence
    pooled between them (the second block's queries pooled, its keys not: the relative shift of 2), the class
    token kept apart (``separate_cls``); its relative attention's own parameters ``r_w_bias``, ``r_r_bias``,
    ``r_kernel``, ``r_s_bias`` and ``seg_embed`` (zeros at init) drawn at random. ``attention_type``:
    ``relative_shift`` (A.2.1) or ``factorized`` (A.2.2); ``dropout``: every dropout's rate (the position
    encodings' too)."""
    from transformers import FunnelConfig, FunnelForSequenceClassification

    config = FunnelConfig(
        vocab_size=40, block_sizes=[1, 1], d_model=16, n_head=2, d_head=8, d_inner=24, num_labels=2,
        attention_type=attention_type, hidden_dropout=dropout, attention_dropout=dropout,
        activation_dropout=dropout, pad_token_id=1,
    )  # fmt: skip
    model = FunnelForSequenceClassification(config).double().eval()
    with torch.no_grad():
        for module in model.modules():
            if type(module).__name__ == "FunnelRelMultiheadAttention":
                for name in ("r_w_bias", "r_r_bias", "r_kernel", "r_s_bias", "seg_embed"):
                    getattr(module, name).normal_(0.0, 0.5)
    return model


def segments_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    """:func:`seq_classification_loss` of a text pair (``token_type_ids`` (B, T), 0 then 1) plus a fixed
    weighting of the last hidden states at every position: a classifier reads the class token alone, whose
    query row the Funnel's last block masks out of its positional and token-type terms."""
    out = model(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
        token_type_ids=batch["token_type_ids"], output_hidden_states=True,
    )  # fmt: skip
    last = out.hidden_states[-1]
    weights = torch.randn(last.shape[1:], generator=torch.Generator().manual_seed(1), dtype=last.dtype)
    return F.cross_entropy(out.logits, batch["labels"], reduction="none") + (last * weights).flatten(1).sum(1)


def roberta() -> nn.Module:
    from transformers import RobertaConfig, RobertaForSequenceClassification

    return _encoder(RobertaConfig, RobertaForSequenceClassification, num_labels=3)


def bert() -> nn.Module:
    """BERT architecture (as all-MiniLM-L6-v2): position ids of batch size 1 broadcast over the batch."""
    from transformers import BertConfig, BertForSequenceClassification

    return _encoder(BertConfig, BertForSequenceClassification, num_labels=2)


LABEL_WORDS = [5, 7]  # the two label words' token ids scored at the mask (Li et al. 2022, sec. 3.2)


def masked_lm(kind: str) -> nn.Module:
    """A tiny masked LM in the text-infilling wrapper (``model.objective=infilling``). Both heads register
    the decoder's bias twice, in the head and in its decoder (tied), and tie the decoder weight to the word
    embeddings: ``roberta`` (RobertaLMHead) or ``bert`` (BertOnlyMLMHead -> BertLMPredictionHead)."""
    from transformers import BertConfig, BertForMaskedLM, RobertaConfig, RobertaForMaskedLM

    from dpexp.models.hf_encoder import MaskedLMInfilling

    config_cls, model_cls = {
        "roberta": (RobertaConfig, RobertaForMaskedLM),
        "bert": (BertConfig, BertForMaskedLM),
    }[kind]
    model = MaskedLMInfilling(_encoder(config_cls, model_cls, num_labels=2))
    head = model.head.predictions if kind == "bert" else model.head
    assert head.decoder.bias is head.bias, "the head no longer registers its bias twice"
    assert head.decoder.weight is model.encoder.embeddings.word_embeddings.weight
    return model


def infilling_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    """Cross entropy over the label words' logits at each example's mask position."""
    logits = model(batch["input_ids"], batch["attention_mask"], batch["mask_positions"])
    return F.cross_entropy(logits[:, LABEL_WORDS], batch["labels"], reduction="none")


class ScaledInput(nn.Module):
    """A module using its own parameter directly (no rule: the torch.func fallback handles it)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 6))
        self.fc = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.tanh(x * self.scale))


class Scale(nn.Module):
    """``x * s``: a module without a rule (the torch.func fallback)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


class InPlaceResidual(nn.Module):
    """A rule-less module whose output the parent then changes in place, as Falcon adds its residual
    (``mlp_output += attention_output``): the output kept from the call no longer records it."""

    def __init__(self) -> None:
        super().__init__()
        self.scaled = Scale()
        self.fc = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.scaled(x)
        h += x
        return self.fc(torch.tanh(h))


class GatedPair(nn.Module):
    """A rule-less module that returns a nested tuple, as Hugging Face attention modules do: its output,
    then (a per-example gate, None, integer indices). Both floating outputs reach the loss; the parent changes
    the first in place afterwards (the fallback keeps the call's own values)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 6))
        self.gate = nn.Parameter(torch.linspace(-1.0, 1.0, 6))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> tuple:
        gate = torch.sigmoid((x * self.gate).sum(-1, keepdim=True))  # (B, 1)
        return x * self.scale * mask, (gate, None, x.argmax(-1))


class TupleOutputNet(nn.Module):
    """Linear -> :class:`GatedPair` (called with the same tensor twice, a mask shared by the batch) ->
    Linear, its output scaled by the gate."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.pair = GatedPair()
        self.head = nn.Linear(6, 3)
        self.register_buffer("mask", torch.tensor([1.0, 1.0, 0.5, 1.0, 0.0, 1.0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc(x))
        y, (gate, _, _) = self.pair(h, self.mask)
        y += h
        return self.head(y) * gate


class CausalMixer(nn.Module):
    """A state-space-style mixer that owns no parameter: it reads its depthwise causal convolution's weight
    and bias itself (``F.conv1d(x, self.conv.weight, ..., groups=channels)``, as Mamba's ``causal_conv1d_fn``)
    and also calls its ``gate`` Linear once as a module, and reads that Linear's weight a second time
    (``F.linear``). Declared with :func:`register_reads`: its fallback covers both submodules."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(6, 6, 3, groups=6, padding=2)
        self.gate = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, 6)
        length = x.shape[1]
        h = F.conv1d(x.transpose(1, 2), self.conv.weight, self.conv.bias, padding=2, groups=6)
        h = F.silu(h[..., :length].transpose(1, 2))
        return h * torch.sigmoid(self.gate(x)) + F.linear(h, self.gate.weight)


register_reads(CausalMixer, "conv", "gate")


class CausalMixerNet(nn.Module):
    """Embedding -> :class:`CausalMixer` -> LayerNorm -> Linear on token sequences (padding id 0)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 6, padding_idx=0)
        self.mixer = CausalMixer()
        self.norm = nn.LayerNorm(6)
        self.out = nn.Linear(6, 11)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(self.mixer(self.embed(ids))))


class ScalarGain(nn.Module):
    """A residual branch scaled by a 0-dim gain it owns (ReZero, NFNet's ``skipinit_gain``): no rule, the
    fallback; called twice, so the gain's two uses meet in a cross term."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.gain = nn.Parameter(torch.tensor(0.7))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.gain * torch.tanh(self.fc(x))


class ScalarGainNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = ScalarGain()
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.block(x)))


def falcon() -> nn.Module:
    """Tiny random Hugging Face Falcon: ``FalconLinear`` layers (``x @ W.T``), parallel attention and MLP,
    and the MLP's output changed in place by the residual."""
    from transformers import FalconConfig, FalconForCausalLM

    config = FalconConfig(
        vocab_size=40,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=16,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        pad_token_id=1,
    )
    return FalconForCausalLM(config).double().eval()


def _decoder(config_cls, model_cls, **kwargs) -> nn.Module:
    config = config_cls(
        vocab_size=40,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        max_position_embeddings=16,
        attention_dropout=0.0,
        pad_token_id=1,
        **kwargs,
    )
    return model_cls(config).double().eval()


def gemma2() -> nn.Module:
    """Tiny random Gemma-2: ``Gemma2TextScaledWordEmbedding`` (a copy of Gemma's scaled embedding, whose rule
    it takes) tied to the head, RMSNorm scaling by ``1 + w`` in float32, soft-capped logits."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    return _decoder(Gemma2Config, Gemma2ForCausalLM)


def gemma4(**moe: int | bool) -> nn.Module:
    """Tiny random Gemma 4 (text): its RMSNorm form (float32, ``pow(., -0.5)``; also in Gemma 3n), per-layer
    input embeddings (a second scaled embedding table and projection), a sliding-window layer (window 4 < T)
    and a full-attention one, scaled embeddings tied to the head; ``moe``: the MoE block's config fields."""
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    return _decoder(
        Gemma4TextConfig,
        Gemma4ForCausalLM,
        vocab_size_per_layer_input=40,
        hidden_size_per_layer_input=4,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=4,
        **moe,
    )


def gemma4_moe() -> nn.Module:
    """:func:`gemma4` with its MoE block on (Gemma 4's 26B-A4B form): beside the dense MLP, a router that
    normalises the block's input, scales it by its own ``scale``, projects it by its child ``proj``, takes the
    top 2 of 4 float32 probabilities renormalised times its ``per_expert_scale``, and experts a copy of
    Mixtral's. The router's parameters drawn away from their initial values."""
    model = _routed(gemma4(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=12))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.router.proj.weight.normal_(0.0, 2.0)
            layer.router.scale.normal_(1.0, 0.3)
            layer.router.per_expert_scale.normal_(1.0, 0.3)
    return model


def glm() -> nn.Module:
    """Tiny random GLM: ``GlmRMSNorm``, a copy of Llama's RMSNorm (its rule by
    :mod:`dpexp.privacy.rules.copies`), partial rotary embeddings, a fused gate-up projection."""
    from transformers import GlmConfig, GlmForCausalLM

    return _decoder(GlmConfig, GlmForCausalLM)


def _routed(model: nn.Module) -> nn.Module:
    """``model`` with its experts on the eager forward (grouped_mm has no float64 kernel on the CPU) and its
    routers' weights drawn at scale 0.5, so that the routing (and its gradient) differs visibly by token."""
    model.set_experts_implementation("eager")
    with torch.no_grad():
        for module in model.modules():
            if type(module).__name__.endswith("TopKRouter"):
                module.weight.normal_(0.0, 0.5)
    return model


def mixtral() -> nn.Module:
    """Tiny random Mixtral: sparse MoE blocks that flatten (B, T, d) to B*T rows, a router (softmax in
    float32, top 2 of 4 experts, renormalised) and experts with 3-D weights (dpexp.privacy.rules.moe)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    return _routed(_decoder(MixtralConfig, MixtralForCausalLM, num_local_experts=4, num_experts_per_tok=2))


def dbrx() -> nn.Module:
    """Tiny random DBRX: its experts' weights stacked (E I, d) in the experts' ``mlp``, which each expert's
    gathered rows are passed to with the expert's slices (``rules/dbrx_moe.py``); a router softmaxing all
    logits, top 2 of 4, the top scores renormalised by their 1-norm; clipped q, k, v; no router jitter. The
    routers' weights at scale 0.5 and the experts' at 0.3: routing and expert outputs differ by token."""
    from transformers import DbrxConfig, DbrxForCausalLM

    config = DbrxConfig(
        d_model=16, n_heads=2, n_layers=2, max_seq_len=16, vocab_size=40, pad_token_id=1,
        ffn_config={"ffn_hidden_size": 24, "moe_num_experts": 4, "moe_top_k": 2, "moe_jitter_eps": None},
        attn_config={"kv_n_heads": 1, "rope_theta": 1e4, "clip_qkv": 8.0},
    )  # fmt: skip
    model = DbrxForCausalLM(config).double().eval()
    with torch.no_grad():
        for block in model.transformer.blocks:
            block.ffn.router.layer.weight.normal_(0.0, 0.5)
            for weight in block.ffn.experts.mlp.parameters():
                weight.normal_(0.0, 0.3)
    return model


def gpt_neox_japanese() -> nn.Module:
    """Tiny random GPT-NeoX-Japanese (2 layers; the last attention returns its ``dense_bias``)."""
    from transformers import GPTNeoXJapaneseConfig, GPTNeoXJapaneseForCausalLM

    config = GPTNeoXJapaneseConfig(
        vocab_size=40,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_multiple_size=2,
        max_position_embeddings=32,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bos_token_id=0,
        eos_token_id=2,
    )
    model = GPTNeoXJapaneseForCausalLM(config).double().eval()
    with torch.no_grad():  # away from the zero initialisation
        for layer in model.gpt_neox_japanese.layers:
            if layer.attention.dense_bias is not None:
                layer.attention.dense_bias.normal_(0, 0.5)
    return model


def llama4() -> nn.Module:
    """Tiny random Llama 4 (text): MoE blocks in which every token goes to every expert (expert-major rows
    of (E*N, d), scaled by the sigmoid of the router's top-1 logit, 0 for the others), a shared expert added
    in place, its RMSNorm form (``Llama4TextRMSNorm``) and the weight-free L2 norm of queries and keys. The
    routers' weights at scale 0.5 and the experts' at 0.3: routing and expert outputs differ by token."""
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    model = _decoder(Llama4TextConfig, Llama4ForCausalLM, intermediate_size_mlp=24, num_local_experts=4)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.feed_forward.router.weight.normal_(0.0, 0.5)
            layer.feed_forward.experts.gate_up_proj.normal_(0.0, 0.3)
            layer.feed_forward.experts.down_proj.normal_(0.0, 0.3)
    return model


def deepseek_v3() -> nn.Module:
    """Tiny random DeepSeek-V3: multi-head latent attention, a dense first layer, then a MoE layer whose
    router (its form also GLM-4-MoE's, Dots1's, EXAONE-MoE's, ...) scores by sigmoid in float32 and picks 2
    of 8 experts within the best 2 of 4 groups, by scores plus a load-balancing bias (drawn here), weights
    renormalised and scaled by 2.5; a shared expert."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config(
        vocab_size=40, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=16, attention_dropout=0.0, pad_token_id=1,
        n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, moe_intermediate_size=12,
        first_k_dense_replace=1, q_lora_rank=8, kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4,
        v_head_dim=8, n_shared_experts=1, routed_scaling_factor=2.5,
    )  # fmt: skip
    model = _routed(DeepseekV3ForCausalLM(config).double().eval())
    with torch.no_grad():
        model.model.layers[1].mlp.gate.e_score_correction_bias.normal_(0.0, 0.1)
    return model


def deepseek_v2(topk_method: str = "group_limited_greedy") -> nn.Module:
    """Tiny random DeepSeek-V2: multi-head latent attention, a dense first layer, then a MoE layer whose
    router softmaxes its float32 logits and picks 2 of 8 experts, within the best 2 of 4 groups (by their
    highest score) for ``group_limited_greedy``, weights scaled by 2.5; a shared expert."""
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    config = DeepseekV2Config(
        vocab_size=40, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=16, attention_dropout=0.0, pad_token_id=1,
        n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, moe_intermediate_size=12,
        first_k_dense_replace=1, q_lora_rank=8, kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4,
        v_head_dim=8, n_shared_experts=1, routed_scaling_factor=2.5, topk_method=topk_method,
    )  # fmt: skip
    return _routed(DeepseekV2ForCausalLM(config).double().eval())


def granite_moe() -> nn.Module:
    """Tiny random Granite-MoE: a router that softmaxes its top-2 logits (in float32), experts a copy of
    Mixtral's."""
    from transformers import GraniteMoeConfig, GraniteMoeForCausalLM

    model = _decoder(GraniteMoeConfig, GraniteMoeForCausalLM, num_local_experts=4, num_experts_per_tok=2)
    return _routed(model)


def qwen3_5_moe() -> nn.Module:
    """Tiny random Qwen3.5-MoE (text; its router also Qwen3-VL-MoE's and Qwen3-Omni-MoE's): top 2 of 4
    experts always renormalised, a gated shared expert, RMSNorm scaling by ``1 + w`` in float32."""
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    return _routed(
        _decoder(
            Qwen3_5MoeTextConfig,
            Qwen3_5MoeForCausalLM,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=12,
            shared_expert_intermediate_size=12,
            layer_types=["full_attention", "full_attention"],
        )
    )


def gpt_oss() -> nn.Module:
    """Tiny random GPT-OSS: a router with a bias that softmaxes its top-2 logits, experts stored transposed
    (E, in, out) with biases and their own gate (interleaved halves, clamped, ``g * sigmoid(alpha g) * (u +
    1)``), and attention that owns its per-head sinks and returns a tuple (``rules/sinks.py``); sliding-window
    and full layers. The key/value cache is off, as in training: the rule refuses a cache, which its second
    run of the attention would extend."""
    from transformers import GptOssConfig, GptOssForCausalLM

    model = _decoder(
        GptOssConfig,
        GptOssForCausalLM,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=4,
        use_cache=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    model.config._attn_implementation = "eager"
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 1.0)
            layer.mlp.router.bias.normal_(0.0, 0.5)
            layer.mlp.experts.gate_up_proj_bias.normal_(0.0, 0.1)
            layer.mlp.experts.down_proj_bias.normal_(0.0, 0.1)
    return _routed(model)


SINKS_DECODERS = {  # model type -> what its tiny configuration needs beyond _decoder's sizes
    "flint": {"num_experts": 4, "num_experts_per_tok": 2, "shared_expert_intermediate_size": 12,
              "moe_intermediate_size": 12, "layer_types": ["sliding_attention", "full_attention"]},
    "mimo_v2_flash": {"n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 12,
                      "layer_types": ["sliding_attention", "full_attention"], "v_head_dim": 4},
    "hy_v4": {"n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 12, "index_topk": 4,
              "index_head_dim": 8, "index_n_heads": 2, "kv_lora_rank": 8, "q_lora_rank": 8,
              "qk_rope_head_dim": 4, "qk_nope_head_dim": 4, "v_head_dim": 8},
    # a window of 6: with 4 a padded query row sees only padded keys, whose float64 mask overflows to -inf in
    # Granite's logsumexp and gives NaN
    "granite_swa": {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 6},
    "granitemoe_swa": {"num_local_experts": 4, "layer_types": ["sliding_attention", "full_attention"],
                       "sliding_window": 6},
}  # fmt: skip


def sinks_decoder(architecture: str) -> nn.Module:
    """Tiny random decoder of ``architecture`` (a key of ``SINKS_DECODERS``) whose attention owns per-head
    sinks (``rules/sinks.py``), drawn at scale 1 so that each head's sink takes a visible share of its
    softmax: Flint's and MiMo-V2-Flash's appended as a score column (MiMo's on its sliding-window layer
    only, its values narrower than its keys), HY-V4's behind a gate on the heads' outputs and a top-4 key
    selection (its indexer frozen: no gradient reaches it), Granite-SWA's and Granite-MoE-SWA's as the
    ``sigmoid(logsumexp - sink)`` scale of the output in float32. A sliding window shorter than the texts;
    the cache off."""
    from transformers import AutoConfig, AutoModelForCausalLM

    sizes = {
        "vocab_size": 40, "hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8, "max_position_embeddings": 16,
        "attention_dropout": 0.0, "pad_token_id": 1, "bos_token_id": 2, "eos_token_id": 2,
        "sliding_window": 4, "use_cache": False,
    }  # fmt: skip
    config = AutoConfig.for_model(architecture, **{**sizes, **SINKS_DECODERS[architecture]})
    config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config).double().eval()
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("eager")
    with torch.no_grad():
        for module in model.modules():
            if isinstance(getattr(module, "sinks", None), nn.Parameter):
                module.sinks.normal_(0.0, 1.0)
            if type(module).__name__ == "HYV4Indexer":  # reaches the loss through top-k indices only
                module.requires_grad_(False)
    return model


def diffllama(implementation: str = "eager") -> nn.Module:
    """Tiny random DiffLlama: differential attention (``rules/differential.py``), two softmax attentions over
    the same queries and keys whose outputs are combined by one learnt lambda per layer (four vectors of the
    head's width, drawn at scale 0.5 so that lambda is far from its initial value), then a parameter-free
    RMSNorm over each head pair; four heads, two key/value heads (the values are split in halves); the cache
    off, as in training;
    ``implementation``: the attention function."""
    from transformers import DiffLlamaConfig, DiffLlamaForCausalLM

    config = DiffLlamaConfig(
        vocab_size=40, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=16, pad_token_id=1, use_cache=False,
    )  # fmt: skip
    config._attn_implementation = implementation
    model = DiffLlamaForCausalLM(config).double().eval()
    with torch.no_grad():
        for layer in model.model.layers:
            for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
                getattr(layer.self_attn, name).normal_(0.0, 0.5)
    return model


def cpmant() -> nn.Module:
    """Tiny random CPM-Ant: its RMSNorm (the variance alone in float32) and a segment position bias, a table
    of relative position buckets and segment pairs looked up per example and shared by every layer's
    attention (``rules/embedding.py``), drawn at scale 1; the cache off."""
    from transformers import CpmAntConfig, CpmAntForCausalLM

    config = CpmAntConfig(
        vocab_size=40, hidden_size=16, num_attention_heads=2, dim_head=8, dim_ff=24, num_hidden_layers=2,
        dropout_p=0.0, use_cache=False, prompt_length=4,
    )  # fmt: skip
    model = CpmAntForCausalLM(config).double().eval()
    with torch.no_grad():
        for module in model.modules():
            if type(module).__name__ == "CpmAntSegmentPositionEmbedding":
                module.relative_attention_bias.normal_(0.0, 1.0)
            if type(module).__name__ == "CpmAntLayerNorm":
                module.weight.normal_(1.0, 0.3)
    return model


def whisper(decoder_only: bool = False) -> nn.Module:
    """Tiny random Whisper on 4 log-mel bins of 8 frames (its encoder's sinusoidal positions frozen), whose
    decoder indexes its learned positions by position ids repeated to the batch (``rules/embedding.py``);
    ``decoder_only``: its decoder as a causal LM, the cross-attention (never called) frozen."""
    from transformers import WhisperConfig, WhisperForCausalLM, WhisperForConditionalGeneration

    config = WhisperConfig(
        vocab_size=40, num_mel_bins=4, d_model=16, encoder_layers=1, decoder_layers=2,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=24, decoder_ffn_dim=24,
        max_source_positions=4, max_target_positions=16, dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0, pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=0,
        use_cache=False,
    )  # fmt: skip
    if not decoder_only:
        return WhisperForConditionalGeneration(config).double().eval()
    model = WhisperForCausalLM(config).double().eval()
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(".encoder_attn" not in name)
    return model


def speech_batch(batch_size: int, gen: torch.Generator) -> Batch:
    """Log-mel features (B, 4, 8) and target texts of 6 tokens, some padded (-100), for :func:`whisper`."""
    labels = torch.randint(3, 40, (batch_size, 6), generator=gen)
    labels[: batch_size // 2, -2:] = -100
    features = torch.randn(batch_size, 4, 8, generator=gen, dtype=torch.float64)
    return {"input_features": features, "labels": labels}


def speech_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    """Sum of each example's target-token losses, padded targets excluded."""
    labels = batch["labels"]
    logits = model(input_features=batch["input_features"], labels=labels).logits
    tokens = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none", ignore_index=-100)
    return tokens.view(labels.shape).sum(1)


def doge(keep_window_size: int = 4) -> nn.Module:
    """Tiny random Doge: dynamic mask attention (``rules/dynamic_mask.py``: ``A`` per key/value head, drawn
    at scale 1, in the bias every query adds for a key; four query heads on two key/value heads; keys past
    the ``keep_window_size`` largest masked, fewer than the texts' 8 positions), eager attention, the cache
    off."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "doge", vocab_size=40, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=4, max_position_embeddings=16,
        keep_window_size=keep_window_size, attention_dropout=0.0, hidden_dropout=0.0, pad_token_id=1,
        use_cache=False,
    )  # fmt: skip
    config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config).double().eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.A.normal_(0.0, 1.0)
    return model


def dory() -> nn.Module:
    """Tiny random Dory (nGPT blocks on the unit sphere, ``rules/ngpt.py``): one input, one recurrent layer
    run twice (two loops) and one output layer; sliding (window 6 < T) and full attention; eager attention,
    the cache off. Its own scales (``lambda_1``, ``lambda_2``, ``suv_gate``, ``suv_up``, ``sqk``,
    ``s_gate``, initialised to one constant each) drawn per channel around it, one ``lambda_1`` at 0 (where
    ``|lambda|``'s derivative is 0), and its LM head's logit scale drawn away from its start."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "dory", vocab_size=40, hidden_size=16, intermediate_size=24, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=4, max_position_embeddings=16,
        sliding_window=6, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        n_input_layers=1, n_output_layers=1, n_recurrent_loops=2, attention_dropout=0.0, pad_token_id=1,
        use_cache=False,
    )  # fmt: skip
    config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config).double().eval()
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for layer in model.model.layers:
            for module in (layer, layer.mlp, layer.self_attn):
                for param in module.parameters(recurse=False):
                    param.mul_(1.0 + 0.5 * torch.randn(param.shape, generator=gen, dtype=param.dtype))
            layer.lambda_1[0] = 0.0
        model.lm_head.logit_scale.uniform_(0.01, 0.05)  # its LM head's scale (rules/scaled_linear.py)
    return model


def rwkv() -> nn.Module:
    """Tiny random RWKV-4 (``rules/rwkv.py``): two blocks of time mixing (the WKV recurrence, run by its
    CPU function) and channel mixing, token shift in both; its own vectors drawn around their starts so that
    each channel differs, the cache off."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "rwkv", vocab_size=40, hidden_size=16, attention_hidden_size=16, intermediate_size=24,
        num_hidden_layers=2, context_length=16, pad_token_id=1, use_cache=False,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(config).double().eval()
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for block in model.rwkv.blocks:
            for module in (block.attention, block.feed_forward):
                for param in module.parameters(recurse=False):
                    param.add_(0.3 * torch.randn(param.shape, generator=gen, dtype=param.dtype))
    return model


def beam_attention(implementation: str = "eager") -> nn.Module:
    """Tiny random Beam with dense MLPs only (its experts are ``NEW_MOE``'s): attention whose output is
    gated per head by ``sigmoid(gate_proj(x) + gate_bias)`` (``rules/attention_gate.py``), the bias drawn
    at scale 1; a sliding-window layer (window 6 < T, rotary; with 4 a padded query row sees only padded
    keys and gives NaN) and a full one (no positions, query scaling by position); ``implementation``: the
    attention function."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "beam", vocab_size=40, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=32,
        attention_dropout=0.0, pad_token_id=1, use_cache=False, sliding_window=6,
        layer_types=["sliding_attention", "full_attention"], mlp_layer_types=["dense", "dense"],
    )  # fmt: skip
    config._attn_implementation = implementation
    model = AutoModelForCausalLM.from_config(config).double().eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.gate_bias.normal_(0.0, 1.0)
    return model


def padded_lm_batch(batch_size: int = 6, seed: int = 0) -> Batch:
    """Padded texts of length 8 over a vocabulary of 40, for the tiny causal LMs."""
    return _padded_text(batch_size, 8, 40, torch.Generator().manual_seed(seed))


def recurrent_gemma() -> nn.Module:
    """Tiny random RecurrentGemma (Griffin): a recurrent layer (RG-LRU, ``rules/rg_lru.py``) and a local
    attention layer (window 6: with 4 a padded query row sees only padded keys and gives NaN). The RG-LRU
    keeps its last call's ``recurrent_states`` as an attribute, which its temporal block resets before each
    call, and its ``SqrtBoundDerivative`` is an ``autograd.Function`` torch.func cannot run: its rule reads
    the call's graph; without it the fallback recomputes it with its attributes as at the call, one example
    at a time."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "recurrent_gemma", vocab_size=40, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, lru_width=16, attention_window_size=6,
        block_types=["recurrent", "attention"], pad_token_id=1, bos_token_id=2, eos_token_id=2,
        use_cache=False,
    )  # fmt: skip
    config._attn_implementation = "eager"
    return AutoModelForCausalLM.from_config(config).double().eval()


def mamba() -> nn.Module:
    """Tiny random Mamba: each mixer owns ``A_log`` and ``D`` and reads its causal convolution's and
    ``dt_proj``'s weights itself (its rule, ``dpexp.privacy.rules.scan_mixers``, claims them), on the
    reference path (a scan over time)."""
    from transformers import MambaConfig, MambaForCausalLM

    config = MambaConfig(
        vocab_size=40, hidden_size=16, state_size=4, num_hidden_layers=2, expand=2, conv_kernel=3,
        time_step_rank=4, pad_token_id=1, use_cache=False,
    )  # fmt: skip
    return MambaForCausalLM(config).double().eval()


def mamba2() -> nn.Module:
    """Tiny random Mamba-2: per-head ``A_log``, ``D`` and ``dt_bias``, two groups of B and C, the causal
    convolution's weight read by the mixer itself, and chunks of 4 positions (sequences of 10: three chunks,
    the last padded), through the module's own chunked scan (``dpexp.privacy.rules.scan_mixers``)."""
    from transformers import Mamba2Config, Mamba2ForCausalLM

    config = Mamba2Config(
        vocab_size=40, hidden_size=16, state_size=4, num_heads=4, head_dim=8, expand=2, n_groups=2,
        conv_kernel=3, num_hidden_layers=2, chunk_size=4, pad_token_id=1, use_cache=False,
    )  # fmt: skip
    return Mamba2ForCausalLM(config).double()


def falcon_h1(rms_norm: bool = False) -> nn.Module:
    """Tiny random Falcon-H1: attention and a Mamba-2 mixer side by side in each layer, µP multipliers away
    from 1 (the mixer's rule must apply them: ``dpexp.privacy.rules.scan_mixers``), the mixer's output gated
    without its norm (Falcon-H1's default) or through it."""
    from transformers import FalconH1Config, FalconH1ForCausalLM

    config = FalconH1Config(
        vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8,
        mamba_n_groups=1, mamba_d_state=4, mamba_d_conv=3, mamba_chunk_size=4, mamba_rms_norm=rms_norm,
        ssm_multipliers=[0.5, 1.5, 0.8, 1.2, 2.0], ssm_in_multiplier=0.7, pad_token_id=1, use_cache=False,
    )  # fmt: skip
    return FalconH1ForCausalLM(config).double()


def falcon_mamba() -> nn.Module:
    """Tiny random Falcon-Mamba: Mamba's mixer with weightless RMSNorms on the time step, B and C."""
    from transformers import FalconMambaConfig, FalconMambaForCausalLM

    config = FalconMambaConfig(
        vocab_size=40, hidden_size=16, state_size=4, num_hidden_layers=2, expand=2, conv_kernel=3,
        time_step_rank=4, pad_token_id=1, use_cache=False,
    )  # fmt: skip
    return FalconMambaForCausalLM(config).double()


def jamba() -> nn.Module:
    """Tiny random Jamba: a Mamba layer with a dense MLP, then an attention layer with a sparse MoE block
    (a router whose top-2 softmax probabilities are not renormalised, Mixtral's experts); the mixer reads its
    convolution's and ``dt_proj``'s weights itself and has RMSNorms (layers of their own) on the time step,
    B and C (``dpexp.privacy.rules.scan_mixers``)."""
    from transformers import JambaConfig, JambaForCausalLM

    return _routed(
        _decoder(
            JambaConfig, JambaForCausalLM, num_experts=4, num_experts_per_tok=2, expert_layer_period=2,
            expert_layer_offset=1, attn_layer_period=2, attn_layer_offset=1, mamba_d_state=4, mamba_d_conv=3,
            mamba_dt_rank=4, use_mamba_kernels=False, use_cache=False,
        )
    )  # fmt: skip


def nemotron_h() -> nn.Module:
    """Tiny random Nemotron-H: a Mamba-2 layer (its mixer reads its convolution's weight itself) and a
    sparse MoE layer whose experts have no gate (``up_proj``, squared ReLU, ``down_proj``) behind a
    DeepSeek-V3-style sigmoid router in float32, with a shared expert."""
    from transformers import NemotronHConfig, NemotronHForCausalLM

    model = _decoder(
        NemotronHConfig, NemotronHForCausalLM, layers_block_type=["linear_attention", "moe"],
        mamba_num_heads=4, mamba_head_dim=8, n_groups=1, ssm_state_size=4, conv_kernel=3, n_routed_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=12, moe_shared_expert_intermediate_size=12,
        use_mamba_kernels=False, use_cache=False,
    )  # fmt: skip
    return _routed(model)


def qwen3_5() -> nn.Module:
    """Tiny random Qwen3.5 (text): a gated delta net layer (its convolution read by the net itself, ``A_log``
    and ``dt_bias`` its own, a gated RMSNorm) and a full-attention layer with a gated output."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    return _decoder(
        Qwen3_5TextConfig, Qwen3_5ForCausalLM, layer_types=["linear_attention", "full_attention"],
        linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
        linear_conv_kernel_dim=3, use_cache=False,
    )  # fmt: skip


def qwen3_next() -> nn.Module:
    """Tiny random Qwen3-Next: a gated delta net whose fused ``in_proj_qkvz`` and ``in_proj_ba`` interleave
    q, k, v, z and b, a per key head, with twice as many value heads as key heads, beside a full-attention
    layer; sparse MoE blocks (4 experts, top 2, a gated shared expert)."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    return _routed(
        _decoder(
            Qwen3NextConfig, Qwen3NextForCausalLM, layer_types=["linear_attention", "full_attention"],
            linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
            linear_conv_kernel_dim=3, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=12,
            shared_expert_intermediate_size=12, use_cache=False,
        )
    )  # fmt: skip


def olmo_hybrid() -> nn.Module:
    """Tiny random OLMo-hybrid: a gated delta net with separate q, k, v, a, b and gate projections and
    ``beta`` doubled (negative eigenvalues allowed), its norm ``o_norm`` and output ``o_proj``, beside a
    full-attention layer."""
    from transformers import OlmoHybridConfig, OlmoHybridForCausalLM

    return _decoder(
        OlmoHybridConfig, OlmoHybridForCausalLM, layer_types=["linear_attention", "full_attention"],
        linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
        linear_conv_kernel_dim=3, linear_allow_neg_eigval=True, use_cache=False,
    )  # fmt: skip


def kimi_linear() -> nn.Module:
    """Tiny random Kimi Linear: a delta attention that decays per channel (its forget gate a layer of its own,
    owning ``A_log`` and ``dt_bias``), beside an MLA attention layer."""
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    config = KimiLinearConfig(
        vocab_size=40, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, layer_types=["linear_attention", "full_attention"],
        mlp_layer_types=["dense", "dense"], linear_num_heads=2, linear_head_dim=8, linear_conv_kernel_dim=3,
        kv_lora_rank=8, q_lora_rank=None, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8,
        max_position_embeddings=16, pad_token_id=1, bos_token_id=0, eos_token_id=2, use_cache=False,
    )  # fmt: skip
    return KimiLinearForCausalLM(config).double().eval()


def lfm2_moe() -> nn.Module:
    """Tiny random LFM2-MoE: LFM2's short convolution and attention, then sparse MoE blocks whose experts'
    activation is the function ``F.silu`` and whose sigmoid router chooses by its scores plus the block's
    load-balancing ``expert_bias`` (a buffer, drawn at random here so that it changes the choice)."""
    from transformers import Lfm2MoeConfig, Lfm2MoeForCausalLM

    model = _routed(
        _decoder(
            Lfm2MoeConfig, Lfm2MoeForCausalLM, layer_types=["conv", "full_attention"], conv_L_cache=3,
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=12, num_dense_layers=1,
            routed_scaling_factor=1.5, use_cache=False,
        )
    )  # fmt: skip
    with torch.no_grad():
        for module in model.modules():
            if type(module).__name__ == "Lfm2MoeTopKRouter":
                module.weight.normal_(0.0, 0.5)
            if hasattr(module, "expert_bias"):
                module.expert_bias.normal_(0.0, 0.3)
    return model


_EXPERTS = {"moe_intermediate_size": 12, "shared_expert_intermediate_size": 12}
_LATENT = {"kv_lora_rank": 8, "q_lora_rank": 8, "qk_rope_head_dim": 4, "qk_nope_head_dim": 4, "v_head_dim": 8}
NEW_MOE = {  # stop 53: MoE families new in transformers 5.2x, (model type, configuration, in float32)
    # a softmax (Cohere2-MoE) or sigmoid of the top-k logits
    "cohere2_moe": ("cohere2_moe", {"num_experts": 4}, False),
    "cohere2_moe_sigmoid": ("cohere2_moe", {"num_experts": 4, "expert_selection_fn": "sigmoid"}, False),
    # sigmoid scores chosen by scores plus a load-balancing bias, passed by the block, scaled
    "hy_v3": ("hy_v3", {"num_experts": 4, "moe_intermediate_size": 12}, False),
    "minimax_m2": ("minimax_m2", {"num_local_experts": 4}, False),  # the same, the logits' sigmoid in float32
    "minimax_m3_vl": ("minimax_m3_vl_text", {"num_local_experts": 4, "dense_intermediate_size": 24}, False),
    # the top k of the logits plus a bias, their sigmoid; a shared expert
    "kolibri1": ("kolibri1", {"num_local_experts": 4, **_EXPERTS}, False),
    # soft-capped float32 logits (the router returns them capped), a frozen bias parameter
    "laguna": ("laguna", {"num_experts": 4, **_EXPERTS, "moe_router_logit_softcapping": 2.0}, False),
    # the softmax of float32 logits, beside a gated delta net
    "lara_mini": ("lara_mini", {"num_experts": 4, **_EXPERTS}, False),
    # experts with a clamped SiLU gate; attention sinks and hyper-connections (the fallback)
    "hy_v4": ("hy_v4", {"n_routed_experts": 4, "moe_intermediate_size": 12}, False),
    # DeepSeek-V3's sigmoid router without groups, multi-head latent attention
    "axk2": (
        "axk2",
        {"n_routed_experts": 4, "moe_intermediate_size": 12, **_LATENT, "num_key_value_heads": 2},
        False,
    ),
    # softmax scores, group-limited (the other groups' scores set to 0), multi-head latent attention
    "mistral4": (
        "mistral4",
        {
            "n_routed_experts": 4,
            "n_group": 2,
            "topk_group": 1,
            "first_k_dense_replace": 0,
            "moe_intermediate_size": 12,
            **_LATENT,
            "num_key_value_heads": 2,
        },
        False,
    ),
    # the top k of float32 sigmoid scores with autocast off; attention sinks (the fallback)
    "flint": ("flint", {"num_experts": 4, "mlp_only_layers": [0], **_EXPERTS}, False),
    # group-limited sigmoid routing, a float32 gate in the experts: in float32, where a float64 model's
    # float32 gate rounds a row differently when the expert's other rows change, which the engine's probe
    # reads as examples mixed (a refusal)
    # stop 58: a hash router (the experts fixed by the token id) before a learned sigmoid router; attention
    # sinks, grouped projections, a compressor and hyper-connections on the fallback
    "deepseek_v4": (
        "deepseek_v4",
        {"n_routed_experts": 4, "moe_intermediate_size": 12, "mlp_layer_types": ["hash_moe", "moe"]},
        False,
    ),
    # stop 64: the same with windows of 4 in its heavily compressed attention, which the texts close (at its
    # default 128 no window closes and the compressor's bias gets no gradient)
    "deepseek_v4_windows": (
        "deepseek_v4",
        {
            "n_routed_experts": 4,
            "moe_intermediate_size": 12,
            "mlp_layer_types": ["hash_moe", "moe"],
            "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 4},
        },
        False,
    ),
    "beam": (
        "beam",
        {"num_experts": 4, "mlp_layer_types": ["dense", "sparse"], "n_group": 2, "topk_group": 1, **_EXPERTS},
        True,
    ),
    # stop 62: a classifier's weight read in float32 by the router, 2 of 4 routed and 2 zero-computation
    # (identity) experts, a scaled softmax not renormalised; multi-head latent attention
    "longcat_flash": (
        "longcat_flash",
        {
            "n_routed_experts": 4,
            "zero_expert_num": 2,
            "expert_ffn_hidden_size": 12,
            "routed_scaling_factor": 1.5,
            **_LATENT,
            "head_dim": 4,
            "num_key_value_heads": 2,
        },
        False,
    ),
}


def new_moe(name: str) -> nn.Module:
    """Tiny random causal LM of :data:`NEW_MOE`: width 16, 2 layers, 2 of 4 experts, the routers' weights
    drawn at scale 0.5 and their load-balancing biases at 0.3, so that routing differs visibly by token and
    the bias changes the choice; parameters initialised to zero drawn at 0.1."""
    import transformers

    model_type, fields, float32 = NEW_MOE[name]
    sizes = {
        "vocab_size": 40, "hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8, "max_position_embeddings": 32,
        "pad_token_id": 1, "use_cache": False, "num_experts_per_tok": 2,
    }  # fmt: skip
    config = transformers.AutoConfig.for_model(model_type, **{**sizes, **fields})
    for key, value in list(vars(config).items()):
        if "drop" in key and isinstance(value, float):
            setattr(config, key, 0.0)
    config._attn_implementation = "eager"
    try:
        model = transformers.AutoModelForCausalLM.from_config(config)
    except ValueError:  # Mistral 4's causal LM, which the auto mapping leaves out
        model = getattr(transformers, type(config).__name__.removesuffix("Config") + "ForCausalLM")(config)
    model = model.double().eval()
    model.set_experts_implementation("eager")
    with torch.no_grad():
        for module in model.modules():
            if "Router" in type(module).__name__:
                weight = getattr(module, "weight", None)
                if weight is None and hasattr(module, "classifier"):  # LongCat-Flash reads its classifier's
                    weight = module.classifier.weight
                if weight is not None:
                    weight.normal_(0.0, 0.5)
            if torch.is_tensor(getattr(module, "e_score_correction_bias", None)):
                # LongCat-Flash adds it to softmax probabilities (about 1/E each), the others to sigmoids
                module.e_score_correction_bias.normal_(0.0, 0.03 if model_type == "longcat_flash" else 0.3)
            if torch.is_tensor(getattr(module, "tid2eid", None)):  # DeepSeek-V4's hash table: all 0 at start
                table = module.tid2eid
                experts = torch.stack([torch.randperm(module.num_experts) for _ in range(len(table))])
                table.copy_(experts[:, : table.shape[1]])
        for parameter in model.parameters():  # HY-V4's hyper-connections start at 0: no gradient elsewhere
            if not parameter.any():
                parameter.normal_(0.0, 0.1)
    for name, parameter in model.named_parameters():  # a sparse-attention indexer picks keys by top-k: the
        if ".indexer." in name:  # language-model loss gives it no gradient (it trains by its own loss)
            parameter.requires_grad_(False)
    return model.float() if float32 else model


def hyper_connected(name: str) -> nn.Module:
    """``new_moe(name)`` (``"deepseek_v4"`` or ``"hy_v4"``) with every hyper-connection's scales drawn apart
    (they start at 1) and its biases away from 0 (``rules/hyper_connections.py``), so that each group's
    logits differ from the others'."""
    model = new_moe(name)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for module in model.modules():
            if "Hyper" in type(module).__name__:
                for param in module.parameters(recurse=False):
                    if param.dim() == 1:
                        param.copy_(0.5 + torch.rand(param.shape, generator=gen, dtype=param.dtype))
    return model


def inkling(shared: int = 2) -> nn.Module:
    """Tiny random Inkling (text): a normed embedding (the table through an RMSNorm), hybrid sliding-window
    and relative-position attention layers with short convolutions, and sparse MoE blocks whose sigmoid router
    weighs the top 2 of 4 routed experts and ``shared`` shared experts together (its global scale a parameter,
    its load-balancing bias a buffer, drawn at random here so that it changes the choice)."""
    from transformers.models.inkling.configuration_inkling import InklingTextConfig
    from transformers.models.inkling.modeling_inkling import InklingForCausalLM

    config = InklingTextConfig(
        vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        head_dim=8, swa_num_attention_heads=2, swa_num_key_value_heads=1, swa_head_dim=8,
        sliding_window_size=4, d_rel=4, rel_extent=8, conv_kernel_size=3, intermediate_size=24,
        moe_intermediate_size=12, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=shared,
        max_position_embeddings=32, pad_token_id=1, bos_token_id=0, eos_token_id=2, use_cache=False,
    )  # fmt: skip
    model = InklingForCausalLM(config).double().eval()
    model.set_experts_implementation("eager")
    with torch.no_grad():
        for module in model.modules():
            if type(module).__name__ == "InklingTopkRouter":
                module.weight.normal_(0.0, 0.5)
                module.global_scale.fill_(1.3)
                module.e_score_correction_bias.normal_(0.0, 0.3)
    return model


def zamba() -> nn.Module:
    """Tiny random Zamba (v1): a Mamba layer whose mixer (``A_log``, ``D``, its time-step and input
    projections as parameters of its own, per head) reads its convolution's weight and has no rule (the
    exact fallback, with ``register_reads``), then two hybrid layers sharing one attention block."""
    from transformers import ZambaConfig, ZambaForCausalLM

    config = ZambaConfig(
        vocab_size=40, hidden_size=16, num_hidden_layers=3, layers_block_type=["mamba", "hybrid", "hybrid"],
        mamba_d_state=4, mamba_d_conv=3, mamba_expand=2, n_mamba_heads=2, num_attention_heads=2,
        num_key_value_heads=2, attention_hidden_size=32, intermediate_size=32, pad_token_id=1,
        use_cache=False, use_mamba_kernels=False,
    )  # fmt: skip
    return ZambaForCausalLM(config).double().eval()


def bailing_hybrid(safe_gate: bool = True) -> nn.Module:
    """Tiny random Bailing-hybrid: Kimi's delta attention with a one-projection forget gate, bounded by a
    sigmoid (``kda_safe_gate``, its default) or Kimi's softplus, beside an MLA attention layer."""
    from transformers import BailingHybridConfig, BailingHybridForCausalLM

    config = BailingHybridConfig(
        vocab_size=40, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, layer_types=["linear_attention", "full_attention"],
        mlp_layer_types=["dense", "dense"], linear_num_heads=2, linear_head_dim=8, linear_conv_kernel_dim=3,
        kv_lora_rank=8, q_lora_rank=None, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8,
        kda_safe_gate=safe_gate, max_position_embeddings=16, pad_token_id=1, bos_token_id=0, eos_token_id=2,
        use_cache=False,
    )  # fmt: skip
    return BailingHybridForCausalLM(config).double().eval()


class Glm5NextLM(nn.Module):
    """GLM-5-Next's text model (transformers has no causal-LM class for it) with a linear head."""

    def __init__(self, config: Any) -> None:
        from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextModel

        super().__init__()
        self.model = Glm5NextTextModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> Any:
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return SimpleNamespace(logits=self.lm_head(hidden))


def glm5_next(lower_bound: float | None = -5.0) -> nn.Module:
    """Tiny random GLM-5-Next (text): the Kimi Delta Attention with a low-rank forget gate bounded by a
    sigmoid (``linear_lower_bound``, its default) or Kimi's softplus (None), beside an MLA attention layer
    with a sparse-attention indexer (frozen: its top-k indices pass no gradient to its parameters) and
    hyper-connections between the layers (``rules/hyper_connections.py``; on the exact fallback until stop
    63)."""
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig

    config = Glm5NextTextConfig(
        vocab_size=40, hidden_size=16, intermediate_size=24, moe_intermediate_size=12, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=8, q_lora_rank=8, qk_rope_head_dim=0,
        qk_nope_head_dim=8, v_head_dim=8, index_topk=16, index_kpool=4, index_head_dim=8, index_n_heads=2,
        linear_head_dim=8, linear_num_heads=2, linear_conv_kernel_dim=3, linear_lower_bound=lower_bound,
        hc_mult=2, max_position_embeddings=32, pad_token_id=1, use_cache=False,
        layer_types=["linear_attention", "full_attention"], mlp_layer_types=["dense", "dense"],
    )  # fmt: skip
    model = Glm5NextLM(config).double().eval()
    for module in model.modules():
        if type(module).__name__ == "Glm5NextTextIndexer":
            module.requires_grad_(False)
    return model


def lfm2() -> nn.Module:
    """Tiny random LFM2: a short-convolution layer (no parameter of its own: it reads its ``conv``'s weight)
    and an attention layer."""
    from transformers import Lfm2Config, Lfm2ForCausalLM

    return _decoder(
        Lfm2Config, Lfm2ForCausalLM, layer_types=["conv", "full_attention"], conv_L_cache=3, use_cache=False
    )


def ernie4_5_moe() -> nn.Module:
    """Tiny random ERNIE-4.5-MoE: a router with float32 logits (autocast off), its top 2 of 4 experts chosen
    by the softmax plus a frozen load-balancing bias (drawn here), weights renormalised; a shared expert."""
    from transformers import Ernie4_5_MoeConfig, Ernie4_5_MoeForCausalLM

    model = _routed(
        _decoder(
            Ernie4_5_MoeConfig, Ernie4_5_MoeForCausalLM, num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=12, moe_num_shared_experts=1, moe_layer_start_index=0,
        )
    )  # fmt: skip
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.moe_statics.e_score_correction_bias.normal_(0.0, 0.1)
    return model


def aria() -> nn.Module:
    """Tiny random Aria (text): a router that softmaxes its top-2 logits, experts stored transposed
    (E, in, out) without biases, a shared expert."""
    from transformers import AriaTextConfig, AriaTextForCausalLM

    return _routed(
        _decoder(AriaTextConfig, AriaTextForCausalLM, moe_num_experts=4, moe_topk=2, moe_num_shared_experts=1)
    )


def qwen2_moe() -> nn.Module:
    """Tiny random Qwen2-MoE: its router's top 2 of 4 experts not renormalised (``norm_topk_prob=False``),
    the experts a copy of Mixtral's (dpexp.privacy.rules.copies), a gated shared expert (plain Linear layers
    on the flattened rows)."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    return _routed(
        _decoder(
            Qwen2MoeConfig,
            Qwen2MoeForCausalLM,
            moe_intermediate_size=12,
            shared_expert_intermediate_size=20,
            num_experts=4,
            num_experts_per_tok=2,
        )
    )


def vit(distilled: bool = False, **kwargs) -> nn.Module:
    """timm's VisionTransformer: cls_token/pos_embed owned by the model itself (the token rule), timm
    LayerNorm. Dropout before the tap is harmless, but the oracle's loop needs a deterministic forward.
    ``distilled``: DeiT's VisionTransformerDistilled (a distillation token after the class token)."""
    from timm.models.deit import VisionTransformerDistilled
    from timm.models.vision_transformer import VisionTransformer

    model = (VisionTransformerDistilled if distilled else VisionTransformer)(
        img_size=8,
        patch_size=4,
        in_chans=3,
        num_classes=3,
        embed_dim=8,
        depth=1,
        num_heads=2,
        mlp_ratio=2.0,
        **kwargs,
    )
    tokens = (model.pos_embed, model.cls_token, model.reg_token, getattr(model, "dist_token", None))
    for token in tokens:  # timm starts tokens at ~0
        if token is not None:
            torch.nn.init.normal_(token, std=0.1)
    return model.double().eval()


def make_case(name: str, batch_size: int = 6, seed: int = 0):
    """(model, loss_fn, batch) for the named architecture."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    on_vectors = {  # models of 6 features and 3 classes
        "mlp": MLP,
        "fallback": ScaledInput,
        "scalar_gain": ScalarGainNet,
        "fallback_inplace": InPlaceResidual,
        "fallback_tuple": TupleOutputNet,
    }
    if name in on_vectors:
        batch = {
            "x": torch.randn(batch_size, 6, generator=gen, dtype=torch.float64),
            "y": torch.randint(0, 3, (batch_size,), generator=gen),
        }
        return on_vectors[name]().double(), classification_loss, batch
    if name in ("vit", "vit_registers", "deit_distilled"):
        batch = {
            "x": torch.randn(batch_size, 3, 8, 8, generator=gen, dtype=torch.float64),
            "y": torch.randint(0, 3, (batch_size,), generator=gen),
        }
        # vit_registers: two register tokens and a position embedding that skips the prefix tokens (DeiT-3)
        # deit_distilled: class and distillation tokens, layer scale (DeiT-III's init_values) in the block
        extra = {
            "vit": {},
            "vit_registers": {"reg_tokens": 2, "no_embed_class": True},
            "deit_distilled": {"distilled": True, "init_values": 0.5},
        }[name]
        return vit(**extra), classification_loss, batch
    if name == "wrn_block":
        batch = {
            "x": torch.randn(batch_size, 3, 8, 8, generator=gen, dtype=torch.float64),
            "y": torch.randint(0, 4, (batch_size,), generator=gen),
        }
        return WRNBlockNet().double(), classification_loss, batch
    if name == "sequence":
        ids = torch.randint(1, 11, (batch_size, 7), generator=gen)
        ids[:, -2:] = 0  # padding
        return SequenceNet().double(), sequence_loss, {"ids": ids}
    if name == "causal_mixer":
        ids = torch.randint(1, 11, (batch_size, 7), generator=gen)
        ids[:, -2:] = 0  # padding
        return CausalMixerNet().double(), sequence_loss, {"ids": ids}
    if name == "flattened":
        ids = torch.randint(1, 11, (batch_size, 7), generator=gen)
        ids[:, -2:] = 0  # padding
        return FlattenedMLPNet().double(), sequence_loss, {"ids": ids}
    if name == "opt":
        return opt(), lm_loss, _padded_text(batch_size, 10, 40, gen)
    decoders = {
        "falcon": falcon, "gemma2": gemma2, "gemma4": gemma4, "glm": glm, "llama4": llama4,
        "gpt_oss": gpt_oss, "mamba": mamba, "mamba2": mamba2, "qwen3_5": qwen3_5, "lfm2": lfm2,
    }  # fmt: skip
    if name in decoders:
        return decoders[name](), lm_loss, _padded_text(batch_size, 10, 40, gen)
    if name in ("gpt2", "gpt2_lora"):
        return gpt2(lora=name == "gpt2_lora"), lm_loss, _padded_text(batch_size, 10, 40, gen)
    if name in ("roberta", "bert", "deberta"):
        batch = _padded_text(batch_size, 10, 40, gen)
        batch["labels"] = torch.randint(0, 2, (batch_size,), generator=gen)
        model = {"roberta": roberta, "bert": bert, "deberta": deberta}[name]()
        return model, seq_classification_loss, batch
    if name in ("funnel", "funnel_factorized"):
        batch = _padded_text(batch_size, 10, 40, gen)
        batch["labels"] = torch.randint(0, 2, (batch_size,), generator=gen)
        second = torch.randint(3, 8, (batch_size, 1), generator=gen)  # where each second segment starts
        batch["token_type_ids"] = (torch.arange(10)[None, :] >= second).long()
        model = funnel("factorized" if name == "funnel_factorized" else "relative_shift")
        return model, segments_loss, batch
    if name in ("roberta_infilling", "bert_infilling"):
        batch = _padded_text(batch_size, 10, 40, gen)
        positions = torch.randint(1, 5, (batch_size,), generator=gen)  # inside every text (>= 5 tokens)
        batch["input_ids"][torch.arange(batch_size), positions] = 2  # the mask token
        batch["mask_positions"] = positions
        batch["labels"] = torch.randint(0, len(LABEL_WORDS), (batch_size,), generator=gen)
        return masked_lm(name.removesuffix("_infilling")), infilling_loss, batch
    raise KeyError(name)


CASES = [
    "mlp",
    "wrn_block",
    "sequence",
    "gpt2",
    "roberta",
    "bert",
    "gpt2_lora",
    "fallback",
    "fallback_inplace",
    "fallback_tuple",
    "scalar_gain",
    "vit",
    "vit_registers",
    "deit_distilled",
    "flattened",
    "opt",
    "falcon",
    "gemma2",
    "gemma4",
    "glm",
    "llama4",
    "gpt_oss",
    "deberta",
    "causal_mixer",
    "mamba",
    "mamba2",
    "qwen3_5",
    "lfm2",
    "roberta_infilling",
    "bert_infilling",
    "funnel",
    "funnel_factorized",
]
