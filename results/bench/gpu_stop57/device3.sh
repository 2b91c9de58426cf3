#!/bin/bash
# Stop 57's third device call: where GPT-2 small's per-layer step loses to bk on the GPU (its kernels and the
# engine's calls timed, bk and per-layer), and WRN-16-4's per-layer kernels, under the new conv path.
set -u
out=$OUT; start=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
mark() { echo "$1 rc $2 at $(($(date +%s) - start)) s"; }
P="python3 -W ignore"
nvidia-smi --query-gpu=name --format=csv,noheader
G="bench_suite=gpu bench_suite.models.gpt2.batch_sizes=[32]"
timeout 80 $P scripts/kernel_profile.py gpt2 nonprivate,bk,perlayer $G > $out/gpt2_kernels.log 2>&1; mark gpt2_kernels $?
timeout 80 $P scripts/engine_timers.py gpt2 nonprivate,bk,perlayer $G > $out/gpt2_timers.log 2>&1; mark gpt2_timers $?
timeout 50 $P scripts/kernel_profile.py wrn16_4 perlayer bench_suite=gpu > $out/wrn_kernels.log 2>&1; mark wrn_kernels $?
for f in gpt2_kernels wrn_kernels; do grep -v -E "USDT|ERROR" $out/$f.log | grep -E "^[a-z]|^ +[0-9.]+ ms +[0-9]+x" | awk '/^[a-z]/{n=0} {if (n++ < 12) print}' | cut -c 1-130; done
grep -v -E "USDT|ERROR" $out/gpt2_timers.log | head -40
