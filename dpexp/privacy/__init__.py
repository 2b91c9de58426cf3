"""The privacy engine: per-example clipping, noise, adaptive thresholds, accounting, and the run-time checks
of what it assumes about a model. Imports torch (and numpy/scipy for accounting) only: no tasks, no Hydra."""

from dpexp.privacy.engine import PrivacyEngine
from dpexp.privacy.individual import IndividualPrivacy
from dpexp.privacy.rules import register_reads, register_rule
from dpexp.privacy.verification import VerificationError

__all__ = ["IndividualPrivacy", "PrivacyEngine", "VerificationError", "register_reads", "register_rule"]
