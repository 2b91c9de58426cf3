"""Where a private step makes the host wait for the GPU (results/bench/analysis.md, stop 51).

    python scripts/host_syncs.py gpt2 nonprivate,bk,perlayer bench_suite=gpu

Builds a model of a bench suite as ``python -m dpexp.bench`` does, runs two warm-up steps, then one step
under ``torch.cuda.set_sync_debug_mode("warn")`` and counts the synchronising calls (``.item()``, ``bool``
of a tensor, ``nonzero``, boolean indexing, copies to the host) by the innermost line of ``dpexp`` on the
stack (else the innermost line of the caller). Each such call stops the host until the device has run
everything queued; the device then idles while the host launches the next kernels. CUDA only.
"""

from __future__ import annotations

import sys
import traceback
import warnings
from collections import Counter
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

from dpexp.bench.measure import _build
from dpexp.bench.plan import run_spec

ROOT = Path(__file__).resolve().parents[1]


def _where() -> str:
    """The innermost frame in the package (else outside torch) of the current stack, as ``file:line``."""
    frames = traceback.extract_stack()[:-2]
    inside = [f for f in frames if "/dpexp/" in f.filename]
    inside = inside or [f for f in frames if "torch" not in f.filename]
    frame = (inside or frames)[-1]
    path = Path(frame.filename)
    return f"{path.relative_to(ROOT) if ROOT in path.parents else path}:{frame.lineno} ({frame.name})"


def main(model_name: str, methods: list[str], overrides: list[str]) -> None:
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = compose("bench", overrides=overrides or ["bench_suite=gpu"])
    entry = cfg.bench_suite.models[model_name]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # on CPU: a dry run, no counts
    cuda = device.type == "cuda"
    for method in methods:
        seq_len = entry.seq_lens[0] if entry.get("seq_lens") else None
        spec = run_spec(cfg, model_name, method, entry.batch_sizes[0], seq_len, str(device))
        bench_model, backend, batch, _ = _build(spec, device, int(entry.batch_sizes[0]))
        counts: Counter[str] = Counter()

        def count(*args, counts=counts, **kwargs) -> None:
            counts.update([_where()])

        for step in range(3):
            if step == 2 and cuda:
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("warn")
            with warnings.catch_warnings():
                warnings.simplefilter("always")
                warnings.showwarning = count
                loss = bench_model.per_example_loss(backend.model, batch)
                backend.backward(loss)
                backend.step()
            if cuda:
                torch.cuda.set_sync_debug_mode("default")
        backend.close()
        print(f"{model_name} {method}: {sum(counts.values())} host syncs in one step")
        for where, n in counts.most_common(25):
            print(f"    {n:5d}  {where}")
        del bench_model, backend, batch


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2].split(","), sys.argv[3:])
