"""Mixture-of-experts layers (dpexp.privacy.rules.moe): the per-example form of 3-D expert weights
(``Routed``) against instantiation, tiny Mixtral and Qwen2-MoE against the brute-force oracle in every
strategy x clipping mode (float64, eager experts; float32 under the grouped_mm and batched_mm kernels), the
routers' recomputation against the modules, the copies that take the rules, and the refusals."""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpexp.privacy import PrivacyEngine
from dpexp.privacy.capture import unsupported_modules
from dpexp.privacy.per_example import Routed
from dpexp.privacy.rules import moe, rule_for
from tests.engine_models import (
    NEW_MOE,
    _padded_text,
    aria,
    dbrx,
    deepseek_v2,
    deepseek_v3,
    ernie4_5_moe,
    gemma4_moe,
    gpt_oss,
    granite_moe,
    jamba,
    lfm2_moe,
    llama4,
    lm_loss,
    mixtral,
    nemotron_h,
    new_moe,
    qwen2_moe,
    qwen3_5_moe,
)
from tests.oracle import SETTINGS, check_clipped_step

pytestmark = pytest.mark.filterwarnings("ignore:noise_multiplier=0")

MODELS = {
    "mixtral": mixtral,
    "qwen2_moe": qwen2_moe,
    "llama4": llama4,
    "deepseek_v2": deepseek_v2,
    "deepseek_v2_greedy": lambda: deepseek_v2("greedy"),
    "deepseek_v3": deepseek_v3,
    "granite_moe": granite_moe,
    "qwen3_5_moe": qwen3_5_moe,
    "gemma4_moe": gemma4_moe,
    "gpt_oss": gpt_oss,  # biased router, transposed biased experts with their own gate
    "aria": aria,  # transposed experts without biases
    "ernie4_5_moe": ernie4_5_moe,  # float32 router, frozen load-balancing bias in a child module
    "jamba": jamba,  # top-k probabilities not renormalised; a Mamba layer (rules/scan_mixers.py)
    "nemotron_h": nemotron_h,  # experts without a gate; a Mamba-2 layer (rules/scan_mixers.py)
    "lfm2_moe": lfm2_moe,  # a sigmoid router passed its block's expert bias; F.silu experts; a short conv
}
# logits or norms in float32 whatever the model's dtype
FLOAT32_MIXERS = ["jamba"]  # its Mamba mixer's A_log, D and dt_proj bias pass through float32
FLOAT32_ROUTERS = [
    "ernie4_5_moe",
    "deepseek_v2",
    "deepseek_v2_greedy",
    "deepseek_v3",
    "qwen3_5_moe",
    "gemma4_moe",
    "gpt_oss",
    "nemotron_h",
]  # gpt_oss: RMSNorm in float32
KERNEL_MODELS = ["mixtral", "qwen2_moe"]  # experts through transformers' kernels (Llama 4's: its own bmm)


# ---------------------------------------------------------------------------------------------- Routed
def _routed(seed: int = 0, batch: int = 5, experts: int = 4, rows: int = 40, shape=(6, 7)) -> tuple:
    """A ``Routed`` of random rows (example ``batch - 1`` has none; rows in random order, one pair much
    longer than the others so that norms take several chunks) and its instantiation by a loop."""
    gen = torch.Generator().manual_seed(seed)
    left = torch.randn(rows, shape[0], generator=gen, dtype=torch.float64)
    right = torch.randn(rows, shape[1], generator=gen, dtype=torch.float64)
    expert = torch.randint(0, experts, (rows,), generator=gen)
    example = torch.randint(0, batch - 1, (rows,), generator=gen)
    expert[:12], example[:12] = 2, 1  # one long pair
    dense = torch.zeros(batch, experts, *shape, dtype=torch.float64)
    for r in range(rows):
        dense[example[r], expert[r]] += torch.outer(left[r], right[r])
    return Routed(left, right, expert, example, batch, (experts, *shape)), dense


