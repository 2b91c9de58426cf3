"""The engine establishes what it assumes about a model, on models it did not choose, or refuses
(dpexp.privacy.capture): per-example structure, every use of every trainable parameter, no state carried
across examples. Each refusal below was a silent privacy violation before the check existed."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpexp.privacy import PrivacyEngine, VerificationError
from dpexp.privacy.capture import discover_layers
from dpexp.privacy.verification import Verifier
from tests.oracle import clipped_mean, group_norms, per_example_grads

pytestmark = pytest.mark.filterwarnings("ignore:noise_multiplier=0", "ignore:.*torch.func fallback")


def _engine(model: nn.Module, **kwargs) -> PrivacyEngine:
    defaults = {"batch_size": 4, "sample_size": 40, "max_grad_norm": 1.0, "noise_multiplier": 0.0}
    return PrivacyEngine(model, **{**defaults, **kwargs})


def _step(model: nn.Module, loss_fn, batch, **kwargs) -> dict[str, torch.Tensor]:
    """One SGD(lr=1) step under the engine; returns minus the update."""
    engine = _engine(model, **kwargs)
    optimizer = engine.attach(torch.optim.SGD(model.parameters(), lr=1.0))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine.backward(loss_fn(model, batch))
    optimizer.step()
    return {n: before[n] - p.detach() for n, p in model.named_parameters()}


def _cross_entropy(model, batch):
    return F.cross_entropy(model(batch["x"]), batch["y"], reduction="none")


class TimeMajor(nn.Module):
    """(B, T, d) -> (T, B, d) -> Linear, LayerNorm -> back: dim 0 of the layers' input is time (or, with
    ``time_major`` off, the same layers on the batch-first tensor)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.norm = nn.LayerNorm(3)
        self.head = nn.Linear(3, 2)
        self.time_major = True

    def forward(self, x):
        if not self.time_major:
            return self.head(torch.tanh(self.norm(self.fc(x)))).sum(1)
        h = self.norm(self.fc(x.transpose(0, 1))).transpose(0, 1)
        return self.head(torch.tanh(h)).sum(1)


class Scale(nn.Module):
    """No rule: the torch.func fallback."""

    def __init__(self, width: int = 3) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, width))

    def forward(self, p, mix=None):
        return p * self.w if mix is None else mix @ (p * self.w)


class SharedPositions(nn.Module):
    """A fallback module applied to a (T, d) tensor shared by all examples, then broadcast over the batch."""

    def __init__(self, length: int) -> None:
        super().__init__()
        self.pos = nn.Parameter(torch.randn(length, 3))
        self.scale = Scale()
        self.head = nn.Linear(3, 2)

    def forward(self, x):
        return self.head(x + self.scale(self.pos)).sum(1)


def _sequence_batch(batch_size: int, length: int):
    gen = torch.Generator().manual_seed(0)
    return {"x": torch.randn(batch_size, length, 3, generator=gen), "y": torch.randint(0, 2, (batch_size,))}


def _oracle_update(model: nn.Module, batch) -> tuple[dict[str, torch.Tensor], list[float]]:
    """The brute-force clipped mean of one step at per-layer thresholds between the examples' norms (some
    examples clipped, some not), and those thresholds."""
    grads = per_example_grads(model, _cross_entropy, batch)
    groups = [[n for n in grads[0] if n.startswith(f"{prefix}.")] for prefix in ("fc", "norm", "head")]
    thresholds = group_norms(grads, groups).median(0).values.tolist()
    return clipped_mean(grads, groups, thresholds, batch_size=len(batch["y"])), thresholds


@pytest.mark.parametrize("strategy", ["bk", "ghost", "instantiate"])
@pytest.mark.parametrize("length", [1, 4, 6])  # 4 = the micro-batch size: only the probe can tell
def test_time_major_position_wise_layers_are_exact(length, strategy):
    """A (T, b, d) input of a position-wise layer is read with the examples in dim 1 once the probe
    establishes it, also where T = b and the sizes fit dim 0 as well."""
    model = TimeMajor().double()
    batch = {**_sequence_batch(4, length), "x": _sequence_batch(4, length)["x"].double()}
    expected, thresholds = _oracle_update(model, batch)
    delta = _step(
        copy.deepcopy(model),
        _cross_entropy,
        batch,
        clipping="per_layer",
        thresholds=thresholds,
        strategy=strategy,
    )
    for name, want in expected.items():
        torch.testing.assert_close(delta[name], want, rtol=1e-7, atol=1e-10)


def test_a_later_micro_batch_is_read_in_the_verified_layout():
    """Verified time-major at T = 6, the same layers at T = 4 = b on the next (unprobed) micro-batch are
    still read time-major: sizes alone would read dim 0 as the examples."""
    model = TimeMajor().double()
    first, second = (_sequence_batch(4, length) for length in (6, 4))
    first["x"], second["x"] = first["x"].double(), second["x"].double()
    expected, thresholds = _oracle_update(model, second)
    engine = _engine(copy.deepcopy(model), clipping="per_layer", thresholds=thresholds)
    engine.backward(_cross_entropy(engine.model, first))
    engine._clipper.end_step()  # the first micro-batch's sums dropped: the second's alone are compared
    engine.backward(_cross_entropy(engine.model, second))
    assert engine._verifier.probe is None  # not probed: the layout came from the verification
    sums = engine._clipper.take_sums()
    for name, want in expected.items():
        torch.testing.assert_close(sums[name] / 4, want, rtol=1e-7, atol=1e-10)


