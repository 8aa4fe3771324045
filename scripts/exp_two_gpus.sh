#!/usr/bin/env bash
# Experiment 2 (four RL arms from ONE warm start) in one device call on a 2-GPU machine (nvidia-h200-x2).
#
# GPU 0 trains the warm start (`jetrl sft` on the chain task, exp_common.GPU_SFT) while GPU 1 runs the GPU
# tests given in $GPU_TESTS (if any); then both GPUs run RL from that one checkpoint at once, two arms each
# (`exp_rl.py --model`), with the same seed, data and hyper-parameters. Everything a device call may bring
# back lands in $OUT: log.txt (every log, concatenated), g0/ and g1/ (each exp_rl.json and its two PNGs);
# `python scripts/exp_rl.py --replot $OUT/g0/exp_rl.json $OUT/g1/exp_rl.json` draws all four arms together.
#
#   OUT=... SFT_STEPS=250 DEADLINE=560 scripts/exp_two_gpus.sh                       # defaults shown
#   ARMS0=bf16,fp8-rollout ARMS1=fp8-rollout-tis,jet SEED=0 scripts/exp_two_gpus.sh  # the arms per GPU
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-runs/exp_two_gpus}"
SFT_STEPS="${SFT_STEPS:-250}"
DEADLINE="${DEADLINE:-560}"          # seconds after the start by which every RL run should be done
ARMS0="${ARMS0:-bf16,fp8-rollout}"
ARMS1="${ARMS1:-fp8-rollout-tis,jet}"
SEED="${SEED:-0}"
GPU_TESTS="${GPU_TESTS:-}"
export PYTHONPATH="$PWD:$PWD/scripts${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
mkdir -p "$OUT/g0" "$OUT/g1"
WORK="$(mktemp -d)"
T0=$(date +%s)
LOGS="$WORK/logs"; mkdir -p "$LOGS"

if [ -n "$GPU_TESTS" ]; then
  (CUDA_VISIBLE_DEVICES=1 python3 -m pytest -m gpu -q -p no:cacheprovider -n 6 $GPU_TESTS > "$LOGS/1_gpu_tests.log" 2>&1
   echo "gpu tests rc=$?" >> "$LOGS/1_gpu_tests.log") &
fi
CUDA_VISIBLE_DEVICES=0 python3 scripts/exp_sft.py --out-dir "$WORK/sft" --steps "$SFT_STEPS" > "$LOGS/0_sft.log" 2>&1
sft_rc=$?
wait
left=$((DEADLINE - ($(date +%s) - T0)))
echo "sft rc=$sft_rc after $(($(date +%s) - T0)) s; RL deadline $left s" | tee -a "$LOGS/0_sft.log"
if [ "$sft_rc" -eq 0 ]; then
  CUDA_VISIBLE_DEVICES=0 python3 scripts/exp_rl.py --model "$WORK/sft" --arms "$ARMS0" --seeds "$SEED" \
    --deadline "$left" --work "$WORK/g0" --out "$OUT/g0" > "$LOGS/2_rl_g0.log" 2>&1 &
  CUDA_VISIBLE_DEVICES=1 python3 scripts/exp_rl.py --model "$WORK/sft" --arms "$ARMS1" --seeds "$SEED" \
    --deadline "$left" --work "$WORK/g1" --out "$OUT/g1" > "$LOGS/3_rl_g1.log" 2>&1 &
  wait
fi
cat "$LOGS"/*.log > "$OUT/log.txt"
echo "== after $(($(date +%s) - T0)) s"
for f in "$LOGS"/*.log; do echo "== $(basename "$f")"; tail -n 12 "$f"; done
