"""RMSNorm rules (Llama, OLMo-2/Gemma, T5 and torch forms) against the brute-force oracle, and the claim
that every registered Hugging Face class has the forward its form reproduces."""

from __future__ import annotations

import importlib
import inspect
import re
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpexp.privacy import PrivacyEngine
from dpexp.privacy.rules import rms_norm, rule_for
from tests.oracle import clipped_mean, engine_update, group_norms, per_example_grads

pytestmark = pytest.mark.filterwarnings("ignore:noise_multiplier=0")


def _hf_class(qualified: str) -> type:
    module, name = qualified.rsplit(".", 1)
    return getattr(importlib.import_module(module), name)


def _forward_source(cls: type) -> str:
    source = inspect.getsource(cls.forward)
    source = re.sub(r"#.*", "", source)  # comments name the family
    source = re.sub(r" ?(:|->) ?torch\.Tensor", "", source)  # some families annotate, others not
    return re.sub(r"\s+", " ", source).strip()


@pytest.mark.parametrize(
    "form",
    [rms_norm.LLAMA_FORM, rms_norm.GEMMA_FORM, rms_norm.GEMMA3N_FORM, rms_norm.MOSHI_FORM, rms_norm.T5_FORM],
    ids=["llama", "gemma", "gemma3n", "moshi", "t5"],
)
def test_registered_classes_share_their_forms_forward(form):
    sources = {_forward_source(_hf_class(name)) for name in form}
    assert len(sources) == 1, sources


class Normed(nn.Module):
    """Linear -> norm -> tanh -> Linear, the norm's scale randomised (Gemma's starts at 0); a gated norm gets
    a second Linear's output as its gate."""

    def __init__(self, norm: nn.Module, gated: bool = False) -> None:
        super().__init__()
        self.inp, self.norm, self.out = nn.Linear(4, 6), norm, nn.Linear(6, 3)
        self.gate = nn.Linear(4, 6) if gated else None
        with torch.no_grad():
            self.norm.weight.normal_(1.0, 0.3)

    def forward(self, x):
        shape = self.norm.weight.shape  # (6,), or (2, 3) for a norm of each head's rows
        gate = () if self.gate is None else (self.gate(x).unflatten(-1, shape),)
        h = self.norm(self.inp(x).unflatten(-1, shape), *gate).flatten(-len(shape))
        return self.out(torch.tanh(h)).sum(1)


def _norms():
    from transformers.models.cohere.modeling_cohere import CohereLayerNorm
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.gemma3n.modeling_gemma3n import Gemma3nRMSNorm
    from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm
    from transformers.models.glm.modeling_glm import GlmRMSNorm
    from transformers.models.helium.modeling_helium import HeliumRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.llama4.modeling_llama4 import Llama4TextRMSNorm
    from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm
    from transformers.models.t5.modeling_t5 import T5LayerNorm

    return {
        **_more_norms(),
        "llama": LlamaRMSNorm(6, eps=1e-5),
        "glm": GlmRMSNorm(6, eps=1e-5),  # a copy of Llama's (dpexp.privacy.rules.copies)
        "olmo2": Olmo2RMSNorm(6, eps=1e-5),
        "helium": HeliumRMSNorm(6, eps=1e-5),
        "gemma": GemmaRMSNorm(6, eps=1e-5),
        "gemma3n": Gemma3nRMSNorm(6, eps=1e-5),
        "gemma4": Gemma4RMSNorm(6, eps=1e-5),
        "llama4": Llama4TextRMSNorm(6, eps=1e-5),
        "t5": T5LayerNorm(6, eps=1e-5),
        "torch": nn.RMSNorm(6, eps=1e-5),
        "cohere": CohereLayerNorm(6, eps=1e-5),  # centred, no bias
        "cohere_heads": CohereLayerNorm((2, 3), eps=1e-5),  # one row per head (its query/key norms)
    }


