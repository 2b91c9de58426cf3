#!/bin/bash
# Stop 60's device call: the oracle on CUDA with the families added since stop 57 (PyTorch's recurrent layers
# and nn.MultiheadAttention, float64 and float32 with the graph reads counted; the timm/torchvision CNNs),
# the gpu suite's bk against non-private as a regression check after stops 58-59, and the new gpu_layers
# suite (torchvision ViT-B/16, ConvNeXt-T, Swin-T at 224; nn.TransformerEncoder in both layouts; nn.LSTM,
# nn.GRU; Opacus' DPLSTM).
set -u
out=$OUT; start=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
mark() { echo "$1 rc $2 at $(($(date +%s) - start)) s" | tee -a "$out/parts.log"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/env.log"
P="python3 -W ignore"
$P -c "import torch, transformers, timm, torchvision, dpexp; print(torch.__version__, transformers.__version__, timm.__version__, torchvision.__version__)" >> "$out/env.log" 2>&1
cat $out/env.log
timeout 240 $P scripts/device_oracle.py --device cuda --out $out/device_oracle.json > $out/oracle.log 2>&1; mark oracle $?
grep -v -E "^attention|^sensitivity" $out/oracle.log | cut -c 1-400 | tail -25
grep -E "^attention" $out/oracle.log | head -5
B="$P -m dpexp.bench bench_suite.max_batch.enabled=false"
timeout 100 $B bench_suite=gpu 'bench_suite.methods=[nonprivate,bk]' '~bench_suite.models.gpt2_untied' '~bench_suite.models.mlp' '~bench_suite.models.vit_base' '~bench_suite.models.llama_lora' 'bench_suite.models.gpt2.batch_sizes=[32]' 'bench_suite.models.roberta.seq_lens=[256]' 'bench_suite.models.llama.methods=[nonprivate,bk]' output=$out/gpu.json hydra.run.dir=/tmp/h_gpu > $out/bench.log 2>&1; mark gpu $?
timeout 170 $B bench_suite=gpu_layers output=$out/gpu_layers.json hydra.run.dir=/tmp/h_gl >> $out/bench.log 2>&1; mark gpu_layers $?
grep -E "\] - \[|Error|error" $out/bench.log | cut -c 50-200 | tail -40
