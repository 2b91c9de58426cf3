"""A whole suite: every planned run (isolated in a subprocess on CPU), the JSON rewritten after each run
with the machine, the resolved config, every raw run and the per-configuration records; on CUDA optionally
the largest batch of each method."""

from __future__ import annotations

import gc
import json
import logging
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from hydra.utils import instantiate, to_absolute_path
from omegaconf import DictConfig, OmegaConf

from dpexp.bench.aggregate import aggregate, method_label
from dpexp.bench.machine import machine_info
from dpexp.bench.measure import _set_threads, run_config, run_isolated
from dpexp.bench.plan import plan
from dpexp.bench.search import max_batches
from dpexp.runtime import resolve_device, write_json_atomic

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1


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


def run_suite(cfg: DictConfig) -> dict[str, Any]:
    """Run every configuration of ``cfg.bench_suite``, rewriting the JSON at ``cfg.output`` after each run."""
    device = str(resolve_device(cfg.device if cfg.bench_suite.device is None else cfg.bench_suite.device))
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
        family = instantiate(spec["model"], _convert_="all").family
        run = {k: spec[k] for k in ("model_name", "method", "batch_size", "seq_len", "repeat")}
        payload["runs"].append({"order": index, "family": family, **run, **result})
        log.info(
            "[%d/%d] %s %s B=%d T=%s: %s",
            index + 1,
            len(specs),
            spec["model_name"],
            method_label(spec["method"], spec["world_size"]),
            spec["batch_size"],
            spec["seq_len"],
            _summary(result),
        )
        payload["records"] = aggregate(payload["runs"])
        write_json_atomic(output, json.dumps(payload, indent=1))
    if cfg.bench_suite.max_batch.enabled and device.startswith("cuda"):
        payload["max_batch"] = list(max_batches(cfg, specs))
    payload.update(complete=True, wall_s=time.perf_counter() - started)
    payload["machine"]["load_average_end"] = list(os.getloadavg())
    write_json_atomic(output, json.dumps(payload, indent=1))
    log.info("wrote %s (%d runs, %.0f s)", output, len(specs), payload["wall_s"])
    return payload
