#!/bin/bash
# Stages as the forty-second round's stage.sh does (release binaries and GPU tests in .gpu/, the
# fortieth round's call.sh, a no-op cargo for examples/embed/run.sh), with this round's step files.
# No base bench: no kernel changed this round, so nothing is timed against an older build.
set -e
cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"
bash docs/bench/2026-11-27-r42/stage.sh
rm -f .gpu/steps/*
cp docs/bench/2026-11-28-r45/steps-*.txt .gpu/steps/
git rev-parse --short HEAD > .gpu/commit
