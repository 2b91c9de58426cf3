"""What a benchmark ran on: CPU and GPU model, counts, memory, library versions, load; and a hash of the
clipping code, so that a suite whose runs disagree shows it was measured while that code changed."""

from __future__ import annotations

import datetime as dt
import hashlib
import os
import platform
from pathlib import Path
from typing import Any

import torch

from dpexp.runtime import cpu_model


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
        "cpu": cpu_model(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
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


def source_hash() -> str:
    """Short hash of the clipping code a run imports (``dpexp/privacy``, the backends): a suite whose runs
    disagree was measured while that code changed."""
    package = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    sources = [
        *package.glob("privacy/**/*.py"),
        *package.glob("backends*.py"),
        *package.glob("backends/**/*.py"),
    ]
    for path in sorted(sources):
        digest.update(path.relative_to(package).as_posix().encode() + path.read_bytes())
    return digest.hexdigest()[:12]
