#!/bin/bash
# usage: gen-cases.sh KVQ_BIN OUTDIR: eleven `kvq gen` runs into OUTDIR, to diff two builds' outputs.
# The tune file is a fixed path that does not exist (no tuned results; the manifest names it, so
# both runs must name the same one).
B=$1; O=$2; rm -rf $O; mkdir -p $O
NONE=/tmp/kvq-gen-cases-no-tune.json
run() { name=$1; shift; "$B" gen "$@" --tune-file $NONE --out $O/$name > $O/$name.stdout 2> $O/$name.stderr; echo "rc=$?" >> $O/$name.stdout; }
run kivi2 --scheme kivi2 --head-dim 128 --gqa 4
run cq1 --scheme calibquant1 --head-dim 64 --gqa 1 --dtype bf16
run kitty --scheme kitty --head-dim 128 --gqa 8
run kivi4s --scheme kivi4 --head-dim 128 --gqa 4 --sample
run int8 --scheme int8 --head-dim 256 --gqa 4 --threads 256 --tile-tokens 16
run fp16 --scheme fp16 --head-dim 128 --gqa 4
run cq2 --scheme calibquant2 --head-dim 128 --gqa 4 --store-scores false
run text --scheme "k = int(3, token, group = 32), v = int(3, channel), sink = 16, page = 64" --head-dim 128 --gqa 2
run commvq --scheme commvq2 --head-dim 128 --gqa 4
run kp --scheme kitty-pro --head-dim 128 --gqa 4 --pack-heads false --min-warps-per-sm 0
run arch --scheme kivi2 --head-dim 128 --gqa 4 --arch sm_90a
