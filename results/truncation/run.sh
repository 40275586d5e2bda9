#!/usr/bin/env bash
# Top-p 0.8 on the toy, the sampler's log-probs as pi_old (--rollout-correction bypass, as prime-rl
# takes them), with and without the mask replay; one seed each, two epochs (Lesson 13).
# Each run's config.json, summary.json, curves.png and metrics.jsonl.gz are kept here.
set -euo pipefail
cd "$(dirname "$0")/../.."
for arm in "plain:" "replay:--mask-replay"; do
    name=${arm%%:*}; flags=${arm#*:}
    python train.py --k 8 --epochs 2 --top-p 0.8 --rollout-correction bypass $flags \
        --out "/tmp/truncation/$name" --overwrite --quiet
    mkdir -p "results/truncation/$name"
    cp "/tmp/truncation/$name"/{config.json,summary.json,curves.png} "results/truncation/$name/"
    gzip -c "/tmp/truncation/$name/metrics.jsonl" > "results/truncation/$name/metrics.jsonl.gz"
done
