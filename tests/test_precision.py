"""The tolerances the run-time checks compare in: TF32 on CUDA where its flags and the model call for it."""

import pytest
import torch
from torch import nn

from dpexp.privacy.precision import runs_tf32, tolerance

CUDA = torch.device("cuda")


@pytest.fixture
def flags():
    """Both TF32 flags off for the test, restored after it."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def test_tolerance_by_precision():
    assert tolerance(torch.float64) == tolerance(torch.float64, tf32=True) == 1e-9
    assert tolerance(torch.float32) == 1e-4
    assert tolerance(torch.float32, tf32=True) == 1e-2  # looser than float32's, tighter than bf16's
    assert tolerance(torch.bfloat16) == tolerance(torch.bfloat16, tf32=True) == 3e-2


def test_tf32_only_on_cuda_and_where_its_flags_reach_the_model(flags):
    lstm, conv, mlp = nn.LSTM(4, 4), nn.Sequential(nn.Conv2d(3, 4, 3)), nn.Sequential(nn.Linear(4, 4))
    assert not any(runs_tf32(m, CUDA) for m in (lstm, conv, mlp))
    torch.backends.cudnn.allow_tf32 = True  # PyTorch's default: cuDNN's convolutions and recurrent layers
    assert runs_tf32(lstm, CUDA) and runs_tf32(conv, CUDA)
    assert not runs_tf32(mlp, CUDA)  # no cuDNN layer: cuBLAS in full float32
    assert not runs_tf32(lstm, torch.device("cpu"))
    torch.backends.cuda.matmul.allow_tf32 = True  # set_float32_matmul_precision("high"): every product
    assert runs_tf32(mlp, CUDA) and not runs_tf32(mlp, torch.device("cpu"))
