"""Small float64 models around ``nn.LSTM``/``GRU``/``RNN``, their cells and ``nn.MultiheadAttention`` for the
oracle and sensitivity tests: time-major and batch-first layouts, bidirectional and stacked layers, a
projected LSTM with given initial states, cells stepped by a loop with and without initial states, self-
and cross-attention with padding and attention masks, ``nn.TransformerEncoderLayer`` and ``nn.Transformer``,
batch-first and time-major. Padded positions (id 0) never enter a loss; a padding-only example has a
finite one."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

Batch = dict[str, torch.Tensor]
VOCAB, CLASSES = 11, 3


def _padding_mask(ids: torch.Tensor) -> torch.Tensor:
    """True at padded positions (id 0), except position 0, which is always attended: a padding-only example
    (an adversarial neighbour in the sensitivity tests) still has a key to attend to."""
    pad = ids == 0
    pad[:, 0] = False
    return pad


class RecurrentNet(nn.Module):
    """Embedding -> recurrent layer -> a head on the mean of the unpadded outputs plus one on ``h_n``.

    ``initial_state``: h_0 (and c_0) computed from the example's mean embedding, passed as ``hx``."""

    def __init__(self, kind: str, batch_first: bool, initial_state: bool = False, **kwargs) -> None:
        super().__init__()
        self.batch_first, self.initial_state = batch_first, initial_state
        self.embed = nn.Embedding(VOCAB, 5, padding_idx=0)
        self.rnn = getattr(nn, kind)(5, 6, batch_first=batch_first, **kwargs)
        width = kwargs.get("proj_size") or 6
        states = self.rnn.num_layers * (2 if self.rnn.bidirectional else 1)
        if initial_state:
            self.h0 = nn.Linear(5, states * width)
            self.c0 = nn.Linear(5, states * 6) if kind == "LSTM" else None
        self.head = nn.Linear(width * (2 if self.rnn.bidirectional else 1), CLASSES)
        self.state_head = nn.Linear(width, CLASSES, bias=False)

    def _state(self, layer: nn.Linear, pooled: torch.Tensor) -> torch.Tensor:
        """(B, d) -> (layers * directions, B, width), the layout of ``hx`` (contiguous: cuDNN's LSTM requires
        it)."""
        states = self.rnn.num_layers * (2 if self.rnn.bidirectional else 1)
        return torch.tanh(layer(pooled)).view(pooled.shape[0], states, -1).transpose(0, 1).contiguous()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        keep = (ids != 0).unsqueeze(-1).to(x.dtype)
        hx = None
        if self.initial_state:
            pooled = x.mean(1)
            h0 = self._state(self.h0, pooled)
            hx = (h0, self._state(self.c0, pooled)) if isinstance(self.rnn, nn.LSTM) else h0
        out, h_n = self.rnn(x if self.batch_first else x.transpose(0, 1), hx)
        h_n = h_n[0] if isinstance(h_n, tuple) else h_n
        out = out if self.batch_first else out.transpose(0, 1)
        pooled = (out * keep).sum(1) / keep.sum(1).clamp_min(1)
        return self.head(pooled) + self.state_head(h_n[-1])


class AttentionNet(nn.Module):
    """Embedding -> ``nn.MultiheadAttention`` -> mean over the unpadded positions -> head.

    ``cross``: the keys and values come from a second embedding of the reversed sequence of 2 more
    positions (kdim = vdim = 6 unless ``packed``), with a banded boolean mask (L, S), the values the keys
    themselves unless ``distinct`` (then 1.5 times them, another tensor); otherwise self-attention with the
    padding mask, and the attention weights also enter the loss unless ``weights`` is off (then the call
    asks for none)."""

    def __init__(
        self, batch_first: bool, cross: bool = False, packed: bool = False, weights: bool = True,
        distinct: bool = False, **kwargs,
    ) -> None:  # fmt: skip
        super().__init__()
        self.batch_first, self.cross, self.weights, self.distinct = batch_first, cross, weights, distinct
        self.embed = nn.Embedding(VOCAB, 8, padding_idx=0)
        dim = 8 if packed or not cross else 6
        if cross:
            self.memory = nn.Embedding(VOCAB, dim)
            kwargs.update(kdim=dim, vdim=dim)
        self.attn = nn.MultiheadAttention(8, 2, batch_first=batch_first, **kwargs)
        self.head = nn.Linear(8, CLASSES)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x, pad = self.embed(ids), _padding_mask(ids)
        keep = (ids != 0).unsqueeze(-1).to(x.dtype)
        layout = (lambda t: t) if self.batch_first else (lambda t: t.transpose(0, 1))
        if self.cross:
            memory_ids = torch.cat([ids[:, :2], ids.flip(1)], 1)  # 2 real keys first: no empty row
            memory = self.memory(memory_ids)
            length, source = ids.shape[1], memory_ids.shape[1]
            # True: not attended
            mask = torch.ones(length, source, dtype=torch.bool, device=ids.device).triu(3)
            key = layout(memory)
            out, _ = self.attn(
                layout(x),
                key,
                layout(1.5 * memory) if self.distinct else key,
                attn_mask=mask,
                key_padding_mask=_padding_mask(memory_ids),
                need_weights=self.weights,
            )
            weights_term = 0.0
        else:
            h = layout(x)
            out, weights = self.attn(h, h, h, key_padding_mask=pad, need_weights=self.weights)
            weights_term = weights.square().sum((1, 2))[:, None] if self.weights else 0.0
        pooled = (layout(out) * keep).sum(1) / keep.sum(1).clamp_min(1)
        return self.head(torch.tanh(pooled)) + weights_term


