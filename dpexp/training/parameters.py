"""Which of a model's parameters a run trains (config key ``parameters``).

A frozen parameter keeps the value the model factory gave it (pretrained, hence public) and takes no part in
clipping or noise: the privacy engine clips and noises exactly the parameters with ``requires_grad``, as for
LoRA's frozen base. Freezing is a choice of the model, made before any data is seen, so it costs no privacy.
It serves the papers' partial fine-tuning: He et al. 2023 app. A.2 train only the attention layers and the
classification head for Tables 4 and 12, and with Adam a pretrained word embedding's rows that no example in a
batch uses receive noise alone, which Adam's per-coordinate scaling turns into steps of about ``lr``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase

from torch import nn

from dpexp.config import ConfigError


@dataclass(frozen=True)
class TrainedParameters:
    """What :func:`select_trained` left trainable: counts of parameter values (elements)."""

    trained: int
    frozen: int

    def record(self) -> dict[str, int]:
        """The run record's fields."""
        return {"parameters_trained": self.trained, "parameters_frozen": self.frozen}


def select_trained(model: nn.Module, train: Sequence[str] | None, freeze: Sequence[str]) -> TrainedParameters:
    """Freeze every parameter of ``model`` whose name (as ``model.named_parameters()`` gives it) matches no
    pattern of ``train`` (None: every name matches) or matches one of ``freeze``; patterns are shell-style
    (``fnmatch``, case-sensitive: ``*`` crosses dots); a tied parameter matches under any of its names and
    is frozen if any of them is. Parameters the factory froze already (LoRA's base) stay frozen. Refuses a
    pattern that matches no parameter (a typo would otherwise silently train or freeze what the user did not
    mean) and a selection that leaves nothing to train."""
    names: dict[nn.Parameter, list[str]] = {}  # a tied parameter under every name it has
    for name, parameter in model.named_parameters(remove_duplicate=False):
        names.setdefault(parameter, []).append(name)
    every = [name for aliases in names.values() for name in aliases]
    for key, patterns in (("parameters.train", train or ()), ("parameters.freeze", freeze)):
        for pattern in patterns:
            if not any(fnmatchcase(name, pattern) for name in every):
                raise ConfigError(
                    f"{key}: the pattern {pattern!r} matches no parameter of the model (its parameters are "
                    f"named like {', '.join(every[:4])}); fix the pattern (shell-style, '*' crosses dots)."
                )

    def matches(aliases: list[str], patterns: Sequence[str]) -> bool:
        return any(fnmatchcase(name, pattern) for name in aliases for pattern in patterns)

    for parameter, aliases in names.items():
        if (train is not None and not matches(aliases, train)) or matches(aliases, freeze):
            parameter.requires_grad_(False)
    trained = sum(p.numel() for p in names if p.requires_grad)
    if trained == 0:
        raise ConfigError(
            f"parameters.train={None if train is None else list(train)} and "
            f"parameters.freeze={list(freeze)} leave no parameter of the model to train; train more or "
            "freeze less."
        )
    return TrainedParameters(trained, sum(p.numel() for p in names) - trained)
