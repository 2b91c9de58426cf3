"""``nn.Embedding``: the per-example gradient of the table is ``sum_t e_{idx_t} (x) dy_t`` (one-hot rows).

Its squared norm is ``sum_{t,s} [idx_t = idx_s] <dy_t, dy_s>`` (ghost norm with an index factor), so the
(V, d) per-example gradient is never formed. Positions equal to ``padding_idx`` receive no gradient.
Inputs of batch size 1 (position ids broadcast over the batch by Hugging Face models) are expanded to the
batch in the forward pass, so that each example's output gradient stays its own.

Hugging Face's scaled word embeddings (Gemma, BART, M2M100, XGLM, ...; Vaswani et al. 2017, sec. 3.4:
embeddings multiplied by sqrt(d_model)) return ``E[idx] * s``, so their per-example gradient is the table's
for the output gradient ``s * dy``; Inkling's normed embedding returns ``norm(E[idx])``, the table's for the
gradient at the norm's input.

Learned positions that compute their own indices (OPT's from the attention mask, ``cumsum(mask) * mask - 1``
offset by 2; MVP's and TrOCR's ``arange`` after a cache, offset by 2; Zhang et al. 2022, OPT, sec. 2.2;
Whisper's decoder's ``weight[position_ids]``) are looked up per example too: the rule reads the indices from
the module's own forward, run once more without recording under a mode that sees its ``F.embedding`` call on
the table (or its indexing by an integer tensor), and refuses a forward that does not return exactly one
lookup of its table (no index arithmetic of its own copied here). CPM-Ant's segment
position bias (its relative attention bias, one row per position bucket or pair of segments, a column per
head) is read so too; it returns its lookup moved to (B, heads, T_q, T_k).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from dpexp.privacy.per_example import Outer, PerExampleGrad
from dpexp.privacy.rules import CallLayout, first_output, register_rule


def _check(module: nn.Embedding) -> None:
    if module.max_norm is not None or module.scale_grad_by_freq or module.sparse:
        raise ValueError(
            f"{module!r}: Embedding with max_norm, scale_grad_by_freq or sparse=True is not supported by the "
            "privacy engine (the first two make one example's gradient depend on the others)."
        )


@register_rule(nn.Embedding, check=_check, expand_broadcast_input=True, position_wise=True)
def embedding_grads(module: nn.Embedding, idx: torch.Tensor, dy: torch.Tensor) -> dict[str, PerExampleGrad]:
    idx = idx.reshape(idx.shape[0], -1)
    g = dy.reshape(idx.shape[0], idx.shape[1], -1)
    if module.padding_idx is not None:
        g = g * (idx != module.padding_idx).unsqueeze(-1).to(g.dtype)
    return {"weight": Outer(idx, g, module.weight.shape, module.num_embeddings)}


_HF = "transformers.models"


def _register_table(*types: str, check: Callable[[nn.Module], None]) -> Callable:
    """Register a rule for Hugging Face embedding subclasses (and their copies) as for ``nn.Embedding``."""
    return register_rule(*types, check=check, expand_broadcast_input=True, position_wise=True, copies=True)


@_register_table(
    # forward: `super().forward(input_ids) * self.embed_scale.to(self.weight.dtype)` (a 0-dim buffer)
    f"{_HF}.gemma.modeling_gemma.GemmaTextScaledWordEmbedding",
    # forward: `super().forward(input_ids) * self.embed_scale` (a float)
    f"{_HF}.m2m_100.modeling_m2m_100.M2M100ScaledWordEmbedding",
    check=_check,
)
def scaled_embedding_grads(
    module: nn.Embedding, idx: torch.Tensor, dy: torch.Tensor
) -> dict[str, PerExampleGrad]:
    scale = module.embed_scale
    return embedding_grads(module, idx, dy * (scale.to(dy.dtype) if torch.is_tensor(scale) else scale))


def _check_normed(module: nn.Embedding) -> None:
    _check(module)
    if any(True for _ in module.embed_norm.children()):
        raise ValueError(
            f"{type(module).__name__}: its embed_norm has submodules, which the normed-embedding rule cannot "
            "run outside the model's hooks. Freeze the embedding table (weight.requires_grad_(False))."
        )


@_register_table(
    # forward: `self.embed_norm(super().forward(input_ids))`, the norm a submodule with its own rule
    f"{_HF}.inkling.modeling_inkling.InklingNormedEmbedding",
    check=_check_normed,
)
def normed_embedding_grads(
    module: nn.Embedding, idx: torch.Tensor, dy: torch.Tensor
) -> dict[str, PerExampleGrad]:
    """Inkling's normed embedding returns ``norm(E[idx])``: the table's per-example gradient is that of
    ``dz = J^T dy`` at ``e = E[idx]``, the norm's backward taken by autograd through its own forward, run
    again outside the model's hooks. Without the rule the fallback formed each example's (V, d) table
    gradient (179 of a 1,247 ms private step, d = 256, V = 32,000, B = 16, T = 64)."""
    with torch.enable_grad():
        e = F.embedding(idx, module.weight.detach(), module.padding_idx).requires_grad_()
        (dz,) = torch.autograd.grad(module.embed_norm.forward(e), e, dy)
    return embedding_grads(module, idx, dz)


class _Lookups(TorchFunctionMode):
    """Records every lookup of rows of ``weight`` during a forward: ``F.embedding(indices, weight)`` and
    ``weight[indices]`` with an integer tensor, as (indices, result, whether by indexing)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight, self.calls = weight, []

    def __torch_function__(self, func: Callable, types: tuple, args: tuple = (), kwargs: dict | None = None):
        result = func(*args, **(kwargs or {}))
        if func is F.embedding and len(args) > 1 and args[1] is self.weight:
            self.calls.append((args[0], result, False))
        elif func is torch.Tensor.__getitem__ and args[0] is self.weight and _rows(args[1]):
            self.calls.append((args[1], result, True))
        return result