@pytest.mark.parametrize("verified_time_major", [True, False])
def test_a_layer_that_changes_layout_after_verification_is_refused(verified_time_major):
    """Sizes that fit only the other layout on an unprobed micro-batch: refused, naming the fix."""
    model = TimeMajor()
    engine = _engine(model)
    model.time_major = verified_time_major
    engine.backward(_cross_entropy(model, _sequence_batch(4, 5)))
    model.time_major = not verified_time_major
    with pytest.raises(VerificationError, match=r"'(fc|norm)' .*where the model was verified.*every_step"):
        engine.backward(_cross_entropy(model, _sequence_batch(4, 5)))


class GatedTimeMajor(nn.Module):
    """A time-major Linear whose output is scaled by ``gate`` (0: no gradient reaches it)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.head = nn.Linear(3, 2)
        self.gate = 0.0

    def forward(self, x):
        h = self.fc(x.transpose(0, 1)).transpose(0, 1)
        return self.head(x + self.gate * h).sum(1)


def test_a_layer_verified_without_gradient_takes_a_layout_only_while_it_has_none():
    """At b = 2, T = 4 the sizes fit a fold of 2 rows and time-major; with no gradient at the layer and the
    examples equal after position 2 (padding), neither check 1 nor check 4 tells them apart, and dim 0's
    reading is kept. At b = 3 only time-major fits: accepted while the layer still gets no gradient (every
    reading gives every example zero), refused once it gets one."""
    model = GatedTimeMajor()
    engine = _engine(model)
    batch = _sequence_batch(2, 4)
    batch["x"][:, 2:] = batch["x"][0, 2:]
    engine.backward(_cross_entropy(model, batch))
    engine.backward(_cross_entropy(model, _sequence_batch(3, 4)))
    model.gate = 1.0
    with pytest.raises(
        VerificationError, match=r"'fc' .*can only be time-major.*verified with its examples in dim 0"
    ):
        engine.backward(_cross_entropy(model, _sequence_batch(3, 4)))


class FlatTimeMajor(nn.Module):
    """(B, T, d) -> (T, B, d) flattened to (T*B, d) -> Linear: b*T rows, but time-major."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.head = nn.Linear(3, 2)

    def forward(self, x):
        h = x.transpose(0, 1)
        flat = self.fc(h.reshape(-1, 3)).view(h.shape).transpose(0, 1)
        return self.head(torch.tanh(flat)).sum(1)


@pytest.mark.parametrize("length", [2, 4, 6])  # 4 = the micro-batch size
def test_flattened_time_major_rows_are_refused(length):
    """b*T rows are folded to (b, T) only when the probe shows that rows [i*T, (i+1)*T) are example i's."""
    with pytest.raises(VerificationError, match=r"layer 'fc' \(Linear\): row \d+ of its output gradient"):
        _step(FlatTimeMajor(), _cross_entropy, _sequence_batch(4, length))


def test_a_layer_verified_batch_first_that_arrives_flattened_is_refused():
    """At T = 1 the time-major flattening is batch-first and passes the probe; with T = 3 on a later
    micro-batch the same layer gets b*T rows in a layout no probe established."""
    model = FlatTimeMajor()
    engine = _engine(model)
    engine.backward(_cross_entropy(model, _sequence_batch(4, 1)))
    with pytest.raises(VerificationError, match=r"flattened into dim 0.*verify_every_step=True"):
        engine.backward(_cross_entropy(model, _sequence_batch(4, 3)))

    model = FlatTimeMajor()
    engine = _engine(model, verify_every_step=True)
    engine.backward(_cross_entropy(model, _sequence_batch(4, 1)))
    with pytest.raises(VerificationError, match=r"row \d+ of its output gradient"):
        engine.backward(_cross_entropy(model, _sequence_batch(4, 3)))


