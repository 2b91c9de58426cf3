"""Efficiency benchmark: ``python -m dpexp.bench [bench_suite=cpu|gpu|scaling|...] [key=value ...]``.

A configuration is one (model, method, batch size, sequence length). Each is trained for ``warmup`` untimed
and ``steps`` timed steps (forward, per-example loss, backward, optimizer step) on generated inputs
(:mod:`dpexp.bench_models`); the methods are the clip configs of ``conf/clip`` composed under ``methods`` in
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
"""

from __future__ import annotations

import datetime as dt
import gc
import hashlib
import importlib
import json
import logging
import multiprocessing as mp
import os
import platform
import re
import statistics
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import hydra
import torch
from hydra.utils import instantiate, to_absolute_path
from omegaconf import DictConfig, OmegaConf

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
BASELINE = "nonprivate"
OPTIMIZERS = {"adam": torch.optim.Adam, "sgd": torch.optim.SGD}


# ---------------------------------------------------------------------------------------------- one config
def _set_threads(threads: int | None) -> None:
    if threads is not None:
        torch.set_num_threads(threads)


def _resident_mb(field: str) -> float | None:
    """``VmRSS`` (now) or ``VmHWM`` (peak since exec) of this process from /proc, in MiB (None off Linux)."""
    try:
        text = Path("/proc/self/status").read_text()
    except OSError:
        return None
    match = re.search(rf"^{field}:\s+(\d+) kB", text, re.MULTILINE)
    return int(match.group(1)) / 1024 if match else None


class _Memory:
    """Memory of one configuration: CUDA allocator statistics, or the resident set of a fresh process."""

    def __init__(self, device: torch.device, isolated: bool) -> None:
        self.device, self.isolated = device, isolated
        self.kind = "cuda_max_allocated" if device.type == "cuda" else "peak_rss" if isolated else None
        self.start = 0.0
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            self.start = torch.cuda.memory_allocated(device) / 2**20

    def now(self) -> float | None:
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device) / 2**20 - self.start
        return _resident_mb("VmRSS") if self.isolated else None

    def peak(self) -> float | None:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) / 2**20 - self.start
        return _resident_mb("VmHWM") if self.isolated else None


def source_hash() -> str:
    """Short hash of the clipping code a run imports (``dpexp/privacy``, ``dpexp/backends.py``): a suite whose
    runs disagree was measured while that code changed."""
    package = Path(__file__).resolve().parent
    digest = hashlib.sha256()
    for path in sorted([*package.glob("privacy/**/*.py"), package / "backends.py"]):
        digest.update(path.relative_to(package).as_posix().encode() + path.read_bytes())
    return digest.hexdigest()[:12]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _build(spec: dict[str, Any], device: torch.device, batch_size: int):
    """Model, backend (wrapping model and optimizer) and a batch on ``device`` for one configuration."""
    from dpexp.backends import build_backend

    bench_model = instantiate(spec["model"])
    torch.manual_seed(spec["seed"])
    with device:
        net = bench_model.build()
    optim = dict(spec["optimizer"])
    optimizer = OPTIMIZERS[optim.pop("name")](net.parameters(), **optim)
    try:
        backend = build_backend(
            spec["clip"],
            model=net,
            optimizer=optimizer,
            batch_size=batch_size,
            sample_size=spec["sample_size"],
            noise_multiplier=spec["noise_multiplier"],
        )
    except Exception as err:
        from dpexp.bench_models import unsupported_modules

        err.unsupported_modules = unsupported_modules(net)  # type: ignore[attr-defined]
        raise
    generator = torch.Generator().manual_seed(spec["seed"])
    batch = {
        k: v.to(device) for k, v in bench_model.make_batch(batch_size, spec["seq_len"], generator).items()
    }
    n_params = sum(p.numel() for p in net.parameters())
    return bench_model, backend, batch, n_params


def _train_step(bench_model, backend, batch, device: torch.device, amp: str | None) -> None:
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if amp == "bf16" else nullcontext()
    with autocast:
        loss = bench_model.per_example_loss(backend.model, batch)
    backend.backward(loss)
    backend.step()


