"""Weight-standardised convolutions: ``dpexp.layers.WSConv2d`` (De et al. 2022, used by He et al. A.1), timm's
``StdConv2d`` and Hugging Face's ``WeightStandardizedConv2d`` (BiT, Kolesnikov et al. 2020, sec. 3.1; its
copies, such as ViT-hybrid's) and timm's ``ScaledStdConv2d`` (NF-ResNets and NFNets, Brock et
al. 2021, sec. 3: scaled weight standardisation with a learnable gain per output channel), each also in
timm's ``*Same`` form (TensorFlow's SAME padding, applied to the input first as the module does).

The convolution uses ``w_hat = (w - mean(w)) / s`` per output channel, ``s = sqrt(var(w) + eps)``, so the
per-example gradient of the raw weight is ``J^T g_hat_i`` with ``g_hat_i`` the plain convolution's
per-example gradient (w.r.t. ``w_hat``) and, per output row of p entries,

    J^T u = (u - mean(u) - w_hat <w_hat, u> / p) / s.

J is the same for every example, so the clipped sum is ``J^T (sum_i c_i g_hat_i)``, and the squared norm
expands (using ``sum(w_hat) = 0``) to

    ||J^T u||^2 = (||u||^2 - p mean(u)^2 + <w_hat, u>^2 (||w_hat||^2 / p^2 - 2 / p)) / s^2,

whose three terms all have ghost forms: ``||u_r||^2 / s_r^2`` is the ghost norm with ``dy`` scaled by
``1/s``; ``mean(u_r) = sum_t dy_{t,r} sum(a_t) / p``; ``<w_hat_r, u_r> = sum_t dy_{t,r} <a_t, w_hat_r>``,
where ``<a_t, w_hat_r>`` is the layer's own bias-free output and ``sum(a_t) = <a_t, 1>`` a convolution of the
input's channel sum with a kernel of ones. The output is kept from the forward pass where a ghost form may be
the cheapest (:func:`keeps_output`); where it was not kept, or was modified in place since, it is recomputed
(one bias-free convolution of the input with ``w_hat``, costed as such).

Scaled weight standardisation convolves with ``gamma_r w_hat_r``, ``gamma_r = gain_r * scale`` (``scale =
gamma / sqrt(p)``): the per-example gradient with respect to ``w_hat_r`` is ``gamma_r`` times the plain
convolution's, i.e. that of output gradients ``gamma_r dy_r``, and the gain's is
``scale <w_hat_r, g'_{i,r}> = scale sum_t dy_{i,t,r} <a_{i,t}, w_hat_r>``, from the same responses
``<a_t, w_hat_r>`` (recomputed once: the layer's output holds ``gamma_r`` times them).
"""

from __future__ import annotations

import copy
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from dpexp.layers import WSConv2d, weight_standardization
from dpexp.privacy.per_example import Dense, NormMode, PerExampleGrad, joined
from dpexp.privacy.rules import register_rule
from dpexp.privacy.rules.conv import ConvWeightGrads, check_conv, explicitly_padded


