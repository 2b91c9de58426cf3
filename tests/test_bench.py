"""The efficiency benchmark (dpexp.bench): the smoke suite end to end, its JSON schema, the report, and the
pieces the measurements rely on (alternation, adjacent baselines, isolation, batch search, error records)."""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import OmegaConf
from torch import nn

from dpexp import bench
from dpexp.bench.models import GPT2LM, MLP
from dpexp.privacy.capture import unsupported_modules

CONF = Path(__file__).resolve().parents[1] / "conf"
FAMILIES = {
    "gpt2",
    "llama",
    "llama_lora",
    "roberta",
    "wrn",
    "vit",
    "mlp",
    "fallback",
    "transformer",
    "recurrent",
}
REPORT = Path(__file__).resolve().parents[1] / "scripts" / "bench_report.py"


def _report_module():
    spec = importlib.util.spec_from_file_location("bench_report", REPORT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_report"] = module  # dataclasses look their module up while the script is executed
    spec.loader.exec_module(module)
    return module


def test_smoke_suite_writes_schema_and_report(tmp_path: Path) -> None:
    output = tmp_path / "smoke.json"
    bench.run_suite(_compose("bench_suite=smoke", "isolation=inprocess", f"output={output}"))

    payload = json.loads(output.read_text())
    assert payload["schema_version"] == bench.SCHEMA_VERSION and payload["complete"]
    assert payload["suite"] == "smoke" and payload["kind"] == "models"
    machine = payload["machine"]
    assert machine["cpu"] and machine["versions"]["torch"] and machine["versions"]["opacus"]
    assert [r["method"] for r in payload["runs"]] == ["nonprivate", "bk", "nonprivate"]
    records = {r["method"]: r for r in payload["records"]}
    assert set(records) == {"nonprivate", "bk"}
    for record in records.values():
        assert record["status"] == "ok", record
        assert (record["model"], record["family"]) == ("gpt2_tiny", "gpt2")
        assert (record["batch_size"], record["seq_len"]) == (4, 8)
        step = record["step_s"]
        assert 0 < step["min"] <= step["median"] <= step["max"] and step["n"] == 2 * len(record["runs"])
        assert record["examples_per_s"] == pytest.approx(4 / step["median"])
        assert set(record["ratios"]) == {"throughput", "throughput_per_run", "peak_mem", "step_mem"}
    assert records["nonprivate"]["ratios"]["throughput"] == pytest.approx(1.0)
    assert records["bk"]["baseline_runs"] == [0, 2]
    assert records["bk"]["ratios"]["throughput"] > 0

    readme = _report_module().report(tmp_path)
    text = readme.read_text()
    assert "## Suite `smoke`" in text and "| gpt2_tiny | 8 | 4 | bk |" in text
    assert (tmp_path / "smoke.png").stat().st_size > 0


def test_the_report_lists_the_targets_measured_again_in_subfolders(tmp_path: Path) -> None:
    """A subfolder of suite JSON (a later, quieter measurement of some models, with its own report) gets its
    targets under the folder's own, dated and linked; a subfolder without target rows is left out."""
    bench_dir = Path(__file__).resolve().parents[1] / "results" / "bench"
    shutil.copy(bench_dir / "cpu_llm.json", tmp_path / "cpu_llm.json")
    (tmp_path / "quiet").mkdir()
    shutil.copy(bench_dir / "quiet_stop37" / "cpu_llm.json", tmp_path / "quiet" / "cpu_llm.json")
    (tmp_path / "empty").mkdir()
    text = _report_module().report(tmp_path).read_text()
    later = text[text.index("## Targets measured again (subfolders)") : text.index("## Suite `cpu_llm`")]
    date = json.loads((tmp_path / "quiet" / "cpu_llm.json").read_text())["machine"]["date"]
    assert f"### `quiet/`, {date} ([its report](quiet/README.md))" in later and "empty" not in later
    row = "| cpu_llm | wrn16_4_b64 B=64 | perlayer throughput / nonprivate | 0.76 | >= 0.85 | **missed** |"
    assert row in later
    assert "gpt2_small" not in later  # that run measured Llama and WRN only


def _compose(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("bench", overrides=list(overrides))


@pytest.mark.parametrize(
    "suite", sorted(p.stem for p in (CONF / "bench_suite").glob("*.yaml") if p.stem != "common")
)
def test_every_suite_composes_and_plans(suite: str) -> None:
    cfg = _compose(f"bench_suite={suite}")
    runs = bench.plan(cfg, "cpu")
    assert runs and all(r["method"] in cfg.methods for r in runs)
    for model_name, entry in cfg.bench_suite.models.items():
        bench_model = instantiate(entry.spec)
        assert bench_model.family in FAMILIES
        assert bench_model.sequence == bool(entry.get("seq_lens")), model_name
    assert {r["clip"]["name"] for r in runs} <= set(cfg.methods)


def test_max_batch_search_reports_ratios_to_the_baseline() -> None:
    cfg = _compose("bench_suite=smoke", "bench_suite.max_batch.cap=4")
    entries = list(bench.max_batches(cfg, bench.plan(cfg, "cpu")))
    assert [(e["method"], e["status"], e["max_batch"], e["ratio"]) for e in entries] == [
        ("nonprivate", "ok", 4, 1.0),
        ("bk", "ok", 4, 1.0),
    ]


def test_isolated_run_measures_its_own_peak_memory() -> None:
    spec = {
        "model": {"_target_": "dpexp.bench.models.MLP", "in_features": 8, "hidden": [16], "num_classes": 3},
        "optimizer": {"name": "sgd", "lr": 0.1},
        "clip": {"name": "bk", "method": "dpexp", "max_grad_norm": 1.0, "engine": {"clipping": "flat"}},
        "batch_size": 4,
        "seq_len": None,
        "warmup": 1,
        "steps": 2,
        "device": "cpu",
        "threads": 1,
        "amp": None,
        "noise_multiplier": 1.0,
        "sample_size": 100,
        "seed": 0,
        "preload": [],
    }
    result = bench.run_isolated(spec, timeout_s=120)
    assert result["status"] == "ok", result
    assert result["mem_kind"] == "peak_rss" and result["threads"] == 1 and len(result["step_s"]) == 2
    assert 0 < result["pre_step_mem_mb"] <= result["peak_mem_mb"]
    assert result["n_params"] == 8 * 16 + 16 + 16 * 3 + 3


def test_data_parallel_run_times_two_ranks_and_plans_after_the_single_process_round() -> None:
    """world_size=2: two gloo processes each run half of the logical batch (the engine's all-reduce in the
    step); the record is rank 0's, labelled ``bk/ddp2`` and compared with the one-process baseline."""
    spec = {
        "model": {"_target_": "dpexp.bench.models.MLP", "in_features": 8, "hidden": [16], "num_classes": 3},
        "optimizer": {"name": "sgd", "lr": 0.1},
        "clip": {"name": "bk", "method": "dpexp", "max_grad_norm": 1.0, "engine": {"clipping": "flat"}},
        "batch_size": 6,
        "seq_len": None,
        "warmup": 1,
        "steps": 2,
        "device": "cpu",
        "threads": 1,
        "amp": None,
        "noise_multiplier": 1.0,
        "sample_size": 100,
        "seed": 0,
        "preload": [],
        "world_size": 2,
    }
    result = bench.run_isolated(spec, timeout_s=120)
    assert result["status"] == "ok", result
    assert result["world_size"] == 2 and len(result["step_s"]) == 2
    odd = bench.run_isolated({**spec, "batch_size": 5}, timeout_s=120)
    assert odd["status"] == "error" and "not divisible by world_size 2" in odd["error"]
    inprocess = bench.run_config(spec)
    assert inprocess["status"] == "error" and "isolation=subprocess" in inprocess["error"]

    runs = bench.plan(_compose("bench_suite=ddp_cpu"), "cpu")
    assert [(r["method"], r["world_size"]) for r in runs] == [
        ("nonprivate", 1), ("bk", 1), ("perlayer", 1), ("nonprivate", 1), ("bk", 2), ("perlayer", 2)
    ]  # fmt: skip
    common = {"model_name": "m", "batch_size": 4, "seq_len": None, "status": "ok", "peak_mem_mb": None}
    timed = [
        {**common, "method": "nonprivate", "world_size": 1, "step_s": [1.0]},
        {**common, "method": "bk", "world_size": 1, "step_s": [2.0]},
        {**common, "method": "bk", "world_size": 2, "step_s": [1.25]},
    ]
    for run in timed:
        run.update(pre_step_mem_mb=None, mem_kind=None, n_params=1)
    records = {r["method"]: r for r in bench.aggregate(timed)}
    assert records["bk/ddp2"]["world_size"] == 2 and records["bk"]["world_size"] == 1
    assert records["bk/ddp2"]["ratios"]["throughput"] == pytest.approx(0.8)


class BatchNormMLP(MLP):
    """An MLP with BatchNorm, which mixes the examples of a batch: the privacy engine must refuse it."""

    def build(self) -> nn.Module:
        return nn.Sequential(
            nn.Linear(self.in_features, 4), nn.BatchNorm1d(4), nn.Linear(4, self.num_classes)
        )


def _one_step(model: dict, seq_len: int | None = None) -> dict:
    """The spec of one bk step of ``model`` (a bench model's config) at batch 2 on CPU."""
    return {
        "model": model,
        "optimizer": {"name": "sgd", "lr": 0.1},
        "clip": {"name": "bk", "method": "dpexp", "max_grad_norm": 1.0, "engine": {"clipping": "flat"}},
        "batch_size": 2,
        "seq_len": seq_len,
        "warmup": 0,
        "steps": 1,
        "device": "cpu",
        "amp": None,
        "noise_multiplier": 1.0,
        "sample_size": 100,
        "seed": 0,
    }


def test_refused_model_records_the_error_and_the_modules_without_rule() -> None:
    model = {"_target_": f"{__name__}.BatchNormMLP", "in_features": 6, "hidden": [], "num_classes": 3}
    result = bench.run_config(_one_step(model))
    assert result["status"] == "error" and result["stage"] == "build"
    assert result["error"].startswith("ValueError:") and "BatchNorm1d" in result["error"]
    assert "dpexp/privacy/capture.py" in result["where"]
    assert result["unsupported_modules"] == {"torch.nn.modules.batchnorm.BatchNorm1d": ["bias", "weight"]}


def test_a_model_config_with_a_list_field_builds_and_trains() -> None:
    """Hugging Face configs validate their fields' types: Gemma 4's ``layer_types`` refused the ListConfig
    Hydra's instantiate passes for a list, so the gemma4_moe entry of the fallbacks suite never ran."""
    model = {
        "_target_": "dpexp.bench.models.HFCausalLM",
        "architecture": "gemma4_text",
        "hidden_size": 16,
        "intermediate_size": 24,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 8,
        "global_head_dim": 8,
        "vocab_size": 40,
        "vocab_size_per_layer_input": 40,
        "hidden_size_per_layer_input": 4,
        "layer_types": ["sliding_attention", "full_attention"],
    }
    result = bench.run_config(_one_step(model, seq_len=6))
    assert result["status"] == "ok", result.get("error")


def test_interleave_puts_the_baseline_around_every_k_methods() -> None:
    methods = ["nonprivate", "a", "b", "c"]
    np_ = "nonprivate"
    assert bench.interleave(methods, 1) == [np_, "a", np_, "b", np_, "c", np_]
    assert bench.interleave(methods, 2) == [np_, "a", "b", np_, "c", np_]
    assert bench.interleave(["a", "b"], 1) == ["a", "b"]


def _run(method: str, seconds: float, peak: float = 100.0, batch: int = 8, status: str = "ok") -> dict:
    run = {"model_name": "m", "family": "mlp", "method": method, "batch_size": batch, "seq_len": None}
    if status != "ok":
        return {**run, "status": "error", "error": "boom", "stage": "build"}
    return {
        **run,
        "status": "ok",
        "step_s": [seconds, seconds],
        "peak_mem_mb": peak,
        "pre_step_mem_mb": 50.0,
        "mem_kind": "peak_rss",
        "n_params": 10,
    }


def test_aggregate_uses_the_adjacent_baselines_of_each_method() -> None:
    # The machine slows down over time: baselines take 1, 2, 4 s; each method is compared with its neighbours.
    runs = [
        _run("nonprivate", 1.0),
        _run("a", 1.5, peak=150.0),
        _run("nonprivate", 2.0),
        _run("b", 6.0),
        _run("nonprivate", 4.0),
        _run("c", 1.0, status="error"),
        _run("nonprivate", 1.0, batch=16),  # another group: never a neighbour of batch-8 runs
    ]
    records = {(r["method"], r["batch_size"]): r for r in bench.aggregate(runs)}
    a, b = records[("a", 8)], records[("b", 8)]
    assert a["baseline_runs"] == [0, 2] and b["baseline_runs"] == [2, 4]
    assert a["ratios"]["throughput"] == pytest.approx(1.5 / 1.5)  # median of neighbour steps (1, 1, 2, 2)
    assert b["ratios"]["throughput"] == pytest.approx(3.0 / 6.0)
    assert a["ratios"]["peak_mem"] == pytest.approx(1.5) and a["ratios"]["step_mem"] == pytest.approx(2.0)
    base = records[("nonprivate", 8)]
    assert base["runs"] == [0, 2, 4] and base["step_s"]["median"] == pytest.approx(2.0)
    assert records[("c", 8)]["status"] == "error" and records[("c", 8)]["error"] == "boom"
    assert records[("nonprivate", 16)]["ratios"]["throughput"] == pytest.approx(1.0)


def test_throughput_ratio_pairs_each_round_with_its_own_baselines() -> None:
    # The machine slowed down during round 2 (neighbours 1 s and 5 s). Per round the method is 0.5x of its
    # neighbours (1 / 2 and median(1, 1, 5, 5) / 6); pooling all steps would give 1 s / 4 s = 0.25x.
    runs = [
        _run("nonprivate", 1.0),
        _run("a", 2.0),
        _run("nonprivate", 1.0),
        _run("nonprivate", 1.0),
        _run("a", 6.0),
        _run("nonprivate", 5.0),
    ]
    records = {r["method"]: r for r in bench.aggregate(runs)}
    assert records["a"]["ratios"]["throughput"] == pytest.approx(0.5)
    assert records["a"]["ratios"]["throughput_per_run"] == pytest.approx([0.5, 0.5])
    assert records["nonprivate"]["ratios"]["throughput"] == pytest.approx(1.0)


@pytest.mark.parametrize(("limit", "start", "cap"), [(37, 8, 4096), (5, 8, 4096), (0, 4, 64), (200, 16, 64)])
def test_find_max_batch_brackets_the_largest_fitting_batch(limit: int, start: int, cap: int) -> None:
    probes = []

    def fits(b: int) -> bool:
        probes.append(b)
        return b <= limit

    assert bench.find_max_batch(fits, start, cap) == min(limit, cap)
    assert len(probes) <= 2 * max(1, cap).bit_length() + 2


def test_find_max_batch_stops_within_the_tolerance() -> None:
    found = bench.find_max_batch(lambda b: b <= 1000, 16, 4096, tolerance=0.05)
    assert 1000 * 0.95 <= found <= 1000


def test_gpt2_loss_is_the_sum_of_next_token_cross_entropies() -> None:
    bench_model = GPT2LM(n_layer=1, n_embd=16, n_head=2, vocab_size=64, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = bench_model.build().eval()
    batch = bench_model.make_batch(3, 7, torch.Generator().manual_seed(0))
    assert batch["position_ids"].shape == (3, 7)  # one row per example, as per-example gradients need
    logits = model(batch["input_ids"]).logits
    ids = batch["input_ids"]
    expected = torch.stack([F.cross_entropy(logits[i, :-1], ids[i, 1:], reduction="sum") for i in range(3)])
    torch.testing.assert_close(bench_model.per_example_loss(model, batch), expected)


@pytest.mark.parametrize("lora", [None, {"rank": 2, "alpha": 2}])
def test_llama_bench_model_loss_and_lora(lora) -> None:
    from dpexp.bench.models import LlamaLM

    bench_model = LlamaLM(
        lora=lora, vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    model = bench_model.build()
    assert model.training and bench_model.family == ("llama_lora" if lora else "llama")
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    if lora:
        assert trainable and all("lora_" in n and ("q_proj" in n or "v_proj" in n) for n in trainable)
    else:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    model.eval()
    batch = bench_model.make_batch(3, 7, torch.Generator().manual_seed(0))
    assert batch["input_ids"].max() < 64 and batch["position_ids"].shape == (3, 7)
    logits = model(input_ids=batch["input_ids"]).logits
    ids = batch["input_ids"]
    expected = torch.stack([F.cross_entropy(logits[i, :-1], ids[i, 1:], reduction="sum") for i in range(3)])
    torch.testing.assert_close(bench_model.per_example_loss(model, batch), expected)


def test_report_targets_follow_family_and_model() -> None:
    """Issue 13's targets: llama at 0.85 / 1.1, llama_lora at 0.9 (throughput only), and 0.92 on the suite's
    gpt2_small only."""
    report = _report_module()

    def record(model: str, family: str, method: str, throughput: float) -> dict:
        ratios = {"throughput": throughput, "peak_mem": 1.05}
        return {"model": model, "family": family, "method": method, "seq_len": 100, "batch_size": 4,
                "status": "ok", "ratios": ratios}  # fmt: skip

    models = [("gpt2_small", "gpt2", 0.9), ("gpt2", "gpt2", 0.9), ("llama_lora", "llama_lora", 0.88)]
    records = [
        record(model, family, method, ratio)
        for model, family, bk in models
        for method, ratio in [("nonprivate", 1.0), ("bk", bk)]
    ]
    suite = {"suite": "s", "kind": "models", "config": {"bench_suite": {"targets": True}}, "records": records}
    rows = report.targets_table([suite])[2:]
    by_model = {}
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        by_model.setdefault(cells[1].split()[0], []).append((cells[2], cells[4], cells[5]))
    assert ("bk throughput / nonprivate", ">= 0.92", "**missed**") in by_model["gpt2_small"]
    assert ("bk throughput / nonprivate", ">= 0.85", "met") in by_model["gpt2_small"]
    assert all(required != ">= 0.92" for _, required, _ in by_model["gpt2"])
    assert by_model["llama_lora"] == [("bk throughput / nonprivate", ">= 0.9", "**missed**")]


def test_fallback_suite_models_have_exactly_the_named_rule_less_modules() -> None:
    """Each model of bench_suite=fallbacks measures the modules its comment names, and no other fallback:
    the README's cost of a fallback is the cost of that module."""
    expected = {
        "dinov2": set(),  # Dinov2Embeddings has a rule now: the entry measures it
        "beit": set(),  # BeitEmbeddings and BeitLayer have rules now: the entry measures them
        "beit_relative": set(),  # BeitRelativePositionBias is shared (dpexp.privacy.shared), no rule needed
        "swin": set(),  # WindowAttention has a rule now: the entry measures it
        "timm_beit": set(),  # timm Beit's Attention and Block: rules since stop 51 (refused before)
        "switch": set(),  # SwitchTransformersExperts: a rule since stop 51 (refused before)
        "hf_swin": set(),  # Hugging Face SwinAttention has a rule now: the entry measures it
        "hf_swinv2": set(),  # Hugging Face Swinv2SelfAttention has a rule now: the entry measures it
        "mamba": set(),  # MambaMixer: a rule since stop 49 (on the fallback with its reads in stops 47-48)
        "qwen3_5": set(),  # Qwen3_5GatedDeltaNet: a rule since stop 49 (the fallback in stops 47-48)
        "lfm2": set(),  # Lfm2ShortConv: a rule since stop 50 (the fallback with its conv's reads in 47-49)
        "jamba": set(),  # router (stop 47) and Mamba mixer (stop 49) have rules, its experts are Mixtral's
        "nemotron_h": set(),  # its ungated experts (stop 47) and Mamba-2 mixer (stop 49) have rules
        "falcon_h1": set(),  # FalconH1Mixer: a rule since stop 50 (the fallback in stops 47-49)
        "qwen3_next": set(),  # Qwen3NextGatedDeltaNet: a rule since stop 50 (the fallback in stops 47-49)
        "kimi_linear": set(),  # its attention's conv1d and its forget gate: rules since stop 50
        "nf_resnet": set(),  # ScaledStdConv2d has a rule now (stop 44)
        "gemma": set(),  # GemmaTextScaledWordEmbedding has a rule now (stop 44)
        "mixtral": set(),  # MixtralTopKRouter and MixtralExperts have rules now (stop 44)
        "dbrx": set(),  # DbrxExperts: a rule since stop 57 (refused before); DbrxRouter's layer is a Linear
        "llama4": set(),  # Llama4Router and Llama4TextExperts have rules now (stop 45)
        "deepseek_v3": set(),  # DeepseekV3TopkRouter has a rule now (stop 45)
        "gemma4_moe": set(),  # Gemma4TextRouter has a rule now (stop 45)
        "dm_nfnet": set(),  # NormFreeBlock's skipinit_gain has a rule now (stop 45)
        "gpt_oss": set(),  # router and experts have rules (stop 46), the attention's sinks (stop 48)
        "deberta": set(),  # DebertaLayerNorm (stop 46), the attention's q_bias and v_bias (stop 48): rules
        "pvt": set(),  # PvtPatchEmbeddings: a rule since stop 52 (the fallback in stops 46-51)
        "zamba": set(),  # ZambaMambaMixer: a rule since stop 52 (the fallback with its reads in 47-51)
        "inkling": set(),  # InklingRelativeLogits: a rule since stop 64; MoE, embedding, short conv: stop 52
        "funnel": set(),  # FunnelRelMultiheadAttention: a rule since stop 69 (the fallback in 46-68)
    }
    cfg = _compose("bench_suite=fallbacks")
    assert set(cfg.bench_suite.models) == set(expected)
    for name, entry in cfg.bench_suite.models.items():
        bench_model = instantiate(OmegaConf.to_container(entry.spec), _convert_="all")
        model = bench_model.build()
        assert {kind.rsplit(".", 1)[1] for kind in unsupported_modules(model)} == expected[name], name
        seq_len = (entry.get("seq_lens") or [None])[0]
        batch = bench_model.make_batch(2, seq_len, torch.Generator().manual_seed(0))
        assert bench_model.per_example_loss(model, batch).shape == (2,)


def test_report_prints_the_papers_ratios_beside_ours() -> None:
    """bu2023_table1's ``paper`` block: bk's throughput over each method (over non-private: its ratio), ours /
    the paper's / the difference, from the latest JSON of the suite where bk ran; a failed method says so."""
    report = _report_module()

    def record(model: str, method: str, throughput: float | None) -> dict:
        status = "ok" if throughput is not None else "error"
        return {"model": model, "method": method, "seq_len": 1, "batch_size": 8, "status": status,
                "ratios": {"throughput": throughput}}  # fmt: skip

    def suite(date: str, records: list[dict]) -> dict:
        return {"suite": "bu2023_table1", "machine": {"date": date}, "records": records}

    early = suite("2026-01-01", [record("beit_large", "bk", 0.1), record("beit_large", "ghost", 0.1)])
    late = suite("2026-02-01", [record("beit_large", m, r) for m, r in [("bk", 0.45), ("ghost", 0.3)]])
    late["records"].append(record("beit_large", "opacus", None))
    other = suite("2026-01-15", [record("roberta_large", m, r) for m, r in [("bk", 0.75), ("ghost", 0.6)]])
    other["records"].append(record("roberta_large", "opacus", 0.5))
    lines = report.paper_lines([late, early, other])
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines[6:]]
    rows = {row[0]: row[1:] for row in cells}
    assert rows["roberta_large"] == ["1.25 / 1.36 / -0.11", "1.50 / 1.96 / -0.46", "0.75 / 0.77 / -0.02"]
    assert rows["beit_large"] == ["1.50 / 1.33 / +0.17", "opacus failed / 38.30 / -", "0.45 / 0.76 / -0.31"]
    assert rows["gpt2_large"] == ["no run / 1.36 / -", "no run / 4.41 / -", "no run / 0.83 / -"]
