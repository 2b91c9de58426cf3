#!/bin/bash
# Stop 60's fourth device call: the recurrent rule's gate arithmetic on CUDA as PyTorch's fused LSTM / GRU
# cell kernels (aten::_thnn_fused_lstm_cell / _thnn_fused_gru_cell, CUDA-only, so checked here): the
# recurrent family of the oracle (TF32 off: float64 and float32), the gpu_layers suite's LSTM and GRU, and
# the LSTM's bk kernels (call 3: 8,709 launches, 0.11x non-private).
set -u
out=$OUT; start=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
mark() { echo "$1 rc $2 at $(($(date +%s) - start)) s" | tee -a "$out/parts.log"; }
P="python3 -W ignore"
timeout 80 $P scripts/device_oracle.py --device cuda --families recurrent --exact-tf32 off --out $out/oracle_fused.json > $out/oracle_fused.log 2>&1; mark oracle_fused $?
grep -E "exactness checks|^FAILED" $out/oracle_fused.log | cut -c 1-400 | head -8
B="$P -m dpexp.bench bench_suite.max_batch.enabled=false"
timeout 60 $B bench_suite=gpu_layers '~bench_suite.models.tv_vit_b16' '~bench_suite.models.tv_convnext_tiny' '~bench_suite.models.tv_swin_t' '~bench_suite.models.torch_encoder_batch_first' '~bench_suite.models.torch_encoder_time_major' '~bench_suite.models.dplstm' output=$out/gpu_layers_fused.json hydra.run.dir=/tmp/h_gl > $out/bench.log 2>&1; mark gpu_layers_fused $?
grep -E "\] - \[" $out/bench.log | cut -c 50-250
timeout 40 $P scripts/kernel_profile.py lstm nonprivate,bk bench_suite=gpu_layers > $out/kernels_lstm_fused.log 2>&1; mark kernels $?
grep -v -E "USDT|ERROR" $out/kernels_lstm_fused.log | grep -E "device time" 