class Standardized(PerExampleGrad):
    """``g_i = J^T g_hat_i`` with ``g_hat_i`` the plain convolution's per-example gradients."""

    def __init__(
        self,
        inner: ConvWeightGrads,
        weight: torch.Tensor,
        eps: float,
        output: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
    ) -> None:
        """``output`` (B, C_out, *out), if known: ``<a_t, w_hat_r> + bias_r`` at every output position (the
        layer's own output, or its responses and no ``bias``)."""
        self.inner, self.shape, self.output, self.bias, self.eps = inner, weight.shape, output, bias, eps
        self.w_hat, self.s = weight_standardization(weight.detach(), eps)  # (C_out, p), (C_out, 1)
        self.p = self.w_hat.shape[1]

    @property
    def batch_size(self) -> int:
        return self.inner.batch_size

    def _vjp(self, u: torch.Tensor) -> torch.Tensor:
        """``J^T u`` for u of shape (..., C_out, p): row r is ``u_r / s_r`` plus ``w_hat_r`` and a constant,
        each times a per-row factor (two fused passes writing the result, not five)."""
        proj = torch.einsum("...rp,rp->...r", u, self.w_hat).unsqueeze(-1)
        inv_s = 1 / self.s
        out = torch.addcmul(u.mean(-1, keepdim=True) * -inv_s, u, inv_s)
        return out.addcmul_(self.w_hat, proj * (-inv_s / self.p))

    def instantiate(self) -> torch.Tensor:
        return joined(self.instantiate_chunks())

    def instantiate_chunks(self) -> list[torch.Tensor]:
        return [
            self._vjp(u.view(len(u), *self.w_hat.shape)).view(len(u), *self.shape)
            for u in self.inner.per_example_chunks()
        ]

    def retain(self, release: bool = False, max_values: int = 0) -> None:
        self.inner.retain(release, max_values)

    def held_extra_values(self) -> int | None:
        return self.inner.held_extra_values()

    def _masked(self, keep: torch.Tensor) -> Standardized:
        other = copy.copy(self)  # the same standardised weight; the kept output serves the norms only
        other.inner, other.output = self.inner.masked(keep), None
        return other

    def _weighted_sum(self, coef: torch.Tensor) -> torch.Tensor:
        return self._vjp(self.inner.weighted_sum(coef).view(self.w_hat.shape)).view(self.shape)

    def _responses(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``<a_t, w_hat_r>`` (B, C_out, T) and ``sum(a_t)`` (B, G, T) for every output position t and group
        (of G: a grouped convolution's patch ``a_t`` of row r holds only its group's input channels), in
        ``dtype``: the first read off the kept output where it has that dtype (under autocast it has not),
        else one bias-free convolution of the input with ``w_hat``; the second from each group's channel
        sum."""
        module = self.inner.module
        x, padding = explicitly_padded(module, self.inner.x.to(dtype))
        conv = partial(F.conv2d, bias=None, stride=module.stride, padding=padding, dilation=module.dilation)
        groups = module.groups
        ones = x.new_ones(groups, 1, *self.shape[2:])
        channel_sums = x.unflatten(1, (groups, -1)).sum(2)  # (B, G, H, W)
        sums = conv(channel_sums, ones, groups=groups).flatten(2)
        if self.output is not None and self.output.dtype == dtype:
            projections = self.output.flatten(2)
            if self.bias is not None:
                projections = projections - self.bias.detach().to(dtype).unsqueeze(-1)
        else:
            projections = responses(module, self.inner.x.to(dtype), self.w_hat.to(dtype)).flatten(2)
        return projections, sums

    def norm_sq(self, mode: NormMode = "auto") -> torch.Tensor:
        """From three per-row statistics of ``u = g_hat_i``: ``||u_r||^2 / s_r^2`` (summed), ``sum(u_r)``
        and ``<w_hat_r, u_r>``, from the instantiated ``u`` (never forming ``J^T u``) or by the ghost form:
        the inner convolution's ghost norm with ``dy`` scaled by ``1 / s``, and ``sum_t dy_{t,r} <a_t, v>``
        for ``v = 1`` and ``v = w_hat_r`` (:meth:`_responses`: costed as ``T C_out p`` per example on top of
        the ghost norm where the output was not kept). The kept output is dropped here: in flat clipping the
        gradients wait for the whole backward pass, and a second norm would recompute it."""
        dtype = torch.promote_types(self.w_hat.dtype, torch.float32)
        w_hat, s = self.w_hat.to(dtype), self.s.squeeze(1).to(dtype)
        dy = self.inner.dy
        method = self.inner.norm_method(mode, ghost_extra=self._ghost_extra(dtype))
        if method != "instantiate":
            g = dy.to(dtype)
            scaled = self.inner.ghost_norm_sq(g / s.view(-1, *[1] * (g.dim() - 2)), method)
            projections, sums = self._responses(dtype)
            g = g.flatten(2)
            total = torch.einsum("bgrt,bgt->bgr", g.unflatten(1, (sums.shape[1], -1)), sums).flatten(1)
            proj = torch.einsum("brt,brt->br", g, projections)
        else:
            stats = []  # per chunk: ||u_r||^2, sum(u_r), <w_hat_r, u_r>, each (b, C_out)
            for u in self.inner.per_example_chunks():
                u = u.view(len(u), *self.w_hat.shape).to(dtype)
                squares = torch.linalg.vector_norm(u, dim=-1).square()  # fused: no squared temporary
                stats.append((squares, u.sum(-1), torch.einsum("brp,rp->br", u, w_hat)))
            squares, total, proj = (torch.cat(column) for column in zip(*stats, strict=True))
            scaled = (squares / s.pow(2)).sum(-1)
        self.output = None  # read by the norm only: not held while the group waits for its clipped sum
        # ||w_hat_r||^2 = p var_r / s_r^2 = p (s_r^2 - eps) / s_r^2: (||w_hat_r||^2 / p^2 - 2 / p) / s_r^2 is
        coeff = -(s.pow(2) + self.eps) / (self.p * s.pow(4))
        return scaled + (-total.pow(2) / self.p / s.pow(2) + proj.pow(2) * coeff).sum(-1)

    def _ghost_extra(self, dtype: torch.dtype) -> int:
        """Multiply-adds per example that the ghost forms add for :meth:`_responses`."""
        positions, kernel = self.inner.dy[0, 0].numel(), self.shape[2:].numel()
        projections = 0 if self.output is not None and self.output.dtype == dtype else self.shape[0] * self.p
        return positions * (projections + kernel) + self.inner.x[0].numel()


def responses(module: nn.Conv2d, x: torch.Tensor, w_hat: torch.Tensor) -> torch.Tensor:
    """``<a_t, w_hat_r>`` at every output position, (B, C_out, *out): the bias-free convolution of ``x`` with
    the standardised weight (C_out, p)."""
    x, padding = explicitly_padded(module, x)
    return F.conv2d(
        x, w_hat.view(module.weight.shape), None, module.stride, padding, module.dilation, module.groups
    )


def keeps_output(module: WSConv2d, x: torch.Tensor, output: torch.Tensor) -> bool:
    """Whether a ghost form may be this call's cheapest norm (the output has the output gradient's shape)
    and the output has the precision the norm is computed in (not under autocast): only then is it worth
    keeping until the layer's backward."""
    if output.dtype != torch.promote_types(module.weight.dtype, torch.float32):
        return False
    probe = ConvWeightGrads(module, x, output)
    return probe.has_ghost_form and probe.norm_method("auto") != "instantiate"


