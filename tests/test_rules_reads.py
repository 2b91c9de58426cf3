"""Modules whose forward reads a submodule's parameters instead of calling it (``register_reads``): the
fallback covers them with the module's own, a read left undeclared or made elsewhere is refused, and a
declaration that contradicts a rule is refused at construction. The oracle and sensitivity cases
(``causal_mixer`` in ``tests/engine_models.py``) and Zamba's mixer below check exactness."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dpexp.privacy import PrivacyEngine
from dpexp.privacy.capture import unsupported_modules
from dpexp.privacy.rules import register_reads
from dpexp.privacy.verification import VerificationError
from tests.engine_models import (
    CausalMixer,
    CausalMixerNet,
    lfm2,
    lm_loss,
    make_case,
    qwen3_5,
    sequence_loss,
    zamba,
)
from tests.oracle import clipped_mean, engine_update, group_norms, per_example_grads

pytestmark = pytest.mark.filterwarnings("ignore:noise_multiplier=0", "ignore:.*torch.func fallback")


class UndeclaredMixer(CausalMixer):
    """The same forward as :class:`CausalMixer`, but a type without the declaration (lookup is by type)."""


class ReadAgain(CausalMixerNet):
    """:class:`CausalMixerNet` whose own forward also reads the mixer's convolution weight: a use outside
    the declared reader's calls."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.mixer(self.embed(ids))
        return self.out(self.norm(h)) * (1 + self.mixer.conv.weight.sum())


def _step(model: nn.Module, batch: dict) -> None:
    engine_update(model, sequence_loss, batch, [[0, 1, 2]], batch_size=3, max_grad_norm=1.0)


def _batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(1, 11, (3, 7), generator=torch.Generator().manual_seed(0))
    ids[:, -2:] = 0
    return {"ids": ids}


def test_the_reading_module_takes_the_parameters_it_reads():
    """The mixer, which owns no parameter, is the fallback layer of ``conv`` and ``gate``; they are no
    layers of their own."""
    assert unsupported_modules(CausalMixerNet()) == {
        "tests.engine_models.CausalMixer": ["conv.bias", "conv.weight", "gate.bias", "gate.weight"]
    }


def test_an_undeclared_read_is_refused_naming_the_parameter():
    model = CausalMixerNet().double()
    model.mixer = UndeclaredMixer().double()
    with pytest.raises(VerificationError, match=r"mixer\.conv\.weight.*used outside"):
        _step(model, _batch())


def test_a_read_outside_the_declared_reader_is_refused():
    with pytest.raises(VerificationError, match=r"mixer\.conv\.weight"):
        _step(ReadAgain().double(), _batch())


def test_a_declaration_on_a_type_with_a_rule_is_refused():
    class ReadingLinear(nn.Linear):
        pass

    from dpexp.privacy.rules import register_rule
    from dpexp.privacy.rules.linear import linear_grads

    register_rule(ReadingLinear)(linear_grads)
    register_reads(ReadingLinear, "extra")
    model = nn.Sequential(ReadingLinear(3, 3))
    with pytest.raises(ValueError, match=r"has a rule and is also declared to read.*remove one"):
        PrivacyEngine(model, batch_size=2, sample_size=10, max_grad_norm=1.0, noise_multiplier=1.0)


@pytest.mark.parametrize("build", [zamba, lfm2, qwen3_5])
def test_hybrid_with_one_padded_example_across_micro_batches_matches_oracle(build):
    """Zamba's mixer (a rule since stop 52, the fallback before), LFM2's short convolution (a rule since stop
    50) and Qwen3.5's gated delta net (a rule since stop 49) get the attention mask only where an example is
    padded (None otherwise): with example 0 the only padded one, the second micro-batch passes None (the same
    verified path: a rule-less layer's path counts its floating-point inputs, a rule's call keeps the mask out
    of its tuple), and check 4's replay, which replaces example 0, passes None too (its arguments are compared
    where both calls have a tensor)."""
    model = build()
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 40, (4, 8), generator=gen)
    mask = torch.ones(4, 8, dtype=torch.long)
    mask[0, -3:] = 0
    ids = ids.masked_fill(mask == 0, 1)
    batch = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
    grads = per_example_grads(model, lm_loss, batch)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    thresholds = group_norms(grads, [names]).median(0).values.tolist()
    expected = clipped_mean(grads, [names], thresholds, batch_size=4)
    delta, _ = engine_update(
        model, lm_loss, batch, [[0, 1], [2, 3]], batch_size=4, thresholds=thresholds, max_grad_norm=1.0
    )
    whole = torch.cat([want.flatten() for want in expected.values()]).norm()
    for name, want in expected.items():  # Zamba's mixer's updates are 1e-15 of the whole: rounding floor
        err = (delta[name] - want).norm()
        assert err < 1e-5 * want.norm() + 1e-12 * whole, f"{name}: error {err:.2e} of {want.norm():.2e}"


def test_the_fallback_gradient_of_a_read_weight_is_the_per_example_gradient():
    """The mixer's per-example gradients of ``conv.weight`` (read only) and ``gate.weight`` (called and read)
    against autograd on each example alone, without clipping."""
    model, loss, batch = make_case("causal_mixer", batch_size=3)
    grads = per_example_grads(model, loss, batch)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    expected = clipped_mean(grads, [names], [1e9], batch_size=3)
    delta, _ = engine_update(model, loss, batch, [[0, 1, 2]], batch_size=3, max_grad_norm=1e9)
    for name in ("mixer.conv.weight", "mixer.gate.weight"):
        torch.testing.assert_close(delta[name], expected[name], rtol=1e-9, atol=1e-12)
