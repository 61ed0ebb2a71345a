#!/bin/bash
# Stages as the forty-second round's stage.sh does (the forty-first's binaries, BASE_BENCH as
# .gpu/v/base-bench, call.sh, a no-op cargo), with this round's step files in place of that
# round's. This round's BASE_BENCH was the forty-second round's base, the bench of d99bc0b, whose
# generic kernel serves GQA 11, 13 and 29 as 9e4585b's does.
set -e
cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"
bash docs/bench/2026-11-27-r42/stage.sh
rm -f .gpu/steps/*
cp docs/bench/2026-11-27-r43/steps-*.txt .gpu/steps/