def _error(err: BaseException, stage: str) -> dict[str, Any]:
    frame = traceback.extract_tb(err.__traceback__)[-1] if err.__traceback__ else None
    return {
        "status": "error",
        "stage": stage,
        "error": f"{type(err).__name__}: {err}"[:2000],
        "where": f"{frame.filename}:{frame.lineno}" if frame else None,
        "unsupported_modules": getattr(err, "unsupported_modules", None),
    }


def run_config(spec: dict[str, Any], isolated: bool = False) -> dict[str, Any]:
    """Time ``spec["warmup"] + spec["steps"]`` training steps of one configuration in this process.

    Returns ``{"status": "ok", "step_s": [timed seconds per step], "peak_mem_mb", "pre_step_mem_mb",
    "mem_kind", "threads", "n_params"}`` or ``{"status": "error", "stage", "error", ...}``. Memory is only
    reported on CUDA or when this process runs nothing else (``isolated``).
    """
    device = torch.device(spec["device"])
    _set_threads(spec.get("threads"))
    memory = _Memory(device, isolated)
    try:
        bench_model, backend, batch, n_params = _build(spec, device, spec["batch_size"])
    except Exception as err:
        return _error(err, "build")
    pre_step = memory.now()
    times = []
    try:
        for _ in range(spec["warmup"] + spec["steps"]):
            _sync(device)
            start = time.perf_counter()
            _train_step(bench_model, backend, batch, device, spec["amp"])
            _sync(device)
            times.append(time.perf_counter() - start)
    except Exception as err:
        return _error(err, "step")
    finally:
        backend.close()
    return {
        "status": "ok",
        "step_s": times[spec["warmup"] :],
        "peak_mem_mb": memory.peak(),
        "pre_step_mem_mb": pre_step,
        "mem_kind": memory.kind,
        "threads": torch.get_num_threads(),
        "n_params": n_params,
        "source_hash": source_hash(),
    }


def _child(spec: dict[str, Any], conn: Any) -> None:
    """Entry point of a spawned process: import ``spec["preload"]`` (the same libraries in every child, so
    that library memory is the same for all methods), then run one configuration."""
    try:
        for module in spec["preload"]:
            importlib.import_module(module)
        result = run_config(spec, isolated=True)
    except BaseException as err:  # report anything, even errors outside the training step
        result = _error(err, "child")
    conn.send(result)
    conn.close()