def test_routed_instantiates_each_examples_expert_blocks():
    grad, dense = _routed()
    torch.testing.assert_close(grad.instantiate(), dense, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("mode", ["ghost", "instantiate", "auto"])
def test_routed_norms_both_ways_equal_instantiation(mode):
    grad, dense = _routed()
    assert len(list(grad._pair_blocks(mode))) > 1  # padded chunks of pairs, largest first
    torch.testing.assert_close(grad.norm_sq(mode), dense.flatten(1).square().sum(1), rtol=1e-12, atol=1e-12)


def test_routed_weighted_sum_mask_sibling_and_cross_term():
    grad, dense = _routed()
    coef = torch.rand(5, dtype=torch.float64)
    torch.testing.assert_close(grad.weighted_sum(coef), torch.einsum("b,b...->...", coef, dense))
    keep = torch.tensor([True, False, True, True, True])
    torch.testing.assert_close(grad.masked(keep).instantiate(), dense * keep.view(-1, 1, 1, 1))
    other, other_dense = _routed(seed=1)
    torch.testing.assert_close(grad.dot(other), (dense * other_dense).flatten(1).sum(1))
    # a sibling takes rows in the order given to the first one's constructor, and its routing
    gen = torch.Generator().manual_seed(0)
    left, right = (
        torch.randn(40, 3, generator=gen, dtype=torch.float64),
        torch.randn(40, 2, dtype=torch.float64),
    )
    expert, example = torch.randint(0, 4, (40,), generator=gen), torch.randint(0, 5, (40,), generator=gen)
    first = Routed(left, right, expert, example, 5, (4, 3, 2))
    assert first._order is not None  # the rows were sorted
    sibling = first.sibling(2 * left, right, (4, 3, 2))
    torch.testing.assert_close(sibling.instantiate(), 2 * first.instantiate())


def test_routed_stacked_experts_block_as_their_3d_form():
    """A weight stored with its experts stacked, (E L, R) (DBRX), given ``experts=E``: the same gradients,
    norms and sums as the (E, L, R) form, in the stacked shape."""
    grad, dense = _routed()
    left, right, expert, example = grad._factors()
    stacked = Routed(left, right, expert, example, 5, (4 * 6, 7), experts=4)
    torch.testing.assert_close(stacked.instantiate(), dense.view(5, 24, 7), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(stacked.norm_sq(), grad.norm_sq(), rtol=1e-12, atol=0)
    coef = torch.rand(5, dtype=torch.float64)
    torch.testing.assert_close(stacked.weighted_sum(coef), grad.weighted_sum(coef).view(24, 7))
    torch.testing.assert_close(stacked.dot(stacked), grad.dot(grad), rtol=1e-12, atol=0)


def test_routed_bias_sums_each_examples_rows_per_expert():
    """A bias (E, R): left factor 1, ``G_i[e] = sum_r right_r`` over example i's rows routed to e."""
    gen = torch.Generator().manual_seed(0)
    right = torch.randn(30, 7, generator=gen, dtype=torch.float64)
    expert, example = torch.randint(0, 4, (30,), generator=gen), torch.randint(0, 5, (30,), generator=gen)
    dense = torch.zeros(5, 4, 7, dtype=torch.float64).index_put_((example, expert), right, accumulate=True)
    bias = Routed(torch.ones(30, 1, dtype=torch.float64), right, expert, example, 5, (4, 7))
    torch.testing.assert_close(bias.instantiate(), dense)
    torch.testing.assert_close(bias.norm_sq(), dense.flatten(1).square().sum(1))
    coef = torch.rand(5, dtype=torch.float64)
    torch.testing.assert_close(bias.weighted_sum(coef), torch.einsum("b,b...->...", coef, dense))


# ---------------------------------------------------------------------------------------------- models
def _routing_spreads(model: nn.Module, batch: dict) -> None:
    """Some expert gets rows of several examples and some example reaches several experts (first router)."""
    router = next(m for m in model.modules() if "Router" in type(m).__name__)
    seen = {}

    def record(module, args, output):  # the selected experts (N, k): output 2, or Llama 4's top scores
        seen["index"] = output[0].topk(module.top_k).indices if len(output) == 2 else output[2]

    handle = router.register_forward_hook(record)
    with torch.no_grad():
        model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    handle.remove()
    index = seen["index"].view(len(batch["input_ids"]), -1)
    weight = next(p for name, p in router.named_parameters() if name.endswith("weight"))  # Gemma 4: proj's
    experts = weight.shape[0]
    examples_per_expert = [len({int(i) for i in (index == e).nonzero()[:, 0]}) for e in range(experts)]
    assert max(examples_per_expert) > 1 and min(len(set(row.tolist())) for row in index) > 1


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("strategy,clipping,groups", SETTINGS)
def test_moe_models_match_oracle(name, strategy, clipping, groups):
    """Float64, eager experts; padded text, two micro-batches, thresholds at the median group norm."""
    torch.manual_seed(0)  # the same routing whatever ran before
    model = MODELS[name]()
    batch = _padded_text(6, 8, 40, torch.Generator().manual_seed(0))
    _routing_spreads(model, batch)
    rel = 1e-6 if name in FLOAT32_ROUTERS or name in FLOAT32_MIXERS else 1e-8
    check_clipped_step(model, lm_loss, batch, [[0, 1, 2], [3, 4, 5]], strategy, clipping, groups, rel=rel)


@pytest.mark.parametrize("name", list(NEW_MOE))
@pytest.mark.parametrize("strategy,clipping,groups", [SETTINGS[0], SETTINGS[4], SETTINGS[8]])
def test_new_moe_models_match_oracle(name, strategy, clipping, groups):
    """Stop 53's MoE families (their routers' forms and experts with their own row gates), in three
    strategy x clipping settings: bk flat, ghost per-layer, instantiate in groups; padded text, two
    micro-batches. Their routers compute in float32 (Beam's whole model is float32, see ``NEW_MOE``)."""
    torch.manual_seed(0)
    model = new_moe(name)
    batch = _padded_text(6, 8, 40, torch.Generator().manual_seed(0))
    _routing_spreads(model, batch)
    tolerance = {"rel": 2e-3, "floor": 1e-6} if NEW_MOE[name][2] else {"rel": 1e-6}
    if name in ("hy_v4", "deepseek_v4", "deepseek_v4_windows"):
        # hyper-connections in float32 (rules/hyper_connections.py), batched: the head's scale, whose gradient
        # is 1e-6 to 3e-5 here, is exact to 5e-12
        tolerance["floor"] = 1e-10
    check_clipped_step(model, lm_loss, batch, [[0, 1, 2], [3, 4, 5]], strategy, clipping, groups, **tolerance)


@pytest.mark.parametrize("strategy,clipping,groups", SETTINGS)
def test_dbrx_experts_match_oracle(strategy, clipping, groups):
    """DBRX's stacked experts, each expert's rows passed to the experts' ``mlp`` with its weight slices
    (``rules/dbrx_moe.py``), its router and attention: float64, padded text, two micro-batches, no
    fallback; some expert gets rows of several examples and every example reaches several experts."""
    from dpexp.privacy.rules import dbrx_moe

    torch.manual_seed(0)
    model = dbrx()
    experts = model.transformer.blocks[0].ffn.experts
    assert rule_for(experts).per_example_grads is dbrx_moe.dbrx_experts_grads
    batch = _padded_text(6, 8, 40, torch.Generator().manual_seed(0))
    seen = []
    handle = experts.register_forward_pre_hook(lambda m, args: seen.append(args[1].view(6, -1)))
    with torch.no_grad():
        model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    handle.remove()
    index = seen[0]
    assert max(len({int(i) for i in (index == e).nonzero()[:, 0]}) for e in range(4)) > 1
    assert min(len(set(row.tolist())) for row in index) > 1
    with warnings.catch_warnings():
        warnings.filterwarnings("error", ".*torch.func fallback")
        check_clipped_step(model, lm_loss, batch, [[0, 1, 2], [3, 4, 5]], strategy, clipping, groups)


def test_dbrx_experts_refusals():
    """Refused with the cause: a trainable parameter besides the stacked weights, an activation not known
    to act elementwise, routing that is not one row per flattened token."""
    from dpexp.privacy.rules import dbrx_moe

    model = dbrx()
    experts = model.transformer.blocks[0].ffn.experts
    experts.mlp.extra = nn.Parameter(torch.zeros(2, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"parameters \['mlp.extra'\] besides mlp.w1, mlp.v1 and mlp.w2"):
        PrivacyEngine(model, batch_size=6, sample_size=60, max_grad_norm=1.0, noise_multiplier=0.0)
    del experts.mlp.extra
    experts.mlp.activation_fn = nn.Softmax(dim=-1)  # mixes a row's features
    with pytest.raises(ValueError, match=r"DbrxExperts: .*activation"):
        PrivacyEngine(model, batch_size=6, sample_size=60, max_grad_norm=1.0, noise_multiplier=0.0)
    hidden = torch.zeros(2, 3, 16, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"needs \(B, T, d\) states with \(B\*T, k\) routing"):
        dbrx_moe.dbrx_inputs(experts, (hidden, torch.zeros(5, 2, dtype=torch.long), torch.zeros(5, 2)), {})


class _RoutedRows(nn.Module):
    """An experts module behind a routing computed from each row alone (no router parameters): row t goes
    to the experts of its k largest first E features, weighted by their softmax."""

    def __init__(self, experts: nn.Module, k: int = 2) -> None:
        super().__init__()
        self.experts, self.k = experts, k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        experts = getattr(self.experts, "total_experts", None) or self.experts.num_experts  # LongCat's too
        top, index = rows[:, :experts].detach().topk(self.k, dim=-1)
        return self.experts(rows, index, top.softmax(-1)).view(x.shape)


@pytest.mark.parametrize("qualified", moe.EAGER_EXPERTS)
def test_experts_with_their_own_row_gates_match_oracle(qualified):
    """Each experts class of :data:`moe.EAGER_EXPERTS` (Mixtral's eager forward written out again, with its
    own clamped or float32 gate) against the oracle, its weights drawn large enough that the clamps act."""
    import importlib

    module_name, _, name = qualified.rpartition(".")
    config = type("Config", (), {"num_local_experts": 4, "num_experts": 4, "hidden_size": 8})()
    config.moe_intermediate_size = 6
    config.intermediate_size, config.hidden_act = 6, "silu"
    config.swiglu_limit, config.swiglu_alpha = 0.5, 1.7  # clamps that act on these weights
    config.n_routed_experts, config.zero_expert_num = 4, 2  # LongCat-Flash's routed and identity experts
    config.expert_ffn_hidden_size = 6
    config._experts_implementation = "eager"  # read by the forward use_experts_implementation wraps
    experts = getattr(importlib.import_module(module_name), name)(config)
    torch.manual_seed(0)
    with torch.no_grad():
        for parameter in experts.parameters():
            parameter.normal_(0.0, 0.7)
    model = _RoutedRows(experts).double()
    batch = {"x": torch.randn(6, 5, 8, dtype=torch.float64)}

    def loss(m: nn.Module, b: dict) -> torch.Tensor:
        return (m(b["x"]) ** 2).sum((1, 2))

    assert rule_for(experts).per_example_grads is moe.experts_grads
    check_clipped_step(model, loss, batch, [[0, 1, 2], [3, 4, 5]], "bk", "per_layer", rel=1e-6)


@pytest.mark.parametrize("implementation", ["grouped_mm", "batched_mm"])
@pytest.mark.parametrize("name", KERNEL_MODELS)
def test_moe_models_match_oracle_under_kernels(name, implementation):
    """The kernels have no float64 on the CPU (grouped_mm): float32, where the rules' eager recomputation
    and the kernels' order of operations agree to float32 rounding."""
    model = MODELS[name]().float()
    model.set_experts_implementation(implementation)
    batch = _padded_text(6, 8, 40, torch.Generator().manual_seed(0))
    check_clipped_step(model, lm_loss, batch, [[0, 1, 2], [3, 4, 5]], "bk", "per_layer", rel=2e-3, floor=1e-6)


@pytest.mark.parametrize("name", list(MODELS))
def test_no_module_is_left_to_the_fallback(name):
    """Every module of the MoE models has a rule: GPT-OSS's attention, which owns its sinks, since stop 48;
    Jamba's Mamba mixer and Nemotron-H's Mamba-2 mixer since stop 49."""
    assert unsupported_modules(MODELS[name]()) == {}


def test_copies_of_the_mixtral_and_qwen2_moe_classes_take_their_rules():
    from transformers import OlmoeConfig, Qwen3MoeConfig
    from transformers.models.olmoe.modeling_olmoe import OlmoeExperts, OlmoeTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts, Qwen3MoeTopKRouter

    small = {"hidden_size": 8, "intermediate_size": 8, "num_experts": 4, "num_experts_per_tok": 2}
    olmoe, qwen3 = OlmoeConfig(**small), Qwen3MoeConfig(**small, moe_intermediate_size=8)
    experts_rule = rule_for(mixtral().model.layers[0].mlp.experts)
    for experts in (OlmoeExperts(olmoe), Qwen3MoeExperts(qwen3)):
        assert rule_for(experts) is experts_rule
    qwen2_router = rule_for(qwen2_moe().model.layers[0].mlp.gate)
    for router in (OlmoeTopKRouter(olmoe), Qwen3MoeTopKRouter(qwen3)):
        assert rule_for(router) is qwen2_router


@pytest.mark.parametrize("norm_topk_prob", [True, False])
@pytest.mark.parametrize("qualified", list(moe.ROUTERS))
def test_router_scores_are_the_modules(qualified, norm_topk_prob):
    """The rule's recomputation from the logits gives the module's scores exactly (float64 model: its
    softmax in float32)."""
    import importlib

    module_name, _, name = qualified.rpartition(".")
    config = type(
        "Config", (), {"num_experts_per_tok": 2, "num_local_experts": 5, "num_experts": 5, "moe_topk": 2}
    )()
    config.moe_num_experts, config.moe_norm_min = 5, 1e-12  # Aria's, ERNIE-4.5's
    config.hidden_size, config.norm_topk_prob = 6, norm_topk_prob
    config.n_group, config.topk_group, config.routed_scaling_factor = 1, 1, 2.5  # DeepSeek-V2's and V3's
    config.topk_method = "group_limited_greedy"  # DeepSeek-V2's
    config.use_expert_bias = True  # LFM2-MoE's: its block passes the bias
    config.expert_selection_fn = "sigmoid" if norm_topk_prob else "softmax"  # Cohere2-MoE's
    config.router_scaling_factor, config.scoring_func = 1.5, "sigmoid"  # HY-V3's, DeepSeek-V4's
    config.moe_router_logit_softcapping, config.output_multiplier = 2.0, 0.7  # Laguna's, Muse Spark's
    config.vocab_size = 9  # DeepSeek-V4's hash router: experts by token id
    config.n_routed_experts, config.zero_expert_num = 3, 2  # LongCat-Flash's: routed and identity experts
    router = getattr(importlib.import_module(module_name), name)(config).double()
    with torch.no_grad():
        for tensor in (*router.parameters(), *router.buffers()):  # GPT-OSS's bias, DeepSeek-V3's buffer
            if tensor.is_floating_point():
                tensor.normal_()
            else:  # the hash router's token -> experts table
                tensor.copy_(torch.stack([torch.randperm(5)[:2] for _ in range(len(tensor))]))
        x = torch.randn(11, 6, dtype=torch.float64)
        takes_bias = len(inspect.signature(router.forward).parameters) > 1  # LFM2-MoE, HY-V3, MiniMax-M2
        others = (torch.randn(5, dtype=torch.float64),) if takes_bias else ()
        if "input_ids" in inspect.signature(router.forward).parameters:
            others = (torch.randint(0, 9, (11,)),)
        form = moe.ROUTERS[qualified]
        outputs, logits_at = router(x, *others), form.logits_at  # Llama 4: (scores, logits)
        weight = router.get_parameter(form.weight)  # LongCat-Flash: its classifier's
        logits = F.linear(x, weight, router.bias if form.bias else None)
        if form.float32_logits:
            logits = F.linear(x.float(), weight.float(), router.bias.float() if form.bias else None)
        if form.logits is not None:  # Laguna's soft cap, Muse Spark's multiplier
            logits = form.logits(router, logits)
        torch.testing.assert_close(outputs[logits_at], logits.to(outputs[logits_at]))
        assert torch.equal(form.scores(router, outputs[logits_at], *others), outputs[1 - logits_at])


# ---------------------------------------------------------------------------------------------- refusals
def _engine(model: nn.Module) -> PrivacyEngine:
    return PrivacyEngine(model, batch_size=2, sample_size=10, max_grad_norm=1.0, noise_multiplier=0.0)


class Softmax(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.softmax(-1)


def _biased(model: nn.Module) -> None:
    experts = model.model.layers[0].mlp.experts
    experts.down_proj_bias = nn.Parameter(torch.zeros(4, 16, dtype=torch.float64))


def _jitter_in_training(model: nn.Module) -> None:
    model.config.router_jitter_noise = 0.1
    model.train()


def _transposed_grouped(model: nn.Module) -> None:
    model.set_experts_implementation("grouped_mm")
    model.model.layers[0].mlp.experts.is_transposed = True


def _ungated(model: nn.Module) -> None:
    model.model.layers[0].mlp.experts.has_gate = False  # Mixtral's forward gates whatever the flag says


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda m: setattr(m.model.layers[0].mlp.experts, "act_fn", Softmax()), "activation Softmax"),
        (_biased, "down_proj_bias"),
        (_jitter_in_training, "jitter"),
        (_transposed_grouped, "is_transposed"),
        (_ungated, r"has_gate\) = \(False, False, False\) is not the \(False, False, True\)"),
    ],
    ids=["activation", "bias", "jitter", "transposed", "ungated"],
)
def test_what_the_rules_cannot_reproduce_is_refused_at_construction(change, message):
    model = mixtral()
    change(model)
    with pytest.raises(ValueError, match=f"MixtralExperts.*{message}"):
        _engine(model)


@pytest.mark.parametrize("attribute,message", [("act_fn", "activation Softmax"), ("bias", "extra_bias")])
def test_what_the_llama4_rules_cannot_reproduce_is_refused_at_construction(attribute, message):
    model = llama4()
    experts = model.model.layers[0].feed_forward.experts
    if attribute == "act_fn":
        experts.act_fn = Softmax()
    else:
        experts.extra_bias = nn.Parameter(torch.zeros(4, 16, dtype=torch.float64))
    with pytest.raises(ValueError, match=f"Llama4TextExperts.*{message}"):
        _engine(model)


def test_another_experts_implementation_is_refused_at_the_call(monkeypatch):
    from transformers.integrations.moe import ExpertsInterface, batched_mm_experts_forward

    monkeypatch.setitem(ExpertsInterface._global_mapping, "custom", batched_mm_experts_forward)
    model = mixtral()
    _engine(model)
    model.config._experts_implementation = "custom"  # registered by a user, set after the engine was built
    batch = _padded_text(2, 6, 40, torch.Generator().manual_seed(0))
    with pytest.raises(
        ValueError, match=r"layer .model\.layers\.0\.mlp\.experts. .*.custom.*set_experts_impl"
    ):
        lm_loss(model, batch)
