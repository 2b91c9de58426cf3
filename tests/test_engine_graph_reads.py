"""Rules that read a layer's call off its autograd graph (:mod:`dpexp.privacy.rules.graph`) hook the nodes
they read. A hook that holds its node is a node -> hook -> node cycle through autograd's C++ graph: on
torchvision's Swin Python's collector never freed it (every step's graph and the capture's records of its
calls stayed alive), on ``nn.MultiheadAttention`` only when a collection ran (until stop 61: 7 MiB a step
on the ``torchvision`` suite's ViT between collections). With the collector off, nothing of a step may
outlive it."""

from __future__ import annotations

import gc

import pytest
import torch

from dpexp.privacy import PrivacyEngine, VerificationError
from dpexp.privacy.capture import Use
from tests.engine_models import _padded_text, doge, dory, hyper_connected, inkling, lm_loss, recurrent_gemma
from tests.oracle import check_clipped_step
from tests.recurrent_models import make_recurrent_case
from tests.timm_cnn_models import make_timm_case

pytestmark = pytest.mark.filterwarnings("ignore:noise_multiplier=0")


def _case(name: str):
    if name == "transformer_encoder":  # nn.MultiheadAttention: its projections and context read
        return make_recurrent_case(name)
    if name == "doge":  # its decoder layers' residual products
        return doge().train(), lm_loss, _padded_text(6, 8, 40, torch.Generator().manual_seed(0))
    model, loss_fn, batch = make_timm_case(name)  # Swin's attention: probabilities, values, dP, d[q|k|v]
    return model.train(), loss_fn, batch


@pytest.mark.parametrize("strategy", ["bk", "ghost"])
@pytest.mark.parametrize("name", ["transformer_encoder", "tv_swin", "tv_swinv2", "doge"])
def test_graph_reads_leave_nothing_of_a_step_alive(name, strategy):
    model, loss_fn, batch = _case(name)
    engine = PrivacyEngine(
        model, batch_size=6, sample_size=60, max_grad_norm=1.0, noise_multiplier=0.0, strategy=strategy
    )
    optimizer = engine.attach(torch.optim.SGD(model.parameters(), lr=0.1))

    def records_after(steps: int) -> int:
        for _ in range(steps):
            engine.backward(loss_fn(model, batch))
            optimizer.step()
            optimizer.zero_grad()
        return sum(isinstance(o, Use) for o in gc.get_objects())

    records_after(1)  # the verified first step
    gc.collect()
    gc.disable()
    try:
        settled = records_after(1)
        assert records_after(3) == settled
    finally:
        gc.enable()


@pytest.mark.parametrize("name", ["doge", "hy_v4"])
def test_a_first_layer_above_frozen_embeddings_is_read_and_exact(name):
    """The first decoder layer's input needs no gradient when the embeddings are frozen; with the engine's
    parameters released, its call would build no graph and the layer's rule (Doge's residual scales, HY-V4's
    hyper-connections) would find nothing to read. The capture anchors the input, and the step matches the
    oracle; without the anchor the layer was refused (stop 64)."""
    torch.manual_seed(0)  # the model's initialisation too: the tolerance is for its float32 parts
    model = doge() if name == "doge" else hyper_connected("hy_v4")
    model.get_input_embeddings().requires_grad_(False)
    batch = _padded_text(6, 8, 40, torch.Generator().manual_seed(0))
    # Doge's eager softmax and HY-V4's connections are float32 (test_rules_decoder_modules.py's tolerances)
    tolerance = {"rel": 1e-6, "floor": 1e-9} if name == "doge" else {"rel": 1e-5}
    check_clipped_step(model, lm_loss, batch, [[0, 1, 2], [3, 4, 5]], "bk", "per_layer", **tolerance)


REFUSED_UNDER_HOOKS = {  # a model -> its module whose rule only reads, as the refusal names it and its rule
    "doge": (doge, r"DogeDecoderLayer: .*off its autograd graph.*freeze input_"),
    "hy_v4": (lambda: hyper_connected("hy_v4"), r"HYV4Hyper\w+: the hyper-connection rule reads .*freeze"),
    "dory": (dory, r"DoryAttention: the nGPT rule reads .*hooks on saved tensors"),
    "inkling": (inkling, r"InklingRelativeLogits: the relative-logits rule reads .*freeze proj"),
    "recurrent_gemma": (recurrent_gemma, r"RecurrentGemmaRglru: the RG-LRU rule reads .*freeze the RG-LRU"),
}


