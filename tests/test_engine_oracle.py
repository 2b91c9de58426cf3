"""Every strategy x clipping mode equals the brute-force oracle (per-example gradients by a Python loop)."""

from __future__ import annotations

import copy

import pytest
import torch

from dpexp.privacy import PrivacyEngine
from dpexp.privacy import clipping as clipping_module
from dpexp.privacy.per_example import Outer, PerExampleGrad
from tests.engine_models import CASES, make_case
from tests.oracle import clipped_mean, engine_update, group_norms, per_example_grads

STRATEGIES = ["bk", "ghost", "instantiate"]
CLIPPINGS = [("flat", None), ("per_layer", None), ("groups", 2)]


@pytest.mark.filterwarnings("ignore:.*torch.func fallback")
def _groups_of(model, clipping, groups):
    engine = PrivacyEngine(
        copy.deepcopy(model),
        batch_size=2,
        sample_size=10,
        max_grad_norm=1.0,
        noise_multiplier=0.0,
        clipping=clipping,
        groups=groups,
    )
    return engine.groups


def _oracle_at_median(model, loss_fn, batch, clipping: str):
    """Thresholds at the median per-group norm (about half the examples clipped) and the oracle update."""
    grads = per_example_grads(model, loss_fn, batch)
    partition = _groups_of(model, clipping, None)
    thresholds = group_norms(grads, partition).median(0).values.tolist()
    size = next(iter(batch.values())).shape[0]
    return thresholds, clipped_mean(grads, partition, thresholds, batch_size=size)


def _per_layer_update_and_oracle(case: str, micro_batches: list[list[int]], **engine_kwargs):
    """Per-layer update of ``case`` (batch 4) at the oracle's median thresholds, and the oracle's."""
    model, loss_fn, batch = make_case(case, batch_size=4)
    thresholds, expected = _oracle_at_median(model, loss_fn, batch, "per_layer")
    delta, _ = engine_update(
        model,
        loss_fn,
        batch,
        micro_batches,
        batch_size=4,
        clipping="per_layer",
        thresholds=thresholds,
        max_grad_norm=1.0,
        **engine_kwargs,
    )
    return delta, expected


def _assert_matches(delta, expected, tolerance: float = 1e-5) -> None:
    for name, want in expected.items():
        err = (delta[name] - want).norm() / want.norm().clamp_min(1e-12)
        assert err < tolerance, f"{name}: relative error {err:.2e}"


@pytest.mark.filterwarnings("ignore:noise_multiplier=0", "ignore:.*torch.func fallback")
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("clipping,groups", CLIPPINGS)
def test_update_matches_oracle(case, strategy, clipping, groups):
    model, loss_fn, batch = make_case(case)
    size = next(iter(batch.values())).shape[0]
    grads = per_example_grads(model, loss_fn, batch)
    partition = _groups_of(model, clipping, groups)
    norms = group_norms(grads, partition)
    thresholds = norms.median(0).values.tolist()  # about half of the examples clipped in every group
    clipped = norms > torch.tensor(thresholds)
    assert clipped.any() and (~clipped).any()

    expected = clipped_mean(grads, partition, thresholds, batch_size=size)
    micro = [[0, 1, 2], [3, 4, 5]] if size == 6 else [list(range(size))]
    delta, _ = engine_update(
        model,
        loss_fn,
        batch,
        micro,
        batch_size=size,
        clipping=clipping,
        groups=groups,
        strategy=strategy,
        thresholds=thresholds,
        max_grad_norm=1.0,
    )
    for name, want in expected.items():
        got = delta[name]
        err = (got - want).norm() / want.norm().clamp_min(1e-12)
        assert err < 1e-5, f"{case}/{strategy}/{clipping}: {name} relative error {err:.2e}"
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    for name in frozen:
        assert torch.equal(delta[name], torch.zeros_like(delta[name])), f"frozen {name} changed"


@pytest.mark.filterwarnings("ignore:noise_multiplier=0")
@pytest.mark.parametrize("case", ["wrn_block", "gpt2", "sequence"])
@pytest.mark.parametrize("norm_mode", ["ghost", "instantiate"])
def test_forced_norm_modes_match_oracle(case, norm_mode):
    """Ghost and instantiated norms are both exact, whichever the cost rule would pick."""
    _assert_matches(*_per_layer_update_and_oracle(case, [[0, 1, 2, 3]], norm_mode=norm_mode))


def test_falcon_linear_layers_have_the_linear_rule():
    """Falcon's ``FalconLinear`` (``x @ W.T + b``) takes the linear rule by name: nothing of the model is left
    to the torch.func fallback, whose exactness on it (its output changed in place) the case above checks."""
    from dpexp.privacy.capture import unsupported_modules
    from tests.engine_models import falcon

    assert unsupported_modules(falcon()) == {}


