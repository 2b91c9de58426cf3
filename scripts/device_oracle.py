"""The oracle tests on another device (a GPU): run where one is lent, ``python scripts/device_oracle.py``.

1. Exactness: every model of ``tests.engine_models.CASES``, ``tests.recurrent_models.MODELS`` (PyTorch's
   recurrent layers and ``nn.MultiheadAttention``, stop 59) and ``tests.timm_cnn_models.BUILDERS`` (the
   convolution rules' batched patch products, which only run off the CPU) x every strategy and clipping
   mode of ``tests.oracle.SETTINGS`` (three of them for the CNNs), in float64 on the device, against the
   brute-force oracle (per-example gradients by a Python loop, on the same device): the relative error of
   every parameter's update, as in ``tests/test_engine_oracle.py``. The recurrent family again in float32
   against the float64 oracle of the same weights, where cuDNN's recurrent kernels (TF32 by default) and the
   fused attention kernels run (float64 takes the math paths), with the attention calls read off their
   autograd graph (``nn.MultiheadAttention``'s, torchvision Swin's) counted against those recomputed.
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
from tests.recurrent_models import MODELS, make_recurrent_case
from tests.timm_cnn_models import BUILDERS, make_timm_case

THREE_SETTINGS = [("bk", "flat", None), ("ghost", "per_layer", None), ("instantiate", "groups", 2)]
FAMILIES = {  # name: (models, maker, settings in float64)
    "engine": (CASES, make_case, SETTINGS),
    "recurrent": (list(MODELS), make_recurrent_case, SETTINGS),
    "timm_cnn": (list(BUILDERS), make_timm_case, THREE_SETTINGS),
}

LOW_PRECISION_CASES = ["gpt2", "wrn_block", "vit", "roberta", "opt"]


def _on(device: torch.device, case: str, dtype: torch.dtype, batch_size: int = 6, family: str = "engine"):
    model, loss_fn, batch = FAMILIES[family][1](case, batch_size=batch_size)
    batch = {k: v.to(device, dtype) if v.is_floating_point() else v.to(device) for k, v in batch.items()}
    return model.to(device, dtype), loss_fn, batch


def _partition(model, clipping: str, groups: int | None) -> list[list[str]]:
    from dpexp.privacy import PrivacyEngine

    return PrivacyEngine(
        copy.deepcopy(model), batch_size=2, sample_size=10, max_grad_norm=1.0, noise_multiplier=0.0,
        clipping=clipping, groups=groups,
    ).groups  # fmt: skip


class _AttentionPaths:
    """Counts the attention calls whose values came off the graph (``_read``) and those recomputed
    (``_recomputed``): ``nn.MultiheadAttention``'s (``rules/attention.py``) and torchvision Swin's
    (``rules/shifted_window.py``), by wrapping the two functions of each rule's module."""

    def __init__(self) -> None:
        from dpexp.privacy.rules import attention, shifted_window

        self.modules, self.counts = (attention, shifted_window), {"read": 0, "recomputed": 0}
        self.saved = [(m._read, m._recomputed) for m in self.modules]

    def __enter__(self) -> dict[str, int]:
        def counted(fn, key):
            def wrapper(*args, **kwargs):
                self.counts[key] += 1
                return fn(*args, **kwargs)

            return wrapper

        for module, (read, recomputed) in zip(self.modules, self.saved, strict=True):
            module._read, module._recomputed = counted(read, "read"), counted(recomputed, "recomputed")
        return self.counts

    def __exit__(self, *exc) -> None:
        for module, (read, recomputed) in zip(self.modules, self.saved, strict=True):
            module._read, module._recomputed = read, recomputed


