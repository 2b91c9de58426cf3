"""One benchmark configuration: build it, time ``warmup + steps`` training steps, measure its memory.

* CPU: every configuration runs in a fresh spawned process (:func:`run_isolated`), whose peak resident
  memory (``VmHWM``) is its own, so one configuration cannot inflate another's memory.
* CUDA: configurations run in this process; memory is ``torch.cuda.max_memory_allocated`` after a reset,
  minus what was allocated before the model was built.
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import re
import socket
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
from dpexp.training.distributed import DataParallel, DistributedConfig
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


def _build(spec: dict[str, Any], device: torch.device, batch_size: int, parallel: DataParallel | None = None):
    """Model, backend (wrapping model and optimizer) and a batch on ``device`` for one configuration; with
    ``parallel`` (a rank of a data-parallel job) the batch is this rank's share of the logical batch, whose
    size B stays the divisor."""
    bench_model = instantiate(spec["model"], _convert_="all")  # plain lists and dicts, as configs expect
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
            aggregation=parallel,
        )
    except Exception as err:
        err.unsupported_modules = unsupported_modules(net)  # type: ignore[attr-defined]
        raise
    generator = torch.Generator().manual_seed(spec["seed"])
    share = batch_size if parallel is None else len(parallel_share(batch_size, parallel))
    batch = {k: v.to(device) for k, v in bench_model.make_batch(share, spec["seq_len"], generator).items()}
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


def parallel_share(batch_size: int, parallel: DataParallel) -> range:
    """The examples of a logical batch of ``batch_size`` that ``parallel``'s rank runs (``[rank::P]``)."""
    return range(batch_size)[parallel.rank :: parallel.world_size]


def run_config(
    spec: dict[str, Any], isolated: bool = False, parallel: DataParallel | None = None
) -> dict[str, Any]:
    """Time ``spec["warmup"] + spec["steps"]`` training steps of one configuration in this process (with
    ``parallel``: this rank's share of every step, whose time includes the all-reduce).

    Returns ``{"status": "ok", "step_s": [timed seconds per step], "peak_mem_mb", "pre_step_mem_mb",
    "mem_kind", "threads", "n_params"}`` or ``{"status": "error", "stage", "error", ...}``. Memory is only
    reported on CUDA or when this process runs nothing else (``isolated``).
    """
    device = torch.device(spec["device"])
    _set_threads(spec.get("threads"))
    memory = _Memory(device, isolated)
    if parallel is None and spec.get("world_size", 1) > 1:
        return _error(ValueError("data-parallel runs (world_size > 1) need isolation=subprocess"), "build")
    try:
        bench_model, backend, batch, n_params = _build(spec, device, spec["batch_size"], parallel)
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
        "world_size": 1 if parallel is None else parallel.world_size,
        "source_hash": source_hash(),
    }


def _child(spec: dict[str, Any], conn: Any, rank: int, port: int | None, timeout_s: float) -> None:
    """Entry point of a spawned process: import ``spec["preload"]`` (the same libraries in every child, so
    that library memory is the same for all methods), join the data-parallel job of ``spec["world_size"]``
    ranks on ``port`` (gloo, collectives waiting at most ``timeout_s``) if there is one, then run one
    configuration."""
    parallel = None
    try:
        for module in spec["preload"]:
            importlib.import_module(module)
        if port is not None:
            os.environ.update(
                RANK=str(rank),
                WORLD_SIZE=str(spec["world_size"]),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
            )
            config = DistributedConfig("ddp", "gloo", timeout_s, spec["world_size"])
            parallel = DataParallel(config, torch.device("cpu"))
        result = run_config(spec, isolated=True, parallel=parallel)
    except BaseException as err:  # report anything, even errors outside the training step
        result = _error(err, "child")
    finally:
        if parallel is not None:
            parallel.close()
    conn.send(result)
    conn.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_isolated(spec: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """:func:`run_config` in a fresh spawned interpreter (one per rank of a data-parallel run, whose result
    is rank 0's); a crash or timeout becomes an error record."""
    world = int(spec.get("world_size", 1))
    if spec["batch_size"] % world:
        return _error(
            ValueError(f"batch {spec['batch_size']} is not divisible by world_size {world}"), "build"
        )
    context = mp.get_context("spawn")
    port = _free_port() if world > 1 else None
    deadline = time.monotonic() + timeout_s
    ranks = []
    for rank in range(world):
        receive, send = context.Pipe(duplex=False)
        process = context.Process(target=_child, args=(spec, send, rank, port, timeout_s), daemon=True)
        process.start()
        send.close()
        ranks.append((receive, process))
    try:
        results = [_receive(receive, process, deadline, timeout_s) for receive, process in ranks]
    finally:
        for receive, process in ranks:
            if process.is_alive():
                process.kill()
            process.join()
            receive.close()
    return next((result for result in results if result["status"] != "ok"), results[0])


def _receive(receive: Any, process: Any, deadline: float, timeout_s: float) -> dict[str, Any]:
    """What one spawned process sent, or the error record of its crash or timeout."""
    try:
        if receive.poll(max(deadline - time.monotonic(), 0)):
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
