"""`make tables` turns stored run records into Markdown tables, and nothing else."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "make_tables.py"


def _record(clip: str, accuracy: float, epsilon: float | None) -> dict:
    return {
        "status": "completed", "task": "digits", "model": "small_cnn", "clip": clip,
        "target_epsilon": epsilon,
        "epsilon": {"rdp": epsilon, "prv": epsilon, "gdp": epsilon} if epsilon else None, "delta": 1e-5,
        "noise_multiplier": 1.2 if epsilon else 0.0, "batch_size": 64, "steps": 10, "accuracy": accuracy,
        "metric_names": ["accuracy", "loss"], "throughput_examples_per_s": 100.0, "peak_memory_bytes": 2**30,
    }  # fmt: skip


def test_tables_are_regenerated_from_records(tmp_path: Path) -> None:
    runs = tmp_path / "runs" / "digits_eps3"
    for clip, acc, eps in [("bk", 0.93, 3.0), ("nonprivate", 0.96, None)]:
        (runs / clip).mkdir(parents=True)
        (runs / clip / "metrics.json").write_text(json.dumps(_record(clip, acc, eps)))
    out = tmp_path / "tables"
    subprocess.run(
        [sys.executable, str(SCRIPT), "--runs", str(tmp_path / "runs"), "--out", str(out)], check=True
    )
    table = (out / "digits_eps3.md").read_text()
    rows = [line for line in table.splitlines() if line.startswith("| small_cnn")]
    assert len(rows) == 2
    assert "| bk | 3.0 | 3.00 |" in rows[0] and "0.9300" in rows[0]
    assert "| nonprivate | - |" in rows[1] and "0.9600" in rows[1]
    assert "digits_eps3" in (out / "README.md").read_text()
