#!/bin/bash
# Stop 57's fourth device call: the noise of a step on the GPU drawn in buckets (one randn, two multi-tensor
# kernels each) against one randn and one add per tensor (HEAD 3d0d55c, .ab/old): GPT-2 small B = 32,
# non-private, bk and per-layer in each; the new noise's per-tensor std on CUDA; per-layer's launches.
set -u
out=$OUT; start=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1
mark() { echo "$1 rc $2 at $(($(date +%s) - start)) s" | tee -a $out/ab.log; }
NEW="env PYTHONPATH=/tmp/site:$PWD python3 -W ignore"
OLD="env -C $PWD/.ab/old PYTHONPATH=$PWD/.ab/old:/tmp/site python3 -W ignore"
nvidia-smi --query-gpu=name --format=csv,noheader > $out/ab.log
$NEW -c "
import torch
from dpexp.privacy.noise import add_device_noises_
g = torch.Generator(device='cuda').manual_seed(0)
ts = [(torch.zeros(300000, device='cuda'), 3.0), (torch.zeros(7, device='cuda'), 2.0), (torch.zeros(500, 400, device='cuda').t(), 0.5)]
add_device_noises_(ts, g)
print('device noise stds', [round(t.std().item(), 3) for t, _ in ts], 'wanted', [s for _, s in ts])
" >> $out/ab.log 2>&1; mark noise_check $?
G="-m dpexp.bench bench_suite=gpu bench_suite.max_batch.enabled=false bench_suite.methods=[nonprivate,bk,perlayer] ~bench_suite.models.gpt2_untied ~bench_suite.models.mlp ~bench_suite.models.roberta ~bench_suite.models.vit_base ~bench_suite.models.llama ~bench_suite.models.llama_lora ~bench_suite.models.wrn16_4 bench_suite.models.gpt2.batch_sizes=[32]"
timeout 70 $OLD $G output=$out/gpt2_old.json hydra.run.dir=/tmp/h1 >> $out/ab.log 2>&1; mark gpt2_old $?
timeout 70 $NEW $G output=$out/gpt2_new.json hydra.run.dir=/tmp/h2 >> $out/ab.log 2>&1; mark gpt2_new $?
timeout 40 $NEW scripts/kernel_profile.py gpt2 bk,perlayer bench_suite=gpu bench_suite.models.gpt2.batch_sizes=[32] > $out/kernels.log 2>&1; mark kernels $?
grep -E "device noise|\] - \[" $out/ab.log | cut -c 1-170
grep -E "^gpt2" $out/kernels.log
