"""Bad input is refused loudly, before training, with a message that names the problem."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from torch import nn

from dpexp.privacy import PrivacyEngine


def _engine(model, **kwargs):
    defaults = {"batch_size": 4, "sample_size": 40, "max_grad_norm": 1.0, "noise_multiplier": 1.0}
    return PrivacyEngine(model, **{**defaults, **kwargs})


class WithOwnParameter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(3))
        self.fc = nn.Linear(3, 3)

    def forward(self, x):
        return self.fc(x * self.scale)


class TupleOutput(nn.Module):
    """A module of its own (no rule) returning a tuple, as a cell or an attention layer does."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))

    def forward(self, x):
        return x * self.scale, x


def test_unsupported_module_is_named_when_the_fallback_is_off():
    with pytest.raises(ValueError, match=r"'' of type WithOwnParameter .*\['scale'\]"):
        _engine(WithOwnParameter(), generic_fallback=False)
    with pytest.raises(ValueError, match=r"'1' of type TupleOutput"):
        _engine(nn.Sequential(nn.Linear(4, 4), TupleOutput()), generic_fallback=False)


class DictOutput(TupleOutput):
    def forward(self, x):
        return {"scaled": x * self.scale}


def test_fallback_module_with_an_output_neither_tensor_nor_tuple_is_refused_at_the_first_forward():
    """A tuple of tensors is taken whole by the fallback (tests/engine_models.TupleOutputNet); a mapping is
    not."""
    model = nn.Sequential(nn.Linear(4, 4), DictOutput())
    with pytest.warns(UserWarning, match="torch.func fallback"):
        _engine(model)
    with pytest.raises(TypeError, match=r"DictOutput.*returned dict.*a tuple of them"):
        model[1](torch.randn(2, 4))


class TopIndices(TupleOutput):
    """Scores by its own parameter, returning only which features score highest (a sparse attention's
    indexer): no gradient reaches the parameter through the indices."""

    def forward(self, x):
        return (x * self.scale).topk(2, dim=-1).indices


def test_a_layer_returning_indices_is_refused_at_the_first_forward_naming_its_parameters():
    model = nn.Sequential(nn.Linear(4, 4), TopIndices())
    with pytest.warns(UserWarning, match="torch.func fallback"):
        _engine(model)
    with pytest.raises(TypeError, match=r"TopIndices\) returned a torch.int64 tensor.*\['scale'\]; freeze"):
        model(torch.randn(2, 4))


def test_fallback_refuses_dropout():
    class Dropping(WithOwnParameter):
        def __init__(self) -> None:
            super().__init__()
            self.drop = nn.Dropout(0.1)

    with pytest.raises(ValueError, match=r"deterministic forward.*dropout"):
        _engine(Dropping())


def test_frozen_unsupported_module_is_fine():
    model = WithOwnParameter()
    model.scale.requires_grad_(False)
    engine = _engine(model)
    assert set(engine.trainable_parameters()) == {"fc.weight", "fc.bias"}


@pytest.mark.parametrize("norm", [nn.BatchNorm1d(4), nn.BatchNorm2d(4), nn.SyncBatchNorm(4)])
def test_batchnorm_is_always_an_error(norm):
    for p in norm.parameters():
        p.requires_grad_(False)  # even frozen: batch statistics mix examples
    with pytest.raises(ValueError, match="mixes examples"):
        _engine(nn.Sequential(nn.Linear(4, 4), norm))


def test_loss_must_be_one_dimensional():
    model = nn.Linear(3, 2)
    engine = _engine(model)
    with pytest.raises(ValueError, match="1-D tensor with one loss per example"):
        engine.backward(model(torch.randn(4, 3)).sum())
    with pytest.raises(ValueError, match="1-D tensor"):
        engine.backward(model(torch.randn(4, 3)))


def test_groups_must_partition_the_parameters():
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2))
    names = ["0.weight", "0.bias", "1.weight", "1.bias"]
    with pytest.raises(ValueError, match="in no group"):
        _engine(model, clipping="groups", groups=[names[:2], names[2:3]])
    with pytest.raises(ValueError, match="is in groups 0 and 1"):
        _engine(model, clipping="groups", groups=[names[:3], names[2:]])
    with pytest.raises(ValueError, match="not a trainable parameter"):
        _engine(model, clipping="groups", groups=[names, ["2.weight"]])
    with pytest.raises(ValueError, match="contiguous"):
        _engine(model, clipping="groups", groups=5)
    with pytest.raises(ValueError, match="need 2 positive thresholds"):
        _engine(model, clipping="per_layer", thresholds=[1.0])


def test_contiguous_stages_cover_every_parameter_once():
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(5)])
    engine = _engine(model, clipping="groups", groups=3)
    flat = [n for g in engine.groups for n in g]
    assert len(engine.groups) == 3 and all(engine.groups)
    assert flat == [n for n, _ in model.named_parameters()]


