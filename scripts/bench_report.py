"""Regenerate ``results/bench/README.md`` and the PNG plots from the benchmark JSON files alone.

``make bench-report`` (or ``python scripts/bench_report.py [--results DIR]``) reads every ``*.json`` that
``python -m dpexp.bench`` wrote in DIR and writes, next to them:

* ``README.md``: the issue-4 targets with met/missed and the margin (and a link to the hand-written
  ``analysis.md`` of the misses when it exists), then per suite the machine, a table
  (model, method, batch, s/step median [min, max], examples/s, throughput and memory ratios to
  ``nonprivate``), the failures with their messages and, on GPU, the largest batch per method;
* ``<file>.png`` (the JSON's name): throughput and peak-memory ratio per method and model (``kind: models``
  suites), or seconds per step, throughput ratio and step memory against sequence length (``kind: scaling``).
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from omegaconf import OmegaConf

from dpexp.bench import aggregate

RESULTS = Path(__file__).resolve().parents[1] / "results" / "bench"
SUITES = Path(__file__).resolve().parents[1] / "conf" / "bench_suite"
Record = dict[str, Any]


@dataclass(frozen=True)
class Target:
    """``method``'s ratio (``throughput`` or ``peak_mem``) to nonprivate, or to ``versus``'s, must be at least
    (``at_least``) or at most ``threshold`` on the models of ``family`` (only the suite's model ``model`` when
    it is given)."""

    family: str
    method: str
    ratio: str
    threshold: float
    versus: str | None = None
    at_least: bool = True
    model: str | None = None

    def applies(self, family: str | None, model: str) -> bool:
        return self.family == family and self.model in (None, model)

    @property
    def label(self) -> str:
        quantity = "throughput" if self.ratio == "throughput" else "peak memory"
        return f"{self.method} {quantity} / {self.versus or 'nonprivate'}"

    def methods(self) -> list[str]:
        return [self.method] + ([self.versus] if self.versus else [])

    def measure(self, by_method: dict[str, Record]) -> float | None:
        mine = _get(by_method, self.method, self.ratio)
        if self.versus is None:
            return mine
        theirs = _get(by_method, self.versus, self.ratio)
        return mine / theirs if mine is not None and theirs else None


def _get(by_method: dict[str, Record], method: str, ratio: str) -> float | None:
    record = by_method.get(method)
    return record["ratios"].get(ratio) if record and record["status"] == "ok" else None


# Issue 4, "Targets (ratios, same session)"; issue 13 ("Performance") raised WRN to 0.85 / 1.1, added the
# Llama families and GPT-2 small at its real width (suite model ``gpt2_small``, 0.92).
_FULL, _OURS = ("gpt2", "roberta", "llama", "wrn"), ("bk", "perlayer")
TARGETS = [
    *(Target(fam, m, "throughput", 0.85) for fam in _FULL for m in _OURS),
    *(Target(fam, m, "peak_mem", 1.1, at_least=False) for fam in _FULL for m in _OURS),
    *(Target("llama_lora", m, "throughput", 0.9) for m in _OURS),
    *(Target("gpt2", m, "throughput", 0.92, model="gpt2_small") for m in _OURS),
    Target("gpt2", "bk", "throughput", 1.3, versus="ghost"),
    Target("gpt2", "bk", "throughput", 1.8, versus="opacus"),
    Target("gpt2", "bk", "throughput", 1.5, versus="opacus_ghost"),
]


def load(results: Path) -> list[dict[str, Any]]:
    """Every benchmark JSON in ``results``, ordered by suite name. Records are recomputed from the raw runs
    by :func:`dpexp.bench.aggregate`, so that every suite is reported with the same (current) estimator."""
    suites = [{**json.loads(path.read_text()), "file": path.name} for path in sorted(results.glob("*.json"))]
    for suite in suites:
        if suite.get("runs"):
            suite["records"] = aggregate(suite["runs"])
    return sorted((s for s in suites if "records" in s), key=lambda s: s["suite"])


def _config_key(record: Record) -> tuple:
    return record["model"], record["seq_len"], record["batch_size"]


def _by_config(records: list[Record]) -> dict[tuple, dict[str, Record]]:
    grouped: dict[tuple, dict[str, Record]] = {}
    for record in records:
        grouped.setdefault(_config_key(record), {})[record["method"]] = record
    return grouped


def _config_label(key: tuple) -> str:
    model, seq_len, batch = key
    return f"{model} T={seq_len} B={batch}" if seq_len is not None else f"{model} B={batch}"


def _fmt(value: float | None, spec: str = ".2f") -> str:
    return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


# ---------------------------------------------------------------------------------------------- markdown
def targets_table(suites: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| suite | model | target | measured | required | met | margin |",
        "|---|---|---|---|---|---|---|",
    ]
    for suite in suites:
        if suite.get("kind") != "models" or not suite["config"]["bench_suite"].get("targets", True):
            continue
        for key, by_method in _by_config(suite["records"]).items():
            family = next(iter(by_method.values())).get("family")
            for target in (t for t in TARGETS if t.applies(family, key[0])):
                if not all(m in by_method for m in target.methods()):
                    continue  # not part of this model's runs
                value = target.measure(by_method)
                sign = ">=" if target.at_least else "<="
                if value is None:
                    failed = [m for m in target.methods() if by_method[m]["status"] != "ok"]
                    met, margin = f"not measured ({', '.join(failed) or 'nonprivate'} failed)", "n/a"
                else:
                    ok = value >= target.threshold if target.at_least else value <= target.threshold
                    diff = value - target.threshold if target.at_least else target.threshold - value
                    met = "met" if ok else "**missed**"
                    margin = f"{diff:+.2f} ({diff / target.threshold:+.0%})"
                lines.append(
                    f"| {suite['suite']} | {_config_label(key)} | {target.label} | {_fmt(value)} "
                    f"| {sign} {target.threshold} | {met} | {margin} |"
                )
    return lines


def machine_lines(suite: dict[str, Any]) -> list[str]:
    machine, config = suite["machine"], suite["config"]["bench_suite"]
    gpu = machine.get("gpu")
    versions = ", ".join(f"{k} {v}" for k, v in machine["versions"].items())
    load_end = machine.get("load_average_end")
    return [
        f"- machine: {machine['cpu']} ({machine['cpu_count']} logical CPUs, {machine['memory_gb']} GB)"
        + (f"; GPU {gpu['name']} ({gpu['memory_gb']} GB, CUDA {gpu['cuda']})" if gpu else ""),
        f"- {versions}; python {machine['python']}; torch threads {machine['torch_threads']}",
        f"- date {machine['date']}; load average at start {_fmt(machine['load_average'][0])}"
        + (f", at end {_fmt(load_end[0])}" if load_end else "")
        + f"; {'complete' if suite.get('complete') else '**incomplete run**'}"
        + _code_versions(suite),
        f"- {config['warmup']} warm-up + {config['steps']} timed steps x {config['repeats']} round(s); "
        f"nonprivate every {config['baseline_every']} method(s); isolation {suite['isolation']}; "
        f"amp {config['amp']}; memory: {_mem_kind(suite)}",
    ]


def _code_versions(suite: dict[str, Any]) -> str:
    hashes = list(dict.fromkeys(r["source_hash"] for r in suite["runs"] if r.get("source_hash")))
    if len(hashes) > 1:
        return f"; **dpexp/privacy changed during the run ({len(hashes)} versions: {', '.join(hashes)})**"
    return f"; dpexp/privacy {hashes[0]}" if hashes else ""


def _mem_kind(suite: dict[str, Any]) -> str:
    kinds = {r.get("mem_kind") for r in suite["records"] if r["status"] == "ok"}
    return {
        "peak_rss": "peak RSS of a fresh process per configuration; step mem = peak - RSS before step 1",
        "cuda_max_allocated": "torch.cuda.max_memory_allocated; step mem = peak - allocated before step 1",
    }.get(next(iter(kinds), None), "not measured")


def baseline_drift(suite: dict[str, Any], record: Record) -> float | None:
    """How much the medians of the nonprivate runs a ratio was computed from differ: max / min - 1."""
    medians = [
        sorted(suite["runs"][i]["step_s"])[len(suite["runs"][i]["step_s"]) // 2]
        for i in record.get("baseline_runs", [])
        if suite["runs"][i]["status"] == "ok"
    ]
    return max(medians) / min(medians) - 1 if len(medians) > 1 else None


def _per_round(ratios: dict[str, Any]) -> str:
    return ", ".join(_fmt(v) for v in ratios.get("throughput_per_run") or [])


def results_table(suite: dict[str, Any]) -> list[str]:
    lines = [
        "The `np drift` column shows how much the nonprivate runs next to a method differed (max / min - 1",
        "of their medians): a large drift means the machine's speed changed and the ratio is uncertain.",
        "",
        "`throughput x np` is the median over rounds of each run's ratio to its neighbouring nonprivate runs",
        "(`per round`).",
        "",
        "| model | T | batch | method | s/step median [min, max] | examples/s | throughput x np | per round "
        "| np drift | peak mem MiB | mem x np | step mem x np |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key, by_method in _by_config(suite["records"]).items():
        model, seq_len, batch = key
        for method, r in by_method.items():
            if r["status"] != "ok":
                lines.append(f"| {model} | {_fmt(seq_len, 'd')} | {batch} | {method} | error | | | | | | | |")
                continue
            step, ratios = r["step_s"], r["ratios"]
            lines.append(
                f"| {model} | {_fmt(seq_len, 'd')} | {batch} | {method} "
                f"| {step['median']:.3f} [{step['min']:.3f}, {step['max']:.3f}] | {r['examples_per_s']:.1f} "
                f"| {_fmt(ratios['throughput'])} | {_per_round(ratios)} "
                f"| {_fmt(baseline_drift(suite, r), '.0%')} "
                f"| {_fmt(r['peak_mem_mb'], '.0f')} "
                f"| {_fmt(ratios['peak_mem'])} | {_fmt(ratios['step_mem'])} |"
            )
    return lines


def error_lines(suite: dict[str, Any]) -> list[str]:
    lines = []
    for r in suite["records"]:
        if r["status"] == "ok":
            continue
        message = r["error"].replace("|", "/").replace("\n", " ")
        lines.append(f"- {_config_label(_config_key(r))} `{r['method']}` ({r.get('stage')}): {message}")
        for kind, params in (r.get("unsupported_modules") or {}).items():
            lines.append(f"  - no privacy rule: `{kind}` owning {', '.join(f'`{p}`' for p in params)}")
    return lines


def max_batch_lines(suite: dict[str, Any]) -> list[str]:
    entries = suite.get("max_batch") or []
    if not entries:
        return []
    lines = ["| model | T | method | largest batch | x np |", "|---|---|---|---|---|"]
    for e in entries:
        value = e["max_batch"] if e["status"] == "ok" else f"error: {e['error'][:80]}"
        lines.append(
            f"| {e['model']} | {_fmt(e['seq_len'], 'd')} | {e['method']} | {value} | {_fmt(e.get('ratio'))} |"
        )
    return lines


def paper_spec(suite: str) -> dict[str, Any] | None:
    """The ``paper`` block of ``conf/bench_suite/<suite>.yaml`` (the published ratios), if it has one."""
    path = SUITES / f"{suite}.yaml"
    spec = OmegaConf.load(path).get("paper") if path.is_file() else None
    return None if spec is None else OmegaConf.to_container(spec)


def paper_lines(suites: list[dict[str, Any]]) -> list[str]:
    """Each suite with a ``paper`` block, in the paper's layout: per model, the throughput of the block's
    ``method`` over each column's method (over ``nonprivate``: the ratio itself), ours / the paper's /
    ours - paper. A model's runs come from the latest JSON of the suite where its ``method`` ran."""
    lines: list[str] = []
    for name in sorted({suite["suite"] for suite in suites}):
        spec = paper_spec(name)
        if spec is None:
            continue
        ours: dict[str, dict[str, Record]] = {}
        for suite in sorted((s for s in suites if s["suite"] == name), key=lambda s: s["machine"]["date"]):
            for (model, _, _), by_method in _by_config(suite["records"]).items():
                if _get(by_method, spec["method"], "throughput") is not None:
                    ours[model] = by_method
        columns = spec["columns"]
        lines += [
            "",
            f"### {spec['title']}: ours / paper / difference (`bench_suite={name}`)",
            "",
            "| model | " + " | ".join(columns.values()) + " |",
            "|---|" + "---|" * len(columns),
        ]
        for model, reported in spec["reported"].items():
            cells = []
            runs = ours.get(model, {})
            for column in columns:
                mine = _get(runs, spec["method"], "throughput")
                if column != "nonprivate":
                    theirs = _get(runs, column, "throughput")
                    mine = mine / theirs if mine is not None and theirs else None
                paper = reported.get(column)
                diff = _fmt(mine - paper, "+.2f") if mine is not None and paper is not None else "-"
                failed = column in runs and runs[column]["status"] != "ok"
                text = _fmt(mine) if mine is not None else f"{column} failed" if failed else "no run"
                cells.append(f"{text} / {_fmt(paper)} / {diff}")
            lines.append(f"| {model} | " + " | ".join(cells) + " |")
    if lines:
        lines = ["", "## Beside the papers", *lines]
    return lines


