"""One benchmark configuration: build it, time ``warmup + steps`` training steps, measure its memory.

* CPU: every configuration runs in a fresh spawned process (:func:`run_isolated`), whose peak resident
  memory (``VmHWM``) is its own, so one configuration cannot inflate another's memory.
* CUDA: configurations run in this process; memory is ``torch.cuda.max_memory_allocated`` after a reset,
  minus what was allocated before the model was built.
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import re
import time
import traceback
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from hydra.utils import instantiate

from dpexp.backends import build_backend
from dpexp.bench.machine import source_hash
from dpexp.privacy.capture import unsupported_modules
from dpexp.training.optim import build_optimizer


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


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _build(spec: dict[str, Any], device: torch.device, batch_size: int):
    """Model, backend (wrapping model and optimizer) and a batch on ``device`` for one configuration."""
    bench_model = instantiate(spec["model"])
    torch.manual_seed(spec["seed"])
    with device:
        net = bench_model.build()
    optimizer = build_optimizer(net.parameters(), spec["optimizer"])
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
