#!/bin/bash
# Stage release binaries and GPU test executables into .gpu/, with the previous commit's bench
# (BASE_BENCH, built from a stash of this round's changes) as .gpu/v/base-bench.
set -e
cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"
source .ci/cuda-env.sh
cargo build --release -p kvq-cli -p kvq-bench --bins
rm -rf .gpu && mkdir -p .gpu/bin .gpu/tests .gpu/v .gpu/steps
cp target/release/kvq target/release/kvq-bench .gpu/bin/
[ -n "${BASE_BENCH:-}" ] && cp "$BASE_BENCH" .gpu/v/base-bench
cp docs/bench/2026-11-27-r40/call.sh .gpu/call.sh
# examples/embed/run.sh builds kvq first; on the GPU machine (no toolchain) a no-op cargo stands in.
mkdir -p .gpu/fake && printf '#!/bin/sh\nexit 0\n' > .gpu/fake/cargo && chmod +x .gpu/fake/cargo
cp docs/bench/2026-11-27-r42/steps-*.txt .gpu/steps/ 2>/dev/null || true
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
strip .gpu/bin/* .gpu/tests/* .gpu/v/* 2>/dev/null || true
ls -la .gpu/bin .gpu/tests .gpu/v
du -sh .gpu