def check_functional_conv(module: nn.Conv2d) -> None:
    """timm's standardised convolutions call ``F.conv2d`` with the module's padding, whatever its
    ``padding_mode``: only zero padding is the same computation as the rule's."""
    check_conv(module)
    if module.padding_mode != "zeros":
        raise ValueError(
            f"{type(module).__name__}: its forward pads with zeros whatever padding_mode says "
            f"({module.padding_mode!r}); set padding_mode='zeros' to train it privately."
        )


def same_padded(module: nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    """The input as timm's ``*Same`` convolutions pad it in their forward (TensorFlow's SAME: the padding
    depends on the input's size, the extra pixel at the end), by timm's own ``pad_same``, or as Hugging Face
    BiT's does, by its own ``pad`` module (``DynamicPad2d``, None where the padding is static); else ``x``."""
    if isinstance(getattr(module, "pad", None), nn.Module):
        return module.pad(x)
    if not getattr(module, "same_pad", False):
        return x
    from timm.layers.padding import pad_same

    return pad_same(x, module.kernel_size, module.stride, module.dilation)


_TIMM = "timm.layers.std_conv"


@register_rule(WSConv2d, check=check_conv, keep_output=keeps_output)
@register_rule(
    f"{_TIMM}.StdConv2d",
    f"{_TIMM}.StdConv2dSame",
    "transformers.models.bit.modeling_bit.WeightStandardizedConv2d",
    check=check_functional_conv,
    keep_output=keeps_output,
    copies=True,
)
def ws_conv_grads(
    module: nn.Conv2d, x: torch.Tensor, dy: torch.Tensor, output: torch.Tensor | None = None
) -> dict[str, PerExampleGrad]:
    x = same_padded(module, x)
    weight = Standardized(ConvWeightGrads(module, x, dy), module.weight, module.eps, output, module.bias)
    grads: dict[str, PerExampleGrad] = {"weight": weight}
    if module.bias is not None:
        grads["bias"] = Dense(dy.flatten(2).sum(2))
    return grads


@register_rule(f"{_TIMM}.ScaledStdConv2d", f"{_TIMM}.ScaledStdConv2dSame", check=check_functional_conv)
def scaled_ws_conv_grads(module: nn.Conv2d, x: torch.Tensor, dy: torch.Tensor) -> dict[str, PerExampleGrad]:
    """Scaled weight standardisation (module docstring): the weight's gradients are those of
    :class:`Standardized` for output gradients ``gamma_r dy_r``, the gain's
    ``scale sum_t dy_t <a_t, w_hat_r>``, both from the responses, computed once."""
    x = same_padded(module, x)
    dtype = torch.promote_types(module.weight.dtype, torch.float32)
    channels = (1, -1, *[1] * (dy.dim() - 2))
    gamma = (module.gain.detach().flatten() * module.scale).to(dy.dtype).view(channels)
    weight = Standardized(ConvWeightGrads(module, x, dy * gamma), module.weight, module.eps)
    weight.output = responses(module, x.to(dtype), weight.w_hat.to(dtype))  # (B, C_out, *out), no bias
    gain = torch.einsum("brt,brt->br", dy.to(dtype).flatten(2), weight.output.flatten(2)) * module.scale
    grads: dict[str, PerExampleGrad] = {"weight": weight, "gain": Dense(gain.view(-1, *module.gain.shape))}
    if module.bias is not None:
        grads["bias"] = Dense(dy.flatten(2).sum(2))
    return grads