class EncoderNet(nn.Module):
    """Embedding -> ``nn.TransformerEncoderLayer`` (dropout 0, padding mask; ``causal``: a causal mask and
    ``is_causal`` hint) -> mean of unpadded -> head."""

    def __init__(self, batch_first: bool = True, norm_first: bool = False, causal: bool = False) -> None:
        super().__init__()
        self.batch_first, self.causal = batch_first, causal
        self.embed = nn.Embedding(VOCAB, 8, padding_idx=0)
        self.encoder = nn.TransformerEncoderLayer(
            8, 2, dim_feedforward=12, dropout=0.0, batch_first=batch_first, norm_first=norm_first
        )
        self.head = nn.Linear(8, CLASSES)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x, pad = self.embed(ids), _padding_mask(ids)
        keep = (ids != 0).unsqueeze(-1).to(x.dtype)
        mask = (
            nn.Transformer.generate_square_subsequent_mask(ids.shape[1], device=x.device, dtype=x.dtype)
            if self.causal
            else None
        )
        h = self.encoder(x if self.batch_first else x.transpose(0, 1), mask, pad, is_causal=self.causal)
        h = h if self.batch_first else h.transpose(0, 1)
        return self.head((h * keep).sum(1) / keep.sum(1).clamp_min(1))


class SharedEncoderNet(EncoderNet):
    """:class:`EncoderNet` whose one ``nn.TransformerEncoderLayer`` is applied twice (weights shared across
    depth, as a Universal Transformer's): two uses of every parameter in each forward, each attention call
    read off its own graph."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x, pad = self.embed(ids), _padding_mask(ids)
        keep = (ids != 0).unsqueeze(-1).to(x.dtype)
        h = self.encoder(self.encoder(x, src_key_padding_mask=pad), src_key_padding_mask=pad)
        return self.head((h * keep).sum(1) / keep.sum(1).clamp_min(1))


class Seq2SeqNet(nn.Module):
    """Embedding -> ``nn.Transformer`` (one encoder and one decoder layer, dropout 0; PyTorch's default
    time-major layout unless ``batch_first``): the decoder reads the sequence reversed, with a causal mask,
    and attends to the encoder's output with its padding mask -> mean of unpadded -> head."""

    def __init__(self, batch_first: bool = False) -> None:
        super().__init__()
        self.batch_first = batch_first
        self.embed = nn.Embedding(VOCAB, 8, padding_idx=0)
        self.transformer = nn.Transformer(
            8, 2, num_encoder_layers=1, num_decoder_layers=1, dim_feedforward=12, dropout=0.0,
            batch_first=batch_first,
        )  # fmt: skip
        self.head = nn.Linear(8, CLASSES)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x, pad = self.embed(ids), _padding_mask(ids)
        keep = (ids != 0).unsqueeze(-1).to(x.dtype)
        target = x.flip(1)
        causal = nn.Transformer.generate_square_subsequent_mask(ids.shape[1], device=x.device, dtype=x.dtype)
        layout = (lambda t: t) if self.batch_first else (lambda t: t.transpose(0, 1))
        h = self.transformer(
            layout(x), layout(target), tgt_mask=causal, src_key_padding_mask=pad, memory_key_padding_mask=pad
        )
        return self.head((layout(h) * keep).sum(1) / keep.sum(1).clamp_min(1))


