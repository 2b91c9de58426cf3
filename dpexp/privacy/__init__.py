"""dpexp's clipping engine. Knows nothing about tasks, data sets or Hydra."""

from dpexp.privacy.engine import PrivacyEngine
from dpexp.privacy.rules import register_rule
from dpexp.privacy.verification import VerificationError

__all__ = ["PrivacyEngine", "VerificationError", "register_rule"]
