#!/usr/bin/env bash
# Reproduces the embedded default model jetrl/assets/tiny-arith (about 5 minutes on 2 CPU cores):
# a 0.74M-parameter Llama-style model trained from scratch by `jetrl sft` on 3-step arithmetic for a
# fixed budget of 600 steps x 64 problems, where it is weak but not hopeless (see its README.md).
# One thread: the result then does not depend on the machine's core count.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m jetrl sft --output-dir jetrl/assets/tiny-arith --task arithmetic --difficulty 3 --steps 600 \
    --batch-size 64 --lr 3e-3 --seed 0 --eval-examples 200 --save-dtype float32 --threads 1 "$@"
