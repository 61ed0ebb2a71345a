#!/bin/bash
# Stages as the forty-second round's stage.sh does (release binaries and GPU tests in .gpu/, the
# previous commit's bench as .gpu/v/base-bench from BASE_BENCH, call.sh, a no-op cargo), with this
# round's step files in place of that round's. This round's BASE_BENCH was the bench of 68cfec4
# (one head tile a warp: FP16 past 8 query heads a KV head in rows of at most 8).
set -e
cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"
bash docs/bench/2026-11-27-r42/stage.sh
rm -f .gpu/steps/*
cp docs/bench/2026-11-27-r44/steps-*.txt .gpu/steps/
