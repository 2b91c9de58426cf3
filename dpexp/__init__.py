"""dpexp: differentially private deep learning experiments.

Hydra entry point: ``python -m dpexp.train``; clipping engine: :mod:`dpexp.privacy`.
"""

__version__ = "0.1.0"