class CellNet(nn.Module):
    """Embedding -> a user's loop over the steps of an ``nn.LSTMCell``/``GRUCell``/``RNNCell`` (one call per
    step, the state kept at padded positions) -> a head on the mean of the unpadded states plus one on the
    last state (and, for an LSTM cell, its cell state). ``initial_state``: the first state computed from the
    example's mean embedding, else the cell's zeros (``hx`` not passed)."""

    def __init__(self, kind: str, initial_state: bool = False, **kwargs) -> None:
        super().__init__()
        self.initial_state = initial_state
        self.embed = nn.Embedding(VOCAB, 5, padding_idx=0)
        self.cell = getattr(nn, kind)(5, 6, **kwargs)
        self.h0 = nn.Linear(5, 6 * (2 if kind == "LSTMCell" else 1)) if initial_state else None
        self.head = nn.Linear(6, CLASSES)
        self.state_head = nn.Linear(6, CLASSES, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        keep = (ids != 0).unsqueeze(-1).to(x.dtype)
        lstm = isinstance(self.cell, nn.LSTMCell)
        state = None  # h, or (h, c) for an LSTM cell, as (B, 6) tensors
        if self.initial_state:
            h0 = torch.tanh(self.h0(x.mean(1)))
            state = tuple(h0.chunk(2, -1)) if lstm else h0
        hs = []
        for t in range(ids.shape[1]):
            new = self.cell(x[:, t]) if state is None else self.cell(x[:, t], state)
            if state is not None:  # a padded step keeps the state
                pairs = zip(new, state, strict=True) if lstm else [(new, state)]
                kept = tuple(torch.where(keep[:, t] > 0, n, s) for n, s in pairs)
                new = kept if lstm else kept[0]
            state = new
            hs.append(state[0] if lstm else state)
        pooled = (torch.stack(hs, 1) * keep).sum(1) / keep.sum(1).clamp_min(1)
        return self.head(pooled) + self.state_head(state[0] + state[1] if lstm else state)


def classification_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    return F.cross_entropy(model(batch["ids"]), batch["y"], reduction="none")


MODELS = {
    "lstm_time_major_bidirectional_2_layers": lambda: RecurrentNet(
        "LSTM", False, bidirectional=True, num_layers=2
    ),
    "lstm_projected_initial_state": lambda: RecurrentNet(
        "LSTM", True, initial_state=True, proj_size=4, num_layers=2
    ),
    "gru_bidirectional_2_layers": lambda: RecurrentNet("GRU", True, bidirectional=True, num_layers=2),
    "gru_time_major_initial_state": lambda: RecurrentNet("GRU", False, initial_state=True),
    "rnn_relu_time_major": lambda: RecurrentNet("RNN", False, nonlinearity="relu", num_layers=2),
    "lstm_cell_initial_state": lambda: CellNet("LSTMCell", initial_state=True),
    "lstm_cell": lambda: CellNet("LSTMCell"),
    "gru_cell_initial_state": lambda: CellNet("GRUCell", initial_state=True),
    "rnn_cell_relu": lambda: CellNet("RNNCell", nonlinearity="relu"),
    "mha_self_weights": lambda: AttentionNet(True),
    "mha_time_major_self": lambda: AttentionNet(False),
    "mha_cross_kdim_bias_kv_zero_attn": lambda: AttentionNet(
        False, cross=True, add_bias_kv=True, add_zero_attn=True
    ),
    "mha_cross_packed_no_bias": lambda: AttentionNet(True, cross=True, packed=True, bias=False),
    # no weights returned: read off the call's graph (the key is the value; three tensors, packed or not)
    "mha_cross_packed_no_weights_time_major": lambda: AttentionNet(
        False, cross=True, packed=True, weights=False
    ),
    "mha_cross_distinct_no_weights": lambda: AttentionNet(
        True, cross=True, packed=True, weights=False, distinct=True
    ),
    "mha_cross_kdim_distinct_no_weights": lambda: AttentionNet(
        True, cross=True, weights=False, distinct=True
    ),
    "transformer_encoder": lambda: EncoderNet(True),
    "transformer_encoder_norm_first_causal": lambda: EncoderNet(True, norm_first=True, causal=True),
    "transformer_encoder_shared_twice": lambda: SharedEncoderNet(True),
    # PyTorch's default layout: the linear and norm layers see (T, B, d), read time-major once probed
    "transformer_encoder_time_major": lambda: EncoderNet(False),
    "transformer_seq2seq_time_major": lambda: Seq2SeqNet(False),
    "transformer_encoder_time_major_norm_first_causal": lambda: EncoderNet(
        False, norm_first=True, causal=True
    ),
}


def make_recurrent_case(name: str, batch_size: int = 6, length: int = 5, seed: int = 0):
    """(model, loss_fn, batch) of the named model: ids (B, length) with padding (id 0) at the end of about
    half the examples (every example keeps at least 2 tokens), labels y."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (batch_size, length), generator=gen)
    lengths = torch.randint(2, length + 1, (batch_size,), generator=gen)
    ids = ids.masked_fill(torch.arange(length)[None, :] >= lengths[:, None], 0)
    batch = {"ids": ids, "y": torch.randint(0, CLASSES, (batch_size,), generator=gen)}
    model = MODELS[name]().double()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))  # away from zero biases and identity norms
    return model.train(), classification_loss, batch
