#!/usr/bin/env bash
# The 2026 wave on the toy, one seed each, two epochs so that the ratio leaves 1 (Lesson 13).
# Each run's config.json, summary.json, curves.png and metrics.jsonl.gz are kept here.
set -euo pipefail
cd "$(dirname "$0")/../.."
for arm in "clip:" "dppotv:--policy-loss dppo-tv" "dppokl:--policy-loss dppo-kl" \
           "sqlogratio:--policy-loss sq-logratio" "maxrl:--norm maxrl" "vespo:--policy-loss vespo" \
           "luspo:--policy-loss luspo --ratio-level sequence"; do
    name=${arm%%:*}; flags=${arm#*:}
    python train.py --k 8 --epochs 2 $flags --out "/tmp/wave_2026/$name" --overwrite
done