@pytest.mark.parametrize("name", list(REFUSED_UNDER_HOOKS))
def test_a_rule_that_only_reads_the_graph_refuses_under_hooks_on_saved_tensors(name):
    """The nodes are found by what they keep; under hooks on saved tensors (activation checkpointing,
    offloading) nothing is read (reading would run the hooks' unpacking early), and a rule with no
    recomputation to fall back on refuses its module at the backward, naming the fix. (The rules that
    recompute instead: ``test_rules_scan_mixers.py``, ``test_rules_graph.py``.)"""
    build, match = REFUSED_UNDER_HOOKS[name]
    model = build().train()
    engine = PrivacyEngine(model, batch_size=6, sample_size=60, max_grad_norm=1.0, noise_multiplier=0.0)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        loss = lm_loss(model, _padded_text(6, 8, 40, torch.Generator().manual_seed(0)))
    with pytest.raises(ValueError, match=match):
        engine.backward(loss)


class _Gain(torch.nn.Module):
    """``y = x * w`` over (B, T, d); with ``side``, a side branch ``x * 2`` its output never uses (kept as an
    attribute, the engine's check of state carried between calls refuses it from the second call on)."""

    def __init__(self, width: int, side: bool) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.linspace(0.5, 1.5, width, dtype=torch.float64))
        self.keeps_side = side

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.keeps_side:
            self.side = x * 2
        return x * self.weight


def _gain_model(side: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), _Gain(4, side), torch.nn.Linear(4, 2)).double()


def _gain_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(batch["x"]).square().sum((1, 2))


def _registered_gain(monkeypatch, graph) -> None:
    """A rule for :class:`_Gain` on the values its ``graph`` reads (``x``, the call's input)."""
    from dpexp.privacy import rules
    from dpexp.privacy.per_example import Dense

    monkeypatch.setattr(rules, "_RULES", dict(rules._RULES))  # the registration ends with the test

    def inputs(module, args, kwargs):
        return (args[0],)

    @rules.register_rule(_Gain, call=rules.CallLayout(inputs, rules.first_output, graph=graph))
    def gain_grads(module, call, dy):
        return {"weight": Dense((dy * call[-1]["x"]).sum(1))}


def test_a_rule_that_reads_values_only_gets_its_call_with_the_outputs_gradient(monkeypatch):
    """A graph read with no node to wait for (here the input, kept as a value) is handed to the rule with
    the outputs' gradient, and the oracle agrees; before, the call waited for nodes that did not exist and
    its gradients were never formed (counted as zero: stop 66, found on Mamba-2 once the engine had
    released its parameters)."""
    from dpexp.privacy.rules.graph import GraphReads

    _registered_gain(
        monkeypatch, lambda module, call, output, boundary: GraphReads({"x": call[0].detach()}, {})
    )
    batch = {"x": torch.randn(6, 5, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1))}
    for micro in ([[0, 1, 2, 3, 4, 5]], [[0, 1, 2], [3, 4, 5]]):
        check_clipped_step(_gain_model(), _gain_loss, batch, micro, "bk", "flat")


def test_a_node_read_that_never_gets_its_gradient_is_refused(monkeypatch):
    """A rule that waits for a node no gradient reaches (here the call's unused side branch) would never
    form its gradients: the engine refuses the backward, naming the layer, instead of counting them as
    zero."""
    from dpexp.privacy.rules.graph import GraphReads

    def graph(module, call, output, boundary):
        return GraphReads({"x": call[0].detach()}, {"side": module.side.grad_fn})

    _registered_gain(monkeypatch, graph)
    model = _gain_model(side=True)
    engine = PrivacyEngine(model, batch_size=6, sample_size=60, max_grad_norm=1.0, noise_multiplier=0.0)
    optimizer = engine.attach(torch.optim.SGD(model.parameters(), lr=1.0))
    batch = {"x": torch.randn(6, 5, 3, dtype=torch.float64)}
    with pytest.raises(
        VerificationError, match=r"layers \['1'\]: their outputs got a gradient but not every node"
    ):
        engine.backward(_gain_loss(model, batch))
    with pytest.raises(VerificationError, match=r"refused this model earlier: layers \['1'\]"):
        optimizer.step()
