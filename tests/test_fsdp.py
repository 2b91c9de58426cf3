"""Sharded data parallel (distributed=fsdp, FSDP2's ``fully_shard``): what holds today.

``fully_shard`` runs on CPU with gloo in the installed torch (two processes: the sharded gradient of a plain
backward is the ranks' mean gradient), but the engine cannot verify a sharded model: FSDP2 swaps in transient
unsharded parameters for the forward and reduce-scatters their gradients (averaged over the ranks) into the
sharded ones, so the engine's check that the per-example gradients add up to autograd's gradient
(:mod:`dpexp.privacy.verification`) fails and the engine refuses the step on every rank, never clipping
silently wrong. The trainer therefore refuses ``distributed=fsdp`` in one line before training."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dpexp.privacy import PrivacyEngine
from dpexp.privacy.verification import VerificationError
from dpexp.training.distributed import FSDP_REFUSAL, start_data_parallel
from tests.test_distributed import WORLD, _compose, _env, _spawn, outside_torchrun  # noqa: F401

N_EXAMPLES = 8


def _model_and_data() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    x = torch.randn(N_EXAMPLES, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    return model, x, torch.arange(N_EXAMPLES) % 3


def _sharded(model: nn.Module) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    return fully_shard(model)


def _fsdp_worker(rank: int, port: int, out: str) -> None:
    """Rank ``rank``: a plain FSDP2 backward of its share, then the engine on the sharded model."""
    _env(rank, port)
    dist.init_process_group("gloo")
    try:
        model, x, y = _model_and_data()
        reference = copy.deepcopy(model)
        F.cross_entropy(reference(x), y, reduction="sum").backward()
        share = list(range(N_EXAMPLES))[rank::WORLD]
        sharded = _sharded(model)
        F.cross_entropy(sharded(x[share]), y[share], reduction="sum").backward()
        # FSDP2 averages the ranks' gradients: the full-batch sum / WORLD
        gaps = {
            n: float((p.grad.full_tensor() - q.grad / WORLD).abs().max())
            for (n, p), (_, q) in zip(sharded.named_parameters(), reference.named_parameters(), strict=True)
        }
        sharded_kinds = sorted({type(p).__name__ for p in sharded.parameters()})
        sharded.zero_grad(set_to_none=True)
        engine = PrivacyEngine(
            sharded, batch_size=N_EXAMPLES, sample_size=100, max_grad_norm=0.1, noise_multiplier=1.0
        )
        try:
            engine.backward(F.cross_entropy(sharded(x[share]), y[share], reduction="none"))
            refusal = None
        except VerificationError as error:
            refusal = str(error)
        result = {"gaps": gaps, "kinds": sharded_kinds, "refusal": refusal}
        Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # two spawned processes: ~40 s on one shared core
@pytest.mark.filterwarnings("ignore")
def test_fully_shard_runs_on_cpu_gloo_but_the_engine_refuses_a_sharded_model(tmp_path):
    assert _spawn(_fsdp_worker, str(tmp_path)) == [0] * WORLD
    for rank in range(WORLD):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["kinds"] == ["DTensor"]  # the parameters are sharded
        assert max(result["gaps"].values()) < 1e-12, result["gaps"]
        assert result["refusal"] is not None and "do not add up to its gradient" in result["refusal"]


def test_fsdp_is_refused_in_one_line_before_training(outside_torchrun):  # noqa: F811
    outside_torchrun.setenv("WORLD_SIZE", "2")
    outside_torchrun.setenv("MASTER_ADDR", "127.0.0.1")
    with pytest.raises(ValueError, match="distributed=fsdp is not available yet") as info:
        start_data_parallel(_compose(["distributed=fsdp"]).distributed, torch.device("cpu"))
    assert str(info.value) == FSDP_REFUSAL and "\n" not in FSDP_REFUSAL and not dist.is_initialized()
