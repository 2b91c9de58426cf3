"""The state-space and delta-net mixers' rules against the brute-force oracle: Mamba's selective scan
(``MambaMixer``, Falcon-Mamba's and Jamba's forms: ``A_log``, ``D`` and the ``conv1d`` and ``dt_proj`` weights
the mixer reads itself; Zamba's in heads, ``x_proj`` and ``dt_proj`` as its own parameters), Mamba-2's
(``Mamba2Mixer`` and its copies in Bamba, Nemotron-H, Granite-hybrid, Zamba2 and Falcon-H1: ``A_log``, ``D``,
``dt_bias`` and ``conv1d``) and the gated delta rule (Qwen3.5's, Qwen3-Next's and OLMo-hybrid's forms:
``A_log``, ``dt_bias`` and ``conv1d``; Kimi Linear's delta attention: ``conv1d``). The ``mamba``, ``mamba2``
and ``qwen3_5`` cases of ``test_engine_oracle`` run every strategy x clipping mode (padding, two
micro-batches, float64), and those cases with ``jamba``, ``nemotron_h``, ``falcon_h1``, ``qwen3_next``,
``zamba`` in ``test_sensitivity`` the released sums; here the rules alone (the fallback must not be taken) on
every form, in training mode and float32, frozen parameters, and the refusals of what the rules cannot
recompute."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from dpexp.privacy import PrivacyEngine
from dpexp.privacy.capture import unsupported_modules
from tests.engine_models import (
    _decoder,
    _padded_text,
    _routed,
    bailing_hybrid,
    falcon_h1,
    falcon_mamba,
    glm5_next,
    jamba,
    kimi_linear,
    lm_loss,
    mamba,
    mamba2,
    nemotron_h,
    olmo_hybrid,
    qwen3_5,
    qwen3_next,
    zamba,
)
from tests.oracle import check_clipped_step

pytestmark = pytest.mark.filterwarnings("ignore:noise_multiplier=0")

MICRO = [[0, 1, 2], [3, 4, 5]]


def bamba() -> nn.Module:
    from transformers import BambaConfig, BambaForCausalLM

    config = BambaConfig(
        vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=8, mamba_n_groups=1,
        mamba_d_state=4, mamba_d_conv=3, mamba_expand=2, mamba_chunk_size=4, pad_token_id=1,
        use_cache=False,
    )  # fmt: skip
    return BambaForCausalLM(config).double()


def granite_hybrid() -> nn.Module:
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    config = GraniteMoeHybridConfig(
        vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, layer_types=["mamba", "attention"], mamba_n_heads=4, mamba_d_head=8,
        mamba_n_groups=1, mamba_d_state=4, mamba_d_conv=3, mamba_expand=2, mamba_chunk_size=4,
        num_local_experts=0, shared_intermediate_size=32, pad_token_id=1, use_cache=False,
    )  # fmt: skip
    return GraniteMoeHybridForCausalLM(config).double()


def zamba2() -> nn.Module:
    from transformers import Zamba2Config, Zamba2ForCausalLM

    config = Zamba2Config(
        vocab_size=40, hidden_size=16, num_hidden_layers=2, layers_block_type=["mamba", "mamba"],
        mamba_d_state=4, mamba_headdim=8, mamba_ngroups=1, mamba_d_conv=3, mamba_expand=2, n_mamba_heads=4,
        num_attention_heads=2, num_key_value_heads=2, attention_head_dim=8, intermediate_size=32,
        chunk_size=4, pad_token_id=1, use_cache=False,
    )  # fmt: skip
    return Zamba2ForCausalLM(config).double()


def qwen3_5_moe_hybrid() -> nn.Module:
    """Qwen3.5-MoE with a gated delta net layer whose value heads outnumber its key heads (2 to 1)."""
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    return _routed(
        _decoder(
            Qwen3_5MoeTextConfig, Qwen3_5MoeForCausalLM, num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=12, shared_expert_intermediate_size=12,
            layer_types=["linear_attention", "full_attention"], linear_num_key_heads=1,
            linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
            linear_conv_kernel_dim=3, use_cache=False,
        )
    )  # fmt: skip


BUILDERS = {
    "mamba": mamba,
    "falcon_mamba": falcon_mamba,
    "jamba": jamba,
    "mamba2": mamba2,
    "bamba": bamba,
    "nemotron_h": nemotron_h,
    "granite_hybrid": granite_hybrid,
    "zamba2": zamba2,
    "falcon_h1": falcon_h1,
    "falcon_h1_norm": lambda: falcon_h1(rms_norm=True),
    "qwen3_5": qwen3_5,
    "qwen3_5_moe": qwen3_5_moe_hybrid,
    "qwen3_next": qwen3_next,
    "olmo_hybrid": olmo_hybrid,
    "zamba": zamba,
}


def _batch() -> dict[str, torch.Tensor]:
    return _padded_text(6, 10, 40, torch.Generator().manual_seed(0))  # examples padded to different lengths


def _first_step(model: nn.Module, loss=lm_loss) -> None:
    """One private step's backward on the usual batch (noise off): where the rules' run-time refusals fire."""
    engine = PrivacyEngine(model, batch_size=6, sample_size=100, max_grad_norm=1.0, noise_multiplier=0.0)
    engine.backward(loss(model, _batch()))


def _mixers(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if hasattr(m, "A_log")]


@pytest.mark.parametrize("name", list(BUILDERS))
def test_no_mixer_is_left_to_the_fallback(name):
    model = BUILDERS[name]()
    assert _mixers(model)
    assert unsupported_modules(model) == {}


@pytest.mark.parametrize(
    "name,strategy,clipping",
    [
        ("mamba", "bk", "flat"),
        ("mamba", "ghost", "per_layer"),
        ("mamba", "instantiate", "flat"),
        ("falcon_mamba", "bk", "per_layer"),
        ("falcon_mamba", "instantiate", "flat"),
        ("jamba", "bk", "flat"),
        ("jamba", "ghost", "per_layer"),
        ("mamba2", "bk", "flat"),
        ("mamba2", "instantiate", "per_layer"),
        ("bamba", "bk", "per_layer"),
        ("nemotron_h", "bk", "flat"),
        ("granite_hybrid", "ghost", "flat"),
        ("zamba2", "bk", "flat"),
        ("falcon_h1", "bk", "flat"),
        ("falcon_h1", "ghost", "per_layer"),
        ("falcon_h1_norm", "bk", "per_layer"),
        ("qwen3_5", "bk", "flat"),
        ("qwen3_5", "ghost", "per_layer"),
        ("qwen3_5_moe", "bk", "per_layer"),
        ("qwen3_next", "bk", "flat"),
        ("qwen3_next", "ghost", "per_layer"),
        ("olmo_hybrid", "bk", "per_layer"),
        ("olmo_hybrid", "instantiate", "flat"),
        ("zamba", "bk", "flat"),
        ("zamba", "ghost", "per_layer"),
        ("zamba", "instantiate", "per_layer"),
    ],
)
def test_rule_matches_oracle_without_the_fallback(name, strategy, clipping):
    """Training mode (the forward tries the fused kernels' path first, which is absent here) and padding:
    Hugging Face masks the padded positions before ``in_proj`` and after the convolution."""
    torch.manual_seed(0)
    model = BUILDERS[name]().train()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", ".*torch.func fallback")  # the mixers must not take it
        check_clipped_step(model, lm_loss, _batch(), MICRO, strategy, clipping, rel=1e-6)


@pytest.mark.parametrize(
    "strategy,clipping", [("bk", "flat"), ("ghost", "per_layer"), ("instantiate", "per_layer")]
)
@pytest.mark.parametrize("build", [kimi_linear, bailing_hybrid, lambda: bailing_hybrid(safe_gate=False)])
def test_kimi_delta_attention_matches_oracle_without_the_fallback(build, strategy, clipping):
    """Kimi Linear's and Bailing-hybrid's attention takes its rule for the convolution, with its forget gate's
    recorded output; the forget gate (``A_log``, ``dt_bias``), a layer of its own, takes the forget-gate rule
    (Kimi's low-rank softplus gate, Bailing's sigmoid-bounded one and its softplus one)."""
    model = build().train()
    assert unsupported_modules(model) == {}
    with warnings.catch_warnings():
        warnings.filterwarnings("error", ".*torch.func fallback")
        check_clipped_step(model, lm_loss, _batch(), MICRO, strategy, clipping, rel=1e-6)


@pytest.mark.parametrize("build", [kimi_linear, glm5_next, qwen3_5, qwen3_next, olmo_hybrid])
def test_delta_attention_reads_its_gradients_off_the_graph(build, monkeypatch):
    """The convolution's output gradient is read at the node that keeps ``conv1d``'s weight, and a delta
    net's decay ``g`` at the product that keeps ``-exp(A_log)``: nothing of the attention runs again (its
    recomputation made to fail here), and the oracle still agrees."""
    from dpexp.privacy.rules import scan_mixers

    def recomputed(*args, **kwargs):
        raise AssertionError("the delta attention was recomputed")

    monkeypatch.setattr(scan_mixers, "_convolved", recomputed)
    torch.manual_seed(0)
    check_clipped_step(build().train(), lm_loss, _batch(), MICRO, "ghost", "per_layer", rel=1e-6)


@pytest.mark.parametrize(
    "build,recomputation",
    [(kimi_linear, "_convolved"), (qwen3_5, "_convolved"), (falcon_h1, "_ssd_recomputed")],
)
def test_a_mixer_recomputes_where_the_graph_gives_nothing(build, recomputation, monkeypatch):
    """Under hooks on saved tensors (activation checkpointing, offloading) nothing is read off the graph:
    the rule recomputes the convolution and the delta attention, or Mamba-2's scan with per-example copies
    (``recomputation``, counted), and the oracle agrees."""
    from dpexp.privacy.rules import scan_mixers

    calls = []
    original = getattr(scan_mixers, recomputation)
    monkeypatch.setattr(scan_mixers, recomputation, lambda *a, **k: calls.append(1) or original(*a, **k))
    torch.manual_seed(0)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        check_clipped_step(build().train(), lm_loss, _batch(), MICRO, "bk", "flat", rel=1e-6)
    assert calls


@pytest.mark.parametrize(
    "build", [mamba, zamba, jamba, mamba2, bamba, falcon_h1, qwen3_5, qwen3_next, olmo_hybrid]
)
def test_left_padded_examples_match_oracle(build):
    """Padding on the left, where the mask the mixers apply before ``in_proj`` and after the convolution
    changes the scan's state at the real positions (on the right it reaches padded positions only)."""
    torch.manual_seed(0)
    model = build().train()
    with (
        torch.no_grad()
    ):  # biases away from their zero initialisation, so that a padded position's output is not
        for p in model.parameters():  # zero before the mask
            p.add_(0.1 * torch.randn_like(p))
    batch = {key: value.flip(1) for key, value in _batch().items()}
    check_clipped_step(model, lm_loss, batch, MICRO, "bk", "flat", rel=1e-6)