@pytest.mark.filterwarnings("ignore:noise_multiplier=0")
def test_expected_batch_size_divides_the_sum():
    """A Poisson batch smaller than B is still divided by the expected B, never by its realized size."""
    model, loss_fn, batch = make_case("mlp", batch_size=3)
    grads = per_example_grads(model, loss_fn, batch)
    partition = _groups_of(model, "flat", None)
    expected = clipped_mean(grads, partition, [1e6], batch_size=10)  # nothing clipped
    delta, _ = engine_update(model, loss_fn, batch, [[0, 1, 2]], batch_size=10, max_grad_norm=1e6)
    for name, want in expected.items():
        torch.testing.assert_close(delta[name], want, rtol=1e-9, atol=1e-12)


def _float32_gpt2_oracle(clipping: str = "flat"):
    """A float32 GPT-2 case, the median thresholds of its group norms, and the oracle update."""
    model, loss_fn, batch = make_case("gpt2", batch_size=4)
    model = model.float()
    return model, loss_fn, batch, *_oracle_at_median(model, loss_fn, batch, clipping)


@pytest.mark.filterwarnings("ignore:noise_multiplier=0")
def test_float32_matches_oracle():
    model, loss_fn, batch, thresholds, expected = _float32_gpt2_oracle()
    delta, _ = engine_update(
        model, loss_fn, batch, [[0, 1], [2, 3]], batch_size=4, thresholds=thresholds, max_grad_norm=1.0
    )
    _assert_matches(delta, expected, tolerance=1e-4)


@pytest.mark.filterwarnings("ignore:noise_multiplier=0")
@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
def test_bfloat16_autocast_is_close_to_the_float32_oracle(clipping):
    """Under autocast the factors are bf16 (a layer's saved input may stay float32); norms are accumulated in
    float32, so clipping stays accurate, whether per-example gradients are instantiated or not."""
    model, loss_fn, batch, thresholds, expected = _float32_gpt2_oracle(clipping)

    def autocast_loss(m, b):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return loss_fn(m, b).float()

    delta, _ = engine_update(
        model,
        autocast_loss,
        batch,
        [[0, 1, 2, 3]],
        batch_size=4,
        thresholds=thresholds,
        max_grad_norm=1.0,
        clipping=clipping,
    )
    flat_got = torch.cat([delta[n].flatten() for n in expected])
    flat_want = torch.cat([w.flatten() for w in expected.values()])
    assert (flat_got - flat_want).norm() / flat_want.norm() < 3e-2


@pytest.mark.filterwarnings("ignore:noise_multiplier=0")
@pytest.mark.parametrize("case", ["wrn_block", "gpt2", "roberta", "vit"])
def test_flat_layers_kept_instantiated_match_oracle(case, monkeypatch):
    """Flat bk keeps the per-example gradients of layers where they are smaller than the layer's activation
    and output gradient, and drops those factors; the update is still exact. Tied weights (GPT-2's wte /
    lm_head, which need a cross term) are never released."""
    released = []
    real = PerExampleGrad.retain

    def spy(self, release=False, max_values=0):
        if release:
            released.append(type(self).__name__)
        return real(self, release, max_values)

    monkeypatch.setattr(PerExampleGrad, "retain", spy)
    model, loss_fn, batch = make_case(case, batch_size=4)
    thresholds, expected = _oracle_at_median(model, loss_fn, batch, "flat")
    delta, _ = engine_update(
        model, loss_fn, batch, [[0, 1], [2, 3]], batch_size=4, thresholds=thresholds, max_grad_norm=1.0
    )
    assert released, "no layer took the keep-instantiated path"
    _assert_matches(delta, expected)


@pytest.mark.filterwarnings("ignore:noise_multiplier=0")
@pytest.mark.parametrize("case", ["gpt2", "roberta", "vit"])
def test_per_layer_linear_sums_from_kept_instantiations_match_oracle(case, monkeypatch):
    """Fused per-layer bk instantiates a linear layer's per-example gradients for its norm when they fit in
    4x the layer's factors, even where the ghost norm alone would be cheaper (the clipped sum is then a
    ``tensordot`` instead of a matmul over T), and the update is still exact."""
    kept = []
    real = Outer.norm_sq

    def spy(self, mode="auto"):
        out = real(self, mode)
        if self._kept is not None and self.ghost_is_cheaper():
            kept.append(self.shape)
        return out

    monkeypatch.setattr(Outer, "norm_sq", spy)
    delta, expected = _per_layer_update_and_oracle(case, [[0, 1], [2, 3]])
    assert kept, "no layer with a cheaper ghost norm was instantiated for its fused sum"
    _assert_matches(delta, expected)


def test_instantiation_for_a_fused_sum_stays_within_the_values_budget():
    """A linear layer's per-example gradients are instantiated for a fused sum only while ``B L R`` stays
    within the budget the engine passes (its trainable parameter count); beyond it the ghost norm is used
    (e.g. an untied LM head with a large vocabulary). The norm is exact either way."""
    g, a = torch.randn(2, 2, 12), torch.randn(2, 2, 6)  # B = T = 2, L = 12, R = 6: the ghost norm is cheaper
    expected = torch.einsum("btl,btr->blr", g, a).flatten(1).pow(2).sum(1)
    within, beyond = Outer(g, a, torch.Size([12, 6]), 12), Outer(g, a, torch.Size([12, 6]), 12)
    within.retain(max_values=2 * 12 * 6)
    beyond.retain(max_values=2 * 12 * 6 - 1)
    for grad in (within, beyond):
        torch.testing.assert_close(grad.norm_sq(), expected, rtol=1e-5, atol=0)
    assert within._kept is not None and beyond._kept is None
    c = torch.tensor([0.5, 1.0])
    torch.testing.assert_close(within.weighted_sum(c), beyond.weighted_sum(c), rtol=1e-5, atol=1e-6)


