"""Where a private step spends its time, by the engine's own calls (results/bench/analysis.md, session 7).

    python scripts/engine_timers.py wrn16_4_b64 nonprivate,bk,perlayer [bench_suite=cpu_llm]

Builds a model of a bench suite as ``python -m dpexp.bench`` does, runs two warm-up steps, then times three
steps split into forward, backward (``backend.backward``) and step, and inside them the wall time of the
engine's calls: the rules (by layer type), the clipper's delivery and group finishing, the noise
(``PrivacyEngine._privatize``), and per parameter shape the norms, instantiations and clipped sums of the
convolution rules. Nested calls are included in their callers' time. A profiler's per-op table attributes
the time of Python hooks to whatever aten op is open, which misled on WRN; these timers do not. On CPU one
torch thread, as the CPU suites; on the suite's CUDA device (``bench_suite=gpu``) every timer synchronises
the device first and last, so each call is charged its kernels' time (and the step is slower than in the
suite). Not a benchmark: ratios to non-private come from the suites.
"""

from __future__ import annotations

import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

from dpexp.bench.measure import _build
from dpexp.bench.plan import run_spec
from dpexp.privacy import clipping
from dpexp.privacy.capture import Capture
from dpexp.privacy.engine import PrivacyEngine
from dpexp.privacy.rules.conv import ConvWeightGrads
from dpexp.privacy.rules.ws_conv import Standardized
from dpexp.runtime import resolve_device

TIMES: defaultdict[str, float] = defaultdict(float)
DEVICE = torch.device("cpu")


def _now() -> float:
    """The wall clock after the device's queued kernels have run."""
    if DEVICE.type == "cuda":
        torch.cuda.synchronize(DEVICE)
    return time.perf_counter()


def _timed(owner: type, name: str, key: Callable[..., str]) -> None:
    """Wrap ``owner.name`` so that its wall time adds to ``TIMES[key(self, *args)]``."""
    method = getattr(owner, name)

    def timed(self, *args, **kwargs):
        start = _now()
        try:
            return method(self, *args, **kwargs)
        finally:
            TIMES[key(self, *args)] += _now() - start

    setattr(owner, name, timed)


def _instrument() -> None:
    _timed(Capture, "per_example_grads", lambda self, use, *_: f"rule {type(use.layer.module).__name__}")
    _timed(clipping.Clipper, "deliver", lambda *_: "clipper: deliver (rules, norms, fused sums)")
    _timed(clipping.Clipper, "_finish_group", lambda *_: "clipper: finish groups (clipped sums)")
    _timed(PrivacyEngine, "_privatize", lambda *_: "engine: noise and / B")
    for owner in (ConvWeightGrads, Standardized):
        for name in ("norm_sq", "weighted_sum", "instantiate_chunks"):
            _timed(owner, name, lambda self, *_, n=name: f"{n} {type(self).__name__} {tuple(self.shape)}")


def main(model_name: str, methods: list[str], overrides: list[str]) -> None:
    global DEVICE
    conf = Path(__file__).resolve().parents[1] / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base=None):
        cfg = compose("bench", overrides=overrides or ["bench_suite=cpu_llm"])
    entry = cfg.bench_suite.models[model_name]
    _instrument()
    device = DEVICE = resolve_device(cfg.bench_suite.device or cfg.device)
    if device.type == "cpu":
        torch.set_num_threads(1)
    for method in methods:
        seq_len = entry.seq_lens[0] if entry.get("seq_lens") else None
        spec = run_spec(cfg, model_name, method, entry.batch_sizes[0], seq_len, str(device))
        bench_model, backend, batch, _ = _build(spec, device, int(entry.batch_sizes[0]))
        phases = defaultdict(float)
        for step in range(5):
            if step == 2:
                TIMES.clear()
                phases.clear()
            start = _now()
            loss = bench_model.per_example_loss(backend.model, batch)
            forward = _now()
            backend.backward(loss)
            backward = _now()
            backend.step()
            phases["forward"] += forward - start
            phases["backward"] += backward - forward
            phases["step"] += _now() - backward
        backend.close()
        print(f"{method}: " + ", ".join(f"{k} {v / 3 * 1000:.0f} ms" for k, v in phases.items()))
        for key, seconds in sorted(TIMES.items(), key=lambda item: -item[1]):
            if seconds / 3 >= 5e-4:
                print(f"    {key:<50} {seconds / 3 * 1000:7.0f} ms")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2].split(","), sys.argv[3:])