def _more_norms() -> dict:
    """RMSNorm forms of stop 46: Mamba-2's (Llama's form), Moshi's and MuseSpark's (float32 products),
    IDEFICS' (T5's), Qwen4-Exp's (grouped), and the gated norms of linear-attention and state-space layers;
    CPM-Ant's and ImageGPT's (stop 62)."""
    from transformers import CpmAntConfig
    from transformers.models.bailing_hybrid.modeling_bailing_hybrid import BailingHybridRMSNormGated
    from transformers.models.bamba.modeling_bamba import BambaRMSNormGated
    from transformers.models.cpmant.modeling_cpmant import CpmAntLayerNorm
    from transformers.models.falcon_h1.modeling_falcon_h1 import FalconH1RMSNormGated
    from transformers.models.idefics.modeling_idefics import IdeficsRMSNorm
    from transformers.models.imagegpt.modeling_imagegpt import ImageGPTLayerNorm
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearRMSNormGated
    from transformers.models.mamba2.modeling_mamba2 import Mamba2RMSNorm, MambaRMSNormGated
    from transformers.models.moshi.modeling_moshi import MoshiRMSNorm
    from transformers.models.muse_spark.modeling_muse_spark import MuseSparkTextCenteredRMSNorm
    from transformers.models.nemotron.modeling_nemotron import NemotronLayerNorm1P
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNormGated
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNormGated
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextRMSNorm

    return {
        "mamba2": Mamba2RMSNorm(6, eps=1e-5),
        "moshi": MoshiRMSNorm(6, eps=1e-5),
        "muse_spark": MuseSparkTextCenteredRMSNorm(6, eps=1e-5),  # scales by 1 + w
        "idefics": IdeficsRMSNorm(6, eps=1e-5),
        "nemotron": NemotronLayerNorm1P(6, eps=1e-5),  # a LayerNorm scaling by 1 + w, with a bias
        "qwen3_next_gated": Qwen3NextRMSNormGated(6, eps=1e-5),  # silu gate after the norm
        "qwen3_5_gated": Qwen3_5RMSNormGated(6, eps=1e-5),  # a copy of Qwen3-Next's
        "kimi_gated": KimiLinearRMSNormGated(6, eps=1e-5),  # sigmoid gate, in float32
        "bailing_gated": BailingHybridRMSNormGated(6, eps=1e-5),  # a copy of Kimi Linear's
        "mamba_gated": MambaRMSNormGated(6, group_size=3, eps=1e-5),  # silu gate before a grouped norm
        "bamba_ungated": BambaRMSNormGated(6, group_size=2, eps=1e-5),  # a copy of Mamba-2's, called without
        "falcon_h1_gate_first": FalconH1RMSNormGated(6, eps=1e-5, n_groups=2, norm_before_gate=False),
        "falcon_h1_norm_first": FalconH1RMSNormGated(6, eps=1e-5, n_groups=3, norm_before_gate=True),
        "qwen4_exp": Qwen4ExpTextRMSNorm(6, eps=1e-5),  # 1 + w
        "qwen4_exp_grouped": Qwen4ExpTextRMSNorm(6, group_size=3, eps=1e-5),
        "cpmant": CpmAntLayerNorm(CpmAntConfig(hidden_size=6, eps=1e-5)),  # the variance alone in float32
        "imagegpt": ImageGPTLayerNorm(6, eps=1e-5),  # all in the input's dtype, by sqrt and division
    }


GATED = (
    "qwen3_next_gated",
    "qwen3_5_gated",
    "kimi_gated",
    "bailing_gated",
    "mamba_gated",
    "falcon_h1_gate_first",
    "falcon_h1_norm_first",
)
FLOAT32 = (
    "moshi",
    "muse_spark",
    "qwen4_exp",
    "qwen4_exp_grouped",
    *GATED,
    "olmo2",
    "helium",
    "gemma",
    "gemma3n",
    "gemma4",
    "cohere",
    "cohere_heads",
)  # compute in float32 whatever the dtype


@pytest.mark.parametrize(
    "name",
    [
        "llama",
        "glm",
        "olmo2",
        "helium",
        "gemma",
        "gemma3n",
        "gemma4",
        "llama4",
        "t5",
        "torch",
        "cohere",
        "cohere_heads",
        *_more_norms(),
    ],
)
@pytest.mark.parametrize("strategy", ["bk", "ghost", "instantiate"])
@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
def test_rms_norm_matches_oracle(name, strategy, clipping):
    assert rule_for(_norms()[name]) is not None
    _assert_matches_oracle(lambda: _norms()[name], name in GATED, strategy, clipping, name in FLOAT32)