@pytest.mark.parametrize("build", [mamba, mamba2, qwen3_5, zamba])
def test_float32_matches_oracle(build):
    torch.manual_seed(0)
    check_clipped_step(build().float(), lm_loss, _batch(), MICRO, "bk", "flat", rel=1e-4, floor=1e-6)


@pytest.mark.parametrize("build", [mamba, mamba2, qwen3_5])
def test_frozen_state_space_parameters_leave_the_convolution_to_the_rule(build):
    model = build()
    for mixer in _mixers(model):
        mixer.A_log.requires_grad_(False)
        (mixer.D if hasattr(mixer, "D") else mixer.dt_bias).requires_grad_(False)
    check_clipped_step(model, lm_loss, _batch(), MICRO, "instantiate", "per_layer", rel=1e-6)


def test_a_cache_is_refused_at_the_call():
    with pytest.raises(ValueError, match=r"MambaMixer was given a cache.*use_cache=False"):
        _first_step(mamba(), lm_loss_with_cache)


def lm_loss_with_cache(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=True)
    return out.logits.sum((1, 2))


def test_a_wrapped_x_proj_is_refused_at_construction():
    class Adapter(nn.Module):
        def __init__(self, inner: nn.Linear) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner(x)

    model = mamba()
    mixer = _mixers(model)[0]
    mixer.x_proj = Adapter(mixer.x_proj)
    with pytest.raises(ValueError, match=r"selective-scan rule.*x_proj is a Adapter.*leave them unwrapped"):
        PrivacyEngine(model, batch_size=6, sample_size=100, max_grad_norm=1.0, noise_multiplier=1.0)


