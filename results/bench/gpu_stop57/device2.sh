#!/bin/bash
# Stop 57's second device call: WRN-16-4 at B = 256 before (HEAD fbd8ed9, .ab/old) and after the unfold and
# instantiation change (ConvWeightGrads off the CPU: patches as strided windows, one batched product per
# chunk), its kernels after; GPT-2 small B = 32 bk under stop 51's final code (264a62a, .ab/s51) and now;
# the oracle on CUDA under the new code.
set -u
out=$OUT; start=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1
mark() { echo "$1 rc $2 at $(($(date +%s) - start)) s" | tee -a "$out/ab.log"; }
NEW="env PYTHONPATH=/tmp/site:$PWD python3 -W ignore"
OLD="env -C $PWD/.ab/old PYTHONPATH=$PWD/.ab/old:/tmp/site python3 -W ignore"
S51="env -C $PWD/.ab/s51 PYTHONPATH=$PWD/.ab/s51:/tmp/site python3 -W ignore"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $out/ab.log
B="-m dpexp.bench bench_suite=gpu bench_suite.max_batch.enabled=false bench_suite.methods=[nonprivate,bk,perlayer] ~bench_suite.models.gpt2_untied ~bench_suite.models.mlp ~bench_suite.models.roberta ~bench_suite.models.vit_base ~bench_suite.models.llama ~bench_suite.models.llama_lora"
W="$B ~bench_suite.models.gpt2"
G="$B ~bench_suite.models.wrn16_4 bench_suite.models.gpt2.batch_sizes=[32] bench_suite.methods=[nonprivate,bk]"
timeout 70 $OLD $W output=$out/wrn_old.json hydra.run.dir=/tmp/h1 >> $out/ab.log 2>&1; mark wrn_old $?
timeout 70 $NEW $W output=$out/wrn_new.json hydra.run.dir=/tmp/h2 >> $out/ab.log 2>&1; mark wrn_new $?
timeout 45 $NEW scripts/kernel_profile.py wrn16_4 bk bench_suite=gpu > $out/kernels.log 2>&1; mark kernels $?
timeout 70 $S51 $G output=$out/gpt2_s51.json hydra.run.dir=/tmp/h3 >> $out/ab.log 2>&1; mark gpt2_s51 $?
timeout 70 $NEW $G output=$out/gpt2_new.json hydra.run.dir=/tmp/h4 >> $out/ab.log 2>&1; mark gpt2_new $?
grep -E "\] - \[" $out/ab.log | cut -c 50-170
grep -v -E "USDT|ERROR" $out/kernels.log | head -24 | cut -c 1-140
timeout 100 $NEW scripts/device_oracle.py --device cuda --out $out/device_oracle.json > $out/oracle.log 2>&1; mark oracle $?
tail -3 $out/oracle.log | cut -c 1-200