def _assert_matches_oracle(make_norm, gated: bool, strategy: str, clipping: str, float32: bool) -> None:
    """The engine's clipped mean on :class:`Normed` around ``make_norm()`` equals the per-example loop's."""
    torch.manual_seed(0)
    model = Normed(make_norm(), gated=gated).double()
    gen = torch.Generator().manual_seed(0)
    batch = {"x": torch.randn(6, 5, 4, generator=gen, dtype=torch.float64)}
    batch["x"][0] = 0.0  # a zero-gradient example

    def loss(m, b):
        return F.softplus(m(b["x"])).sum(1)

    grads = per_example_grads(model, loss, batch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        groups = PrivacyEngine(
            Normed(make_norm(), gated=gated), batch_size=2, sample_size=10, max_grad_norm=1.0,
            noise_multiplier=0.0, clipping=clipping,
        ).groups  # fmt: skip
    thresholds = group_norms(grads, groups).median(0).values.clamp_min(1e-3).tolist()
    expected = clipped_mean(grads, groups, thresholds, batch_size=6)
    delta, _ = engine_update(
        model, loss, batch, [[0, 1, 2], [3, 4, 5]], batch_size=6, strategy=strategy, clipping=clipping,
        thresholds=thresholds, max_grad_norm=1.0,
    )  # fmt: skip
    rtol, atol = (1e-5, 1e-7) if float32 else (1e-7, 1e-10)  # float32 rounding of the backward
    for param, want in expected.items():
        torch.testing.assert_close(delta[param], want, rtol=rtol, atol=atol)


def _mamba_gated_norm_5_17(self, hidden_states, gate=None):
    """``MambaRMSNormGated.forward`` as transformers 5.17 has it: no ``group_size``, the whole width."""
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    if gate is not None:
        hidden_states = hidden_states * F.silu(gate.to(torch.float32))
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    return self.weight * hidden_states.to(input_dtype)


@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
def test_mamba2_gated_norm_without_groups_matches_oracle(monkeypatch, clipping):
    """Mamba-2's gated norm before ``group_size`` existed (transformers 5.17, on the GPU machine of stop 51,
    where the rule failed on the missing attribute) normalises over all features."""
    from transformers.models.mamba2.modeling_mamba2 import MambaRMSNormGated

    monkeypatch.setattr(MambaRMSNormGated, "forward", _mamba_gated_norm_5_17)

    def make_norm():
        norm = MambaRMSNormGated(6, group_size=6, eps=1e-5)
        del norm.group_size
        return norm

    _assert_matches_oracle(make_norm, True, "bk", clipping, float32=True)


def test_torch_rms_norm_over_two_axes_matches_oracle():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(4, 6), nn.Unflatten(-1, (2, 3)), nn.RMSNorm((2, 3)), nn.Flatten(-2), nn.Linear(6, 2)
    )
    model = model.double()
    with torch.no_grad():
        model[2].weight.normal_(1.0, 0.3)
    batch = {"x": torch.randn(4, 5, 4, dtype=torch.float64)}

    def loss(m, b):
        return m(b["x"]).pow(2).sum((1, 2))

    grads = per_example_grads(model, loss, batch)
    groups = [list(grads[0])]
    thresholds = group_norms(grads, groups).median(0).values.tolist()
    expected = clipped_mean(grads, groups, thresholds, batch_size=4)
    delta, _ = engine_update(
        model, loss, batch, [[0, 1, 2, 3]], batch_size=4, thresholds=thresholds, max_grad_norm=1.0
    )
    for param, want in expected.items():
        torch.testing.assert_close(delta[param], want, rtol=1e-7, atol=1e-10)


@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
@pytest.mark.parametrize("tied", [True, False])
def test_llama_matches_oracle_without_fallback(clipping, tied, recwarn):
    """A tiny Hugging Face Llama (RMSNorm, SwiGLU, rotary attention): every layer has a rule now."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=30, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=32, tie_word_embeddings=tied,
    )  # fmt: skip
    model = LlamaForCausalLM(config).double().eval()
    for module in model.modules():
        if hasattr(module, "variance_epsilon"):
            torch.nn.init.normal_(module.weight, 1.0, 0.3)
    ids = torch.randint(0, 30, (4, 7), generator=torch.Generator().manual_seed(0))

    def loss(m, b):
        logits = m(input_ids=b["ids"]).logits[:, :-1]
        flat = F.cross_entropy(logits.flatten(0, 1), b["ids"][:, 1:].flatten(), reduction="none")
        return flat.view(len(b["ids"]), -1).sum(1)

    batch = {"ids": ids}
    grads = per_example_grads(model, loss, batch)
    engine = PrivacyEngine(
        model, batch_size=2, sample_size=10, max_grad_norm=1.0, noise_multiplier=0.0, clipping=clipping
    )
    groups = engine.groups
    engine.detach()
    assert not [w for w in recwarn if "fallback" in str(w.message)]
    thresholds = group_norms(grads, groups).median(0).values.tolist()
    expected = clipped_mean(grads, groups, thresholds, batch_size=4)
    delta, _ = engine_update(
        model, loss, batch, [[0, 1], [2, 3]], batch_size=4, clipping=clipping, thresholds=thresholds,
        max_grad_norm=1.0,
    )  # fmt: skip
    for param, want in expected.items():
        torch.testing.assert_close(delta[param], want, rtol=1e-7, atol=1e-10)


def test_imagegpt_needs_no_fallback_and_matches_oracle():
    """ImageGPT (its norm scales an RMS normalisation computed in the input's dtype) as a whole causal model
    of colour-cluster tokens, no module left to the fallback."""
    from transformers import ImageGPTConfig, ImageGPTForCausalImageModeling

    from dpexp.privacy.capture import unsupported_modules
    from tests.oracle import check_clipped_step

    config = ImageGPTConfig(
        vocab_size=17, n_positions=16, n_embd=16, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, use_cache=False,
    )  # fmt: skip
    model = ImageGPTForCausalImageModeling(config).double().eval()
    assert unsupported_modules(model) == {}
    ids = torch.randint(0, 16, (4, 9), generator=torch.Generator().manual_seed(0))

    def loss(m: nn.Module, b: dict) -> torch.Tensor:
        logits, targets = m(input_ids=b["ids"]).logits[:, :-1], b["ids"][:, 1:]
        return (
            F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")
            .view(targets.shape)
            .sum(1)
        )

    check_clipped_step(model, loss, {"ids": ids}, [[0, 1], [2, 3]], "bk", "per_layer", rel=1e-8)