def test_the_fused_kernels_path_is_refused(monkeypatch):
    """With mamba_ssm installed, a training forward returns the fused kernel's output and never calls
    x_proj: simulated by a stand-in kernel that returns an output of the right shape."""
    from transformers.models.mamba import modeling_mamba

    model = mamba().train()

    def fused(xz, *args, **kwargs):  # stands for mamba_inner_fn: the mixer's output, no call of x_proj
        return xz.transpose(1, 2)[..., : model.config.hidden_size]

    monkeypatch.setattr(modeling_mamba, "mamba_inner_fn", fused)
    with pytest.raises(Exception, match=r"called its submodules .*fused kernels of mamba_ssm"):
        _first_step(model)


def test_a_mixer_whose_forward_differs_is_refused(monkeypatch):
    """A scan that is not Mamba's (here its output scaled) is not reproduced by the rule's recomputation:
    refused, not approximated."""
    from transformers.models.mamba import modeling_mamba

    scan = modeling_mamba.mamba_selective_scan
    monkeypatch.setattr(modeling_mamba, "mamba_selective_scan", lambda *a, **k: 1.5 * scan(*a, **k))
    model = mamba()
    with pytest.raises(Exception, match=r"recomputation of out_proj's input does not reproduce"):
        _first_step(model)


