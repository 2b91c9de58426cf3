"""Modules whose forward reads a submodule's parameters instead of calling it
(:func:`~dpexp.privacy.rules.register_reads`): Inkling 2's short convolutions pass their causal depthwise
convolution's weight to a kernel, ``causal_conv1d_fn(x, self.conv1d.weight.squeeze(1), self.conv1d.bias)``
(its reference implementation: ``F.conv1d`` with ``groups = channels``), never calling ``self.conv1d``. Their
exact fallback takes the convolution's parameters with their own. Mamba's, Falcon-Mamba's, Jamba's and
Zamba's mixers (which also read ``dt_proj``'s weight, or own it), the Mamba-2 mixers of Mamba-2, Bamba,
Nemotron-H, Granite-hybrid, Zamba2 and Falcon-H1, the gated delta nets of Qwen3.5's, Qwen3-Next's and
OLMo-hybrid's forms and the Kimi Delta Attention of Kimi Linear, Bailing-hybrid and GLM-5-Next
(:mod:`dpexp.privacy.rules.scan_mixers`), and LFM2's and (stop 52) Inkling's short convolutions
(:mod:`dpexp.privacy.rules.short_conv`) have rules that claim what they read, as (stop 61) torchvision's
Swin attention does (:mod:`dpexp.privacy.rules.shifted_window`).
"""

from __future__ import annotations

from dpexp.privacy.rules import register_reads

_READS = {  # model family -> {its module class: the submodules its forward reads}
    "inkling2": {"Inkling2ShortConvolution": ("conv1d",)},
    "inkling2_loop": {"Inkling2LoopShortConvolution": ("conv1d",)},
}

for _family, _classes in _READS.items():
    for _name, _submodules in _classes.items():
        register_reads(f"transformers.models.{_family}.modeling_{_family}.{_name}", *_submodules)
