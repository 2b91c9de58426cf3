"""dpexp: differentially private deep learning experiments.

Entry points: ``python -m dpexp.train`` and ``python -m dpexp.bench``; imports run one way, entry points ->
training / bench -> backends -> privacy (README, "Architecture"). The engine alone: :mod:`dpexp.privacy`.
"""

__version__ = "0.1.0"
