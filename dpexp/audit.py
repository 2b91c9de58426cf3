"""Entry point: ``python -m dpexp.audit [audit=white_box|black_box] [key=value ...]`` (``conf/audit.yaml``).

Trains the configured run once with canaries (:mod:`dpexp.privacy.audit`; Steinke, Nasr & Jagielski 2023),
scores them, and reports the empirical lower bound on epsilon beside the accountants' epsilon, with the
tightness (lower bound / epsilon). A lower bound above the calibrating accountant's epsilon means the run did
not deliver its guarantee: the audit says so in one line and exits with status 1. The result goes to the
run's directory (``audit.json``) and, with ``audit.save_to``, to a file of its own (``results/audit/``).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torch.utils.data import Dataset, Subset

from dpexp.backends import TrainingBackend
from dpexp.backends.engine import EngineBackend
from dpexp.config import ConfigError, composition_refusals  # importing dpexp.config registers the schema
from dpexp.privacy.audit import DiracCanaries, correct_guesses, epsilon_lower_bound
from dpexp.runtime import debug_requested, is_project_error, one_line, write_json_atomic
from dpexp.tasks.base import Task
from dpexp.training.hooks import RunHooks
from dpexp.training.loop import run_training

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
GROUPS = ("task", "model", "clip", "accountant", "noise", "optim", "audit")
RESULT_FILE = "audit.json"


class WhiteBoxCanaries(RunHooks):
    """Dirac gradient canaries in the engine: drawn when the backend is ready, added at every logical step
    (Poisson, rate q) after the data's micro-batches, scored from the privatised gradients the optimizer
    receives minus the data's clipped sum at the canaries' coordinates (known to a white-box auditor), so
    that only the canaries and the noise remain in the scores."""

    def __init__(self, m: int, magnitude: float, seed: int) -> None:
        self.m, self.magnitude = m, magnitude
        self.generator = torch.Generator().manual_seed(seed)
        self.canaries: DiracCanaries | None = None
        self.scores = torch.zeros(m, dtype=torch.float64)

    def backend_ready(self, backend: TrainingBackend, sample_rate: float) -> None:
        if not isinstance(backend, EngineBackend):
            raise ValueError(
                "audit=white_box puts gradient canaries into the dpexp engine (clip.method=dpexp); "
                "audit other methods with audit=black_box"
            )
        self.engine, self.sample_rate = backend.engine, sample_rate
        self.params = self.engine.trainable_parameters()
        shapes = {name: p.shape for name, p in self.params.items()}
        magnitude = self.magnitude * self.engine.max_grad_norm
        self.canaries = DiracCanaries.draw(shapes, self.m, magnitude, self.generator)
        # runs after the engine's own pre-step hook (registered first): p.grad is the released gradient
        backend.optimizer.register_step_pre_hook(lambda *_: self._score())

    def before_step(self, step: int) -> None:
        names = set(self.canaries.names)
        self.known = self.canaries.read({name: self.engine.clipped_sum_so_far(name) for name in names})
        grads = self.canaries.step_gradients(self.sample_rate, self.params, self.generator)
        if grads:
            self.engine.add_per_example_gradients(grads)

    def _score(self) -> None:
        """``B * released - known``: the canaries' clipped part plus the noise at each canary's coordinate
        (the data's clipped sum, which the white-box auditor knows, taken out: section 6 of the paper)."""
        released = self.canaries.read({name: p.grad for name, p in self.params.items()})
        self.scores += released * self.engine.batch_size - self.known

    @property
    def included(self) -> torch.Tensor:
        return self.canaries.included


class InputCanaries(RunHooks):
    """Mislabelled training examples: m examples leave the training set; each comes back with a random wrong
    label with probability 1/2; its score is minus its loss under the final model."""

    def __init__(self, m: int, seed: int) -> None:
        self.m = m
        self.generator = torch.Generator().manual_seed(seed)
        self.scores = torch.zeros(m, dtype=torch.float64)

    def training_set(self, task: Task, dataset: Dataset) -> Dataset:
        n = len(dataset)
        if not 0 < self.m < n:
            raise ValueError(f"audit.canaries={self.m}: need between 1 and {n - 1} (the training set's size)")
        order = torch.randperm(n, generator=self.generator).tolist()
        pool, kept = order[: self.m], order[self.m :]
        labels = task.info.num_labels
        self.canaries = []
        for i in pool:
            example = dataset[i]
            shift = int(torch.randint(1, labels, (1,), generator=self.generator))
            self.canaries.append(task.relabelled(example, (task.label_of(example) + shift) % labels))
        self.included = torch.rand(self.m, generator=self.generator) < 0.5
        members = [c for c, inside in zip(self.canaries, self.included.tolist(), strict=True) if inside]
        return _Concatenated(Subset(dataset, kept), members)

    def finished(self, model: nn.Module, task: Task) -> dict[str, Any]:
        device = next(model.parameters()).device
        for start in range(0, self.m, 256):
            batch = task.collate(self.canaries[start : start + 256])
            batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}
            self.scores[start : start + 256] = -task.per_example_loss(model, batch).double().cpu()
        return {}


