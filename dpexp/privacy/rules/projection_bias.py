"""Biases a module adds to the output of its own bias-free projection: DeBERTa's (v1; He et al. 2021,
DeBERTa: Decoding-enhanced BERT with Disentangled Attention, sec. 3.1) ``DisentangledSelfAttention``, whose
``in_proj`` (an ``nn.Linear`` without bias, its own layer) computes the queries, keys and values of every
head at once, and which adds ``q_bias`` to the queries and ``v_bias`` to the values:

    qp = in_proj(x),   q[h, t] = qp[t, h, 0] + q_bias[h],   v[h, t] = qp[t, h, 2] + v_bias[h],

with ``qp`` (B, T, heads * 3 * D) read per head as (heads, 3, D) (its ``transpose_for_scores`` and
``chunk(3)``). A bias's gradient is the gradient of what it is added to, so example i's is a sum over its
positions of the gradient at ``in_proj``'s output,

    d q_bias_i[h] = sum_t dqp_i[t, h, 0],   d v_bias_i[h] = sum_t dqp_i[t, h, 2],

which the rule reads there (an output tap): exact, whatever the attention does with them after (scaling,
the disentangled content-to-position and position-to-content terms, the masked softmax). Without the rule
the module took the exact fallback, which recomputed the whole attention per example. A forward that does
not call ``in_proj`` (the ``query_states`` path, which reads its weight) is refused by the verification.

ConvBERT's ``SeparableConv1D`` (Jiang et al. 2020, sec. 3.2: a depthwise then a pointwise ``nn.Conv1d``,
both bias-free and rules of their own) adds its ``bias`` (C_out, 1) to the pointwise output last, so its
per-example gradient is ``d bias_i = sum_t dy_i[:, t]`` from the gradient at the module's output.

GPT-NeoX-Japanese's last ``GPTNeoXJapaneseAttention`` returns its ``dense_bias`` beside the output of its
bias-free ``dense`` projection, and the decoder layer adds it there before dropout and the residual
(``bias_dropout_add``): ``d dense_bias_i = sum_t d dense_i[t]``, read at ``dense``'s output (an output tap).
Without the rule the module's third output, the parameter itself, reached the loss without a row per example
and the model was refused. That the caller adds the returned bias to ``dense``'s output and nowhere else is
what the verification's check of the example sums against autograd's gradient establishes.
"""

from __future__ import annotations

import torch
from torch import nn

from dpexp.privacy.per_example import Dense, PerExampleGrad
from dpexp.privacy.rules import as_sequence, refuse, register_rule, unknown_parameters

_DEBERTA = "transformers.models.deberta.modeling_deberta.DisentangledSelfAttention"
_BIASES = {"q_bias": 0, "v_bias": 2}  # parameter -> its block of each head's (query, key, value)


def _check(module: nn.Module) -> None:
    own = {name for name, p in module.named_parameters(recurse=False) if p.requires_grad}
    reason = None
    if own - set(_BIASES):
        reason = f"it owns parameters {sorted(own - set(_BIASES))} the rule does not know"
    elif not isinstance(getattr(module, "in_proj", None), nn.Module):
        reason = "it has no in_proj submodule, at whose output the rule reads the biases' gradients"
    refuse(module, "projection-bias", "module", reason, "Otherwise freeze q_bias and v_bias.")


@register_rule(_DEBERTA, check=_check, tap="in_proj", tap_output=True)
def projection_bias_grads(
    module: nn.Module, qp: torch.Tensor, d_qp: torch.Tensor
) -> dict[str, PerExampleGrad]:
    """``d_qp``: (B, T, heads * 3 * D), the gradient at ``in_proj``'s output; returns ``d q_bias`` and
    ``d v_bias`` (B, heads * D) by the sums of the module docstring."""
    blocks = d_qp.unflatten(-1, (module.num_attention_heads, 3, -1)).sum(1)  # (B, heads, 3, D)
    return {
        name: Dense(blocks[:, :, k].flatten(1).to(getattr(module, name).dtype)) for name, k in _BIASES.items()
    }


def _check_separable(module: nn.Module) -> None:
    reason = unknown_parameters(module, {"bias"})
    refuse(module, "separable-convolution bias", "module", reason, "Freeze them, or register a rule for it.")


@register_rule("transformers.models.convbert.modeling_convbert.SeparableConv1D", check=_check_separable)
def separable_bias_grads(module: nn.Module, x: torch.Tensor, dy: torch.Tensor) -> dict[str, PerExampleGrad]:
    """``dy``: (B, C_out, T) at the module's output; returns ``d bias`` (B, C_out, 1)."""
    return {"bias": Dense(dy.sum(2, keepdim=True).to(module.bias.dtype))}


def _check_returned_bias(module: nn.Module) -> None:
    reason = unknown_parameters(module, {"dense_bias"})
    if reason is None and not isinstance(getattr(module, "dense", None), nn.Module):
        reason = "it has no dense submodule, at whose output the rule reads the bias's gradient"
    refuse(module, "returned-bias", "module", reason, "Otherwise freeze dense_bias.")


@register_rule(
    "transformers.models.gpt_neox_japanese.modeling_gpt_neox_japanese.GPTNeoXJapaneseAttention",
    check=_check_returned_bias,
    tap="dense",
    tap_output=True,
)
def returned_bias_grads(
    module: nn.Module, out: torch.Tensor, d_out: torch.Tensor
) -> dict[str, PerExampleGrad]:
    """``d_out``: (B, T, d) at ``dense``'s output; returns ``d dense_bias`` (B, d), the sum over positions."""
    return {"dense_bias": Dense(as_sequence(d_out).sum(1).to(module.dense_bias.dtype))}