@pytest.mark.parametrize("family,build", [("mamba2", mamba2), ("qwen3_5", qwen3_5)])
def test_a_mixer_whose_convolution_differs_is_refused_where_it_is_recomputed(monkeypatch, family, build):
    """Mamba-2's rule, and the delta net's where the graph gives nothing (here: hooks on saved tensors), run
    the module's own scan function but compute the convolution themselves: a module whose convolution
    differs (here scaled) is refused at the scan's output."""
    import importlib

    modeling = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    conv = modeling.causal_conv1d_fn
    monkeypatch.setattr(modeling, "causal_conv1d_fn", lambda x, w, b, **k: conv(x, w, b) * 0.5)
    model = build()
    with (
        torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t),
        pytest.raises(Exception, match=r"recomputation of the norm's input does not reproduce"),
    ):
        _first_step(model)


def test_a_delta_net_whose_convolution_differs_is_exact_where_the_graph_is_read(monkeypatch):
    """Read off the graph, the gradient at the convolution's output is autograd's whatever follows it (here
    the output scaled): nothing is recomputed, so nothing needs refusing, and the oracle agrees."""
    from transformers.models.qwen3_5 import modeling_qwen3_5

    conv = modeling_qwen3_5.causal_conv1d_fn
    monkeypatch.setattr(modeling_qwen3_5, "causal_conv1d_fn", lambda x, w, b, **k: conv(x, w, b) * 0.5)
    torch.manual_seed(0)
    check_clipped_step(qwen3_5().train(), lm_loss, _batch(), MICRO, "ghost", "per_layer", rel=1e-6)


def test_a_mamba2_mixer_without_its_scan_function_is_refused_at_construction(monkeypatch):
    from transformers.models.mamba2 import modeling_mamba2

    monkeypatch.delattr(modeling_mamba2, "mamba2_chunk_scan")
    with pytest.raises(ValueError, match=r"state-space-duality rule.*has no mamba2_chunk_scan function"):
        PrivacyEngine(mamba2(), batch_size=6, sample_size=100, max_grad_norm=1.0, noise_multiplier=1.0)


def test_a_delta_net_of_an_unknown_form_is_refused_at_construction():
    """The rule tells the form by its input projections (``DELTA_FORMS``): a net with none of them (here
    Qwen3.5's fused projection renamed) is refused, naming the rule, not run on a guess."""
    model = qwen3_5()
    mixer = _mixers(model)[0]
    mixer.qkv_proj = mixer.in_proj_qkv
    del mixer.in_proj_qkv
    with pytest.raises(
        ValueError, match=r"gated-delta-rule rule.*none of the input projections the rule knows"
    ):
        PrivacyEngine(model, batch_size=6, sample_size=100, max_grad_norm=1.0, noise_multiplier=1.0)


@pytest.mark.filterwarnings("ignore:.*Glm5NextTextHyperConnection.*fallback")
@pytest.mark.parametrize(
    "lower_bound,strategy,clipping", [(-5.0, "bk", "flat"), (None, "ghost", "per_layer")]
)
def test_glm5_next_delta_attention_matches_oracle(lower_bound, strategy, clipping):
    """GLM-5-Next's Kimi Delta Attention and forget gate (sigmoid-bounded, or Kimi's softplus) take their
    rules, and since stop 64 its hyper-connections (``rules/hyper_connections.py``): none on the fallback.
    The connections compute in float32, batched: their scales' gradients (about 1e-6) differ from the
    oracle's one example at a time by up to 1e-10 absolute (5e-11 seen), hence the floor, as in
    ``test_rules_moe.py``."""
    torch.manual_seed(0)
    model = glm5_next(lower_bound).train()
    assert unsupported_modules(model) == {}
    check_clipped_step(model, lm_loss, _batch(), MICRO, strategy, clipping, rel=1e-6, floor=1e-10)


