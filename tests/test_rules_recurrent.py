"""``nn.LSTM``/``GRU``/``RNN``, their cells and ``nn.MultiheadAttention`` (``nn.TransformerEncoderLayer``)
rules against the brute-force oracle in every strategy x clipping mode, and what they refuse: layouts the
probe must reject, unbatched and packed inputs, dropout the recomputation cannot replay, a wrong rule
(check 2)."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence

from dpexp.privacy import PrivacyEngine, rules
from dpexp.privacy.capture import unsupported_modules
from dpexp.privacy.per_example import Dense
from dpexp.privacy.rules import attention
from dpexp.privacy.verification import VerificationError
from tests.oracle import clipped_mean, engine_update, group_norms, per_example_grads
from tests.recurrent_models import MODELS, RecurrentNet, make_recurrent_case

pytestmark = pytest.mark.filterwarnings("ignore:noise_multiplier=0")

SETTINGS = [
    (strategy, clipping, groups)
    for strategy in ("bk", "ghost", "instantiate")
    for clipping, groups in (("flat", None), ("per_layer", None), ("groups", 2))
]
# every model in one setting by default (cycling through the 9), the full product marked slow
DEFAULT = [pytest.param(name, *SETTINGS[i % len(SETTINGS)], id=name) for i, name in enumerate(MODELS)]
EVERYWHERE = [
    pytest.param(name, *setting, marks=pytest.mark.slow, id=f"{name}-{'-'.join(map(str, setting))}")
    for name in MODELS
    for setting in SETTINGS
]


def _engine(model, **kwargs) -> PrivacyEngine:
    return PrivacyEngine(
        model, batch_size=6, sample_size=60, max_grad_norm=1.0, noise_multiplier=0.0, **kwargs
    )


def _check_against_oracle(model, loss_fn, batch, strategy="bk", clipping="flat", groups=None, micro=None):
    size = batch["ids"].shape[0]
    grads = per_example_grads(model, loss_fn, batch)
    engine = _engine(copy.deepcopy(model), clipping=clipping, groups=groups)
    partition = engine.groups
    engine.detach()
    norms = group_norms(grads, partition)
    thresholds = norms.median(0).values.tolist()  # about half of the examples clipped in every group
    clipped = norms > torch.tensor(thresholds)
    assert clipped.any() and (~clipped).any()
    expected = clipped_mean(grads, partition, thresholds, batch_size=size)
    delta, _ = engine_update(
        model, loss_fn, batch, micro or [[0, 1, 2], [3, 4, 5]], batch_size=size, strategy=strategy,
        clipping=clipping, groups=groups, thresholds=thresholds, max_grad_norm=1.0,
    )  # fmt: skip
    for name, want in expected.items():
        torch.testing.assert_close(delta[name], want, rtol=1e-7, atol=1e-10, msg=name)


@pytest.mark.parametrize("name,strategy,clipping,groups", DEFAULT)
def test_rule_matches_oracle(name, strategy, clipping, groups, recwarn):
    _check_against_oracle(*make_recurrent_case(name), strategy, clipping, groups)
    assert not [w for w in recwarn if "fallback" in str(w.message)]


@pytest.mark.parametrize("name,strategy,clipping,groups", EVERYWHERE)
def test_rule_matches_oracle_everywhere(name, strategy, clipping, groups):
    _check_against_oracle(*make_recurrent_case(name), strategy, clipping, groups)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="PyTorch's fused cell kernels are CUDA-only")
@pytest.mark.parametrize(
    "name",
    ["lstm_time_major_bidirectional_2_layers", "lstm_projected_initial_state", "gru_bidirectional_2_layers"],
)
def test_fused_cells_on_cuda_match_oracle(name):
    """On CUDA the rule's gate arithmetic is PyTorch's fused LSTM / GRU cell kernels (``rules/recurrent.py``
    ``_step``), exact like the composite form (on the GPU machine, also ``scripts/device_oracle.py``: stop
    60's 264 recurrent checks there)."""
    model, loss_fn, batch = make_recurrent_case(name)
    batch = {k: v.cuda() for k, v in batch.items()}
    _check_against_oracle(model.cuda(), loss_fn, batch, "ghost", "per_layer")


@pytest.mark.parametrize(
    "name",
    [
        "lstm_time_major_bidirectional_2_layers",
        "mha_time_major_self",
        "transformer_encoder_time_major",
        "transformer_seq2seq_time_major",
    ],
)
def test_time_major_with_length_equal_to_batch_is_exact(name):
    """The batch dimension comes from ``batch_first``, not from sizes: T == B changes nothing."""
    _check_against_oracle(*make_recurrent_case(name, length=6), micro=[[0, 1, 2, 3, 4, 5]])


def test_multihead_attention_covers_its_out_proj():
    """``out_proj`` is never called by its parent: its parameters are the attention rule's, no layer of their
    own (which would be refused as never used), and no module is left to the fallback."""
    model, _, _ = make_recurrent_case("transformer_encoder")
    assert unsupported_modules(model) == {}
    engine = _engine(model, clipping="per_layer")
    groups = {tuple(g) for g in engine.groups}
    assert ("encoder.self_attn.in_proj_weight", "encoder.self_attn.in_proj_bias",
            "encoder.self_attn.out_proj.weight", "encoder.self_attn.out_proj.bias") in groups  # fmt: skip


@pytest.mark.parametrize(
    "name,reads",
    [
        ("transformer_encoder", 4),  # one attention, 2 micro-batches x 2 passes (ghost)
        ("transformer_encoder_time_major", 4),
        ("transformer_encoder_norm_first_causal", 4),
        ("transformer_seq2seq_time_major", 12),  # two self-attentions and the decoder's cross-attention
        ("transformer_encoder_shared_twice", 8),  # one layer called twice: two uses, each its own graph
        ("mha_cross_packed_no_weights_time_major", 4),  # the key is the value: q and kv projections
        ("mha_cross_distinct_no_weights", 4),  # three tensors: in_proj_weight in three
        ("mha_cross_kdim_distinct_no_weights", 4),  # kdim = vdim = 6: three weights
        ("mha_self_weights", 4),  # the weights returned (and in the loss): the context from their bmm
        ("mha_cross_packed_no_bias", 4),  # weights returned by default, an attention mask
        ("mha_time_major_self", 4),
        ("mha_cross_kdim_bias_kv_zero_attn", 0),  # bias_k and zero attention: recomputed
    ],
)
def test_attention_is_read_off_the_graph_and_equals_the_recomputation(name, reads, monkeypatch):
    """The context and the projections' output gradients come from the call's autograd graph, on the
    verified micro-batch (whose parameters require gradients) and the next (whose do not), in every form
    of the projections, with the weights returned or not; every read gives the recomputation's
    per-example gradients, and the update is the oracle's. ``bias_k`` and zero attention recompute."""
    rule = rules.rule_for(nn.MultiheadAttention(4, 2))
    seen = []

    def compared(module, x, dy):
        grads = rule.per_example_grads(module, x, dy)
        if len(x) > 8:
            for key, want in rule.per_example_grads(module, x[:8], dy).items():
                torch.testing.assert_close(grads[key].instantiate(), want.instantiate(), msg=key)
            seen.append(module)
        return grads

    key = f"{nn.MultiheadAttention.__module__}.{nn.MultiheadAttention.__qualname__}"
    monkeypatch.setitem(rules._RULES, key, dataclasses.replace(rule, per_example_grads=compared))
    _check_against_oracle(*make_recurrent_case(name), "ghost", "per_layer")
    assert len(seen) == reads


def test_attention_with_a_frozen_projection_is_exact():
    """A frozen ``in_proj_weight`` beside trainable ones: its matmul keeps the weight all the same, the
    graph is read, and the frozen weight's per-example gradient is left out."""
    model, loss_fn, batch = make_recurrent_case("transformer_encoder")
    model.encoder.self_attn.in_proj_weight.requires_grad_(False)
    _check_against_oracle(model, loss_fn, batch, "bk", "per_layer")


@pytest.mark.parametrize("name", ["transformer_encoder", "mha_cross_kdim_distinct_no_weights"])
def test_a_wrong_graph_read_is_caught_by_the_parameter_sums(name, monkeypatch):
    """Check 2 covers the graph reads: projection gradients handed to the next example (a read in the
    wrong row order would do the same) are refused on the first micro-batch, naming a projection."""
    read = attention._read

    def shifted(*args):
        context, dproj = read(*args)
        return context, [d.roll(1, 0) for d in dproj]

    monkeypatch.setattr(attention, "_read", shifted)
    model, loss_fn, batch = make_recurrent_case(name)
    with pytest.raises(VerificationError, match=r"(in|q)_proj_weight"):
        engine_update(model, loss_fn, batch, [[0, 1, 2]], batch_size=6, max_grad_norm=1.0)


class WrongLayout(nn.Module):
    """A time-major LSTM (batch_first=False) fed a batch-first tensor: it recurs over the examples."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn, self.head = nn.LSTM(4, 5), nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(x)[0].mean(1))


class WrongLayoutAttention(nn.Module):
    """A time-major attention (batch_first=False) fed batch-first tensors: it attends across examples."""

    def __init__(self) -> None:
        super().__init__()
        self.attn, self.head = nn.MultiheadAttention(4, 2), nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.attn(x, x, x, need_weights=False)[0].mean(1))


def _float_loss(model, batch):
    return torch.nn.functional.cross_entropy(model(batch["x"]), batch["y"], reduction="none")


@pytest.mark.parametrize("module", [WrongLayout, WrongLayoutAttention])
@pytest.mark.parametrize("length,match", [(6, "depends on other examples"), (5, "dim 0")])
def test_wrong_layout_is_refused(module, length, match):
    """At T == B only the probe can tell (row i of the output gradient mixes examples), else the sizes."""
    torch.manual_seed(0)
    model = module().double()
    engine = _engine(model)
    optimizer = engine.attach(torch.optim.SGD(model.parameters(), lr=1.0))
    batch = {"x": torch.randn(6, length, 4, dtype=torch.float64), "y": torch.randint(0, 3, (6,))}
    with pytest.raises(VerificationError, match=match):
        engine.backward(_float_loss(model, batch))
    del optimizer


def test_a_wrong_rule_is_caught_by_the_parameter_sums(monkeypatch):
    """Check 2 covers these rules: a rule that drops the recurrent map's gradient is refused on the first
    micro-batch, naming the parameter."""
    rule = rules.rule_for(nn.GRU(1, 1))

    def broken(module, x, dy):
        grads = rule.per_example_grads(module, x, dy)
        grads["weight_hh_l0"] = Dense(torch.zeros(dy.shape[0], *module.weight_hh_l0.shape, dtype=dy.dtype))
        return grads

    key = f"{nn.GRU.__module__}.{nn.GRU.__qualname__}"
    monkeypatch.setitem(rules._RULES, key, dataclasses.replace(rule, per_example_grads=broken))
    model, loss_fn, batch = make_recurrent_case("gru_bidirectional_2_layers")
    with pytest.raises(VerificationError, match=r"rnn\.weight_hh_l0"):
        engine_update(model, loss_fn, batch, [[0, 1, 2]], batch_size=6, max_grad_norm=1.0)


class Calls(nn.Module):
    """Calls ``layer`` through ``call(layer, x)`` and sums its first output into 3 logits."""

    def __init__(self, layer: nn.Module, call) -> None:
        super().__init__()
        self.layer, self.call, self.head = layer, call, nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.call(self.layer, x)[0].flatten(0, -2)[: x.shape[0]])


def _packed(layer, x):
    return layer(pack_padded_sequence(x, torch.full((x.shape[0],), x.shape[1]), batch_first=True))[1]


REFUSED = {
    "packed_sequence": (nn.LSTM(4, 4, batch_first=True), _packed, "PackedSequence.*padded"),
    "unbatched_lstm": (nn.LSTM(4, 4), lambda m, x: m(x[0]), "unbatched input.*batch_first=True"),
    "unbatched_cell": (nn.GRUCell(4, 4), lambda m, x: m(x[0, 0]), r"unbatched input.*pass \(B, input_size\)"),
    "unbatched_attention": (
        nn.MultiheadAttention(4, 2),
        lambda m, x: m(x[0], x[0], x[0]),
        "unbatched query.*batch_first=True",
    ),
    "lstm_dropout": (nn.GRU(4, 4, 2, dropout=0.1, batch_first=True), lambda m, x: m(x), "set dropout=0"),
    "attention_dropout": (
        nn.MultiheadAttention(4, 2, dropout=0.1, batch_first=True),
        lambda m, x: m(x, x, x),
        "set dropout=0",
    ),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_unsupported_calls_are_refused_naming_the_layer_and_the_fix(case):
    layer, call, match = REFUSED[case]
    model = Calls(layer, call).double().train()
    engine = _engine(model)
    engine.attach(torch.optim.SGD(model.parameters(), lr=1.0))
    x = torch.randn(6, 5, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match=rf"layer 'layer' \({type(layer).__name__}\): .*{match}"):
        engine.backward(model(x).sum(1))


def test_dropout_is_accepted_in_eval_mode():
    """Dropout between layers only acts in training: in eval mode the rule is exact."""
    model = RecurrentNet("LSTM", True, num_layers=2, dropout=0.5).double().eval()
    _, loss_fn, batch = make_recurrent_case("gru_bidirectional_2_layers")
    _check_against_oracle(model, loss_fn, batch)


class _AutocastNet(nn.Module):
    """Linear -> MultiheadAttention -> LSTM -> LSTMCell -> Linear: under autocast every recurrent and
    attention layer receives half-precision inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(6, 8), nn.Linear(8, 3)
        self.mha = nn.MultiheadAttention(8, 2, batch_first=True)
        self.lstm, self.cell = nn.LSTM(8, 8, batch_first=True), nn.LSTMCell(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        h, _ = self.mha(h, h, h)
        h, _ = self.lstm(h)
        state, _ = self.cell(h[:, -1])
        return self.out(state)


@pytest.mark.filterwarnings("ignore:noise_multiplier=0")
def test_recurrent_and_attention_rules_run_under_bf16_autocast():
    """The rules recompute the layers from their recorded inputs, which autocast gives them in bf16 (a dtype
    error against the float32 weights before); in float32, so the update is the float32 oracle's up to bf16
    rounding of the forward."""
    torch.manual_seed(0)
    model = _AutocastNet()
    gen = torch.Generator().manual_seed(0)
    batch = {"x": torch.randn(4, 5, 6, generator=gen), "y": torch.randint(0, 3, (4,), generator=gen)}

    def loss(m, b, autocast=True):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            return nn.functional.cross_entropy(m(b["x"]).float(), b["y"], reduction="none")

    grads = per_example_grads(model, lambda m, b: loss(m, b, autocast=False), batch)
    groups = [list(grads[0])]
    thresholds = group_norms(grads, groups).median(0).values.tolist()
    expected = clipped_mean(grads, groups, thresholds, batch_size=4)
    delta, _ = engine_update(
        model, loss, batch, [[0, 1, 2, 3]], batch_size=4, thresholds=thresholds, max_grad_norm=1.0
    )
    got = torch.cat([delta[n].flatten() for n in expected])
    want = torch.cat([w.flatten() for w in expected.values()])
    assert (got - want).norm() / want.norm() < 3e-2
