"""``nn.LSTM``, ``nn.GRU`` and ``nn.RNN``: per-example gradients from the pre-activations of their maps.

Every weight of a recurrent layer enters through a linear map applied at every step t, in every layer l and
direction: the input map ``a_t = W_ih x_t + b_ih`` and the recurrent map ``c_t = W_hh h_{t-1} + b_hh``
(``x_t`` the layer's input, the previous layer's output for l > 0; ``h_{t-1}`` its previous hidden state,
``h_0`` given or zero), and for an LSTM with ``proj_size > 0`` the projection ``h_t = W_hr m_t``,
``m_t = o_t * tanh(c_t)``. The gates are functions of ``a_t`` and ``c_t`` (PyTorch's documented
equations: LSTM ``i, f, g, o = split(a_t + c_t)``; GRU ``r, z`` from ``a + c``, ``n = tanh(a_n + r * c_n)``;
RNN ``h_t = tanh(a_t + c_t)`` or relu). The loss reaches ``W_ih`` only through the ``a_t``, so example i's
gradients are sums over its steps (Bu et al. 2023, eq. 2, once per map):

    dW_ih = sum_t da_t (x) x_t,   db_ih = sum_t da_t,   dW_hh = sum_t dc_t (x) h_{t-1},   db_hh = sum_t dc_t,
    dW_hr = sum_t dh_t (x) m_t,

in the factored :class:`~dpexp.privacy.per_example.Outer` / ``Dense`` forms (ghost or instantiated norms,
cross terms and clipped sums follow). The gradients ``da_t, dc_t, dh_t`` of every example at every step come
from one recomputation of the layer from its captured input, with its parameters detached and a zero
tensor added to each map's output (one for both maps of an LSTM or RNN, whose step sees only ``a_t + c_t``,
so ``dc_t = da_t``), and one autograd backward of ``<outputs, dy>`` to those zeros; ``dy``
holds the gradients of every output the engine captured (output, ``h_n``, ``c_n``; zeros for an unused
one). Opacus obtains the same sums by replacing the layer with its own re-implementation (``DPLSTM``, built
from ``nn.Linear`` cells); here the user's module runs unchanged (cuDNN kernels included), only the rule
recomputes, at the cost of one more forward and backward of the layer.

The engine sees the call batch-first, from the module's ``batch_first`` (``h_0``/``h_n`` always have the
batch in dim 1); the probe establishes it. Refused at the call, with the fix: an unbatched (2-D) input, a
``PackedSequence`` and dropout between layers in training (its mask, drawn inside the fused kernel, cannot
be replayed by the recomputation).

``nn.LSTMCell``, ``nn.GRUCell`` and ``nn.RNNCell`` are one step of the same maps (T = 1, one layer and
direction, parameters without the ``_l0`` suffix), called by the user's loop once per step: each call is one
use of the cell, recomputed the same way, and the engine adds an example's gradients over the calls.
Refused at the call: an unbatched (1-D) input.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import PackedSequence

from dpexp.privacy.per_example import Dense, Outer, PerExampleGrad
from dpexp.privacy.rules import CallLayout, register_rule

Recurrent = nn.LSTM | nn.GRU | nn.RNN
Cell = nn.LSTMCell | nn.GRUCell | nn.RNNCell


def _hidden_out(module: Recurrent) -> int:
    """Width of ``h_t``: ``proj_size`` for a projected LSTM, else ``hidden_size``."""
    return getattr(module, "proj_size", 0) or module.hidden_size


def recurrent_inputs(module: Recurrent, args: tuple, kwargs: dict[str, Any]) -> tuple:
    """``(x, h_0, c_0)``: x (B, T, input_size), the initial states (B, layers * directions, width) or None."""
    x = args[0] if args else kwargs["input"]
    hx = args[1] if len(args) > 1 else kwargs.get("hx")
    if isinstance(x, PackedSequence):
        raise ValueError(
            "got a PackedSequence, whose data has no batch dimension; pass the padded batch tensor (e.g. "
            "pad_packed_sequence) and leave padded positions out of the loss"
        )
    if x.dim() != 3:
        raise ValueError(
            f"got an unbatched input of shape {tuple(x.shape)}; the privacy engine needs the batch in the "
            "input: pass (B, T, input_size) with batch_first=True, or (T, B, input_size)"
        )
    if module.training and module.dropout > 0 and module.num_layers > 1:
        raise ValueError(
            f"applies dropout (p={module.dropout}) between its layers in training, whose mask the "
            "per-example gradient rule cannot replay; set dropout=0 (apply nn.Dropout between layers instead)"
        )
    h0, c0 = hx if isinstance(module, nn.LSTM) and hx is not None else (hx, None)
    return (
        x if module.batch_first else x.transpose(0, 1),
        None if h0 is None else h0.transpose(0, 1),
        None if c0 is None else c0.transpose(0, 1),
    )


def recurrent_output_grad(module: Recurrent, grads: list[torch.Tensor | None]) -> torch.Tensor:
    """Gradients of ``(output, h_n[, c_n])`` packed batch-first: (B, T * D * width + layers * D * (width
    [+ hidden_size]))."""
    out, *states = grads
    out = out if module.batch_first else out.transpose(0, 1)
    parts = [out, *(s.transpose(0, 1) for s in states)]
    return torch.cat([p.reshape(p.shape[0], -1) for p in parts], 1)


def _step(
    module: Recurrent | Cell, a: torch.Tensor, c: torch.Tensor, h: torch.Tensor, cell: torch.Tensor | None
):
    """One step from the maps' outputs ``a_t``, ``c_t`` and the previous state: ``(m_t or h_t, cell_t)``.
    On CUDA an LSTM's and a GRU's gate arithmetic is PyTorch's own fused kernel for it (what ``nn.LSTMCell``
    and ``nn.GRUCell`` run there; the equations below): one launch forward and one backward a step in place
    of about twelve and twenty, which bound the recomputation on a GPU (stop 60: 8,709 launches in an LSTM's
    bk step, ``results/bench/gpu_stop60/call3/kernels_lstm.log``)."""
    fused = a.is_cuda
    if isinstance(module, nn.LSTM | nn.LSTMCell):
        if fused:
            h, cell, _ = torch.ops.aten._thnn_fused_lstm_cell(a, c, cell)
            return h, cell
        i, f, g, o = (a + c).chunk(4, -1)
        cell = torch.sigmoid(f) * cell + torch.sigmoid(i) * torch.tanh(g)
        return torch.sigmoid(o) * torch.tanh(cell), cell
    if isinstance(module, nn.GRU | nn.GRUCell):
        if fused:
            return torch.ops.aten._thnn_fused_gru_cell(a, c, h)[0], None
        (ar, az, an), (cr, cz, cn) = a.chunk(3, -1), c.chunk(3, -1)
        r, z = torch.sigmoid(ar + cr), torch.sigmoid(az + cz)
        n = torch.tanh(an + r * cn)
        return (1 - z) * n + z * h, None
    return (torch.tanh if module.nonlinearity == "tanh" else F.relu)(a + c), None


def _direction(
    module: Recurrent | Cell,
    suffix: str,
    inp: torch.Tensor,
    h: torch.Tensor,
    cell: torch.Tensor | None,
    zeros: dict[str, torch.Tensor],
    factors: dict[str, torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One layer and direction over the sequence ``inp`` (B, T, in) from the states ``h``, ``cell``, with a
    zero added to each map's output (``zeros``, by parameter name) and each map's input at every step kept
    in ``factors``: ``(outputs (B, T, width), h_n, c_n)``. Runs in the weights' dtype: under autocast the
    layer ran in half precision, and its recorded inputs are recomputed from in float32 (the norms and clipped
    sums are those of these gradients, which differ from autograd's by half-precision rounding)."""
    w = {n: getattr(module, n + suffix, None) for n in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")}
    w = {n: None if t is None else t.detach() for n, t in w.items()}
    dtype = w["weight_ih"].dtype
    inp, h, cell = inp.to(dtype), h.to(dtype), None if cell is None else cell.to(dtype)
    batch, steps = inp.shape[:2]
    z_a = inp.new_zeros(batch, steps, w["weight_ih"].shape[0], requires_grad=True)
    # an LSTM's and an RNN's step sees only a_t + c_t, so dc_t = da_t: one zero serves both maps (a GRU's
    # reset gate multiplies part of c_t, so it needs its own)
    z_c = inp.new_zeros(z_a.shape, requires_grad=True) if isinstance(module, nn.GRU | nn.GRUCell) else None
    zeros["weight_ih" + suffix], zeros["weight_hh" + suffix] = z_a, z_a if z_c is None else z_c
    factors["weight_ih" + suffix] = inp.detach()
    projection = getattr(module, "weight_hr" + suffix, None)
    if projection is not None:
        z_h = zeros["weight_hr" + suffix] = inp.new_zeros(batch, steps, h.shape[-1], requires_grad=True)
        z_h_steps = z_h.unbind(1)
    # one unbind per sequence, not a select per step: each select's backward fills a (B, T, width) zero
    a = (F.linear(inp, w["weight_ih"], w["bias_ih"]) + z_a).unbind(1)
    z_c_steps = None if z_c is None else z_c.unbind(1)
    hs, previous, ms = [None] * steps, [None] * steps, [None] * steps
    for t in reversed(range(steps)) if suffix.endswith("_reverse") else range(steps):
        previous[t] = h
        c = F.linear(h, w["weight_hh"], w["bias_hh"])
        if z_c_steps is not None:
            c = c + z_c_steps[t]
        h, cell = _step(module, a[t], c, h, cell)
        if projection is not None:
            ms[t] = h
            h = F.linear(h, projection.detach()) + z_h_steps[t]
        hs[t] = h
    factors["weight_hh" + suffix] = torch.stack(previous, 1).detach()
    if projection is not None:
        factors["weight_hr" + suffix] = torch.stack(ms, 1).detach()
    return torch.stack(hs, 1), h, cell


def recurrent_grads(module: Recurrent, x: tuple, dy: torch.Tensor) -> dict[str, PerExampleGrad]:
    """Per-example gradients of every weight of every layer and direction, see the module docstring."""
    inp, h0, c0 = x
    batch = inp.shape[0]
    dirs, lstm = 2 if module.bidirectional else 1, isinstance(module, nn.LSTM)
    zeros: dict[str, torch.Tensor] = {}  # parameter name -> zero added to its map's output
    factors: dict[str, torch.Tensor] = {}  # parameter name -> the map's input at every step (B, T, in)
    h_n, c_n = [], []
    with torch.enable_grad():
        inp = inp.detach()
        for layer in range(module.num_layers):
            outputs = []
            for d in range(dirs):
                k = layer * dirs + d
                h = inp.new_zeros(batch, _hidden_out(module)) if h0 is None else h0[:, k].detach()
                cell = inp.new_zeros(batch, module.hidden_size) if c0 is None else c0[:, k].detach()
                suffix = f"_l{layer}" + ("_reverse" if d else "")
                out, h, cell = _direction(module, suffix, inp, h, cell if lstm else None, zeros, factors)
                outputs.append(out)
                h_n.append(h)
                c_n.append(cell)
            inp = torch.cat(outputs, -1)
        results = [inp, torch.stack(h_n, 1)] + ([torch.stack(c_n, 1)] if lstm else [])
        sizes = [r[0].numel() for r in results]
        dys = [g.view_as(r).to(r.dtype) for g, r in zip(dy.split(sizes, 1), results, strict=True)]
    return _map_grads(module, results, dys, zeros, factors)


def _map_grads(
    module: Recurrent | Cell,
    results: list[torch.Tensor],
    dys: list[torch.Tensor],
    zeros: dict[str, torch.Tensor],
    factors: dict[str, torch.Tensor],
) -> dict[str, PerExampleGrad]:
    """``da_t``, ``dc_t`` (``dh_t``) by one backward of ``<results, dys>`` to the zeros added to the maps'
    outputs, and every weight's per-example gradient from them and the maps' inputs ``factors``."""
    distinct = list({id(z): z for z in zeros.values()}.values())  # an LSTM's two maps share one zero
    with torch.enable_grad():
        dzs = torch.autograd.grad(results, distinct, dys, allow_unused=True)
    found = {id(z): torch.zeros_like(z) if dz is None else dz for z, dz in zip(distinct, dzs, strict=True)}
    grads: dict[str, PerExampleGrad] = {}
    for name, zero in zeros.items():
        dz = found[id(zero)]
        grads[name] = Outer(dz, factors[name], getattr(module, name).shape, dz.shape[-1])
        bias = name.replace("weight", "bias")
        if bias != name and getattr(module, bias, None) is not None:
            grads[bias] = Dense(dz.sum(1))
    return grads


register_rule(nn.LSTM, nn.GRU, nn.RNN, call=CallLayout(recurrent_inputs, recurrent_output_grad))(
    recurrent_grads
)


def cell_inputs(module: Cell, args: tuple, kwargs: dict[str, Any]) -> tuple:
    """``(x, h, c)``: x (B, input_size), the previous state h (B, hidden_size) and, for an LSTM cell, c;
    None where not given (zeros)."""
    x = args[0] if args else kwargs["input"]
    hx = args[1] if len(args) > 1 else kwargs.get("hx")
    if x.dim() != 2:
        raise ValueError(
            f"got an unbatched input of shape {tuple(x.shape)}; the privacy engine needs the batch in the "
            "input: pass (B, input_size)"
        )
    h, c = hx if isinstance(module, nn.LSTMCell) and hx is not None else (hx, None)
    return x, h, c


def cell_output_grad(module: Cell, grads: list[torch.Tensor | None]) -> torch.Tensor:
    """Gradients of ``h'`` (and ``c'`` of an LSTM cell) side by side: (B, hidden_size [* 2])."""
    return torch.cat([g.reshape(g.shape[0], -1) for g in grads], 1)


@register_rule(nn.LSTMCell, nn.GRUCell, nn.RNNCell, call=CallLayout(cell_inputs, cell_output_grad))
def cell_grads(module: Cell, x: tuple, dy: torch.Tensor) -> dict[str, PerExampleGrad]:
    """Per-example gradients of a cell's weights for one call: the recurrent layer's with one step."""
    inp, h, c = x
    batch, lstm = inp.shape[0], isinstance(module, nn.LSTMCell)
    zeros: dict[str, torch.Tensor] = {}
    factors: dict[str, torch.Tensor] = {}
    with torch.enable_grad():
        h = inp.new_zeros(batch, module.hidden_size) if h is None else h.detach()
        cell = (inp.new_zeros(batch, module.hidden_size) if c is None else c.detach()) if lstm else None
        _, h, cell = _direction(module, "", inp.detach().unsqueeze(1), h, cell, zeros, factors)
    results = [h] + ([cell] if lstm else [])
    dys = [g.view_as(r).to(r.dtype) for g, r in zip(dy.split(module.hidden_size, 1), results, strict=True)]
    return _map_grads(module, results, dys, zeros, factors)
