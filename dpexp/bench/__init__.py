"""Efficiency benchmark: ``python -m dpexp.bench [bench_suite=cpu|gpu|scaling|...] [key=value ...]``.

A configuration is one (model, method, batch size, sequence length). Each is trained for ``warmup`` untimed
and ``steps`` timed steps (forward, per-example loss, backward, optimizer step) on generated inputs
(:mod:`dpexp.bench.models`); the methods are the clip configs of ``conf/clip`` composed under ``methods`` in
``conf/bench.yaml``, built by :func:`dpexp.backends.build_backend` exactly as the trainer builds them.

* CPU: every configuration runs in a fresh spawned process, whose peak resident memory (``VmHWM``) is its own,
  so one configuration cannot inflate another's memory.
* CUDA: configurations run in this process; memory is ``torch.cuda.max_memory_allocated`` after a reset,
  minus what was allocated before the model was built. Optionally the largest batch that fits is searched
  (doubling, then bisection, catching out-of-memory errors).

Within a (model, batch, sequence length) group the runs alternate with the ``nonprivate`` baseline
(``nonprivate, m1, .., m_k, nonprivate, ...`` with ``baseline_every = k``), and each method's ratios use
the baseline runs adjacent to its own runs, so slow drift of the machine cancels. The JSON written to
``output`` holds the machine, the resolved config, every raw run and the per-configuration records with
their ratios to ``nonprivate``; ``scripts/bench_report.py`` turns it into tables and plots.

The package, one module per job: :mod:`~dpexp.bench.plan` (which runs, in which order),
:mod:`~dpexp.bench.measure` (one configuration, isolated), :mod:`~dpexp.bench.search` (largest batch),
:mod:`~dpexp.bench.aggregate` (ratios), :mod:`~dpexp.bench.machine` (what it ran on),
:mod:`~dpexp.bench.models` (generated-input models), :mod:`~dpexp.bench.suite` (the driver). It may import
the backends (every method is built as the trainer builds it), the privacy rules and :mod:`dpexp.runtime`.
"""

from dpexp.bench.aggregate import aggregate
from dpexp.bench.measure import run_config, run_isolated
from dpexp.bench.plan import interleave, plan
from dpexp.bench.search import find_max_batch, max_batches
from dpexp.bench.suite import SCHEMA_VERSION, run_suite

__all__ = [
    "SCHEMA_VERSION",
    "aggregate",
    "find_max_batch",
    "interleave",
    "max_batches",
    "plan",
    "run_config",
    "run_isolated",
    "run_suite",
]