def test_plain_loss_backward_is_refused():
    model = nn.Linear(3, 2)
    _engine(model)
    with pytest.raises(RuntimeError, match=r"engine.backward\(per_example_loss\)"):
        model(torch.randn(4, 3)).sum().backward()


def test_broadcast_input_to_a_linear_layer_is_refused():
    class Broadcasting(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bias_net = nn.Linear(3, 3)
            self.register_buffer("const", torch.ones(1, 3))

        def forward(self, x):
            return x + self.bias_net(self.const)  # (1, 3) broadcast: the gradient is summed over the batch

    model = Broadcasting()
    engine = _engine(model)
    with pytest.raises(RuntimeError, match="broadcast over the batch"):
        engine.backward(model(torch.randn(4, 3)).sum(1))


def test_in_place_modification_of_a_saved_input_is_refused():
    class InPlace(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(3, 3)

        def forward(self, x):
            h = x * 2
            out = self.fc(h)
            h.mul_(3)  # changes the activation the per-example gradient needs
            return out + h.detach()

    model = InPlace()
    engine = _engine(model)
    with pytest.raises(RuntimeError, match="modified in place"):
        engine.backward(model(torch.randn(4, 3)).sum(1))


def test_impossible_settings():
    with pytest.raises(ValueError, match="exceeds the data set size"):
        _engine(nn.Linear(2, 2), batch_size=50)
    with pytest.raises(ValueError, match="unknown clipping strategy 'fast'"):
        _engine(nn.Linear(2, 2), strategy="fast")
    with pytest.raises(ValueError, match="noise_multiplier must be >= 0"):
        _engine(nn.Linear(2, 2), noise_multiplier=-1.0)


def test_secure_mode_refuses_a_seeded_generator():
    with pytest.raises(ValueError, match=r"secure_mode=True .*never from a seed: pass generator=None"):
        _engine(nn.Linear(2, 2), secure_mode=True, generator=torch.Generator().manual_seed(0))


def test_optimizer_must_cover_exactly_the_private_parameters():
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2))
    engine = _engine(model)
    with pytest.raises(ValueError, match="does not update"):
        engine.attach(torch.optim.SGD(model[0].parameters(), lr=0.1))


def test_detach_restores_the_model():
    model = nn.Linear(3, 2)
    engine = _engine(model)
    assert not model.weight.requires_grad
    engine.detach()
    assert model.weight.requires_grad
    model(torch.randn(2, 3)).sum().backward()
    assert model.weight.grad is not None


class BatchCentred(WithOwnParameter):
    """Subtracts the batch mean of its scaled input: no choice of per-example inputs reproduces it."""

    def forward(self, x):
        h = x * self.scale
        return self.fc(h - h.mean(0))


class InPairs(WithOwnParameter):
    """Scales each example by its partner's norm (rows 0-1, 2-3, ...): one example alone cannot be run."""

    def forward(self, x):
        h = x * self.scale
        pairs = h.reshape(-1, 2, h.shape[-1])
        return self.fc((pairs * pairs.flip(1).norm(dim=-1, keepdim=True)).reshape(h.shape))


@pytest.mark.parametrize(
    "model,match",
    [
        (
            BatchCentred,
            r"\(BatchCentred\) .*no choice .*: the closest choice missed its output by \d\.\de[+-]\d+ of its "
            r"largest value, where torch.float64 rounding allows 1e-09: .*mixes examples",
        ),
        (InPairs, r"\(InPairs\) .*no choice .*: no choice that ran gave outputs of the shapes it returned"),
    ],
    ids=["mixes_examples", "not_per_example"],
)
def test_the_fallback_search_says_why_no_choice_reproduced_the_module(model, match):
    """The fallback's message states what its search saw: how far the closest choice was from the recorded
    output (rounding, or a forward that is not per example), or the error that stopped every choice."""
    module = model().double()
    engine = _engine(module, noise_multiplier=0.0)
    with pytest.raises(RuntimeError, match=match):
        engine.backward(module(torch.randn(4, 3, dtype=torch.float64)).pow(2).sum(1))


class KeepsState(WithOwnParameter):
    """Keeps a state from its call and adds it in the next unless its owner resets it first (RecurrentGemma's
    RG-LRU and its temporal block)."""

    def __init__(self) -> None:
        super().__init__()
        self.state = None

    def forward(self, x):
        h = x * self.scale if self.state is None else x * self.scale + self.state
        self.state = h[:, :1].detach()
        return self.fc(h)


