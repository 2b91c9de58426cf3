"""A call layout's ``keeps`` (``dpexp.privacy.rules.CallLayout``): the capture keeps what a module's
submodules receive or return during its training call and hands the rule exactly that call's values, a call
at a time."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dpexp.privacy.per_example import Dense
from dpexp.privacy.rules import CallLayout, first_output, register_rule
from tests.oracle import check_clipped_step

pytestmark = pytest.mark.filterwarnings("ignore:noise_multiplier=0")


class _ScaledProjection(nn.Module):
    """``proj(x) * scale``: ``scale`` (d,) is the module's own parameter, ``proj`` a layer of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) * self.scale


class _TwoCalls(nn.Module):
    """The same module called twice per forward, on different inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.block = _ScaledProjection()
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(torch.tanh(self.block(x)))).squeeze(-1)


SEEN: list[tuple[torch.Tensor, torch.Tensor]] = []  # (kept proj output, the call's input) per rule call


def _inputs(module: nn.Module, args: tuple, kwargs: dict) -> tuple:
    return (args[0],)


@register_rule(
    _ScaledProjection,
    call=CallLayout(_inputs, first_output, keeps=lambda module: {"h": ("proj", "output")}),
)
def _scale_grads(module: nn.Module, call: tuple, dy: torch.Tensor) -> dict[str, Dense]:
    """``d scale = sum_t dy_t * h_t`` with ``h = proj(x)`` as kept in the call (B, T, d)."""
    x, kept = call
    (h,) = kept["h"]
    SEEN.append((h.detach(), x.detach()))
    return {"scale": Dense((dy * h).sum(1))}


def _loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return (model(batch["x"]) - batch["y"]).square().sum(1)


def _batch() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "x": torch.randn(6, 5, 4, generator=gen, dtype=torch.float64),
        "y": torch.randn(6, 5, generator=gen, dtype=torch.float64),
    }


@pytest.mark.parametrize(
    "strategy,clipping", [("bk", "flat"), ("ghost", "per_layer"), ("instantiate", "flat")]
)
def test_a_rule_that_reads_kept_values_matches_oracle(strategy, clipping):
    torch.manual_seed(0)
    check_clipped_step(_TwoCalls().double(), _loss, _batch(), [[0, 1, 2], [3, 4, 5]], strategy, clipping)


def test_each_call_hands_the_rule_its_own_values():
    from dpexp.privacy import PrivacyEngine

    torch.manual_seed(0)
    model = _TwoCalls().double()
    engine = PrivacyEngine(model, batch_size=6, sample_size=60, max_grad_norm=1.0, noise_multiplier=0.0)
    batch = _batch()
    with torch.no_grad():  # an evaluation forward first: not recorded, nothing of it reaches the rule
        model(batch["x"] + 1)
    SEEN.clear()
    engine.backward(_loss(model, batch))
    assert len(SEEN) >= 2  # both calls (the verification's first step may run the rule once more)
    for h, x in SEEN:  # the kept output is proj's of the same call's input
        assert torch.allclose(h, model.block.proj(x).detach())
    inputs = {x.data_ptr() for _, x in SEEN}
    assert len(inputs) == 2  # the two calls, each with its own input