class _Concatenated(Dataset):
    """A data set followed by a list of extra examples."""

    def __init__(self, base: Dataset, extra: list[Any]) -> None:
        self.base, self.extra = base, extra

    def __len__(self) -> int:
        return len(self.base) + len(self.extra)

    def __getitem__(self, i: int) -> Any:
        return self.base[i] if i < len(self.base) else self.extra[i - len(self.base)]


def audit_result(
    record: Mapping[str, Any], canaries: WhiteBoxCanaries | InputCanaries, cfg: DictConfig
) -> dict[str, Any]:
    """The audit's numbers: guesses, correct guesses, the lower bound, the accountants' epsilon, tightness."""
    audit = cfg.audit
    r, v = correct_guesses(canaries.scores, canaries.included, audit.guesses, audit.abstain_low)
    bound = epsilon_lower_bound(audit.canaries, r, v, record["delta"], audit.confidence)
    epsilons = record.get("epsilon") or {}
    claimed = epsilons.get(record["accountant"])
    return {
        "variant": audit.variant,
        "canaries": audit.canaries,
        "included": int(canaries.included.sum()),
        "guesses": r,
        "correct": v,
        "confidence": audit.confidence,
        "delta": record["delta"],
        "epsilon_lower_bound": bound,
        "accountant": record["accountant"],
        "epsilon": epsilons,
        "tightness": bound / claimed if claimed else None,
        "task": record["task"],
        "model": record["model"],
        "clip": record["clip"],
        "noise_multiplier": record["noise_multiplier"],
        "steps": record["steps"],
        "sample_rate": record["sample_rate"],
        "test_metrics": {name: record[name] for name in record.get("metric_names", [])},
        "command": "python -m dpexp.audit " + " ".join(_overrides()),
        "config": OmegaConf.to_container(cfg, resolve=True, enum_to_str=True),
    }


def _overrides() -> list[str]:
    try:
        return list(HydraConfig.get().overrides.task)
    except ValueError:  # not under Hydra (tests)
        return []


def run_audit(
    cfg: DictConfig, output_dir: str | Path, choices: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """Train ``cfg`` once with canaries and return the audit's result (also written to ``output_dir``)."""
    audit = cfg.audit
    if cfg.get("resume") is not None:
        raise ConfigError("resume: an audit trains once from the start (its canaries are not checkpointed)")
    if cfg.distributed.name != "none":
        raise ConfigError(
            f"distributed={cfg.distributed.name}: an audit runs in one process (every rank would insert the "
            "white-box canaries into its own share); use distributed=none"
        )
    if audit.variant == "white_box":
        canaries: WhiteBoxCanaries | InputCanaries = WhiteBoxCanaries(
            audit.canaries, audit.magnitude, audit.seed
        )
    elif audit.variant == "black_box":
        canaries = InputCanaries(audit.canaries, audit.seed)
    else:
        raise ValueError(f"Unknown audit.variant {audit.variant!r}; valid choices: white_box, black_box.")
    record = run_training(cfg, output_dir, choices, canaries)
    result = audit_result(record, canaries, cfg)
    text = json.dumps(result, indent=2) + "\n"
    write_json_atomic(Path(output_dir) / RESULT_FILE, text)
    if audit.save_to:
        write_json_atomic(hydra.utils.to_absolute_path(audit.save_to), text)
    return result


def verdict(result: Mapping[str, Any]) -> tuple[str, bool]:
    """A summary for the terminal; whether the lower bound exceeds the calibrating accountant's epsilon."""
    name = result["accountant"]
    claimed = result["epsilon"].get(name)
    bound = result["epsilon_lower_bound"]
    violated = claimed is not None and bound > claimed
    tightness = f"{result['tightness']:.2f}" if result["tightness"] is not None else "n/a"
    lines = [
        f"{result['variant']} audit of {result['task']} / {result['clip']}: {result['correct']} of "
        f"{result['guesses']} guesses right among {result['canaries']} canaries "
        f"({result['included']} included)",
        f"empirical epsilon lower bound {bound:.3f} at {result['confidence']:.0%} confidence (delta "
        f"{result['delta']:.3g}); accountant epsilon {name}={claimed:.3f}; tightness {tightness}",
    ]
    if violated:
        lines.append(
            f"privacy audit FAILED: the lower bound {bound:.3f} exceeds the claimed epsilon {claimed:.3f} "
            f"({name}): this run did not deliver ({claimed:.3f}, {result['delta']:.3g})-DP"
        )
    return "\n".join(lines), violated


@hydra.main(version_base=None, config_path=str(CONF_DIR), config_name="audit")
def main(cfg: DictConfig) -> None:
    """Audit the run of ``cfg``; exit status 1 if the audit failed, 2 on a refusal (printed in one line)."""
    runtime = HydraConfig.get().runtime
    choices = {group: runtime.choices[group] for group in GROUPS if group in runtime.choices}
    try:
        result = run_audit(cfg, runtime.output_dir, choices)
    except Exception as error:
        if debug_requested(cfg.debug) or not is_project_error(error):
            raise
        print(one_line(error), file=sys.stderr)
        sys.exit(2)
    text, violated = verdict(result)
    print(text)
    print(f"audit: {runtime.output_dir}/{RESULT_FILE}")
    if violated:
        sys.exit(1)


if __name__ == "__main__":
    with composition_refusals(exit_code=2):
        main()
