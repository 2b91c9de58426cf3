"""dpexp's clipping engine. Knows nothing about tasks, data sets or Hydra."""

from dpexp.privacy.engine import PrivacyEngine
from dpexp.privacy.rules import register_rule

__all__ = ["PrivacyEngine", "register_rule"]