def _rows(index: Any) -> bool:
    return torch.is_tensor(index) and not index.is_floating_point() and index.dtype != torch.bool


def _one_lookup(
    module: nn.Module, table: torch.Tensor, args: tuple, kwargs: dict[str, Any], fix: str
) -> tuple:
    """``(indices, looked up, by indexing, output)``: the module's forward run once more without recording,
    and its one lookup of ``table`` (:class:`_Lookups`); refused (``fix`` offered) where it makes another
    number of lookups."""
    lookups = _Lookups(table)
    with torch.no_grad(), lookups:
        output = type(module).forward(module, *args, **kwargs)
    if len(lookups.calls) != 1:
        raise ValueError(
            f"its forward makes {len(lookups.calls)} lookups of its table, where the rule reads the indices "
            f"of its one lookup; {fix}"
        )
    return (*lookups.calls[0], output)


def lookup_inputs(module: nn.Embedding, args: tuple, kwargs: dict[str, Any]) -> tuple[torch.Tensor]:
    """``(indices,)``: the rows a table that computes its own indices looks up, from its forward run once more
    without recording; refused unless that forward returns one lookup of its table, unchanged."""
    fix = "freeze the table or register a rule"
    indices, looked_up, by_index, output = _one_lookup(module, module.weight, args, kwargs, fix)
    if looked_up is not output:
        raise ValueError(f"its forward returns something else than its lookup of its table; {fix}")
    if by_index and module.padding_idx is not None:  # indexing passes a gradient to the padding row too
        raise ValueError(f"it indexes its table, which has a padding_idx the lookup does not apply; {fix}")
    return (indices,)


# Not their copies: BART's, mBART's, PLBART's and BioGPT's are looked up once for all examples and declared
# shared (dpexp.privacy.shared).
@register_rule(
    # forward: `super().forward(position_ids + self.offset)`, the ids computed from its arguments
    f"{_HF}.opt.modeling_opt.OPTLearnedPositionalEmbedding",
    f"{_HF}.mvp.modeling_mvp.MvpLearnedPositionalEmbedding",
    f"{_HF}.trocr.modeling_trocr.TrOCRLearnedPositionalEmbedding",
    # forward: `self.weight[position_ids]` (the decoder passes arange(T) repeated to the batch), or a slice
    # of the rows for the text's length where no position ids are given (no lookup: refused)
    f"{_HF}.whisper.modeling_whisper.WhisperPositionalEmbedding",
    check=_check,
    call=CallLayout(lookup_inputs, first_output),
)
def learned_position_grads(
    module: nn.Embedding, call: tuple[torch.Tensor], dy: torch.Tensor
) -> dict[str, PerExampleGrad]:
    """``call = (indices (B, T),)`` as the module looked them up, ``dy`` (B, T, d): the table's rule."""
    return embedding_grads(module, call[0], dy)


# forward: the (B, T, T) buckets of each query-key pair from the positions and segments of its arguments, then
# `F.embedding(buckets, self.relative_attention_bias).permute(0, 3, 1, 2).contiguous()`
CPMANT_SEGMENT_BIAS = f"{_HF}.cpmant.modeling_cpmant.CpmAntSegmentPositionEmbedding"


def segment_bias_inputs(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[torch.Tensor]:
    """``(buckets (B, T_q, T_k),)``: the rows CPM-Ant's segment position bias looks up, from its forward run
    once more; refused unless that forward returns its one lookup (B, T_q, T_k, heads) as (B, heads, T_q,
    T_k)."""
    fix = "freeze relative_attention_bias or register a rule"
    buckets, looked_up, _, output = _one_lookup(module, module.relative_attention_bias, args, kwargs, fix)
    if not (torch.is_tensor(output) and torch.equal(output, looked_up.permute(0, 3, 1, 2))):
        raise ValueError(
            f"its forward returns something else than its lookup moved to (B, heads, T, T); {fix}"
        )
    return (buckets,)


@register_rule(CPMANT_SEGMENT_BIAS, call=CallLayout(segment_bias_inputs, first_output))
def segment_bias_grads(
    module: nn.Module, call: tuple[torch.Tensor], dy: torch.Tensor
) -> dict[str, PerExampleGrad]:
    """CPM-Ant's relative attention bias (a table of its position buckets and segment pairs, one column per
    head): the table's rule for the buckets ``call[0]`` (B, T_q, T_k) and the gradient at the lookup, ``dy``
    (B, heads, T_q, T_k) moved back to (B, T_q*T_k, heads)."""
    table = module.relative_attention_bias
    buckets = call[0].reshape(call[0].shape[0], -1)
    g = dy.permute(0, 2, 3, 1).reshape(*buckets.shape, dy.shape[1])
    return {"relative_attention_bias": Outer(buckets, g, table.shape, table.shape[0])}
