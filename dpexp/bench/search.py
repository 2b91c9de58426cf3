"""The largest batch that fits on a CUDA device, per (model, method, sequence length): doubling, then
bisection, catching out-of-memory errors."""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
from omegaconf import DictConfig

from dpexp.bench.aggregate import ratio
from dpexp.bench.measure import _build, _error, _sync, _train_step
from dpexp.bench.plan import BASELINE

log = logging.getLogger(__name__)


def find_max_batch(fits: Callable[[int], bool], start: int, cap: int, tolerance: float = 0.0) -> int:
    """Largest b in [1, cap] with ``fits(b)`` (assumed monotone), or 0 if not even 1 fits.

    Doubles from ``start`` until a batch fails (or ``cap`` fits), then bisects until the bracket
    ``(ok, failed)`` is at most ``max(1, tolerance * ok)`` wide; returns the largest batch that fitted.
    """
    ok, failed, b = 0, None, max(1, min(start, cap))
    while failed is None:
        if not fits(b):
            failed = b
        elif b >= cap:
            return b
        else:
            ok, b = b, min(2 * b, cap)
    while failed - ok > max(1, int(tolerance * ok)):
        mid = (ok + failed) // 2
        if fits(mid):
            ok = mid
        else:
            failed = mid
    return ok


def _fits(spec: dict[str, Any], batch_size: int) -> bool:
    """One training step at ``batch_size``; False on CUDA out-of-memory, other errors propagate.

    (Without CUDA nothing is out of memory before the machine is: the search is only run on CUDA.)"""
    device = torch.device(spec["device"])
    backend = None
    try:
        bench_model, backend, batch, _ = _build(spec, device, batch_size)
        _train_step(bench_model, backend, batch, device, spec["amp"])
        _sync(device)
        return True
    except torch.cuda.OutOfMemoryError:
        return False
    finally:
        if backend is not None:
            backend.close()
        del backend
        gc.collect()
        torch.cuda.empty_cache()


def max_batches(cfg: DictConfig, runs: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Largest batch per (model, method, seq) of ``runs`` (searched from the run's batch size up to
    ``bench_suite.max_batch.cap``) and its ratio to the baseline's."""
    suite = cfg.bench_suite.max_batch
    seen: dict[tuple, dict[str, Any]] = {}
    for run in runs:
        key = (run["model_name"], run["method"], run["seq_len"])
        if key in seen or (suite.models is not None and run["model_name"] not in suite.models):
            continue
        spec = dict(run, amp=cfg.bench_suite.amp)
        try:
            largest = find_max_batch(
                lambda b, s=spec: _fits(s, b), run["batch_size"], suite.cap, suite.tolerance
            )
            seen[key] = {
                "model": key[0],
                "method": key[1],
                "seq_len": key[2],
                "status": "ok",
                "max_batch": largest,
            }
        except Exception as err:
            seen[key] = {"model": key[0], "method": key[1], "seq_len": key[2], **_error(err, "max_batch")}
        log.info("max batch %s %s T=%s: %s", *key, seen[key].get("max_batch", seen[key].get("error")))
    for (model_name, _, seq_len), entry in seen.items():
        base = seen.get((model_name, BASELINE, seq_len), {})
        entry["ratio"] = ratio(entry.get("max_batch"), base.get("max_batch"))
        yield entry
