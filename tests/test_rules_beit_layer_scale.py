"""Hugging Face BEiT's (and data2vec-vision's) layer scale ``lambda_1``, ``lambda_2``, owned by the layer and
multiplied into both residual branches before its one ``drop_path``: against the brute-force oracle in every
strategy x clipping mode (float64, two micro-batches), with drop-path on (the per-example masks of each
forward reproduced for the oracle), a frozen lambda, and the refusal of a vanishing lambda."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpexp.privacy.capture import unsupported_modules
from tests.oracle import check_clipped_step, clipped_mean, engine_update, group_norms, slice_batch

pytestmark = pytest.mark.filterwarnings("ignore:noise_multiplier=0")

MICRO = [[0, 1, 2], [3, 4, 5]]
SETTINGS = [
    (strategy, clipping, groups)
    for strategy in ("bk", "ghost", "instantiate")
    for clipping, groups in (("flat", None), ("per_layer", None), ("groups", 2))
]


class LayerNet(nn.Module):
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


def loss_fn(model: LayerNet, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(model(batch["x"]), batch["y"], reduction="none")


def _batch() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {"x": torch.randn(6, 4, 5, generator=gen, dtype=torch.float64), "y": torch.arange(6) % 3}


@pytest.mark.parametrize("kind", ["beit", "data2vec"])
def test_layers_have_a_rule(kind):
    assert unsupported_modules(LayerNet(kind)) == {}


@pytest.mark.parametrize("kind", ["beit", "data2vec"])
@pytest.mark.parametrize("strategy,clipping,groups", SETTINGS, ids=[f"{s}-{c}" for s, c, _ in SETTINGS])
def test_beit_layer_scale_matches_oracle(kind, strategy, clipping, groups):
    torch.manual_seed(0)
    model = LayerNet(kind).double()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", ".*torch.func fallback")  # the layer must not take the fallback
        check_clipped_step(model, loss_fn, _batch(), MICRO, strategy, clipping, groups)


def test_frozen_lambda_matches_oracle():
    torch.manual_seed(0)
    model = LayerNet("beit").double()
    model.layers[0].lambda_2.requires_grad_(False)
    model.layers[1].lambda_1.requires_grad_(False)
    check_clipped_step(model, loss_fn, _batch(), MICRO, "ghost", "per_layer")


@pytest.mark.parametrize("strategy", ["bk", "ghost", "instantiate"])
def test_drop_path_matches_oracle_on_the_same_masks(strategy):
    """Drop-path draws per-example masks in every forward: the engine's micro-batch forwards and the
    oracle's (per-example gradients from the same batch forward, one autograd call per example's loss) run
    under the same seeds, so they see the same masks."""
    torch.manual_seed(0)
    model = LayerNet("beit", drop_path=0.5).double().train()
    batch = {**_batch(), "seed": torch.tensor([10, 10, 10, 11, 11, 11])}

    def seeded_loss(m: nn.Module, b: dict[str, torch.Tensor]) -> torch.Tensor:
        torch.manual_seed(int(b["seed"][0]))
        return loss_fn(m, b)

    params = dict(model.named_parameters())
    grads = []
    for index in MICRO:
        losses = seeded_loss(model, slice_batch(batch, index))
        for loss in losses:
            parts = torch.autograd.grad(loss, list(params.values()), retain_graph=True)
            grads.append(dict(zip(params, parts, strict=True)))
    partition = [list(params)]  # flat clipping: one group
    norms = group_norms(grads, partition)
    thresholds = norms.median(0).values.tolist()
    clipped = norms > torch.tensor(thresholds)
    assert clipped.any() and (~clipped).any()
    expected = clipped_mean(grads, partition, thresholds, batch_size=6)
    delta, _ = engine_update(
        copy.deepcopy(model), seeded_loss, batch, MICRO, batch_size=6, strategy=strategy,
        clipping="flat", thresholds=thresholds, max_grad_norm=1.0,
    )  # fmt: skip
    dropped = [float(g["layers.0.lambda_1"].abs().sum()) == 0 for g in grads]
    assert any(dropped) and not all(dropped)  # some examples' branches were dropped, some kept
    for name, want in expected.items():
        assert (delta[name] - want).norm() < 1e-9 * want.norm() + 1e-14, name


def test_vanishing_lambda_is_refused():
    from dpexp.privacy import PrivacyEngine

    model = LayerNet("beit").double()
    with torch.no_grad():
        model.layers[1].lambda_2[3] = 0.0
    engine = PrivacyEngine(model, batch_size=6, sample_size=60, max_grad_norm=1.0, noise_multiplier=0.0)
    with pytest.raises(ValueError, match=r"BeitLayer: a layer-scale lambda_2 is below .*freeze it"):
        engine.backward(loss_fn(model, _batch()))