def later_lines(results: Path) -> list[str]:
    """The targets of the suites in ``results``' subfolders (each a later measurement of some models, with
    its own report), in date order: where a model is in both, this folder's table and a subfolder's differ
    by when and how quietly they were measured."""
    folders = []
    for folder in (f for f in sorted(results.iterdir()) if f.is_dir()):
        if (suites := load(folder)) and len(table := targets_table(suites)) > 2:  # rows beyond the header
            folders.append((suites[0]["machine"]["date"], folder.name, table))
    lines = []
    for date, name, table in sorted(folders):
        lines += ["", f"### `{name}/`, {date} ([its report]({name}/README.md))", "", *table]
    if lines:
        lines = ["", "## Targets measured again (subfolders)", *lines]
    return lines


def write_markdown(
    suites: list[dict[str, Any]], out: Path, plots: dict[str, list[str]], later: list[str]
) -> None:
    lines = [
        "# dpexp efficiency benchmark",
        "",
        "Generated by `make bench-report` (`scripts/bench_report.py`) from the JSON files in this",
        "folder, which `python -m dpexp.bench bench_suite=<suite>` writes. Ratios are to `nonprivate`",
        "measured in the same session, alternating with it (`x np`: throughput = nonprivate s/step /",
        "method s/step, per run against the nonprivate runs just before and after it, then the median",
        "over rounds; memory = method / nonprivate). Timings taken while other jobs share the machine",
        "are noisy: see the load averages and the `np drift` column.",
        "",
        "## Targets (issue 4)",
        "",
        "Memory targets use the peak ratio (`mem x np`). On CPU the peak RSS includes the libraries",
        "every process holds (torch, transformers, opacus: about 0.8 GiB), which dilutes the ratio;",
        "`step mem x np` compares only what a training step adds to the built model (sharper).",
        "",
        *targets_table(suites),
    ]
    if (out / "analysis.md").exists():
        lines += [
            "",
            "Why the missed targets are missed, with the profiles behind it and what was done about it:",
            "[analysis.md](analysis.md) (written by hand; the numbers above come from the JSON alone).",
        ]
    lines += later
    lines += paper_lines(suites)
    for suite in suites:
        heading = f"## Suite `{suite['suite']}` (`{suite['file']}`)"
        lines += ["", heading, "", *machine_lines(suite), "", *results_table(suite)]
        if errors := error_lines(suite):
            lines += ["", "Failures:", "", *errors]
        if batches := max_batch_lines(suite):
            lines += ["", "Largest physical batch that fits:", "", *batches]
        lines += ["", *(f"![{name}]({name})" for name in plots.get(suite["file"], []))]
    (out / "README.md").write_text("\n".join(lines) + "\n")


