#!/bin/bash
# Stage release binaries and GPU test executables into .gpu/
set -e
cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"
source .ci/cuda-env.sh
cargo build --release -p kvq-cli -p kvq-bench --bins
mkdir -p .gpu/bin .gpu/tests
cp target/release/kvq target/release/kvq-bench .gpu/bin/
exe() { cargo test --release --no-run "$@" --message-format=json 2>/dev/null | python3 -c '
import sys,json
for l in sys.stdin:
    try: m=json.loads(l)
    except: continue
    if m.get("reason")=="compiler-artifact" and m.get("executable") and m["target"]["kind"]==["test"]:
        print(m["target"]["name"], m["executable"])'; }
exe -p kvq --test gpu_decode --test gpu_paged | while read n e; do cp "$e" .gpu/tests/$n; done
exe -p kvq-runtime --test gpu --test tune_gpu | while read n e; do
  case $n in gpu) cp "$e" .gpu/tests/rt-gpu;; tune_gpu) cp "$e" .gpu/tests/tune_gpu;; esac; done
exe -p kvq-cli --test gpu | while read n e; do cp "$e" .gpu/tests/cli-gpu; done
strip .gpu/bin/* .gpu/tests/* 2>/dev/null || true
ls -la .gpu/bin .gpu/tests
du -sh .gpu
