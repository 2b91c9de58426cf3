"""Per-configuration records from raw runs: pooled timings and memory, and ratios to the non-private
baseline (paired with its adjacent runs; see :func:`aggregate`)."""

from __future__ import annotations

import statistics
from typing import Any

from dpexp.bench.plan import BASELINE


def _group_key(run: dict[str, Any]) -> tuple:
    return run["model_name"], run["batch_size"], run["seq_len"]


def _adjacent_baselines(runs: list[dict[str, Any]], index: int) -> list[int]:
    """Indices of the nearest successful baseline runs before and after ``runs[index]`` in its group."""
    key = _group_key(runs[index])
    same = [
        i
        for i, r in enumerate(runs)
        if _group_key(r) == key and r["method"] == BASELINE and r["status"] == "ok"
    ]
    before = [i for i in same if i < index]
    after = [i for i in same if i > index]
    return ([before[-1]] if before else []) + ([after[0]] if after else [])


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    return numerator / denominator if numerator is not None and denominator else None


def _paired_throughput(runs: list[dict[str, Any]], index: int) -> float | None:
    """Baseline s/step over ``runs[index]``'s s/step (medians), the baseline being the runs just before and
    after it: the machine's drift between rounds cancels within each pair."""
    neighbours = _adjacent_baselines(runs, index)
    if not neighbours:
        return None
    baseline = statistics.median(t for i in neighbours for t in runs[i]["step_s"])
    return baseline / statistics.median(runs[index]["step_s"])


def method_label(method: str, world_size: int) -> str:
    """``method``, or ``method/ddp<P>`` for a run on P data-parallel processes."""
    return method if world_size == 1 else f"{method}/ddp{world_size}"


def aggregate(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One record per (model, method, batch, seq): pooled timings and memory, and ratios to the baseline.

    ``ratios.throughput`` is the median over the method's runs of the paired ratio (baseline s/step of the
    adjacent baseline runs / the run's s/step; :func:`_paired_throughput`), so that a round measured while the
    machine was slow is compared with baselines measured in that same state; pooling all steps instead would
    compare across rounds. The memory ratios use the baseline runs adjacent to the method's runs (for the
    baseline itself: all of its runs, ratio 1).
    ``step_mem`` is the memory a step adds on top of the built model (peak - pre-step).
    Data-parallel runs (``world_size`` > 1: the logical batch split over that many processes) are records of
    their own, ``<method>/ddp<world_size>`` (:func:`method_label`), compared with the one-process baseline.
    """
    records: dict[tuple, dict[str, Any]] = {}
    for index, run in enumerate(runs):
        key = (*_group_key(run), method_label(run["method"], run.get("world_size", 1)))
        record = records.setdefault(key, {"runs": [], "baseline_runs": set()})
        record["runs"].append(index)
        if run["method"] == BASELINE:
            record["baseline_runs"].add(index)
        else:
            record["baseline_runs"].update(_adjacent_baselines(runs, index))
    out = []
    for (model_name, batch_size, seq_len, method), record in records.items():
        mine = [runs[i] for i in record["runs"]]
        ok = [r for r in mine if r["status"] == "ok"]
        base = [runs[i] for i in sorted(record["baseline_runs"]) if runs[i]["status"] == "ok"]
        entry: dict[str, Any] = {
            "model": model_name,
            "family": mine[0].get("family"),
            "method": method,
            "batch_size": batch_size,
            "seq_len": seq_len,
            "world_size": mine[0].get("world_size", 1),
            "runs": record["runs"],
            "baseline_runs": sorted(record["baseline_runs"]),
        }
        if not ok:
            failed = mine[0]
            entry.update(status="error", error=failed["error"], stage=failed.get("stage"))
            entry["unsupported_modules"] = failed.get("unsupported_modules")
            out.append(entry)
            continue
        steps = [t for r in ok for t in r["step_s"]]
        ok_indices = [i for i in record["runs"] if runs[i]["status"] == "ok"]
        paired = [1.0] if method == BASELINE else [_paired_throughput(runs, i) for i in ok_indices]
        median = statistics.median(steps)
        peak = _median([r["peak_mem_mb"] for r in ok])
        step_mem = _median([_delta(r) for r in ok])
        entry.update(
            status="ok",
            step_s={"median": median, "min": min(steps), "max": max(steps), "n": len(steps)},
            examples_per_s=batch_size / median,
            peak_mem_mb=peak,
            step_mem_mb=step_mem,
            mem_kind=ok[0]["mem_kind"],
            n_params=ok[0]["n_params"],
            ratios={
                "throughput": _median(paired),
                "throughput_per_run": paired,
                "peak_mem": ratio(peak, _median([r["peak_mem_mb"] for r in base])),
                "step_mem": ratio(step_mem, _median([_delta(r) for r in base])),
            },
        )
        out.append(entry)
    return out


def _delta(run: dict[str, Any]) -> float | None:
    if run.get("peak_mem_mb") is None or run.get("pre_step_mem_mb") is None:
        return None
    return run["peak_mem_mb"] - run["pre_step_mem_mb"]
