#!/usr/bin/env bash
# The embedding example in one command: build `kvq`, generate kernels and a sample batch for a few
# schemes and shapes (including scheme text, a calibrated scheme, bf16 and CommVQ), then let
# examples/embed/embed.py — plain Python with ctypes, the CUDA driver API and NVRTC, no kvq — launch
# them on its own buffers and stream and check the outputs against the CPU reference.
#
#   bash examples/embed/run.sh                 # on a GPU machine: everything
#   bash examples/embed/run.sh --check-only    # anywhere with libnvrtc: layout checks + compile
#   KVQ_BIN=path/to/kvq bash examples/embed/run.sh   # a prebuilt kvq (a GPU machine without cargo)
#
# Outputs go to target/embed/<name>/. Exit status 0 only if every case passes.
set -euo pipefail
cd "$(dirname "$0")/../.."

mode=()
if [ "${1:-}" = "--check-only" ]; then
    mode=(--check-only)
fi

if [ -n "${KVQ_BIN:-}" ]; then
    kvq=$KVQ_BIN
else
    cargo build --release -p kvq-cli --bin kvq
    kvq=target/release/kvq
fi
out=target/embed
rm -rf "$out"

# name | scheme | head_dim | gqa | dtype
cases=(
    "kivi2|kivi2|128|4|f16"
    "kivi4|kivi4|128|4|f16"
    "kitty-bf16|kitty|128|4|bf16"
    "kitty-pro-gqa8|kitty-pro|128|8|f16"
    "calibquant2-d64|calibquant2|64|8|f16"
    "int8-mha|int8|128|1|f16"
    "fp16-d256|fp16|256|2|bf16"
    "kivi2-gqa16|kivi2|128|16|f16"
    "calibquant1-gqa12|calibquant1|128|12|bf16"
    "calibquant1-gqa11|calibquant1|128|11|f16"
    "kivi2-mqa71|kivi2|64|71|bf16"
    "custom|k = int(3, channel), v = int(4, token, group = 32), sink = 16, local = 64|128|4|f16"
    "commvq1|commvq1|128|4|f16"
    "commvq2-bf16|commvq2|128|4|bf16"
    "codebook-custom|k = codebook(rope_commutative, levels = 16, residuals = 3, pairs_per_code = 32, span = head), v = codebook(additive, rows = 64), sink = 16, local = 32, page = 64|64|8|f16"
)

failed=0
for c in "${cases[@]}"; do
    IFS='|' read -r name scheme head_dim gqa dtype <<<"$c"
    "$kvq" gen --scheme "$scheme" --head-dim "$head_dim" --gqa "$gqa" --dtype "$dtype" \
        --out "$out/$name" --sample --arch sm_90a >/dev/null
    if ! python3 examples/embed/embed.py "$out/$name" "${mode[@]}"; then
        failed=$((failed + 1))
    fi
done

if [ "$failed" -ne 0 ]; then
    echo "embed: $failed of ${#cases[@]} cases FAILED" >&2
    exit 1
fi
echo "embed: all ${#cases[@]} cases passed${mode:+ (check-only: no GPU launches)}"
