#!/bin/bash
# Stop 57's device call: the oracle on CUDA under the current engine (check 3's watch, the window-attention
# keeps), the gpu suite's bk and per-layer against non-private without the largest-batch search, the
# window-attention suite on the device, GPT-2's host syncs, and WRN-16-4's kernels (scripts/kernel_profile.py).
set -u
out=$OUT; start=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
mark() { echo "$1 rc $2 at $(($(date +%s) - start)) s" | tee -a "$out/parts.log"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/env.log"
P="python3 -W ignore"
$P -c "import torch, transformers, dpexp; print(torch.__version__, transformers.__version__, dpexp.__file__)" >> "$out/env.log" 2>&1
timeout 100 $P scripts/device_oracle.py --device cuda --out $out/device_oracle.json > $out/oracle.log 2>&1; mark oracle $?
tail -4 $out/oracle.log
timeout 180 $P -m dpexp.bench bench_suite=gpu bench_suite.max_batch.enabled=false 'bench_suite.methods=[nonprivate,bk,perlayer]' '~bench_suite.models.gpt2_untied' '~bench_suite.models.mlp' '~bench_suite.models.vit_base' 'bench_suite.models.gpt2.batch_sizes=[32]' 'bench_suite.models.roberta.seq_lens=[256]' 'bench_suite.models.llama.methods=[nonprivate,bk,perlayer]' 'bench_suite.models.llama_lora.methods=[nonprivate,bk,perlayer]' output=$out/gpu.json hydra.run.dir=/tmp/h_gpu > $out/bench.log 2>&1; mark gpu $?
grep -E "\] - \[" $out/bench.log | cut -c 50-170
timeout 50 $P -m dpexp.bench bench_suite=window_attention bench_suite.device=cuda output=$out/window_attention.json hydra.run.dir=/tmp/h_wa >> $out/bench.log 2>&1; mark window_attention $?
timeout 45 $P scripts/host_syncs.py gpt2 bk > $out/host_syncs.log 2>&1; mark syncs $?
head -8 $out/host_syncs.log
timeout 50 $P scripts/kernel_profile.py wrn16_4 nonprivate,bk bench_suite=gpu > $out/kernels.log 2>&1; mark kernels $?
grep -v -E "USDT|ERROR" $out/kernels.log | head -60
