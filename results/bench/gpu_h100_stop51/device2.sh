#!/bin/bash
# Stop 51's second device call: the oracle after the Mamba-2 norm fix, Bu et al. Table 1's BEiT-large with
# the new rules, and the largest-batch search of He et al. Figure 1 on GPT-2 small (bk against non-private).
set -u
out=$OUT; start=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
left() { echo $(( 270 - ($(date +%s) - start) )); }
mark() { echo "$1 rc $2 at $(($(date +%s) - start)) s" | tee -a "$out/parts.log"; }
P="python3 -W ignore"
timeout 80 $P scripts/device_oracle.py --device cuda --out $out/device_oracle.json > $out/oracle.log 2>&1; mark oracle $?
head -1 $out/oracle.log; grep FAILED $out/oracle.log | cut -c 1-300
timeout 110 $P -m dpexp.bench bench_suite=bu2023_table1 bench_suite.max_batch.enabled=false '~bench_suite.models.roberta_large' '~bench_suite.models.gpt2_large' output=$out/bu2023_table1_beit.json hydra.run.dir=/tmp/h_bu > $out/suites.log 2>&1; mark beit $?
t=$(left); [ $t -gt 40 ] && { timeout $t $P -m dpexp.bench bench_suite=he2023_figure1 '~bench_suite.models.gpt2_medium' 'bench_suite.methods=[nonprivate,bk]' 'bench_suite.max_batch.models=[gpt2]' output=$out/he2023_figure1_max_batch.json hydra.run.dir=/tmp/h_he >> $out/suites.log 2>&1; mark max_batch $?; }
grep -E "\] - |wrote" $out/suites.log | grep -v "^\[transformers" | cut -c 50-220 | tail -30
