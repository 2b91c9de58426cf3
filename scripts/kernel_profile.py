"""Which device kernels a private step runs, and for how long (results/bench/analysis.md, stop 57).

    python scripts/kernel_profile.py wrn16_4 nonprivate,bk bench_suite=gpu

Builds a model of a bench suite as ``python -m dpexp.bench`` does, runs two warm-up steps, then profiles one
step with ``torch.profiler`` and prints, per method, the step's device time, its number of kernel launches
and the kernels that took the most device time (name, calls, total). On CPU (no CUDA device) the same table
reads the operators' CPU time. Where :mod:`engine_timers` charges time to the engine's calls, this names the
kernels inside them: many cheap launches and a few slow ones call for different fixes. Not a benchmark.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from torch.profiler import ProfilerActivity, profile

from dpexp.bench.measure import _build
from dpexp.bench.plan import run_spec

ROOT = Path(__file__).resolve().parents[1]


def _profile(step: Callable[[], None], cuda: bool) -> profile:
    """One ``step`` under the profiler, after two warm-up steps."""
    for _ in range(2):
        step()
    if cuda:
        torch.cuda.synchronize()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        step()
        if cuda:
            torch.cuda.synchronize()
    return prof


def _table(prof: profile, cuda: bool, top: int) -> tuple[str, list[tuple[str, int, float]]]:
    """A summary line and the ``top`` rows (name, calls, microseconds): kernels on CUDA, else operators."""
    events = prof.key_averages()
    if cuda:
        kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        timed = sorted(kernels, key=lambda e: e.self_device_time_total, reverse=True)
        total = sum(e.self_device_time_total for e in kernels)
        summary = f"{total / 1e3:.1f} ms of device time in {sum(e.count for e in kernels)} kernel launches"
        return summary, [(e.key, e.count, e.self_device_time_total) for e in timed[:top]]
    timed = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events)
    summary = f"{total / 1e3:.1f} ms of CPU time in {sum(e.count for e in events)} operator calls"
    return summary, [(e.key, e.count, e.self_cpu_time_total) for e in timed[:top]]


def main(model_name: str, methods: list[str], overrides: list[str], top: int = 25) -> None:
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = compose("bench", overrides=overrides or ["bench_suite=gpu"])
    entry = cfg.bench_suite.models[model_name]
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    for method in methods:
        seq_len = entry.seq_lens[0] if entry.get("seq_lens") else None
        spec = run_spec(cfg, model_name, method, entry.batch_sizes[0], seq_len, str(device))
        bench_model, backend, batch, _ = _build(spec, device, int(entry.batch_sizes[0]))

        def step(bench_model=bench_model, backend=backend, batch=batch) -> None:
            backend.backward(bench_model.per_example_loss(backend.model, batch))
            backend.step()

        prof = _profile(step, cuda)
        backend.close()
        summary, rows = _table(prof, cuda, top)
        print(f"{model_name} {method}: {summary}")
        for name, count, us in rows:
            print(f"    {us / 1e3:8.2f} ms {count:6d}x  {name[:110]}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2].split(","), sys.argv[3:])
