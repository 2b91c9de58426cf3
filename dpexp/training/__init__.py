"""Training: the loop behind ``python -m dpexp.train`` (:mod:`.loop`), what a run fixes before it trains
(:mod:`.plan`), logical batches and micro-batches (:mod:`.sampling`), optimizers and learning-rate schedules
(:mod:`.optim`, the only optimizer table) and the run record (:mod:`.record`). Imports: backends, tasks,
models, the privacy accountants, :mod:`dpexp.runtime`; never the privacy engine directly.
"""