def run_isolated(spec: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """:func:`run_config` in a fresh spawned interpreter; a crash or timeout becomes an error record."""
    context = mp.get_context("spawn")
    receive, send = context.Pipe(duplex=False)
    process = context.Process(target=_child, args=(spec, send), daemon=True)
    process.start()
    send.close()
    try:
        if receive.poll(timeout_s):
            return receive.recv()
        if process.is_alive():
            return {"status": "error", "stage": "child", "error": f"timed out after {timeout_s:.0f} s"}
        process.join()
        return {
            "status": "error",
            "stage": "child",
            "error": f"process died with exit code {process.exitcode} (killed: probably out of memory)",
        }
    except EOFError:
        process.join()
        return {
            "status": "error",
            "stage": "child",
            "error": f"process died with exit code {process.exitcode}",
        }
    finally:
        if process.is_alive():
            process.kill()
        process.join()
        receive.close()


# ---------------------------------------------------------------------------------------------- max batch
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


# ---------------------------------------------------------------------------------------------- planning
def interleave(methods: list[str], baseline_every: int) -> list[str]:
    """``[B, m1..mk, B, m(k+1).., B]`` with ``B`` the baseline every ``baseline_every`` methods."""
    others = [m for m in methods if m != BASELINE]
    if BASELINE not in methods:
        return others
    order = [BASELINE]
    for i in range(0, len(others), baseline_every):
        order += [*others[i : i + baseline_every], BASELINE]
    return order


def plan(cfg: DictConfig, device: str) -> list[dict[str, Any]]:
    """Every run in execution order: groups (model, batch, seq) one after another, ``repeats`` rounds each."""
    suite = cfg.bench_suite
    if not suite.models:
        raise ValueError(f"suite {suite.name!r} has no models; choose a suite such as bench_suite=cpu")
    runs = []
    for model_name, entry in suite.models.items():
        methods = list(entry.get("methods") or suite.methods)
        unknown = sorted(set(methods) - set(cfg.methods))
        if unknown:
            raise ValueError(
                f"{model_name}: unknown methods {unknown}; defined in conf/bench.yaml: {sorted(cfg.methods)}"
            )
        seq_lens = list(entry.get("seq_lens") or [None])
        for batch_size in entry.batch_sizes:
            for seq_len in seq_lens:
                for repeat in range(suite.repeats):
                    for method in interleave(methods, suite.baseline_every):
                        runs.append(
                            {
                                "model_name": model_name,
                                "model": OmegaConf.to_container(entry.spec, resolve=True),
                                "optimizer": OmegaConf.to_container(entry.optimizer, resolve=True),
                                "method": method,
                                "clip": OmegaConf.to_container(cfg.methods[method], resolve=True),
                                "batch_size": int(batch_size),
                                "seq_len": None if seq_len is None else int(seq_len),
                                "repeat": repeat,
                                "warmup": int(suite.warmup),
                                "steps": int(suite.steps),
                                "device": device,
                                "threads": cfg.threads,
                                "amp": suite.amp,
                                "noise_multiplier": float(cfg.noise_multiplier),
                                "sample_size": int(cfg.sample_size),
                                "seed": int(cfg.seed),
                                "preload": list(cfg.preload),
                            }
                        )
    return runs


# ---------------------------------------------------------------------------------------------- aggregation
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


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    return numerator / denominator if numerator is not None and denominator else None


def _paired_throughput(runs: list[dict[str, Any]], index: int) -> float | None:
    """Baseline s/step over ``runs[index]``'s s/step (medians), the baseline being the runs just before and
    after it: the machine's drift between rounds cancels within each pair."""
    neighbours = _adjacent_baselines(runs, index)
    if not neighbours:
        return None
    baseline = statistics.median(t for i in neighbours for t in runs[i]["step_s"])
    return baseline / statistics.median(runs[index]["step_s"])


def aggregate(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One record per (model, method, batch, seq): pooled timings and memory, and ratios to the baseline.

    ``ratios.throughput`` is the median over the method's runs of the paired ratio (baseline s/step of the
    adjacent baseline runs / the run's s/step; :func:`_paired_throughput`), so that a round measured while the
    machine was slow is compared with baselines measured in that same state; pooling all steps instead would
    compare across rounds. The memory ratios use the baseline runs adjacent to the method's runs (for the
    baseline itself: all of its runs, ratio 1).
    ``step_mem`` is the memory a step adds on top of the built model (peak - pre-step).
    """
    records: dict[tuple, dict[str, Any]] = {}
    for index, run in enumerate(runs):
        key = (*_group_key(run), run["method"])
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
                "peak_mem": _ratio(peak, _median([r["peak_mem_mb"] for r in base])),
                "step_mem": _ratio(step_mem, _median([_delta(r) for r in base])),
            },
        )
        out.append(entry)
    return out


def _delta(run: dict[str, Any]) -> float | None:
    if run.get("peak_mem_mb") is None or run.get("pre_step_mem_mb") is None:
        return None
    return run["peak_mem_mb"] - run["pre_step_mem_mb"]


# ---------------------------------------------------------------------------------------------- machine
def _cpu_model() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    match = re.search(r"^model name\s*:\s*(.+)$", text, re.MULTILINE)
    return match.group(1).strip() if match else platform.machine()


def machine_info(device: str) -> dict[str, Any]:
    """CPU and GPU model, core/thread counts, memory, library versions, date and load average."""
    import opacus
    import psutil
    import timm
    import transformers

    info: dict[str, Any] = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "torch_threads": torch.get_num_threads(),
        "memory_gb": round(psutil.virtual_memory().total / 2**30, 1),
        "load_average": list(os.getloadavg()),
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "opacus": opacus.__version__,
            "timm": timm.__version__,
        },
        "device": device,
        "gpu": None,
    }
    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(torch.device(device))
        info["gpu"] = {
            "name": props.name,
            "memory_gb": round(props.total_memory / 2**30, 1),
            "capability": f"{props.major}.{props.minor}",
            "cuda": torch.version.cuda,
            "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
        }
    return info


# ---------------------------------------------------------------------------------------------- driver
def _resolve_device(requested: str) -> str:
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device={requested} but CUDA is not available; use device=cpu or device=auto")
    return requested


def _isolated(isolation: str, device: str) -> bool:
    if isolation not in ("auto", "subprocess", "inprocess"):
        raise ValueError(f"unknown isolation {isolation!r}; valid: auto, subprocess, inprocess")
    return isolation == "subprocess" or (isolation == "auto" and not device.startswith("cuda"))


def _summary(run: dict[str, Any]) -> str:
    if run["status"] != "ok":
        return f"ERROR {run['error'][:200]}"
    steps, peak = run["step_s"], run["peak_mem_mb"]
    memory = f", peak {peak:.0f} MiB" if peak is not None else ""
    return f"median {statistics.median(steps):.3f} s/step [{min(steps):.3f}, {max(steps):.3f}]{memory}"


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
        entry["ratio"] = _ratio(entry.get("max_batch"), base.get("max_batch"))
        yield entry


def _write(path: Path, payload: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(payload, indent=1))
    tmp.replace(path)


def run_suite(cfg: DictConfig) -> dict[str, Any]:
    """Run every configuration of ``cfg.bench_suite``, rewriting the JSON at ``cfg.output`` after each run."""
    device = _resolve_device(cfg.device if cfg.bench_suite.device is None else cfg.bench_suite.device)
    isolated = _isolated(cfg.isolation, device)
    _set_threads(cfg.threads)
    output = Path(to_absolute_path(cfg.output))
    specs = plan(cfg, device)
    payload: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "suite": cfg.bench_suite.name,
        "kind": cfg.bench_suite.kind,
        "complete": False,
        "machine": machine_info(device),
        "isolation": "subprocess" if isolated else "inprocess",
        "config": OmegaConf.to_container(cfg, resolve=True),
        "runs": [],
        "records": [],
        "max_batch": [],
    }
    started = time.perf_counter()
    for index, spec in enumerate(specs):
        result = run_isolated(spec, cfg.timeout_s) if isolated else run_config(spec)
        if not isolated and device.startswith("cuda"):
            gc.collect()
            torch.cuda.empty_cache()
        family = instantiate(spec["model"]).family
        run = {k: spec[k] for k in ("model_name", "method", "batch_size", "seq_len", "repeat")}
        payload["runs"].append({"order": index, "family": family, **run, **result})
        log.info(
            "[%d/%d] %s %s B=%d T=%s: %s",
            index + 1,
            len(specs),
            spec["model_name"],
            spec["method"],
            spec["batch_size"],
            spec["seq_len"],
            _summary(result),
        )
        payload["records"] = aggregate(payload["runs"])
        _write(output, payload)
    if cfg.bench_suite.max_batch.enabled and device.startswith("cuda"):
        payload["max_batch"] = list(max_batches(cfg, specs))
    payload.update(complete=True, wall_s=time.perf_counter() - started)
    payload["machine"]["load_average_end"] = list(os.getloadavg())
    _write(output, payload)
    log.info("wrote %s (%d runs, %.0f s)", output, len(specs), payload["wall_s"])
    return payload


@hydra.main(config_path="../conf", config_name="bench", version_base="1.3")
def main(cfg: DictConfig) -> None:
    run_suite(cfg)


if __name__ == "__main__":
    main()
