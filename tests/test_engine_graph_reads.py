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

from dpexp.privacy import PrivacyEngine
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
