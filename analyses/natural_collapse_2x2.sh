#!/usr/bin/env bash
# The 2x2 of figures/natural_collapse/ (issue 43): {ALiBi, no positional bias} x {weight decay
# 0.1, 0.5}, the same seed (initialisation and data order), schedule and step count per arm; two
# arms at a time, one thread each. The no-bias arm is ALiBi clamped to within 1e-6 of 0.
# Usage: analyses/natural_collapse_2x2.sh [SEED]   (then: python analyses/natural_collapse.py)
set -euo pipefail
cd "$(dirname "$0")/.."
SEED=${1:-0}
STEPS=4000
common=(--steps "$STEPS" --minutes 120 --eval-every 250 --n-layer 4 --n-head 8 --hidden 128
        --seq-len 256 --batch 16 --lr 3e-3 --bos --span-share 0.38 --seed "$SEED")
arm() {  # arm NAME WEIGHT_DECAY [BIAS ARGS...]
    local name=$1 wd=$2
    shift 2
    OMP_NUM_THREADS=1 python analyses/train_organism.py "${common[@]}" --weight-decay "$wd" "$@" \
        --name "nc-$name-s$SEED" --out "runs/nc-$name-s$SEED" \
        --export "analyses/natural_collapse_models/$name-s$SEED" > "runs/nc-$name-s$SEED.log" 2>&1
}
mkdir -p runs analyses/natural_collapse_models
arm alibi-wd0.1 0.1 & arm alibi-wd0.5 0.5 & wait
arm nobias-wd0.1 0.1 --bias clamped --bias-c 1e-6 & arm nobias-wd0.5 0.5 --bias clamped --bias-c 1e-6 & wait
