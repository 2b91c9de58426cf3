#!/bin/bash
# Stop 60's third device call: the recurrent family of the oracle with cuBLAS' and cuDNN's TF32 off (the
# float32 checks, nn.RNN(relu) included, which call 2 refused at a 0.088 gap under
# TF32), then with PyTorch's defaults (the relu RNN's refusal now names the TF32 flags), after the test
# model's hx was made contiguous (cuDNN's LSTM refuses a strided one); and the kernels of the LSTM's bk step.
set -u
out=$OUT; start=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
mark() { echo "$1 rc $2 at $(($(date +%s) - start)) s" | tee -a "$out/parts.log"; }
P="python3 -W ignore"
timeout 80 $P scripts/device_oracle.py --device cuda --families recurrent --exact-tf32 off --out $out/oracle_tf32_off.json > $out/oracle_tf32_off.log 2>&1; mark oracle_tf32_off $?
grep -E "exactness checks|^FAILED" $out/oracle_tf32_off.log | cut -c 1-300
timeout 80 $P scripts/device_oracle.py --device cuda --families recurrent --out $out/oracle_tf32_default.json > $out/oracle_tf32_default.log 2>&1; mark oracle_tf32_default $?
grep -E "exactness checks|^FAILED" $out/oracle_tf32_default.log | cut -c 1-300
grep -o "If this is the cause[^\"]*" $out/oracle_tf32_default.log | head -1
timeout 50 $P scripts/kernel_profile.py lstm nonprivate,bk bench_suite=gpu_layers > $out/kernels_lstm.log 2>&1; mark kernels $?
grep -v -E "USDT|ERROR" $out/kernels_lstm.log | head -40
