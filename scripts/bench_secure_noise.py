"""Cost of the engine's noise: time to add N(0, 1) noise to float32 tensors of 2^18..2^24 values on CPU,
the secure sampler and the engine's streams against torch's ``normal_``.

    python scripts/bench_secure_noise.py [--out results/bench/secure_noise.json] [--repeats 5] [--threads 1]

Four ways, each timed ``repeats`` times per size in alternation (median and minimum are recorded):

* ``normal_``: ``tensor.normal_()``, torch's CPU generator over the whole tensor;
* ``add_default``: :func:`dpexp.privacy.noise.add_gaussian_noise_`, the engine's default path (``normal_``
  chunk by chunk into a cache-sized buffer, added in place);
* ``add_secure``: the same with ``secure=True``: OS CSPRNG bits, Box-Muller in float64, sums of
  ``SECURE_SUMMANDS`` Gaussians (:func:`dpexp.privacy.noise.secure_standard_normal`);
* ``add_streams``: :func:`dpexp.privacy.noise.add_gaussian_noises_`, the engine's step (``NOISE_STREAMS``
  generators, in parallel threads from ``PARALLEL_NOISE_MIN`` values): with ``--threads 2`` it shows what
  the second core buys.

The JSON holds no ``runs`` or ``records``, so ``scripts/bench_report.py`` leaves it alone.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from dpexp.bench.machine import machine_info
from dpexp.privacy.noise import (
    CPU_NOISE_CHUNK,
    NOISE_STREAMS,
    SECURE_SUMMANDS,
    add_gaussian_noise_,
    add_gaussian_noises_,
)

SIZES = tuple(2**e for e in range(18, 25))
METHODS: dict[str, Callable[[torch.Tensor], object]] = {
    "normal_": lambda t: t.normal_(),
    "add_default": lambda t: add_gaussian_noise_(t, 1.0),
    "add_secure": lambda t: add_gaussian_noise_(t, 1.0, secure=True),
    "add_streams": lambda t: add_gaussian_noises_([(t, 1.0)]),
}


def time_once(method: Callable[[torch.Tensor], object], tensor: torch.Tensor) -> float:
    """Seconds of one call on ``tensor``."""
    start = time.perf_counter()
    method(tensor)
    return time.perf_counter() - start


def measure(size: int, repeats: int) -> dict[str, dict[str, float]]:
    """Median and minimum seconds per method for one tensor size, after one untimed warm-up call each."""
    tensor = torch.zeros(size)
    seconds: dict[str, list[float]] = {name: [] for name in METHODS}
    for method in METHODS.values():
        method(tensor)
    for _ in range(repeats):
        for name, method in METHODS.items():
            seconds[name].append(time_once(method, tensor))
    return {
        name: {
            "median_s": statistics.median(values),
            "min_s": min(values),
            "ns_per_value": statistics.median(values) / size * 1e9,
        }
        for name, values in seconds.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("results/bench/secure_noise.json"))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (as the CPU suites)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    machine = machine_info("cpu")
    started = time.perf_counter()
    sizes = []
    for size in SIZES:
        times = measure(size, args.repeats)
        ratio = times["add_secure"]["median_s"] / times["normal_"]["median_s"]
        streams = times["add_streams"]["median_s"] / times["add_default"]["median_s"]
        sizes.append({"values": size, **times, "secure_over_normal_": ratio, "streams_over_default": streams})
        line = ", ".join(f"{name} {t['median_s'] * 1e3:.1f} ms" for name, t in times.items())
        print(
            f"2^{size.bit_length() - 1} values: {line}; secure / normal_ {ratio:.1f}x, streams / default "
            f"{streams:.2f}x",
            flush=True,
        )
    result = {
        "benchmark": "secure_noise",
        "machine": machine,
        "dtype": "float32",
        "repeats": args.repeats,
        "cpu_noise_chunk": CPU_NOISE_CHUNK,
        "secure_summands": SECURE_SUMMANDS,
        "noise_streams": NOISE_STREAMS,
        "sizes": sizes,
        "wall_s": time.perf_counter() - started,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
