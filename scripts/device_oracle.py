"""The oracle tests on another device (a GPU): run where one is lent, ``python scripts/device_oracle.py``.

1. Exactness: every model of ``tests.engine_models.CASES`` x every strategy and clipping mode of
   ``tests.oracle.SETTINGS``, in float64 on the device, against the brute-force oracle (per-example gradients
   by a Python loop, on the same device): the relative error of every parameter's update, as in
   ``tests/test_engine_oracle.py``.
2. Sensitivity in low precision: for a few models in float32 (TF32 off, then on) and under bf16 autocast,
   each example alone through the engine with every example clipped; ``||released sum|| / C`` (per group) is
   how far one example can move the released sum relative to the bound the accountant assumes
   (1 + rounding; the noise is calibrated to C).

Writes a JSON summary (``--out``) and exits non-zero when an update differs from the oracle by more than
``--tolerance`` or a case raises.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.engine_models import CASES, make_case
from tests.oracle import SETTINGS, clipped_mean, engine_update, group_norms, per_example_grads

LOW_PRECISION_CASES = ["gpt2", "wrn_block", "vit", "roberta", "opt"]


def _on(device: torch.device, case: str, dtype: torch.dtype, batch_size: int = 6):
    model, loss_fn, batch = make_case(case, batch_size=batch_size)
    batch = {k: v.to(device, dtype) if v.is_floating_point() else v.to(device) for k, v in batch.items()}
    return model.to(device, dtype), loss_fn, batch


def _partition(model, clipping: str, groups: int | None) -> list[list[str]]:
    from dpexp.privacy import PrivacyEngine

    return PrivacyEngine(
        copy.deepcopy(model), batch_size=2, sample_size=10, max_grad_norm=1.0, noise_multiplier=0.0,
        clipping=clipping, groups=groups,
    ).groups  # fmt: skip


def exactness(device: torch.device) -> list[dict]:
    """Worst relative error of the update per (case, strategy, clipping) in float64 on ``device``."""
    rows = []
    for case in CASES:
        model, loss_fn, batch = _on(device, case, torch.float64)
        grads = per_example_grads(model, loss_fn, batch)
        size = next(iter(batch.values())).shape[0]
        micro = [[0, 1, 2], [3, 4, 5]] if size == 6 else [list(range(size))]
        for strategy, clipping, groups in SETTINGS:
            row = {"case": case, "strategy": strategy, "clipping": clipping, "groups": groups}
            try:
                partition = _partition(model, clipping, groups)
                thresholds = group_norms(grads, partition).median(0).values.tolist()
                expected = clipped_mean(grads, partition, thresholds, batch_size=size)
                delta, _ = engine_update(
                    model, loss_fn, batch, micro, batch_size=size, clipping=clipping, groups=groups,
                    strategy=strategy, thresholds=thresholds, max_grad_norm=1.0,
                )  # fmt: skip
                errors = [(delta[n] - w).norm() / w.norm().clamp_min(1e-12) for n, w in expected.items()]
                row["max_rel_error"] = float(max(errors))
            except Exception as err:  # recorded, and the script fails
                row["error"] = f"{type(err).__name__}: {err}"[:500]
                row["where"] = traceback.format_exc(limit=-3)[-800:]
            rows.append(row)
    return rows


@contextlib.contextmanager
def _tf32(enabled: bool):
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = enabled
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def _autocast_loss(loss_fn, device: torch.device):
    def loss(model, batch):
        with torch.autocast(device.type, dtype=torch.bfloat16):
            return loss_fn(model, batch).float()

    return loss


def _clipped_sums(model, loss_fn, example, clipping: str, thresholds: list[float]) -> dict[str, torch.Tensor]:
    """The engine's clipped sum of one example alone, before noise, by parameter (read from the engine, not
    from a parameter update, whose float32 difference would round away a small sum)."""
    from dpexp.privacy import PrivacyEngine

    model = copy.deepcopy(model)
    engine = PrivacyEngine(
        model, batch_size=1, sample_size=10, max_grad_norm=1.0, noise_multiplier=0.0, clipping=clipping,
        thresholds=thresholds,
    )  # fmt: skip
    engine.backward(loss_fn(model, example))
    return {name: engine.clipped_sum_so_far(name) for group in engine.groups for name in group}


def sensitivity(device: torch.device) -> list[dict]:
    """max_i max_k ||clipped sum of example i alone, group k|| / C_k, every example clipped (C_k a tenth of
    the smallest float64 oracle norm of group k), per case, clipping mode and precision."""
    rows = []
    modes = [("float32", False), ("tf32", True), ("bf16_autocast", False)]
    for case in LOW_PRECISION_CASES:
        reference, loss64, batch64 = _on(device, case, torch.float64)
        grads = per_example_grads(reference, loss64, batch64)
        for clipping in ("flat", "per_layer"):
            groups = _partition(reference, clipping, None)
            thresholds = (group_norms(grads, groups).min(0).values / 10).tolist()
            for precision, tf32 in modes:
                row = {"case": case, "clipping": clipping, "precision": precision}
                try:
                    model, loss_fn, batch = _on(device, case, torch.float32)
                    if precision == "bf16_autocast":
                        loss_fn = _autocast_loss(loss_fn, device)
                    worst = whole = 0.0
                    with _tf32(tf32):
                        for i in range(next(iter(batch.values())).shape[0]):
                            one = {k: v[i : i + 1] for k, v in batch.items()}
                            delta = _clipped_sums(model, loss_fn, one, clipping, thresholds)
                            squares = [sum(float(delta[n].double().norm()) ** 2 for n in g) for g in groups]
                            ratios = [s**0.5 / c for s, c in zip(squares, thresholds, strict=True)]
                            worst = max(worst, *ratios)
                            whole = max(whole, (sum(squares) / sum(c * c for c in thresholds)) ** 0.5)
                    # per group (each C_k), and the whole contribution against sqrt(sum_k C_k^2), the
                    # sensitivity the noise is calibrated to
                    row.update(max_ratio_to_bound=worst, max_ratio_whole=whole)
                except Exception as err:
                    row["error"] = f"{type(err).__name__}: {err}"[:500]
                rows.append(row)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default="device_oracle.json")
    parser.add_argument("--tolerance", type=float, default=1e-5)
    args = parser.parse_args()
    device = torch.device(args.device)
    started = time.perf_counter()
    exact = exactness(device)
    sens = sensitivity(device)
    failed = [r for r in exact if "error" in r or r["max_rel_error"] > args.tolerance]
    summary = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else str(device),
        "torch": torch.__version__,
        "wall_s": time.perf_counter() - started,
        "exactness": exact,
        "worst_rel_error": max((r.get("max_rel_error", float("inf")) for r in exact), default=None),
        "failed": failed,
        "sensitivity": sens,
    }
    Path(args.out).write_text(json.dumps(summary, indent=1))
    print(f"{len(exact)} exactness checks, worst relative error {summary['worst_rel_error']:.2e}, "
          f"{len(failed)} failed; {summary['wall_s']:.0f} s")  # fmt: skip
    for row in failed:
        print("FAILED", json.dumps(row)[:600])
    for row in sens:
        print("sensitivity", json.dumps(row)[:300])
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