def _check(device, family, case, dtype, settings) -> list[dict]:
    """Worst relative error of the update per setting for one model, the engine in ``dtype`` against the
    float64 oracle on the same weights and inputs."""
    reference, loss_fn, batch64 = _on(device, case, torch.float64, family=family)
    grads = per_example_grads(reference, loss_fn, batch64)
    model = copy.deepcopy(reference).to(dtype)
    batch = {k: v.to(dtype) if v.is_floating_point() else v for k, v in batch64.items()}
    size = next(iter(batch.values())).shape[0]
    micro = [[0, 1, 2], [3, 4, 5]] if size == 6 else [list(range(size))]
    rows = []
    for strategy, clipping, groups in settings:
        row = {"family": family, "case": case, "dtype": str(dtype)[6:], "strategy": strategy,
               "clipping": clipping, "groups": groups}  # fmt: skip
        try:
            partition = _partition(reference, clipping, groups)
            thresholds = group_norms(grads, partition).median(0).values.tolist()
            expected = clipped_mean(grads, partition, thresholds, batch_size=size)
            with _AttentionPaths() as paths:
                delta, _ = engine_update(
                    model, loss_fn, batch, micro, batch_size=size, clipping=clipping, groups=groups,
                    strategy=strategy, thresholds=thresholds, max_grad_norm=1.0,
                )  # fmt: skip
            errors = [(delta[n].double() - w).norm() / w.norm().clamp_min(1e-12) for n, w in expected.items()]
            row["max_rel_error"] = float(max(errors))
            if any(paths.values()):
                row["attention"] = dict(paths)
        except Exception as err:  # recorded, and the script fails
            row["error"] = f"{type(err).__name__}: {err}"[:500]
            row["where"] = traceback.format_exc(limit=-3)[-800:]
        rows.append(row)
    return rows


def exactness(device: torch.device, families: list[str]) -> list[dict]:
    """Every model of ``families`` x its family's settings in float64 on ``device``, then the recurrent
    family in float32 (:data:`THREE_SETTINGS`)."""
    rows = []
    for family in families:
        for case in FAMILIES[family][0]:
            rows += _check(device, family, case, torch.float64, FAMILIES[family][2])
    if "recurrent" in families:
        for case in FAMILIES["recurrent"][0]:
            rows += _check(device, "recurrent", case, torch.float32, THREE_SETTINGS)
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
    parser.add_argument("--tolerance", type=float, default=1e-5, help="float64 updates' relative error")
    parser.add_argument("--tolerance32", type=float, default=1e-3, help="float32 updates' relative error")
    parser.add_argument("--families", default=",".join(FAMILIES), help="comma-separated names")
    parser.add_argument(
        "--exact-tf32",
        choices=["on", "off", "default"],
        default="default",
        help="cuBLAS' and cuDNN's TF32 flags for the exactness checks (default: PyTorch's)",
    )
    args = parser.parse_args()
    device = torch.device(args.device)
    started = time.perf_counter()
    flags = contextlib.nullcontext() if args.exact_tf32 == "default" else _tf32(args.exact_tf32 == "on")
    with flags:
        exact = exactness(device, args.families.split(","))
    sens = sensitivity(device)
    limit = {"float64": args.tolerance, "float32": args.tolerance32}
    failed = [r for r in exact if "error" in r or r["max_rel_error"] > limit[r["dtype"]]]
    summary = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else str(device),
        "exact_tf32": args.exact_tf32,
        "torch": torch.__version__,
        "wall_s": time.perf_counter() - started,
        "exactness": exact,
        "worst_rel_error": max(
            (r.get("max_rel_error", float("inf")) for r in exact if r["dtype"] == "float64"), default=None
        ),
        "worst_rel_error_float32": max(
            (r.get("max_rel_error", float("inf")) for r in exact if r["dtype"] == "float32"), default=None
        ),
        "attention_calls": {
            key: sum(r.get("attention", {}).get(key, 0) for r in exact) for key in ("read", "recomputed")
        },
        "failed": failed,
        "sensitivity": sens,
    }
    Path(args.out).write_text(json.dumps(summary, indent=1))
    print(f"{len(exact)} exactness checks, worst relative error {summary['worst_rel_error']:.2e} (float64), "
          f"{summary['worst_rel_error_float32'] or 0:.2e} (float32), {len(failed)} failed; "
          f"attention calls {summary['attention_calls']}; {summary['wall_s']:.0f} s")  # fmt: skip
    for row in exact:
        if "attention" in row and row["dtype"] == "float32":
            print("attention", row["case"], row["strategy"], row["attention"], f"{row['max_rel_error']:.1e}")
    for row in failed:
        print("FAILED", json.dumps(row)[:600])
    for row in sens:
        print("sensitivity", json.dumps(row)[:300])
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
