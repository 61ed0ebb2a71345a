#!/bin/bash
# The c11 call's staging: stage.sh, plus HEAD_BENCH (the bench of 49830d9: two head tiles at most)
# as .gpu/v/head-bench.
set -e
cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"
bash docs/bench/2026-11-27-r44/stage.sh
cp "$HEAD_BENCH" .gpu/v/head-bench && strip .gpu/v/head-bench
