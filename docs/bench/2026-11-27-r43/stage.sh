#!/bin/bash
# Stages as the forty-first round's stage.sh does, plus: a base bench (BASE_BENCH; this round used
# the forty-second round's, the bench of d99bc0b, whose generic kernel serves GQA 11, 13 and 29 as
# 9e4585b's does) as .gpu/v/base-bench, the fortieth round's call.sh, this round's step files,
# and a no-op cargo for examples/embed/run.sh (the GPU machine has no toolchain).
set -e
cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"
rm -rf .gpu
bash docs/bench/2026-11-27-r41/stage.sh
mkdir -p .gpu/v .gpu/steps .gpu/fake
if [ -n "${BASE_BENCH:-}" ]; then cp "$BASE_BENCH" .gpu/v/base-bench && strip .gpu/v/base-bench; fi
cp docs/bench/2026-11-27-r40/call.sh .gpu/call.sh
cp docs/bench/2026-11-27-r43/steps-*.txt .gpu/steps/
printf '#!/bin/sh\nexit 0\n' > .gpu/fake/cargo && chmod +x .gpu/fake/cargo
