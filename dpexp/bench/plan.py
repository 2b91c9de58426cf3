"""The runs of a suite in execution order: groups (model, batch, sequence length) one after another,
``repeats`` rounds each, the methods of a round interleaved with the non-private baseline
(``nonprivate, m1, .., m_k, nonprivate, ...`` with ``baseline_every = k``) so that each method's ratios use
the baseline runs adjacent to its own runs, and slow drift of the machine cancels."""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf

BASELINE = "nonprivate"


def interleave(methods: list[str], baseline_every: int) -> list[str]:
    """``[B, m1..mk, B, m(k+1).., B]`` with ``B`` the baseline every ``baseline_every`` methods."""
    others = [m for m in methods if m != BASELINE]
    if BASELINE not in methods:
        return others
    order = [BASELINE]
    for i in range(0, len(others), baseline_every):
        order += [*others[i : i + baseline_every], BASELINE]
    return order


def _methods_and_world_sizes(
    methods: list[str], world_sizes: list[int], baseline_every: int
) -> list[tuple[str, int]]:
    """One round: the interleaved methods in one process, then every private method on each larger number
    of data-parallel processes (the baseline runs in one process only)."""
    if any(w < 1 for w in world_sizes):
        raise ValueError(f"world_sizes must be >= 1, got {world_sizes}")
    order = [(method, 1) for method in interleave(methods, baseline_every)] if 1 in world_sizes else []
    private = [m for m in methods if m != BASELINE]
    return order + [(method, w) for w in world_sizes if w > 1 for method in private]


def plan(cfg: DictConfig, device: str) -> list[dict[str, Any]]:
    """Every run in execution order: groups (model, batch, seq) one after another, ``repeats`` rounds each."""
    suite = cfg.bench_suite
    if not suite.models:
        raise ValueError(f"suite {suite.name!r} has no models; choose a suite such as bench_suite=cpu")
    runs = []
    for model_name, entry in suite.models.items():
        methods = list(entry.get("methods") or suite.methods)
        unknown = sorted(set(methods) - set(cfg.methods))
        if unknown:
            raise ValueError(
                f"{model_name}: unknown methods {unknown}; defined in conf/bench.yaml: {sorted(cfg.methods)}"
            )
        seq_lens = list(entry.get("seq_lens") or [None])
        world_sizes = [int(w) for w in entry.get("world_sizes") or [1]]
        for batch_size in entry.batch_sizes:
            for seq_len in seq_lens:
                for repeat in range(suite.repeats):
                    for method, world_size in _methods_and_world_sizes(
                        methods, world_sizes, suite.baseline_every
                    ):
                        spec = run_spec(cfg, model_name, method, batch_size, seq_len, device)
                        runs.append({**spec, "repeat": repeat, "world_size": world_size})
    return runs


def run_spec(
    cfg: DictConfig, model_name: str, method: str, batch_size: int, seq_len: int | None, device: str
) -> dict[str, Any]:
    """One run of the suite's model ``model_name`` with ``method``, as ``measure._build`` builds it."""
    suite, entry = cfg.bench_suite, cfg.bench_suite.models[model_name]
    return {
        "model_name": model_name,
        "model": OmegaConf.to_container(entry.spec, resolve=True),
        "optimizer": OmegaConf.to_container(entry.optimizer, resolve=True),
        "method": method,
        "clip": OmegaConf.to_container(cfg.methods[method], resolve=True),
        "batch_size": int(batch_size),
        "seq_len": None if seq_len is None else int(seq_len),
        "warmup": int(suite.warmup),
        "steps": int(suite.steps),
        "device": device,
        "threads": cfg.threads,
        "amp": suite.amp,
        "noise_multiplier": float(cfg.noise_multiplier),
        "sample_size": int(cfg.sample_size),
        "seed": int(cfg.seed),
        "preload": list(cfg.preload),
    }