# ---------------------------------------------------------------------------------------------- plots
def _methods(records: list[Record]) -> list[str]:
    return list(dict.fromkeys(r["method"] for r in records))


def plot_ratios(suite: dict[str, Any], out: Path) -> str:
    """Grouped bars: throughput and peak-memory ratio to nonprivate per method, one group per model config
    (no bar: the method was not run on that model; a red x: it failed)."""
    grouped = _by_config(suite["records"])
    methods = [m for m in _methods(suite["records"]) if m != "nonprivate"]
    fig, axes = plt.subplots(2, 1, figsize=(max(8, 1.6 * len(grouped)), 8), sharex=True)
    width = 0.8 / max(1, len(methods))
    for ax, ratio, title, guide in (
        (axes[0], "throughput", "throughput / nonprivate (higher is better)", 0.85),
        (axes[1], "peak_mem", "peak memory / nonprivate (lower is better)", 1.1),
    ):
        for j, method in enumerate(methods):
            values = [_get(by_method, method, ratio) for by_method in grouped.values()]
            xs = [i + (j - (len(methods) - 1) / 2) * width for i in range(len(grouped))]
            ax.bar(xs, [v if v is not None else 0 for v in values], width, label=method)
            for x, by_method in zip(xs, grouped.values(), strict=True):
                if method in by_method and by_method[method]["status"] != "ok":
                    ax.text(x, 0.02, "x", ha="center", va="bottom", fontsize=8, color="red")
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.axhline(guide, color="grey", linestyle="--", linewidth=0.8)
        ax.set_title(title)
    axes[1].set_xticks(range(len(grouped)), [_config_label(k) for k in grouped], rotation=20, ha="right")
    axes[0].legend(ncol=4, fontsize=8)
    fig.suptitle(f"suite {suite['suite']} (x: failed)")
    fig.tight_layout()
    name = f"{Path(suite['file']).stem}.png"
    fig.savefig(out / name, dpi=100)
    plt.close(fig)
    return name


