"""Hugging Face models nobody here chose, against the brute-force oracle: ``python scripts/audit_models.py``.

Each architecture is built from a tiny random configuration of its ``model_type`` (``AutoConfig.for_model``:
2 layers, width 16, dropout 0, eager attention, experts on their eager forward, float64) as a causal LM, a
sequence classifier or an image classifier, and one step of two micro-batches of 3 examples runs under bk
with flat clipping and under ghost with per-layer clipping, the thresholds at the median group norm (clipped
and unclipped examples both), against the clipped mean of per-example gradients taken one example at a time.

One line per model: ``EXACT`` (the worst error of any parameter's update, relative to its norm plus 1e-3 of
the whole update's, and the modules left to the ``torch.func`` fallback; the state-space and delta-rule scans
run in float32 inside a float64 model, and a parameter whose update is 1e-8 of the whole, such as Falcon-H1's
``A_log``, differs from the oracle's by float32's rounding then), ``REFUSED`` (the engine's one-line
refusal: an error of the kinds the entry points print in one line, raised by dpexp's own code,
:func:`dpexp.runtime.is_project_error`), ``ERROR`` (anything else raised while the engine runs the model, or a
model whose own gradients are not finite at the tiny sizes), ``NOT BUILT`` (the tiny configuration does not
build, or the model's own forward and backward fail on it, before the engine is involved: a configuration
check, sizes it does not fit) or ``VIOLATION`` (an update off the oracle's by more than ``--tolerance``: the
outcome that must never occur). Exits non-zero on a violation. ``--json`` writes the lines as records, with
the ``phase`` an unfinished audit stopped in (``build``, ``model``, ``engine``).
``--all`` (stop 53) audits every other model type of transformers' causal-LM, sequence- and
image-classification mappings, each in a process of its own, ``--jobs`` at a time: NOT BUILT also for one
that runs out of ``--seconds`` or memory (the multimodal wrappers, whose towers keep their default sizes).
``--again FILE`` (stop 54) audits once more the records of FILE that did not finish (every outcome but EXACT
and VIOLATION, save those out of time), or its records of the models named, and writes FILE with them
replaced. A refusal whose fix is
``verify_every_step=True`` (data-dependent control flow: experts called by routing) is taken as a user would
take it, and the record says so (``"verify_every_step": true``, stop 55).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import subprocess
import sys
import tempfile
import warnings
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.oracle import clipped_mean, engine_update, group_norms, per_example_grads

CAUSAL = [  # the stop-46 audit's decoders
    "qwen3_next", "falcon_h1", "olmo_hybrid", "kimi_linear", "smollm3", "ernie4_5", "exaone4", "apertus",
    "arcee", "seed_oss", "lfm2", "hunyuan_v1_dense", "glm4", "glm4_moe", "minimax", "qwen3_moe", "olmoe",
    "phimoe", "granitemoeshared", "hunyuan_v1_moe", "ernie4_5_moe", "flex_olmo", "jetmoe", "cohere2",
    "gemma3_text", "stablelm", "nemotron",
]  # fmt: skip
TEXT = [
    "modernbert",
    "roberta-prelayernorm",
    "xlm-roberta-xl",
    "ernie",
    "esm",
    "nystromformer",
    "yoso",
    "fnet",
]
VISION = ["vit_msn", "ijepa", "poolformer", "focalnet", "swiftformer"]
SIZES = {
    "causal": {"vocab_size": 40, "hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 2,
               "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8,
               "max_position_embeddings": 32, "pad_token_id": 1, "use_cache": False},
    "text": {"vocab_size": 40, "hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2,
             "intermediate_size": 24, "max_position_embeddings": 32, "pad_token_id": 1, "num_labels": 2},
    "vision": {"image_size": 16, "patch_size": 4, "num_channels": 3, "hidden_size": 16,
               "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 24, "num_labels": 2},
}  # fmt: skip
HYBRID = [  # the state-space and linear-attention hybrids (stop 47), each with a mixer layer (and CAUSAL's
    # lfm2, with a short-convolution layer since OVERRIDES)
    "mamba", "falcon_mamba", "mamba2", "bamba", "granitemoehybrid", "falcon_h1", "qwen3_5_text",
    "jamba", "nemotron_h",
]  # fmt: skip
LATENT = {"kv_lora_rank": 8, "q_lora_rank": 8, "qk_rope_head_dim": 4, "qk_nope_head_dim": 4, "v_head_dim": 8,
          "num_key_value_heads": 2}  # fmt: skip
STAGES = {  # vision models of two stages, their widths per stage
          "depths": [1, 1], "hidden_size": None, "num_hidden_layers": None, "num_attention_heads": None,
          "intermediate_size": None}  # fmt: skip
LATENT_MODELS = [  # multi-head latent attention (stop 53)
    "deepseek_v2", "deepseek_v3", "deepseek_v32", "glm4_moe_lite", "glm_moe_dsa", "minicpm3", "sarvam_mla",
    "axk1", "longcat_flash", "youtu", "mistral4",
]  # fmt: skip
OVERRIDES = {  # per model type: what its configuration needs beyond SIZES to build with a mixer at width 16
    "mamba2": {"num_heads": 4, "head_dim": 8, "n_groups": 1},
    "bamba": {"mamba_n_heads": 4, "mamba_d_head": 8, "mamba_n_groups": 1},
    "granitemoehybrid": {"mamba_n_heads": 4, "mamba_d_head": 8, "mamba_n_groups": 1,
                         "layer_types": ["mamba", "attention"]},
    "zamba2": {"layer_types": ["mamba", "hybrid"], "mamba_headdim": 8, "n_mamba_heads": 4},
    "lfm2": {"layer_types": ["conv", "full_attention"]},
    # stop 53: multi-head latent attention, partial rotary dimensions, equal key/value heads
    **{name: dict(LATENT) for name in LATENT_MODELS},
    "codegen": {"rotary_dim": 4},
    "gptj": {"rotary_dim": 4},
    "dots3_note_text": {"num_key_value_heads": 2},
    # stop 54: the configurations that did not build at SIZES (None leaves a SIZES key out)
    # (multi-head latent attention whose head_dim is the rotary part, as their configurations set it)
    **{name: {**LATENT, "head_dim": 4} for name in ("deepseek_v3", "axk1", "axk2", "longcat_flash", "youtu")},
    "deepseek_v2": {**LATENT, "head_dim": 4, "num_experts_per_tok": 2},
    "cohere_compass_text": {
        "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e4}}},
    "dbrx": {"d_model": 16, "n_heads": 2, "n_layers": 2, "ffn_config": {"ffn_hidden_size": 24,
             "moe_num_experts": 4, "moe_top_k": 2},
             "attn_config": {"kv_n_heads": 1, "rope_theta": 1e4, "clip_qkv": 8.0}},
    "dots1": {"moe_intermediate_size": 8, "n_routed_experts": 4, "num_experts_per_tok": 2,
              "n_shared_experts": 1, "first_k_dense_replace": 1},
    "falcon": {"num_kv_heads": 1, "head_dim": None},
    "gpt_neo": {"attention_types": [[["global", "local"], 1]], "num_layers": 2},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_experts": 4, "num_experts_per_tok": 2,
                 "moe_intermediate_size": 8},
    "prophetnet": {"num_hidden_layers": None, "num_encoder_layers": 1, "num_decoder_layers": 2, "ngram": 2},
    # stop 58: XLNet has no position limit (its configuration refuses the key) and names its sizes its own way
    "xlnet": {"max_position_embeddings": None, "d_model": 16, "n_layer": 2, "n_head": 2, "d_inner": 24},
    # the encoder-decoder families' decoders (their own names for heads, widths and layers) and others whose
    # defaults do not fit width 16
    **{name: {"d_model": 16, "encoder_attention_heads": 2, "decoder_attention_heads": 2, "encoder_layers": 1,
              "decoder_layers": 2, "encoder_ffn_dim": 24, "decoder_ffn_dim": 24}
       for name in ("blenderbot", "plbart", "whisper")},
    "diffllama": {"num_key_value_heads": 2},
    "funnel": {"num_hidden_layers": None, "block_sizes": [1, 1], "d_model": 16, "n_head": 2, "d_head": 8,
               "d_inner": 24},
    "squeezebert": {"embedding_size": 16},
    **{name: {**STAGES, "embed_dim": 8, "num_heads": [1, 2], "window_size": 2}
       for name in ("swin", "swinv2", "donut-swin")},
    **{name: {**STAGES, "hidden_sizes": [8, 16], "num_stages": 2} for name in ("convnext", "convnextv2")},
    **{name: {**STAGES, "hidden_sizes": [8, 16], "num_encoder_blocks": 2, "num_attention_heads": [1, 2],
              "sr_ratios": [2, 1], "sequence_reduction_ratios": [2, 1], "patch_sizes": [4, 2],
              "strides": [4, 2], "mlp_ratios": [2, 2], "decoder_hidden_size": 16}
       for name in ("pvt", "pvt_v2", "segformer")},
    "regnet": {**STAGES, "embedding_size": 8, "hidden_sizes": [8, 16], "groups_width": 4, "layer_type": "x"},
    "bit": {**STAGES, "embedding_size": 8, "hidden_sizes": [8, 16], "layer_type": "preactivation",
            "num_groups": 2},
    "hiera": {**STAGES, "image_size": [16, 16], "patch_size": [3, 3], "patch_stride": [2, 2],
              "patch_padding": [1, 1], "embed_dim": 8, "num_heads": [1, 2], "query_stride": [2, 2],
              "masked_unit_size": [2, 2], "num_query_pool": 1},
    "efficientnet": {**STAGES, "image_size": 64, "width_coefficient": 0.1, "depth_coefficient": 0.1,
                     "hidden_dim": 32},
    "mobilevitv2": {"image_size": 64},
}  # fmt: skip
SETTINGS = [("bk", "flat"), ("ghost", "per_layer")]


def build(architecture: str, kind: str) -> tuple[nn.Module, dict, callable]:
    """(model, batch of 6, per-example loss) for ``architecture`` as a ``kind`` model."""
    import transformers

    fields = {**SIZES[kind], **OVERRIDES.get(architecture, {})}
    fields = {key: value for key, value in fields.items() if value is not None}  # None: leave it out
    config = transformers.AutoConfig.for_model(architecture, **fields)
    for key, value in list(vars(config).items()):
        if "drop" in key and isinstance(value, float):  # the fallback and the oracle need determinism
            setattr(config, key, 0.0)
    config._attn_implementation = "eager"
    auto = {
        "causal": transformers.AutoModelForCausalLM,
        "text": transformers.AutoModelForSequenceClassification,
        "vision": transformers.AutoModelForImageClassification,
    }[kind]
    model = auto.from_config(config).double().eval()
    if hasattr(model, "set_experts_implementation"):
        with contextlib.suppress(ValueError, NotImplementedError):  # a model without experts
            model.set_experts_implementation("eager")
    generator = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 2, (6,), generator=generator)
    if kind == "vision":
        side = fields.get("image_size", 16) if isinstance(fields.get("image_size", 16), int) else 16
        batch = {"pixel_values": torch.randn(6, 3, side, side, generator=generator, dtype=torch.float64)}
    else:
        ids = torch.randint(3, 40, (6, 8), generator=generator)
        mask = torch.ones(6, 8, dtype=torch.long)
        mask[0, -3:], ids[0, -3:] = 0, 1  # a padded example
        batch = {"input_ids": ids, "attention_mask": mask}

    def loss(m: nn.Module, b: dict) -> torch.Tensor:
        inputs = {k: v for k, v in b.items() if k not in ("labels", "targets")}
        logits = m(**inputs, **({"use_cache": False} if kind == "causal" else {})).logits
        if kind != "causal":
            return F.cross_entropy(logits, b["labels"], reduction="none")
        targets = b["targets"][:, 1:]
        tokens = F.cross_entropy(logits[:, :-1].flatten(0, 1), targets.flatten(), reduction="none")
        return tokens.view(targets.shape).sum(1)

    if kind == "causal":
        batch["targets"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    else:
        batch["labels"] = labels
    return model, batch, loss


def audit(architecture: str, kind: str, tolerance: float) -> dict:
    """One model's record: its outcome, the worst relative errors and the modules left to the fallback."""
    from dpexp.privacy import PrivacyEngine
    from dpexp.privacy.capture import unsupported_modules
    from dpexp.privacy.verification import VerificationError
    from dpexp.runtime import is_project_error

    record = {"model": architecture, "kind": kind}
    phase = "build"
    try:
        torch.manual_seed(0)
        model, batch, loss = build(architecture, kind)
        # copied before any forward: a model may keep tensors of its last forward as attributes
        # (RecurrentGemma's recurrent states), which deepcopy refuses
        pristine = copy.deepcopy(model)
        record["fallback"] = {name.rsplit(".", 1)[1]: p for name, p in unsupported_modules(model).items()}
        phase = "model"
        grads = per_example_grads(model, loss, batch)
        phase = "engine"
        if not all(torch.isfinite(g).all() for example in grads for g in example.values()):
            raise ArithmeticError("the model's own per-example gradients are not finite at this size")
        errors = []
        for strategy, clipping in SETTINGS:
            groups = PrivacyEngine(
                copy.deepcopy(pristine), batch_size=6, sample_size=60, max_grad_norm=1.0,
                noise_multiplier=0.0, clipping=clipping,
            ).groups  # fmt: skip
            thresholds = group_norms(grads, groups).median(0).values.clamp_min(1e-6).tolist()
            expected = clipped_mean(grads, groups, thresholds, batch_size=6)
            update = partial(
                engine_update, pristine, loss, batch, [[0, 1, 2], [3, 4, 5]], batch_size=6, strategy=strategy,
                clipping=clipping, thresholds=thresholds, max_grad_norm=1.0,
            )  # fmt: skip
            try:
                delta, _ = update(verify_every_step=record.get("verify_every_step", False))
            except VerificationError as refusal:  # the fix a refusal names, taken as a user would
                if "verify_every_step=True" not in str(refusal):
                    raise
                record["verify_every_step"] = True
                delta, _ = update(verify_every_step=True)
            whole = torch.cat([v.flatten() for v in expected.values()]).norm()
            errors.append(
                max(
                    float((delta[k] - v).norm() / (v.norm() + 1e-3 * whole).clamp_min(1e-12))
                    for k, v in expected.items()
                )
            )
        record["errors"] = errors
        record["outcome"] = "EXACT" if max(errors) < tolerance else "VIOLATION"
    except Exception as error:  # every outcome is reported
        refused = phase == "engine" and is_project_error(error)
        record["outcome"] = "NOT BUILT" if phase != "engine" else "REFUSED" if refused else "ERROR"
        record["phase"] = phase
        record["message"] = f"{type(error).__name__}: {' '.join(str(error).split())[:500]}"
    return record


