"""How many aten operations one training step runs, per method (results/bench/analysis.md, stop 51).

    python scripts/op_counts.py gpt2 bk,perlayer bench_suite=cpu

Builds a model of a bench suite as ``python -m dpexp.bench`` does, runs two warm-up steps on the CPU, then
counts the aten operations of a third under a ``TorchDispatchMode``, and prints the total per method and, for
the second method against the first, the operations whose counts differ. On a GPU nearly every operation
that is not a view is a kernel launch, and a per-layer step (one group per parameter) is bound by them: the
count is a deterministic stand-in for that cost, measurable where no GPU is. Not a timing.
"""

from __future__ import annotations

import sys
from collections import Counter
from contextlib import nullcontext
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from torch.utils._python_dispatch import TorchDispatchMode

from dpexp.bench.measure import _build
from dpexp.bench.plan import run_spec

ROOT = Path(__file__).resolve().parents[1]


class _Counting(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def main(model_name: str, methods: list[str], overrides: list[str]) -> None:
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = compose("bench", overrides=overrides or ["bench_suite=cpu"])
    entry = cfg.bench_suite.models[model_name]
    torch.set_num_threads(1)
    counted: dict[str, Counter[str]] = {}
    for method in methods:
        seq_len = entry.seq_lens[0] if entry.get("seq_lens") else None
        spec = run_spec(cfg, model_name, method, entry.batch_sizes[0], seq_len, "cpu")
        bench_model, backend, batch, _ = _build(spec, torch.device("cpu"), int(entry.batch_sizes[0]))
        for step in range(3):
            mode = _Counting()
            with mode if step == 2 else nullcontext():
                loss = bench_model.per_example_loss(backend.model, batch)
                backend.backward(loss)
                backend.step()
        backend.close()
        counted[method] = mode.counts
        print(f"{model_name} {method}: {sum(mode.counts.values())} aten ops in one step")
    if len(methods) > 1:
        first, second = counted[methods[0]], counted[methods[1]]
        changed = sorted((second[k] - first[k], k) for k in first | second if second[k] != first[k])
        print(f"{methods[1]} - {methods[0]}: " + ", ".join(f"{op} {n:+d}" for n, op in changed))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2].split(","), sys.argv[3:])
