#!/bin/bash
# The GPU checks of one device session, each bounded (stop 45: 290 s for the first three parts on an H200;
# stop 51 ran parts 1, 5 and 6 in about 5 minutes on an H100). All six take about 12 minutes, more than one
# call may run: name the parts to run, e.g. `bash scripts/gpu_checks.sh OUT_DIR 1234`, then `... OUT_DIR 56`. Run from the repository root on the GPU machine:
#
#   bash scripts/gpu_checks.sh OUT_DIR [PARTS]      (PARTS: digits of the parts below, default all)
#
# Python packages the machine lacks (hydra-core, omegaconf, antlr4 4.9.3, opacus, peft, timm, prv-accountant)
# travel as wheels in .whl/ (ignored by git): build them here with
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_17_x86_64 \
#       -d .whl hydra-core==1.3.8 omegaconf==2.3.1 opacus==1.6.0 peft==0.21.2 timm==1.0.31 prv-accountant==0.2.0
#   pip wheel --no-deps -w .whl antlr4-python3-runtime==4.9.3      # an sdist only
# (the machine's own torch and transformers are used: 2.11 and 5.17 in stops 45 and 51). The working tree
# travels within 64 MiB as the disk counts it: results/runs (~53 MiB of small files) must be moved out of the
# checkout for the call and back after (stop 51). Parts:
#   1. scripts/device_oracle.py: the oracle tests' models on CUDA in float64 (the recurrent ones in float32
#      too), and one example's clipped sum against its bound in float32, TF32 and bf16 autocast (stop 60:
#      about 90 s);
#   2. the gpu suite (bk, per-layer, ghost, Opacus against non-private) without the largest-batch search;
#   3. the gpu_bf16 suite on GPT-2 and Llama;
#   4. the convolution norm methods per WRN shape, and the engine's calls timed on WRN-16-4;
#   5. the host syncs of one GPT-2 step (bk, per-layer);
#   6. He et al. Figure 1's and Bu et al. Table 1's suites without their largest-batch searches;
#   7. the gpu_layers suite (torchvision's ViT-B/16, ConvNeXt-T, Swin-T; nn.TransformerEncoder; nn.LSTM,
#      nn.GRU, Opacus' DPLSTM; stop 60: about 50 s).
set -u
out=${1:?usage: bash scripts/gpu_checks.sh OUT_DIR [PARTS]}
parts=${2:-1234567}
part() { [[ $parts == *$1* ]]; }
mkdir -p "$out"
start=$(date +%s)
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1
mark() { echo "$1 rc $2 at $(($(date +%s) - start)) s" | tee -a "$out/parts.log"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >"$out/env.log"

if part 1; then
    timeout 120 python3 -W ignore scripts/device_oracle.py --device cuda --out "$out/device_oracle.json" \
        >"$out/oracle.log" 2>&1
    mark oracle $?
fi

bench="python3 -W ignore -m dpexp.bench bench_suite.max_batch.enabled=false"
if part 2; then
    timeout 240 $bench bench_suite=gpu "output=$out/gpu.json" "hydra.run.dir=$out/hydra_gpu" \
        '~bench_suite.models.gpt2_untied' '~bench_suite.models.mlp' 'bench_suite.models.gpt2.batch_sizes=[32]' \
        'bench_suite.models.roberta.seq_lens=[256]' >"$out/bench.log" 2>&1
    mark gpu $?
fi

if part 3; then
    timeout 90 $bench bench_suite=gpu_bf16 "output=$out/gpu_bf16.json" "hydra.run.dir=$out/hydra_bf16" \
        'bench_suite.methods=[nonprivate,bk,perlayer]' '~bench_suite.models.gpt2_untied' '~bench_suite.models.roberta' \
        '~bench_suite.models.vit_base' '~bench_suite.models.mlp' '~bench_suite.models.wrn16_4' \
        '~bench_suite.models.llama_lora' 'bench_suite.models.gpt2.batch_sizes=[32]' \
        'bench_suite.models.llama.methods=[nonprivate,bk,perlayer]' >>"$out/bench.log" 2>&1
    mark gpu_bf16 $?
fi

if part 4; then
    timeout 40 python3 scripts/conv_norm_bench.py --device cuda --batch 256 >"$out/conv_norms.md" 2>&1
    mark conv_norms $?
    timeout 60 python3 -W ignore scripts/engine_timers.py wrn16_4 nonprivate,bk,perlayer bench_suite=gpu \
        >"$out/engine_timers.log" 2>&1
    mark engine_timers $?
fi

if part 5; then
    timeout 60 python3 -W ignore scripts/host_syncs.py gpt2 bk,perlayer bench_suite=gpu >"$out/host_syncs.log" 2>&1
    mark host_syncs $?
fi

if part 6; then
    timeout 90 $bench bench_suite=he2023_figure1 "output=$out/he2023_figure1.json" "hydra.run.dir=$out/hydra_he" \
        >>"$out/bench.log" 2>&1
    mark he2023_figure1 $?
    timeout 120 $bench bench_suite=bu2023_table1 "output=$out/bu2023_table1.json" "hydra.run.dir=$out/hydra_bu" \
        >>"$out/bench.log" 2>&1
    mark bu2023_table1 $?
fi

if part 7; then
    timeout 120 $bench bench_suite=gpu_layers "output=$out/gpu_layers.json" "hydra.run.dir=$out/hydra_layers" \
        >>"$out/bench.log" 2>&1
    mark gpu_layers $?
fi
