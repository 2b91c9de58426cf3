#!/usr/bin/env bash
# `make test`: the selected tests as N pytest processes at once (N = SHARDS, default 2, one per core), each
# running its part (--shard=I/N: the heavy tests of tests/durations.json balanced over the parts, the others
# by a hash of their node id; tests/sharding.py), with one torch thread. Part 0 prints as it goes; the
# others' output is printed whole when they have ended. The exit status is the first non-zero one. Each part
# ends with its 15 slowest tests (the default suite's ~10-minute budget is kept by marking the slowest
# `slow`). Arguments are passed to every pytest (e.g. `-m ""` for the whole suite, `--record-durations`).
set -u
PY=${PY:-.venv/bin/python}
N=${SHARDS:-2}
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
part() {
    OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 "$PY" -m pytest -q -p no:cacheprovider --durations=15 \
        --shard="$1/$N" "${@:2}"
}
pids=()
for ((i = 1; i < N; i++)); do
    part "$i" "$@" >"$logs/$i.log" 2>&1 &
    pids+=($!)
done
echo "=== tests, part 0 of $N ==="
part 0 "$@"
status=$?
echo "=== tests, part 0 of $N: exit $status ==="
for ((i = 1; i < N; i++)); do
    wait "${pids[$((i - 1))]}"
    code=$?
    echo "=== tests, part $i of $N: exit $code ==="
    cat "$logs/$i.log"
    if [ "$status" -eq 0 ]; then status=$code; fi
done
exit "$status"
