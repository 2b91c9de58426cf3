"""The autocast state of a module's call, for a rule that recomputes part of the module's forward.

The rules run in the backward pass, outside autocast. A recomputation that is to reproduce a call made under
autocast (:func:`~dpexp.privacy.rules.submodule_values.reproduced`) must run its operations in the precisions
the call ran them in: autocast casts a matrix product's or a convolution's float32 operands to its dtype
(bfloat16, float16) and leaves an elementwise product of a bfloat16 and a float32 tensor to type promotion.
The state is recorded where the capture records the call (:class:`~dpexp.privacy.rules.CallLayout`'s
``inputs``, which run in the forward, inside the user's ``torch.autocast``), and the rule runs the
recomputation in it again (:func:`replay`): the same operations then round the same way, and the gradients
the rule takes through them are those of the computation autocast ran. Where the module turns autocast off
around its own operations (``maybe_autocast(enabled=False)``), it does so inside the replay too.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Autocast:
    """``device``'s autocast state at a call: ``dtype`` the type autocast casts to, None where it was off."""

    device: str
    dtype: torch.dtype | None


def autocast_at(x: torch.Tensor) -> Autocast:
    """The autocast state now (in a call's forward) on ``x``'s device."""
    device = x.device.type
    return Autocast(device, torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None)


def replay(state: Autocast) -> AbstractContextManager:
    """A context running operations in ``state`` again: autocast on in its dtype, or off."""
    if state.dtype is None:
        return torch.autocast(state.device, enabled=False)
    return torch.autocast(state.device, dtype=state.dtype)
