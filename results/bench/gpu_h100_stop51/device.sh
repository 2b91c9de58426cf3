#!/bin/bash
# Stop 51's device call: A/B of the device-side masking (old = HEAD 4807529 in .ab/old), host syncs, oracle,
# He et al. Figure 1 and Bu et al. Table 1 suites without the largest-batch search.
set -u
out=$OUT; start=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1
left() { echo $(( 530 - ($(date +%s) - start) )); }
mark() { echo "$1 rc $2 at $(($(date +%s) - start)) s" | tee -a "$out/parts.log"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/env.log"
NEW="env PYTHONPATH=/tmp/site:$PWD python3 -W ignore"
OLD="env -C $PWD/.ab/old PYTHONPATH=$PWD/.ab/old:/tmp/site python3 -W ignore"
$NEW -c "import torch, transformers, dpexp; print(torch.__version__, transformers.__version__, dpexp.__file__)" >> "$out/env.log" 2>&1
$OLD -c "import dpexp; print(dpexp.__file__)" >> "$out/env.log" 2>&1
S="-m dpexp.bench bench_suite=gpu bench_suite.max_batch.enabled=false bench_suite.methods=[nonprivate,bk,perlayer] ~bench_suite.models.gpt2_untied ~bench_suite.models.mlp ~bench_suite.models.roberta ~bench_suite.models.vit_base ~bench_suite.models.llama_lora bench_suite.models.gpt2.batch_sizes=[32] bench_suite.models.llama.methods=[nonprivate,bk,perlayer]"
timeout 110 $OLD $S output=$out/ab_old.json hydra.run.dir=/tmp/h_old > $out/ab.log 2>&1; mark ab_old $?
timeout 110 $NEW $S output=$out/ab_new.json hydra.run.dir=/tmp/h_new >> $out/ab.log 2>&1; mark ab_new $?
grep -E "\] - \[" $out/ab.log | cut -c 50-170
(timeout 45 $OLD $PWD/scripts/host_syncs.py gpt2 bk,perlayer; timeout 45 $NEW $PWD/scripts/host_syncs.py gpt2 bk,perlayer; timeout 40 $NEW $PWD/scripts/host_syncs.py wrn16_4 perlayer) > $out/host_syncs.log 2>&1; mark syncs $?
grep -A4 "host syncs" $out/host_syncs.log | head -60
timeout 90 $NEW scripts/device_oracle.py --device cuda --out $out/device_oracle.json > $out/oracle.log 2>&1; mark oracle $?
tail -3 $out/oracle.log
t=$(left); [ $t -gt 30 ] && { timeout $(( t * 55 / 100 )) $NEW -m dpexp.bench bench_suite=he2023_figure1 bench_suite.max_batch.enabled=false output=$out/he2023_figure1.json hydra.run.dir=/tmp/h_he > $out/suites.log 2>&1; mark he2023_figure1 $?; }
t=$(left); [ $t -gt 30 ] && { timeout $t $NEW -m dpexp.bench bench_suite=bu2023_table1 bench_suite.max_batch.enabled=false output=$out/bu2023_table1.json hydra.run.dir=/tmp/h_bu >> $out/suites.log 2>&1; mark bu2023_table1 $?; }
grep -E "\] - \[|wrote" $out/suites.log | cut -c 50-170
