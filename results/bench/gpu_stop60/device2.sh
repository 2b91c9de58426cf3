#!/bin/bash
# Stop 60's second device call, after call 1 found (a) the oracle's recurrent models building their masks on
# the CPU (fixed in tests/recurrent_models.py) and (b) check 2 refusing nn.LSTM and nn.GRU on CUDA at a
# relative gap of 7e-4 and 1e-3: autograd's gradient through cuDNN's recurrent kernels in TF32 (PyTorch's
# default) against the rule's float32 per-example gradients. Now the oracle again with every family,
# tf32_rnn.py (that gap with cuDNN's TF32 on and off, against float64), the recurrent entries of gpu_layers
# under the TF32-aware tolerance (dpexp.privacy.precision.runs_tf32), and the kernels of the
# TransformerEncoder's bk step (0.43x non-private in call 1).
set -u
out=$OUT; start=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
mark() { echo "$1 rc $2 at $(($(date +%s) - start)) s" | tee -a "$out/parts.log"; }
P="python3 -W ignore"
timeout 40 $P results/bench/gpu_stop60/tf32_rnn.py > $out/tf32_rnn.log 2>&1; mark tf32_rnn $?
cat $out/tf32_rnn.log | tail -6
B="$P -m dpexp.bench bench_suite.max_batch.enabled=false"
timeout 60 $B bench_suite=gpu_layers '~bench_suite.models.tv_vit_b16' '~bench_suite.models.tv_convnext_tiny' '~bench_suite.models.tv_swin_t' '~bench_suite.models.torch_encoder_batch_first' '~bench_suite.models.torch_encoder_time_major' output=$out/gpu_layers_recurrent.json hydra.run.dir=/tmp/h_gl > $out/bench.log 2>&1; mark gpu_layers_recurrent $?
grep -E "\] - \[" $out/bench.log | cut -c 50-250
timeout 240 $P scripts/device_oracle.py --device cuda --out $out/device_oracle.json > $out/oracle.log 2>&1; mark oracle $?
grep -v -E "^attention|^sensitivity" $out/oracle.log | cut -c 1-400 | tail -12
grep -E "^attention" $out/oracle.log | head -4
timeout 50 $P scripts/kernel_profile.py torch_encoder_batch_first nonprivate,bk bench_suite=gpu_layers > $out/kernels.log 2>&1; mark kernels $?
grep -v -E "USDT|ERROR" $out/kernels.log | head -50