class _LongSequence(torch.nn.Module):
    """Three 300 x 300 linear layers over T = 128 tokens: per-example gradients (90k values) larger than the
    factors (T (L + R) = 77k), and instantiating them cheaper than the ghost norm (T^2 (L + R) = 9.8M >
    100 L R), so flat bk keeps them."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = (torch.nn.Linear(300, 300) for _ in range(3))

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x))))).tanh().mean((1, 2))


def test_ghost_or_kept_instantiation_by_cost():
    """An untied 768 x 50257 LM head at T = 100 takes the ghost norm (writing its 38.6M values per example
    costs more than the Gram), a 768 x 3072 layer at T = 512 is kept instantiated, so is a 256 x 1024 one
    (its per-example gradient stays in cache) at T = 128; smaller than the factors (a narrow layer over a
    long sequence) is always kept."""

    def extra(t, left, right):
        return Outer(
            torch.zeros(1, t, left), torch.zeros(1, t, right), torch.Size([left, right]), left
        ).held_extra_values()

    assert extra(100, 768, 50257) is None
    assert extra(100, 768, 3072) is None
    assert extra(512, 768, 3072) > 0
    assert extra(128, 256, 1024) > 0
    assert extra(64, 4, 8) < 0


@pytest.mark.filterwarnings("ignore:noise_multiplier=0")
def test_flat_keeps_larger_linear_instantiations_within_the_budget(monkeypatch):
    """Flat bk also keeps linear layers' per-example gradients that are larger than their factors where that
    is faster, as long as the extra values of one backward pass stay within one parameter-sized tensor; the
    update is exact."""
    extras = []
    real = PerExampleGrad.retain

    def spy(self, release=False, max_values=0):
        if release:
            extras.append(self.held_extra_values())
        return real(self, release, max_values)

    monkeypatch.setattr(PerExampleGrad, "retain", spy)
    torch.manual_seed(0)
    model = _LongSequence().double()
    batch = {"x": torch.randn(4, 128, 300, dtype=torch.float64)}

    def loss_fn(m, b):
        return m(b["x"])

    n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    thresholds, expected = _oracle_at_median(model, loss_fn, batch, "flat")
    delta, _ = engine_update(
        model, loss_fn, batch, [[0, 1, 2, 3]], batch_size=4, thresholds=thresholds, max_grad_norm=1.0
    )
    larger = [e for e in extras if e > 0]
    assert len(larger) == 2, "both layers before the input layer (where the flat group completes) are kept"
    assert sum(larger) <= n_trainable
    _assert_matches(delta, expected)

    # with a budget of only the largest extra, one layer is kept and the budget holds; still exact
    budget = max(larger)
    monkeypatch.setattr(
        clipping_module.BookKeeping, "retention_budget", lambda self: clipping_module.RetentionBudget(budget)
    )
    extras.clear()
    delta, _ = engine_update(
        model, loss_fn, batch, [[0, 1, 2, 3]], batch_size=4, thresholds=thresholds, max_grad_norm=1.0
    )
    constrained = [e for e in extras if e > 0]
    assert sum(constrained) <= budget and len(constrained) == 1
    _assert_matches(delta, expected)


@pytest.mark.filterwarnings("ignore:noise_multiplier=0")
@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
def test_explicit_per_example_gradients_are_clipped_like_examples(clipping):
    """Examples given by their gradients (the audit's Dirac canaries) are clipped per group with the engine's
    thresholds and summed: a coordinate of value v becomes v * min(1, C_k / |v|)."""
    from dpexp.privacy.per_example import OneHot

    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2)).double()
    engine = PrivacyEngine(
        model, batch_size=4, sample_size=40, max_grad_norm=2.0, noise_multiplier=0.0, clipping=clipping
    )
    optimizer = engine.attach(torch.optim.SGD(model.parameters(), lr=1.0))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    index = torch.tensor([0, 5, 5])
    value = torch.tensor([10.0, 0.5, -3.0], dtype=torch.float64)
    engine.add_per_example_gradients({"0.weight": OneHot(index, value, model[0].weight.shape)})
    optimizer.step()
    threshold = float(engine.thresholds[0])
    clipped = value * (threshold / value.abs()).clamp(max=1.0)
    expected = torch.zeros(12, dtype=torch.float64).index_add_(0, index, clipped).view(4, 3) / 4
    torch.testing.assert_close(before["0.weight"] - model[0].weight.detach(), expected)
    for name in ("0.bias", "1.weight", "1.bias"):
        assert torch.equal(before[name], dict(model.named_parameters())[name].detach())
