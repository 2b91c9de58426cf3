#!/bin/bash
# Stop 51's third device call: where BEiT-large's bk step spends its time (engine timers, host syncs).
set -u
out=$OUT
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
timeout 70 python3 -W ignore scripts/host_syncs.py beit_large bk bench_suite=bu2023_table1 > $out/beit_host_syncs.log 2>&1; echo syncs $?
grep -v "^\[transformers" $out/beit_host_syncs.log | tail -12
timeout 80 python3 -W ignore scripts/engine_timers.py beit_large nonprivate,bk bench_suite=bu2023_table1 > $out/beit_engine_timers.log 2>&1; echo timers $?
grep -v "^\[transformers" $out/beit_engine_timers.log | tail -25
