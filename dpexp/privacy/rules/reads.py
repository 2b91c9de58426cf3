"""Modules whose forward reads a submodule's parameters instead of calling it
(:func:`~dpexp.privacy.rules.register_reads`): Inkling 2's short convolutions pass their causal depthwise
convolution's weight to a kernel, ``causal_conv1d_fn(x, self.conv1d.weight.squeeze(1), self.conv1d.bias)``
(its reference implementation: ``F.conv1d`` with ``groups = channels``), never calling ``self.conv1d``. Their
exact fallback takes the convolution's parameters with their own. Mamba's, Falcon-Mamba's, Jamba's and
Zamba's mixers (which also read ``dt_proj``'s weight, or own it), the Mamba-2 mixers of Mamba-2, Bamba,
Nemotron-H, Granite-hybrid, Zamba2 and Falcon-H1, the gated delta nets of Qwen3.5's, Qwen3-Next's and
OLMo-hybrid's forms and the Kimi Delta Attention of Kimi Linear, Bailing-hybrid and GLM-5-Next
(:mod:`dpexp.privacy.rules.scan_mixers`), and LFM2's and (stop 52) Inkling's short convolutions
(:mod:`dpexp.privacy.rules.short_conv`) have rules that claim what they read.
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

# torchvision's Swin attention passes its qkv and proj weights to shifted_window_attention (Liu et al. 2021,
# sec. 3.2); V2's also calls its cpb_mlp (Linear, ReLU, Linear) on the relative coordinates, a table without
# the batch (Liu et al. 2022, sec. 3.3), whose output meets the batch in the scores
_SWIN = "torchvision.models.swin_transformer"
register_reads(f"{_SWIN}.ShiftedWindowAttention", "qkv", "proj")
register_reads(f"{_SWIN}.ShiftedWindowAttentionV2", "qkv", "proj", "cpb_mlp.0", "cpb_mlp.2")
