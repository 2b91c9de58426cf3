"""Per-layer cost of a convolution's per-example gradient norms on WRN-16-4's layer shapes (CIFAR-10).

    python scripts/conv_norm_bench.py [--batch 64] [--repeats 3] [--threads 1] [--max-seconds 3] \
        [--device cpu]

For every distinct layer shape, milliseconds (minimum over ``repeats``) of each way to the squared norms in
:class:`dpexp.privacy.rules.conv.ConvWeightGrads`: ``instantiate`` (batch-grouped weight-gradient
convolution, then ``vector_norm``), ``unfold`` (ghost norm over ``F.unfold`` patches) and ``pixels`` (ghost
norm over pixel Grams, :func:`~dpexp.privacy.rules.conv.patch_gram_norm_sq`); for scale, the layer's batch
weight gradient (``wgrad``: the clipped sum of a ghost form, or the non-private weight gradient) and the
weight-standardised rule's responses (``responses``: its ghost forms' extra convolution). A method whose
first run takes longer than ``max_seconds`` is not repeated. ``auto`` is the method the cost model
(:func:`~dpexp.privacy.rules.conv.norm_costs`) picks, ``model`` its predicted times in the same order,
scaled by the instantiation's measured rate. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from dpexp.privacy.rules.conv import ConvWeightGrads, _weight_grad

# (C_in, C_out, kernel, stride, input size, layers of WRN-16-4 with this shape)
WRN16_4 = [
    (3, 16, 3, 1, 32, 1),
    (16, 64, 3, 1, 32, 1),
    (16, 64, 1, 1, 32, 1),
    (64, 64, 3, 1, 32, 3),
    (64, 128, 3, 2, 32, 1),
    (64, 128, 1, 2, 32, 1),
    (128, 128, 3, 1, 16, 3),
    (128, 256, 3, 2, 16, 1),
    (128, 256, 1, 2, 16, 1),
    (256, 256, 3, 1, 8, 3),
]
METHODS = ("instantiate", "unfold", "pixels")


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def best_ms(fn: Callable[[], object], repeats: int, max_seconds: float, device: torch.device) -> float:
    """Minimum wall time of ``fn`` in ms over ``repeats`` runs (one if the first exceeds ``max_seconds``),
    the device's kernels included."""
    times = []
    for _ in range(repeats):
        start = _now(device)
        fn()
        times.append(_now(device) - start)
        if times[0] > max_seconds:
            break
    return 1e3 * min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--max-seconds", type=float, default=3.0)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    where = args.device if args.device != "cpu" else f"{args.threads} thread(s)"
    print(f"batch {args.batch}, {where}, float32, ms (min of {args.repeats})\n")
    header = [
        "C_in",
        "C_out",
        "k",
        "stride",
        "map",
        "layers",
        *METHODS,
        "wgrad",
        "responses",
        "auto",
        "model",
    ]
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for shape in WRN16_4:
        print(row(*shape, args), flush=True)


def row(c_in: int, c_out: int, k: int, stride: int, size: int, layers: int, args: argparse.Namespace) -> str:
    """One layer shape's line of the table."""
    device = torch.device(args.device)
    conv = nn.Conv2d(c_in, c_out, k, stride=stride, padding=k // 2, bias=False, device=device)
    x = torch.randn(args.batch, c_in, size, size, device=device)
    dy = torch.randn_like(conv(x).detach())
    grads = ConvWeightGrads(conv, x, dy)
    kernels = torch.randn(c_out + 1, c_in, k, k, device=device)
    runs: dict[str, Callable[[], object]] = {
        "instantiate": lambda: grads.norm_sq("instantiate"),
        "unfold": lambda: grads.ghost_norm_sq(dy, "unfold"),
        "pixels": lambda: grads.ghost_norm_sq(dy, "pixels"),
        "wgrad": lambda: _weight_grad(conv, x, dy, 1, conv.weight.shape),
        "responses": lambda: F.conv2d(x, kernels, None, stride, k // 2),
    }
    ms = {name: best_ms(fn, args.repeats, args.max_seconds, device) for name, fn in runs.items()}
    costs = grads.norm_costs()
    rate = ms["instantiate"] / costs["instantiate"]
    model = " / ".join(f"{rate * costs[m]:.0f}" for m in METHODS)
    cells = " | ".join(f"{ms[name]:.1f}" for name in runs)
    shape = f"{c_in} | {c_out} | {k} | {stride} | {size} | {layers}"
    return f"| {shape} | {cells} | {grads.norm_method('auto')} | {model} |"


if __name__ == "__main__":
    main()