class FlatConv(nn.Module):
    """A Conv1d on (B*T, C, L) rows: its rule acts on whole examples, so the rows cannot be folded."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(3, 2, 1)

    def forward(self, x):  # x: (B, T, 3, L)
        return self.conv(x.flatten(0, 1)).view(x.shape[0], -1).sum(1, keepdim=True).expand(-1, 2)


def test_flattened_input_of_a_layer_that_is_not_position_wise_is_refused():
    batch = {"x": torch.randn(4, 3, 3, 5), "y": torch.randint(0, 2, (4,))}
    with pytest.raises(VerificationError, match=r"'conv' \(Conv1d\).*3 x the batch size.*cannot be folded"):
        _step(FlatConv(), _cross_entropy, batch)


class FlatRouter(nn.Module):
    """A rule-less router on (B, T, d) tokens flattened to (B*T, d), returning its logits and top-1 indices,
    as a mixture-of-experts router (Phi-MoE's) without a rule."""

    class Router(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(2, 3))

        def forward(self, rows):
            logits = rows @ self.weight.T
            return logits, logits.argmax(-1)

    def __init__(self) -> None:
        super().__init__()
        self.router = self.Router()

    def forward(self, x):  # x: (B, T, 3)
        logits, _ = self.router(x.flatten(0, 1))
        return logits.view(x.shape[0], x.shape[1], 2).mean(1)


def test_a_rule_less_layer_on_flattened_rows_is_refused_naming_the_flattening():
    """Its tuple output has T x B rows: the refusal says what that may be and what folds it (a position-wise
    rule), without deciding from the sizes that it is a flattening."""
    batch = {"x": torch.randn(4, 5, 3), "y": torch.randint(0, 2, (4,))}
    with pytest.raises(
        VerificationError, match=r"'router' \(Router\).*5 x the batch size.*position_wise=True"
    ):
        _step(FlatRouter(), _cross_entropy, batch)


class KeywordPositions(nn.Module):
    """BioGPT's position embedding: an Embedding subclass called on the (B, T) attention mask that looks up
    the (1, T) position ids it gets by keyword, its output broadcast over the batch."""

    class Positions(nn.Embedding):
        def forward(self, mask, position_ids=None):
            return super().forward(position_ids)

    def __init__(self) -> None:
        super().__init__()
        self.positions = self.Positions(8, 3)
        self.head = nn.Linear(3, 2)

    def forward(self, x):  # x: (B, T, 3)
        mask = torch.ones(x.shape[:2], dtype=torch.long)
        positions = self.positions(mask, position_ids=torch.arange(x.shape[1])[None])
        return self.head(torch.tanh(x + positions).mean(1))


def test_a_layer_whose_output_does_not_follow_its_batch_first_input_is_refused_naming_the_cause():
    """The input has the batch size, the output gradient leading size 1: the refusal says the output is
    computed from something else and broadcast, not that the input is flattened or time-major."""
    batch = {"x": torch.randn(4, 5, 3), "y": torch.randint(0, 2, (4,))}
    with pytest.raises(
        VerificationError, match=r"'positions' \(Positions\).*does not follow the input's rows"
    ):
        _step(KeywordPositions(), _cross_entropy, batch)


@pytest.mark.parametrize("length", [4, 6, 8])  # 8 = twice the micro-batch size, as a flattened input
def test_fallback_on_a_tensor_shared_by_all_examples_is_refused(length):
    """Whatever the sizes suggest, the refusal names register_shared (Blenderbot-small's positions, arange(T)
    with T = 3 B, were called a flattened input)."""
    with pytest.raises(VerificationError, match=r"layer 'scale' \(Scale\).*register_shared"):
        _step(SharedPositions(length), _cross_entropy, _sequence_batch(4, length))


@pytest.mark.parametrize("length", [4, 7])  # 4 = the micro-batch size
def test_t5_relative_attention_bias_gets_per_example_gradients(length):
    """T5's relative_attention_bias is an Embedding on (q, k) buckets, broadcast over the batch later: it was
    refused; its per-example gradient is now taken where the bias meets the batch (dpexp.privacy.shared),
    and the clipped step equals the brute-force oracle's."""
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(0)
    config = T5Config(vocab_size=30, d_model=8, d_kv=4, d_ff=12, num_layers=1, num_heads=2, dropout_rate=0.0)
    model = T5EncoderModel(config).double()
    batch = {"ids": torch.randint(0, 30, (4, length))}

    def loss(m, b):
        return m(input_ids=b["ids"]).last_hidden_state.pow(2).sum((1, 2))

    grads = per_example_grads(model, loss, batch)
    names = list(grads[0])
    threshold = float(group_norms(grads, [names]).median())
    expected = clipped_mean(grads, [names], [threshold], batch_size=4)
    delta = _step(copy.deepcopy(model), loss, batch, max_grad_norm=threshold)
    bias = "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"
    assert expected[bias].norm() > 0
    for name, want in expected.items():
        torch.testing.assert_close(delta[name], want, rtol=1e-9, atol=1e-12)


class HandTied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(7, 3)
        self.fc = nn.Linear(3, 3)

    def forward(self, ids):
        return F.linear(torch.tanh(self.fc(self.emb(ids))), self.emb.weight)


class ReadOnlyWeights(nn.Module):
    """``fc`` is never called: its weights are only read through F.linear."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 2)

    def forward(self, x):
        return F.linear(x, self.fc.weight, self.fc.bias)


class BiasRegisteredTwice(nn.Module):
    """``fc.bias`` registered again as the parent's own ``bias``, as Hugging Face's masked-LM heads tie
    ``decoder.bias`` to the head's ``bias``; ``direct``: the parent also adds it itself, outside ``fc``."""

    def __init__(self, direct: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 2)
        self.bias = self.fc.bias
        self.direct = direct

    def forward(self, x):
        y = self.fc(torch.tanh(x))
        return y + self.bias if self.direct else y


def test_a_parameter_registered_in_a_module_and_its_submodule_belongs_to_the_submodule():
    """The parent's own registration adds no layer (its fallback would count fc's use twice); the update
    equals the oracle's."""
    torch.manual_seed(0)
    model = BiasRegisteredTwice(direct=False).double()
    batch = {"x": torch.randn(4, 3, dtype=torch.float64), "y": torch.randint(0, 2, (4,))}
    layers, _ = discover_layers(model, generic_fallback=True)
    assert [(layer.name, layer.params) for layer in layers] == [
        ("fc", {"weight": "fc.weight", "bias": "bias"})
    ]
    grads = per_example_grads(model, _cross_entropy, batch)
    expected = clipped_mean(grads, [list(grads[0])], [0.1], batch_size=4)
    delta = _step(model, _cross_entropy, batch, max_grad_norm=0.1)
    for name, want in expected.items():
        torch.testing.assert_close(delta[name], want, rtol=1e-9, atol=1e-12)


def test_a_parameter_registered_twice_and_used_outside_the_inner_call_is_refused():
    batch = {"x": torch.randn(4, 3), "y": torch.randint(0, 2, (4,))}
    with pytest.raises(VerificationError, match=r"parameter 'bias'.*\['fc'\]"):
        _step(BiasRegisteredTwice(direct=True), _cross_entropy, batch)


def test_hand_tied_output_layer_is_refused_naming_the_parameter():
    ids = torch.randint(0, 7, (4, 5), generator=torch.Generator().manual_seed(0))

    def loss(m, b):
        logits = m(b["ids"])
        return F.cross_entropy(logits.flatten(0, 1), b["ids"].flatten(), reduction="none").view(4, 5).sum(1)

    with pytest.raises(VerificationError, match=r"parameter 'emb.weight'.*\['emb'\].*F.linear"):
        _step(HandTied(), loss, {"ids": ids})


def test_weights_read_outside_their_module_are_refused():
    batch = {"x": torch.randn(4, 3), "y": torch.randint(0, 2, (4,))}
    with pytest.raises(VerificationError, match=r"parameter 'fc.(weight|bias)'"):
        _step(ReadOnlyWeights(), _cross_entropy, batch)


@pytest.mark.parametrize("tf32", [False, True])
def test_under_tf32_a_use_outside_the_module_is_still_refused_and_the_flags_are_named(tf32, monkeypatch):
    """On CUDA with TF32 (precision.runs_tf32) check 2 compares at TF32's tolerance, 1e-2: a parameter read
    outside its module still differs by whole terms, and the refusal names the TF32 flags as a possible
    cause (a ReLU flipped by TF32's rounding); without TF32 it does not."""
    monkeypatch.setattr("dpexp.privacy.verification.runs_tf32", lambda model, device: tf32)
    batch = {"x": torch.randn(4, 3), "y": torch.randint(0, 2, (4,))}
    with pytest.raises(VerificationError, match=r"parameter 'fc.(weight|bias)'") as refused:
        _step(ReadOnlyWeights(), _cross_entropy, batch)
    assert ("torch.backends.cudnn.allow_tf32" in str(refused.value)) == tf32


def test_parameter_used_in_the_loss_is_refused():
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    batch = {"x": torch.randn(4, 3), "y": torch.randint(0, 2, (4,))}

    def loss(m, b):  # a per-example penalty on the first layer's weight, outside any module call
        return _cross_entropy(m, b) + (m[0].weight.pow(2).sum() * b["x"].pow(2).sum(1))

    with pytest.raises(VerificationError, match=r"parameter '0.weight'"):
        _step(model, loss, batch)


@pytest.mark.parametrize("affine", [True, False])
def test_running_statistics_are_refused_before_a_step(affine):
    model = nn.Sequential(
        nn.Conv2d(2, 2, 3),
        nn.InstanceNorm2d(2, track_running_stats=True, affine=affine),
        nn.Flatten(),
        nn.Linear(18, 2),
    )
    engine = _engine(model)
    with pytest.raises(ValueError, match=r"module '1' \(InstanceNorm2d\) changed its buffer 'running_mean'"):
        model(torch.randn(4, 2, 5, 5))
    assert engine.steps == 0


def test_ibert_is_refused_in_training():
    """I-BERT's ``QuantAct`` modules track the min and max of the whole batch's activations in buffers in
    training, even with ``quant_mode`` off: refused at the first training forward, naming the buffer (its
    quantised embedding takes the fallback; in evaluation mode nothing is tracked)."""
    from transformers import IBertConfig, IBertForSequenceClassification

    config = IBertConfig(
        vocab_size=40, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=12,
        max_position_embeddings=16, num_labels=2,
    )  # fmt: skip
    model = IBertForSequenceClassification(config).train()
    engine = _engine(model)
    with pytest.raises(ValueError, match=r"\(QuantAct\) changed its buffer 'x_min'"):
        model(input_ids=torch.randint(3, 40, (4, 6)))
    assert engine.steps == 0


def _opacus(model: nn.Module):
    from dpexp.backends.opacus import OpacusBackend

    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return OpacusBackend(model, optimizer, batch_size=4, max_grad_norm=1.0, noise_multiplier=1.0)


def test_running_statistics_are_refused_in_the_opacus_baseline():
    class Accumulating(nn.Module):  # state Opacus' validator does not know about
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("seen", torch.zeros(4))

        def forward(self, x):
            if self.training:
                self.seen += x.detach().mean(0)
            return x

    backend = _opacus(nn.Sequential(nn.Linear(4, 4), Accumulating(), nn.Linear(4, 2)))
    with pytest.raises(ValueError, match=r"module '1' \(Accumulating\) changed its buffer 'seen'"):
        backend.model(torch.randn(4, 4))


def test_state_kept_in_an_attribute_is_refused_in_the_opacus_baseline():
    """Opacus does not replay a forward, so a tensor attribute a training forward wrote cannot be
    established free of the batch's data: refused when the next call finds it (Opacus' own per-layer
    ``activations`` are not the model's state)."""

    class Carried(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.prev = None

        def forward(self, h):
            out = h if self.prev is None else h + self.prev
            self.prev = h.detach().mean(0)
            return out

    backend = _opacus(nn.Sequential(nn.Linear(3, 4), Carried(), nn.Linear(4, 2)))
    backend.model(torch.randn(4, 3))
    with pytest.raises(ValueError, match=r"module '1' \(Carried\): its attribute 'prev'.*no replay"):
        backend.model(torch.randn(4, 3))
    backend.close()


class BatchCentred(nn.Module):
    """Subtracts the batch mean before its only layer: examples mixed before any trainable layer."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 2)

    def forward(self, x):
        return self.fc(x - x.mean(0, keepdim=True))


def test_examples_mixed_before_the_first_layer_are_refused():
    batch = {"x": torch.randn(4, 3), "y": torch.randint(0, 2, (4,))}
    with pytest.raises(VerificationError, match="floating-point input 0 of the model"):
        _step(BatchCentred(), _cross_entropy, batch)


def test_examples_mixed_in_an_input_that_requires_gradients_are_refused():
    """An input that already requires gradients (a user's leaf, or the output of an upstream computation
    outside the model) is probed too: once such inputs went unchecked and a batch-centring front trained."""
    upstream = torch.randn(4, 3, requires_grad=True)
    batch = {"x": upstream * 2.0, "y": torch.randint(0, 2, (4,))}
    with pytest.raises(VerificationError, match="floating-point input 0 of the model"):
        _step(BatchCentred(), _cross_entropy, batch)


def test_an_input_that_requires_gradients_keeps_its_gradient():
    """Probing an input that requires gradients leaves the user's gradient of it as autograd's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    x = torch.randn(4, 3)
    expected_x = x.clone().requires_grad_(True)
    F.cross_entropy(
        copy.deepcopy(model)(expected_x), torch.tensor([0, 1, 0, 1]), reduction="none"
    ).sum().backward()
    leaf = x.clone().requires_grad_(True)
    engine = _engine(model)
    loss = F.cross_entropy(engine.model(leaf), torch.tensor([0, 1, 0, 1]), reduction="none")
    engine.backward(loss)
    torch.testing.assert_close(leaf.grad, expected_x.grad)


def test_a_loss_that_mixes_examples_is_refused():
    model = nn.Linear(3, 3)
    x = torch.randn(4, 3)

    def contrastive(m, b):  # every example's loss depends on every other example's output
        z = m(b["x"])
        return torch.logsumexp(z @ z.T, dim=1)

    with pytest.raises(VerificationError, match=r"layer '' \(Linear\)"):
        _step(model, contrastive, {"x": x})


class FrozenEmbeddingCentred(nn.Module):
    """Token ids -> frozen embedding -> batch centring -> trainable head: no probed tensor precedes the
    mixing (the ids are integers, the embedding is frozen), so only check 4 sees it."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 3).requires_grad_(False)
        self.fc = nn.Linear(3, 2)

    def forward(self, ids):
        h = self.embed(ids).mean(1)
        return self.fc(h - h.mean(0, keepdim=True))


class DetachedCentring(nn.Module):
    """Centring by a detached batch mean: invisible to any gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 2)

    def forward(self, x):
        return self.fc(x - x.mean(0, keepdim=True).detach())


class NoGradFront(nn.Module):
    """A front computed without gradients that normalises over the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.front, self.fc = nn.Linear(3, 3), nn.Linear(3, 2)

    def forward(self, x):
        with torch.no_grad():
            h = self.front(x)
            h = h - h.mean(0)
        return self.fc(h)


class DetachedBetweenLayers(nn.Module):
    """Examples mixed between two trainable layers by a detached statistic."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.fc = nn.Linear(3, 3), nn.Linear(3, 2)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        return self.fc(h / h.norm(dim=1).mean().detach())


class DetachedAfterLastLayer(nn.Module):
    """Outputs scaled by a detached batch statistic after the last trainable layer."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 2)

    def forward(self, x):
        z = self.fc(x)
        return z / z.norm(dim=1).mean().detach()


_FLOATS = {"x": torch.randn(4, 3), "y": torch.tensor([0, 1, 0, 1])}
_IDS = {"x": torch.randint(0, 10, (4, 5), generator=torch.Generator().manual_seed(0)), "y": _FLOATS["y"]}


@pytest.mark.parametrize(
    ("model", "batch", "match"),
    [
        (
            FrozenEmbeddingCentred,
            _IDS,
            r"layer 'fc' \(Linear\): when example 0's data changed, its input moved",
        ),
        (DetachedCentring, _FLOATS, r"layer 'fc' \(Linear\): when example 0's data changed"),
        (NoGradFront, _FLOATS, r"layer 'fc' \(Linear\): when example 0's data changed"),
        (DetachedBetweenLayers, _FLOATS, r"layer 'fc' \(Linear\): when example 0's data changed"),
        (DetachedAfterLastLayer, _FLOATS, r"output tensor 0 of the model .* moved for other examples"),
    ],
)
def test_examples_mixed_where_no_gradient_shows_it_are_refused(model, batch, match):
    """Check 4: mixing after a frozen prefix on integer inputs, or through a detached or no_grad batch
    statistic, leaves every probed output gradient per-example; each of these trained silently before."""
    with pytest.raises(VerificationError, match=match):
        _step(model(), _cross_entropy, batch)


def test_a_micro_batch_of_identical_examples_does_not_count_as_verified():
    """With every example the same there is nothing to replace: the next micro-batch of the same
    structure is verified again, and its mixing refused."""
    model = DetachedCentring()
    engine = _engine(model)
    same = torch.randn(1, 3).expand(4, 3).clone()
    engine.backward(F.cross_entropy(model(same), _FLOATS["y"], reduction="none"))
    with pytest.raises(VerificationError, match="when example 0's data changed"):
        engine.backward(F.cross_entropy(model(_FLOATS["x"]), _FLOATS["y"], reduction="none"))


def test_dropout_replays_with_the_masks_of_the_verified_forward():
    """The replay starts from the forward's random state: dropout draws the same masks, so a per-example
    model with dropout is not refused, and the user's random state is left as it was."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.Dropout(0.5), nn.Tanh(), nn.Linear(8, 2))
    engine = _engine(model)
    loss = F.cross_entropy(model(_FLOATS["x"]), _FLOATS["y"], reduction="none")
    state = torch.get_rng_state()
    engine.backward(loss)
    assert torch.equal(state, torch.get_rng_state())
    assert engine.trainable_parameters()  # the replay left the parameters to the engine
    assert not any(p.requires_grad for p in model.parameters())


class BatchDecidesLayers(nn.Module):
    """Whether the second layer runs depends on example 0 alone."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(3, 2), nn.Linear(2, 2)

    def forward(self, x):
        h = self.a(x)
        return self.b(h) if float(x[0, 0].detach()) > 0 else h


def test_one_example_deciding_the_layers_of_the_others_is_refused():
    x = _FLOATS["x"].clone()
    x[0, 0], x[1, 0] = 1.0, -1.0  # example 0 replaced by example 1 flips the branch
    with pytest.raises(VerificationError, match="fewer layers"):
        _step(BatchDecidesLayers(), _cross_entropy, {"x": x, "y": _FLOATS["y"]})


def test_a_model_without_batch_first_inputs_is_refused():
    class TimeMajorInput(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(3, 2)

        def forward(self, x):  # x: (T, B, 3), made batch-first inside
            return self.fc(x.transpose(0, 1)).sum(1)

    with pytest.raises(VerificationError, match="no input of the model has the micro-batch's 4 examples"):
        _step(TimeMajorInput(), _cross_entropy, {"x": torch.randn(5, 4, 3), "y": _FLOATS["y"]})


class InputFreeBias(nn.Module):
    """A module called without inputs that returns its whole table (as BEiT's relative position bias)."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(2))

    def forward(self):
        return self.table * 1.0


def test_a_layer_called_without_tensor_inputs_is_refused_naming_it():
    class WithBias(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.bias = nn.Linear(3, 2), InputFreeBias()

        def forward(self, x):
            return self.fc(x) + self.bias()

    with pytest.raises(
        VerificationError, match=r"layer 'bias' \(InputFreeBias\) was called without a tensor"
    ):
        _step(WithBias(), _cross_entropy, _FLOATS)


class MaskedMix(nn.Module):
    """A fallback module taking a per-example input and a (T, T) matrix shared by all examples, with
    T = B: the fallback must vmap over the first only, which it establishes from the recorded output."""

    def __init__(self, length: int) -> None:
        super().__init__()
        self.register_buffer("mix", torch.tril(torch.ones(length, length)) / length)
        self.scale = Scale()
        self.head = nn.Linear(3, 2)

    def forward(self, x):
        return self.head(torch.tanh(self.scale(x, self.mix))).sum(1)


def test_fallback_establishes_which_inputs_carry_the_example():
    model = MaskedMix(4).double()
    batch = _sequence_batch(4, 4)
    batch["x"] = batch["x"].double()
    grads = per_example_grads(model, _cross_entropy, batch)
    groups = [list(grads[0])]
    thresholds = group_norms(grads, groups).median(0).values.tolist()
    expected = clipped_mean(grads, groups, thresholds, batch_size=4)
    delta = _step(copy.deepcopy(model), _cross_entropy, batch, thresholds=thresholds)
    for name, want in expected.items():
        torch.testing.assert_close(delta[name], want, rtol=1e-7, atol=1e-10)


def _counting_probes(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = Verifier.run_probe

    def spy(self, loss):
        calls.append(loss.shape[0])
        return real(self, loss)

    monkeypatch.setattr(Verifier, "run_probe", spy)
    return calls


def test_verification_runs_once_per_input_structure(monkeypatch):
    calls = _counting_probes(monkeypatch)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    engine = _engine(model)
    for shape in [(1, 3), (4, 3), (3, 3), (2, 5, 3), (4, 6, 3)]:
        out = model(torch.randn(*shape))
        engine.backward(out.reshape(shape[0], -1).sum(1))
    # the single example is not probed (nothing to mix); then once per structure (rank 2, rank 3)
    assert calls == [4, 2]
    assert all(not p.requires_grad for p in model.parameters())
    assert all(p.grad is None for p in model.parameters())


def test_verify_every_step_probes_every_micro_batch(monkeypatch):
    calls = _counting_probes(monkeypatch)
    model = nn.Linear(3, 2)
    engine = _engine(model, verify_every_step=True)
    for _ in range(3):
        engine.backward(model(torch.randn(4, 3)).sum(1))
    assert calls == [4, 4, 4]


class Branching(nn.Module):
    """Data-dependent control flow: which layer runs depends on the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(3, 2), nn.Linear(3, 2)

    def forward(self, x):
        return self.a(x) if float(x.sum()) > 0 else self.b(x)


class _FailingBackward(torch.autograd.Function):
    """The identity whose backward raises ``error``: a backward that stops part-way, as an out-of-memory
    or a Ctrl-C would."""

    @staticmethod
    def forward(ctx, x, error):
        ctx.error = error
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise ctx.error


class _Breaks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.error = nn.Linear(3, 4), nn.Linear(4, 2), None

    def forward(self, x):
        h = self.a(x)
        return self.b(h if self.error is None else _FailingBackward.apply(h, self.error))


@pytest.mark.parametrize("error", [RuntimeError("no memory left"), KeyboardInterrupt("no memory left")])
@pytest.mark.parametrize("strategy", ["bk", "ghost"])
def test_a_backward_that_fails_part_way_leaves_the_engine_refusing_every_step(strategy, error):
    """The second micro-batch's backward stops after ``b``'s gradients reached the clipper and before
    ``a``'s did: the step's sums are partial, so neither the optimizer's step nor another backward runs."""
    model = _Breaks()
    engine = _engine(model, batch_size=8, strategy=strategy)
    optimizer = engine.attach(torch.optim.SGD(model.parameters(), lr=1.0))
    before = [p.detach().clone() for p in model.parameters()]
    engine.backward(model(torch.randn(4, 3)).sum(1))
    model.error = error
    with pytest.raises(type(error), match="no memory left"):
        engine.backward(model(torch.randn(4, 3)).sum(1))
    name = type(error).__name__
    with pytest.raises(VerificationError, match=rf"failed part-way \({name}: no memory left"):
        optimizer.step()
    model.error = None
    model.broken = False
    with pytest.raises(VerificationError, match="refused this model earlier"):
        engine.backward(model(torch.randn(4, 3)).sum(1))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))


def test_an_unverified_path_through_the_layers_is_refused_unless_every_step_is_verified():
    positive, negative = torch.rand(4, 3), -torch.rand(4, 3)
    model = Branching()
    engine = _engine(model)
    engine.backward(model(positive).sum(1))
    with pytest.raises(VerificationError, match="verify_every_step=True"):
        engine.backward(model(negative).sum(1))
    with pytest.raises(VerificationError, match="refused this model earlier"):
        engine.backward(model(positive).sum(1))

    model = Branching()
    engine = _engine(model, verify_every_step=True)
    engine.backward(model(positive).sum(1))
    engine.backward(model(negative).sum(1))


def test_verification_leaves_the_random_state_alone():
    """Probe weights and directions come from their own generator: a seeded run is the same with or
    without verification."""
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    engine = _engine(model)
    x = torch.randn(4, 3)
    torch.manual_seed(3)
    state = torch.get_rng_state()
    engine.backward(model(x).sum(1))
    assert torch.equal(state, torch.get_rng_state())


def test_layers_called_without_the_model_are_refused():
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    engine = _engine(model)
    with pytest.raises(RuntimeError, match="model given to the PrivacyEngine"):
        engine.backward(model[1](model[0](torch.randn(4, 3))).sum(1))


class RolledLinear(nn.Linear):
    """Same forward as nn.Linear; its (deliberately wrong) rule gives example i the gradient of i + 1."""


def test_a_rule_that_attributes_gradients_to_the_wrong_example_is_refused(monkeypatch):
    """The sum over examples is right, only the attribution is wrong: clipping would bound the wrong vector.
    The parameter-use check weights examples by the probe's v_i, so it sees it."""
    from dpexp.privacy import rules
    from dpexp.privacy.per_example import Dense

    def rolled(module, x, dy):
        grads = rules.rule_for(nn.Linear(1, 1)).per_example_grads(module, x, dy)
        return {name: Dense(grad.instantiate().roll(1, 0)) for name, grad in grads.items()}

    monkeypatch.setattr(rules, "_RULES", dict(rules._RULES))
    rules.register_rule(RolledLinear)(rolled)
    model = nn.Sequential(RolledLinear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    batch = {"x": torch.randn(4, 3), "y": torch.randint(0, 2, (4,))}
    with pytest.raises(VerificationError, match=r"parameter '0.(weight|bias)'.*a rule is wrong"):
        _step(model, _cross_entropy, batch)


class ScaledWithNorm(nn.Module):
    """No rule, a tuple output: ``(x * w, ||w||)``, the second without a row per example."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, 3))

    def forward(self, x):
        return x * self.w, self.w.norm()


class NormUser(nn.Module):
    def __init__(self, use_norm: bool) -> None:
        super().__init__()
        self.scaled, self.head, self.use_norm = ScaledWithNorm(), nn.Linear(3, 2), use_norm

    def forward(self, x):
        y, norm = self.scaled(x)
        return self.head(y) * (norm if self.use_norm else 1.0)


def test_a_tuple_output_without_a_row_per_example_that_reaches_the_loss_is_refused():
    """The fallback splits only outputs with one row per example; another output that gets a gradient
    (here ``||w||``, which scales every example's logits) carries the batch's sum: refused, naming it."""
    batch = {"x": torch.randn(4, 3, dtype=torch.float64), "y": torch.tensor([0, 1, 1, 0])}
    model = NormUser(use_norm=True).double()
    engine = _engine(model)
    with pytest.raises(VerificationError, match=r"'scaled' \(ScaledWithNorm\).*output 1 of shape \(\)"):
        engine.backward(_cross_entropy(model, batch))
    # unused, it gets no gradient: exact
    model = NormUser(use_norm=False).double()
    grads = per_example_grads(model, _cross_entropy, batch)
    names = [n for n, p in model.named_parameters()]
    expected = clipped_mean(grads, [names], [0.5], batch_size=4)
    delta = _step(model, _cross_entropy, batch, max_grad_norm=0.5)
    for name, want in expected.items():
        torch.testing.assert_close(delta[name], want)


class CachedGate(nn.Module):
    """A rule-less layer (a gate of its own) that, as a decoder's mixer, is passed a key/value cache."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.gate = nn.Parameter(torch.linspace(0.5, 1.5, 4))
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, cache: object = None) -> torch.Tensor:
        return self.head(torch.tanh(self.proj(x)) * self.gate)


class CachedModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mixer = CachedGate()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from transformers import DynamicCache

        return self.mixer(x, cache=DynamicCache())


def test_the_fallback_refuses_a_key_value_cache():
    """Its recomputation would extend the cache: the fix (use_cache=False) is named."""
    model = CachedModel().double()
    engine = _engine(model)
    batch = {"x": torch.randn(4, 4, dtype=torch.float64), "y": torch.arange(4) % 3}
    with pytest.raises(RuntimeError, match=r"CachedGate.*DynamicCache.*use_cache=False"):
        engine.backward(_cross_entropy(model, batch))


def test_the_fallback_searches_which_inputs_carry_the_example_once_per_call_structure(monkeypatch):
    """With B = 6, GatedPair's (6,) mask could be per example: the first call tries the choices until one
    alone reproduces the output; later calls of the same structure try that one first (still checked
    against the recorded output), and a call whose recorded output it does not reproduce searches again."""
    from dpexp.privacy.rules import functional
    from tests.engine_models import make_case

    calls = []
    vmapped = functional._vmapped

    def counted(*a):  # (dims, examples): a choice is tried on one example before all six
        calls.append((a[4], next(iter(a[5].values())).shape[0]))
        return vmapped(*a)

    monkeypatch.setattr(functional, "_vmapped", counted)
    model, loss_fn, batch = make_case("fallback_tuple", batch_size=6)
    engine = _engine(model, batch_size=6)
    engine.backward(loss_fn(model, batch))
    # only (x batched, mask shared) reproduces example 0, and then all six
    assert calls == [([0, 0], 1), ([0, None], 1), ([0, None], 6), ([None, 0], 1), ([None, None], 1)]
    engine.backward(loss_fn(model, batch))
    assert calls[5:] == [([0, None], 6)]  # remembered: no search
    # a call whose output the remembered choice does not reproduce (forced here): the search runs again
    monkeypatch.setattr(functional, "reproduces", lambda recorded, recomputed: len(calls) > 7)
    engine.backward(loss_fn(model, batch))
    # (reproduction forced from here on: (0, 0) then passes too, and the search stops at the second choice)
    assert calls[6:] == [([0, None], 6), ([0, 0], 1), ([0, 0], 6), ([0, None], 1), ([0, None], 6)]


@pytest.mark.parametrize(
    "failure",
    [
        RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 40000000000 bytes."),
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB"),
    ],
    ids=["cpu", "cuda"],
)
def test_the_fallback_reports_running_out_of_memory_not_mixed_examples(monkeypatch, failure):
    """An allocation failure while the fallback tries a choice of batched inputs says nothing about the
    choice: it is reported as memory, with the fix, and never as a forward that mixes examples."""
    from dpexp.privacy.rules import functional
    from tests.engine_models import make_case

    def out_of_memory(*a):
        raise failure

    monkeypatch.setattr(functional, "_vmapped", out_of_memory)
    model, loss_fn, batch = make_case("fallback_tuple", batch_size=6)
    engine = _engine(model, batch_size=6)
    with pytest.raises(
        RuntimeError, match=r"GatedPair.*ran out of memory.*Lower physical_batch_size"
    ) as caught:
        engine.backward(loss_fn(model, batch))
    assert "mixes examples" not in str(caught.value)


class ScaledInPlace(nn.Module):
    """A layer's 3-D output divided in place, as Longformer scales its queries: a Linear's (a view of its
    matmul), or (``viewed``) a rule-less module's that returns a view of a product."""

    def __init__(self, viewed: bool = False) -> None:
        super().__init__()
        self.fc = ViewedScale() if viewed else nn.Linear(3, 3)
        self.head = nn.Linear(3, 2)

    def forward(self, x):
        h = self.fc(x)
        h /= 2.0
        return self.head(torch.tanh(h)).sum(1)


class ViewedScale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, 3))

    def forward(self, x):
        return (x * self.weight).flatten(0, 1).view(x.shape)


def test_a_linear_output_changed_in_place_is_exact():
    """Autograd drops the hook on a view modified in place; a Linear's output is a view of its matmul, which
    nothing else holds, and the engine hooks that instead (Longformer's queries)."""
    model = ScaledInPlace().double()
    batch = {**_sequence_batch(4, 5), "x": _sequence_batch(4, 5)["x"].double()}
    grads = per_example_grads(model, _cross_entropy, batch)
    thresholds = group_norms(grads, [list(grads[0])]).median(0).values.tolist()
    expected = clipped_mean(grads, [list(grads[0])], thresholds, batch_size=4)
    delta = _step(copy.deepcopy(model), _cross_entropy, batch, thresholds=thresholds)
    for name, want in expected.items():
        torch.testing.assert_close(delta[name], want, rtol=1e-7, atol=1e-10)


def test_a_layer_output_whose_gradient_never_arrives_is_refused_with_its_cause():
    """A rule-less module's view output changed in place: no gradient reaches the engine for ``fc`` (whose
    parameter still has one), and the refusal says why instead of blaming a use outside the module."""
    with pytest.raises(VerificationError, match=r"'fc.weight' has a gradient.*never reached.*in place"):
        _step(ScaledInPlace(viewed=True), _cross_entropy, _sequence_batch(4, 5))


class OwnsAndReturnsAMapping(nn.Module):
    """A module that owns a parameter itself and returns a dict: no tensor output to hook."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 2)
        self.offset = nn.Parameter(torch.zeros(2))

    def forward(self, x):
        return {"logits": self.fc(x) + self.offset}


def test_a_module_without_tensor_output_names_the_parameters_it_owns():
    class Wrapper(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = OwnsAndReturnsAMapping()

        def forward(self, x):
            return self.inner(x)["logits"]

    with pytest.raises(TypeError, match=r"'inner' .*freeze its parameters \['inner.offset'\]"):
        _step(Wrapper(), _cross_entropy, _FLOATS)
