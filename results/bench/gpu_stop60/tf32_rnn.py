"""How far autograd's float32 gradient of an nn.LSTM / nn.GRU on CUDA is from the exact one, with cuDNN's
TF32 on (PyTorch's default) and off: the gap check 2 of dpexp.privacy.verification measured (stop 60's
first device call refused the gpu_layers suite's LSTM and GRU at 7e-4 and 1e-3 against its float32
tolerance of 1e-4). The gpu_layers suite's shapes: 2 layers, 512 wide, B = 64, T = 128. Run on the device:
``python results/bench/gpu_stop60/tf32_rnn.py``."""

import sys

import torch

from dpexp.bench.models import TorchRecurrentClassifier

DEVICE = sys.argv[1] if len(sys.argv) > 1 else "cuda"


def grads(bench, model, batch):
    model.zero_grad()
    bench.per_example_loss(model, batch).sum().backward()
    return {n: p.grad.double().clone() for n, p in model.named_parameters()}


for kind in ("LSTM", "GRU"):
    bench = TorchRecurrentClassifier(kind=kind, hidden_size=512)
    torch.manual_seed(0)
    model = bench.build().to(DEVICE)
    batch = {k: v.to(DEVICE) for k, v in bench.make_batch(64, 128, torch.Generator().manual_seed(0)).items()}
    exact = grads(bench, model.double(), batch)
    model.float()
    for tf32 in (True, False):
        torch.backends.cudnn.allow_tf32 = tf32
        got = grads(bench, model, batch)
        gaps = {n: float((got[n] - exact[n]).abs().max() / exact[n].abs().max()) for n in exact}
        worst = max(gaps, key=gaps.get)
        print(f"{kind} cudnn.allow_tf32={tf32}: worst max-abs gap / max-abs {gaps[worst]:.2e} ({worst})")
torch.backends.cudnn.allow_tf32 = True