def plot_scaling(suite: dict[str, Any], out: Path) -> str:
    """Seconds per step, throughput ratio and step memory against T, one column per (model, batch size)."""
    records = [r for r in suite["records"] if r["status"] == "ok"]
    panels = sorted({(r["model"], r["batch_size"]) for r in records})
    rows = (
        ("s / step (median)", lambda r: r["step_s"]["median"], "log"),
        ("throughput / nonprivate", lambda r: r["ratios"]["throughput"], "linear"),
        ("step memory MiB (peak - before step 1)", lambda r: r["step_mem_mb"], "log"),
    )
    columns = max(1, len(panels))
    fig, axes = plt.subplots(len(rows), columns, figsize=(6 * columns, 4 * len(rows)), squeeze=False)
    for col, (model, batch) in enumerate(panels):
        for method in _methods(records):
            mine = sorted(
                (r for r in records if (r["model"], r["batch_size"], r["method"]) == (model, batch, method)),
                key=lambda r: r["seq_len"],
            )
            style = "--" if method.startswith("bk_") else "-"
            for row, (_, value, _) in enumerate(rows):
                points = [(r["seq_len"], value(r)) for r in mine if value(r) is not None]
                axes[row][col].plot(*zip(*points, strict=True), style, marker="o", label=method)
        for row, (ylabel, _, yscale) in enumerate(rows):
            ax = axes[row][col]
            ax.set_xscale("log", base=2)
            ax.set_yscale(yscale)
            ax.set_xlabel("sequence length T")
            ax.set_ylabel(ylabel)
            ax.set_title(f"{model}, batch {batch}")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"suite {suite['suite']}: scaling with sequence length (dashed: bk with a forced norm mode)")
    fig.tight_layout()
    name = f"{Path(suite['file']).stem}.png"
    fig.savefig(out / name, dpi=100)
    plt.close(fig)
    return name


def report(results: Path, out: Path | None = None) -> Path:
    """Write README.md and the plots for every suite JSON in ``results`` into ``out`` (default: the same)."""
    out = out or results
    out.mkdir(parents=True, exist_ok=True)
    suites = load(results)
    if not suites:
        raise SystemExit(f"no benchmark JSON in {results}; run `python -m dpexp.bench` first")
    plots: dict[str, list[str]] = {}
    for suite in suites:
        if not any(r["status"] == "ok" for r in suite["records"]):
            continue
        plot = plot_scaling if suite.get("kind") == "scaling" else plot_ratios
        plots[suite["file"]] = [plot(suite, out)]
    write_markdown(suites, out, plots, later_lines(results))
    return out / "README.md"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=RESULTS, help="folder with the suite JSON files")
    parser.add_argument(
        "--out", type=Path, default=None, help="where to write README.md and PNGs (default: same)"
    )
    args = parser.parse_args()
    print(f"wrote {report(args.results, args.out)}")


if __name__ == "__main__":
    main()