FINISHED = ("EXACT", "VIOLATION")


def _timed_out(record: dict) -> bool:
    return record.get("phase") == "time" or record.get("message", "").startswith("over ")


def every_other_type() -> list[tuple[str, str]]:
    """(model type, kind) of every type in transformers' causal-LM, sequence-classification and
    image-classification mappings that the default lists leave out, each under its first mapping."""
    from transformers.models.auto import modeling_auto as auto

    mappings = {
        "causal": auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        "text": auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES,
        "vision": auto.MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES,
    }
    seen = set(CAUSAL + HYBRID + TEXT + VISION)
    todo = []
    for kind, names in mappings.items():
        todo += [(name, kind) for name in names if name not in seen]
        seen |= set(names)
    return todo


def audit_apart(architecture: str, kind: str, tolerance: float, seconds: int) -> dict:
    """:func:`audit` in a process of its own, stopped after ``seconds`` (a multimodal wrapper keeps its
    towers' full default sizes): NOT BUILT when it ran out of time or memory."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "record.json"
        command = [sys.executable, __file__, architecture, "--kind", kind, "--tolerance", str(tolerance)]
        with contextlib.suppress(subprocess.TimeoutExpired):
            subprocess.run([*command, "--json", str(out)], capture_output=True, timeout=seconds)
        if out.is_file():
            return json.loads(out.read_text())[0]
    return {
        "model": architecture,
        "kind": kind,
        "outcome": "NOT BUILT",
        "phase": "time",
        "message": f"over {seconds} s or memory",
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="*", help="model types (default: the stop-46 audit's 40)")
    parser.add_argument("--kind", choices=list(SIZES), help="how to build the named models (default: causal)")
    parser.add_argument("--all", action="store_true", help="every other type (stop 53), each in a process")
    parser.add_argument("--seconds", type=int, default=240, help="the time each --all process has")
    parser.add_argument("--jobs", type=int, default=1, help="--all processes at a time")
    parser.add_argument("--tolerance", type=float, default=1e-5)
    parser.add_argument("--json", type=Path, help="write the records here")
    parser.add_argument(
        "--again", type=Path, help="audit this file's unfinished records (or named models) again, rewrite it"
    )
    args = parser.parse_args()
    earlier = json.loads(args.again.read_text()) if args.again else []
    todo = (
        [(r["model"], r["kind"]) for r in earlier if r["model"] in args.models]
        if args.again and args.models
        else [(name, args.kind or "causal") for name in args.models]
        if args.models
        else [(r["model"], r["kind"]) for r in earlier if r["outcome"] not in FINISHED and not _timed_out(r)]
        if args.again
        else every_other_type()
        if args.all
        else [(n, "causal") for n in CAUSAL + HYBRID]
        + [(n, "text") for n in TEXT]
        + [(n, "vision") for n in VISION]
    )
    warnings.filterwarnings("ignore")
    if args.all or args.again:  # processes of their own, --jobs at a time
        pool = ThreadPoolExecutor(args.jobs)
        done = pool.map(lambda job: audit_apart(*job, args.tolerance, args.seconds), todo)
    else:
        done = (audit(name, kind, args.tolerance) for name, kind in todo)
    records = []
    for (name, kind), record in zip(todo, done, strict=True):
        records.append(record)
        detail = (
            f"errors {[f'{e:.1e}' for e in record['errors']]} fallback {record['fallback']}"
            if "errors" in record
            else record["message"]
        )
        print(f"{name} ({kind}): {record['outcome']} {detail}", flush=True)
    if args.again:  # the file's records in their order, the audited ones replaced
        again = {(r["model"], r["kind"]): r for r in records}
        records = [again.get((r["model"], r["kind"]), r) for r in earlier]
    if args.json or args.again:
        (args.json or args.again).write_text(json.dumps(records, indent=1) + "\n")
    return 1 if any(r["outcome"] == "VIOLATION" for r in records) else 0


if __name__ == "__main__":
    sys.exit(main())