def test_a_forget_gate_whose_forward_differs_is_refused(monkeypatch):
    """Kimi Linear's forget gate with another decay (here halved) is not reproduced by the rule: refused."""
    from transformers.models.kimi_linear import modeling_kimi_linear

    gate = modeling_kimi_linear.KimiLinearForgetGate
    forward = gate.forward
    monkeypatch.setattr(gate, "forward", lambda self, h: 0.5 * forward(self, h))
    with pytest.raises(RuntimeError, match=r"KimiLinearForgetGate: the rule's recomputation of the gate"):
        _first_step(kimi_linear())


MAMBA2_FORMS = ["mamba2", "bamba", "nemotron_h", "granite_hybrid", "zamba2", "falcon_h1", "falcon_h1_norm"]


def _no_recomputation(*args, **kwargs):
    raise AssertionError("the Mamba-2 scan was recomputed")


@pytest.mark.parametrize("name", MAMBA2_FORMS)
def test_mamba2_mixers_read_their_gradients_off_the_graph(name, monkeypatch):
    """Every Mamba-2 form reads its gradients at the scan's products (``A dt`` by ``-exp(A_log)``, ``D x``
    by ``D``), its softplus and its convolution: the scan never runs again (its recomputation made to fail
    here), and the oracle agrees."""
    from dpexp.privacy.rules import scan_mixers

    monkeypatch.setattr(scan_mixers, "_ssd_recomputed", _no_recomputation)
    torch.manual_seed(0)
    check_clipped_step(BUILDERS[name]().train(), lm_loss, _batch(), MICRO, "ghost", "per_layer", rel=1e-6)


@pytest.mark.parametrize("frozen", [("A_log",), ("D",), ("dt_bias",), ("conv1d.weight", "conv1d.bias")])
def test_a_mamba2_mixer_with_frozen_parameters_reads_the_others_off_the_graph(frozen, monkeypatch):
    """Only the nodes of trainable parameters are looked for: with one of them frozen (its node may keep
    nothing for it, or not exist), the others are still read, and the oracle agrees."""
    from dpexp.privacy.rules import scan_mixers

    monkeypatch.setattr(scan_mixers, "_ssd_recomputed", _no_recomputation)
    torch.manual_seed(0)
    model = mamba2().train()
    for mixer in _mixers(model):
        for name in frozen:
            mixer.get_parameter(name).requires_grad_(False)
    check_clipped_step(model, lm_loss, _batch(), MICRO, "bk", "flat", rel=1e-6)


def _doubled_time_step(scan):
    return lambda x, dt, *a, **k: scan(x, 2 * dt, *a, **k)


def _narrower_limit(scan):
    return lambda *a, **k: scan(*a, **{**k, "dt_limit": (0.0, 0.05)})


@pytest.mark.parametrize(
    "function,change,refusal",
    [
        ("mamba2_chunk_scan", _doubled_time_step, "the time step's softplus input"),
        ("mamba2_chunk_scan", _narrower_limit, "the time step"),
        ("causal_conv1d_fn", lambda conv: lambda x, w, b, **k: conv(x, w, b) * 0.5, "the skip's input"),
    ],
)
def test_a_mamba2_mixer_whose_forward_differs_is_refused_where_the_graph_is_read(
    monkeypatch, function, change, refusal
):
    """The values the read nodes kept (at the first step: the engine has not released the parameters yet)
    are checked against their recomputation from ``in_proj``'s output, which establishes whose example
    each row is: a scan given another time step (here doubled), clamped to other limits, or a convolution
    that differs (here scaled) is refused, not read."""
    from transformers.models.mamba2 import modeling_mamba2

    monkeypatch.setattr(modeling_mamba2, function, change(getattr(modeling_mamba2, function)))
    with pytest.raises(RuntimeError, match=f"Mamba2Mixer: the rule's recomputation of {refusal} does not"):
        _first_step(mamba2().train())
