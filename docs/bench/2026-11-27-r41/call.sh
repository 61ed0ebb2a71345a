#!/bin/bash
# .gpu/call.sh STEPFILE: runs each line "name limit_s command" in order; logs in /tmp/r, tarred to $OUT/r.tgz.
set -u
cd "$(dirname "$0")/.."
mkdir -p /tmp/r
export KVQ_REQUIRE_GPU=1
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv > /tmp/r/gpu.txt 2>&1
cp "$1" /tmp/r/steps.txt
while read -r name limit cmd; do
    [ -z "$name" ] && continue
    start=$(date +%s)
    timeout "$limit" bash -c "$cmd" </dev/null > "/tmp/r/$name.log" 2>&1
    rc=$?
    echo "$name rc=$rc $(( $(date +%s) - start ))s" | tee -a /tmp/r/summary.txt
    tar czf "$OUT/r.tgz" -C /tmp r
done < "$1"