class ResetsState(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = KeepsState()

    def forward(self, x):
        self.inner.state = None
        return self.inner(x)


@pytest.mark.parametrize("strategy,clipping", [("bk", "flat"), ("instantiate", "per_layer")])
def test_the_fallback_recomputes_a_module_with_its_attributes_as_at_the_call(strategy, clipping):
    """The module's last call left ``state``, of the batch's rows; its owner resets it before each call. The
    fallback recomputes it with ``state`` as it was at the call (None), not as the call left it."""
    from tests.oracle import check_clipped_step

    model = nn.Sequential(nn.Linear(3, 3), ResetsState()).double()
    batch = {"x": torch.randn(6, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))}

    def loss(m, b):
        return m(b["x"]).pow(2).sum(1)

    check_clipped_step(model, loss, batch, [[0, 1, 2], [3, 4, 5]], strategy, clipping)


def test_the_fallback_search_names_the_error_that_stopped_every_choice(monkeypatch):
    from dpexp.privacy.rules import functional

    def fails(*args):
        raise RuntimeError("no forward for this call")

    monkeypatch.setattr(functional, "_vmapped", fails)
    monkeypatch.setattr(functional, "_looped", fails)
    module = WithOwnParameter().double()
    engine = _engine(module, noise_multiplier=0.0)
    match = r"failed for every choice \(RuntimeError: no forward for this call\)"
    with pytest.raises(RuntimeError, match=match):
        engine.backward(module(torch.randn(4, 3, dtype=torch.float64)).pow(2).sum(1))


class ThroughNumPy(WithOwnParameter):
    """Takes the sign of its input through NumPy, example by example: torch.func cannot run it."""

    def forward(self, x):
        return self.fc(x * self.scale * torch.from_numpy(np.sign(x.detach().numpy())))


@pytest.mark.parametrize(
    "strategy,clipping", [("bk", "flat"), ("ghost", "per_layer"), ("instantiate", "flat")]
)
def test_a_forward_torch_func_cannot_run_is_taken_one_example_at_a_time(strategy, clipping):
    """The fallback runs such a module one example at a time with plain autograd, and says so once."""
    from tests.oracle import check_clipped_step

    model = nn.Sequential(nn.Linear(3, 3), ThroughNumPy()).double()
    batch = {"x": torch.randn(6, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))}

    def loss(m, b):
        return m(b["x"]).pow(2).sum(1)

    with pytest.warns(
        UserWarning, match=r"\(ThroughNumPy\): torch.func cannot run its forward .*one example at"
    ):
        check_clipped_step(model, loss, batch, [[0, 1, 2], [3, 4, 5]], strategy, clipping)


@pytest.mark.parametrize(
    "strategy,clipping", [("bk", "flat"), ("ghost", "per_layer"), ("instantiate", "groups")]
)
def test_recurrent_gemma_without_its_rule_takes_the_fallback_as_called(strategy, clipping, monkeypatch):
    """Refused before stop 55: the RG-LRU's recomputation read the states its call had left. Its rule
    (``rules/rg_lru.py``, stop 65) removed, the fallback recomputes it one example at a time with its
    ``recurrent_states`` as at the call."""
    from dpexp.privacy import rules
    from dpexp.privacy.rules.rg_lru import _RGLRU
    from tests.engine_models import lm_loss, padded_lm_batch, recurrent_gemma
    from tests.oracle import check_clipped_step

    monkeypatch.delitem(rules._RULES, _RGLRU)
    torch.manual_seed(0)
    groups = 2 if clipping == "groups" else None
    with pytest.warns(UserWarning, match=r"RecurrentGemmaRglru\): torch.func cannot run its forward"):
        check_clipped_step(
            recurrent_gemma(),
            lm_loss,
            padded_lm_batch(),
            [[0, 1, 2], [3, 4, 5]],
            strategy,
            clipping,
            groups,
            rel=1e-6,
            floor=1e-9,
        )


class ScaledByTable(WithOwnParameter):
    """Scales its output by the sum of a table shared by all examples, read as a Python number."""

    def forward(self, x, table):
        return self.fc(x * self.scale) * float(table.sum())


class PassesTable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = ScaledByTable()
        self.register_buffer("table", torch.rand(3, 3, generator=torch.Generator().manual_seed(1)))

    def forward(self, x):
        return self.inner(x, self.table)


def test_a_choice_torch_func_cannot_run_does_not_make_the_module_run_one_example_at_a_time():
    """With the table taken per example, torch.func cannot read it as a number (the loop can, and misses
    the output); taken whole, torch.func runs the module. That choice is found: no loop, no warning."""
    from tests.oracle import check_clipped_step

    model = PassesTable().double()
    batch = {"x": torch.randn(6, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))}

    def loss(m, b):
        return m(b["x"]).pow(2).sum(1)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_clipped_step(model, loss, batch, [[0, 1, 2], [3, 4, 5]], "bk", "flat")
    assert not [w for w in caught if "cannot run its forward" in str(w.message)]
