#!/usr/bin/env bash
# Experiment 2 (RL arms from ONE warm start) in one device call on a 2-GPU machine (nvidia-h200-x2).
#
# GPU 0 trains the warm start (`scripts/exp_sft.py`: `jetrl sft` of exp_common.GPU_SFT on the chain task) while
# GPU 1 runs the GPU tests given in $GPU_TESTS and then the command $GPU1_CMD (if any; both together are cut off
# after $GPU1_LIMIT seconds, so that they cannot eat the RL arms' time). Then every arm runs RL from that one
# checkpoint (`exp_rl.py --model`), all at the same time, each in its own process: the arms of $ARMS0 on GPU 0 as
# soon as the SFT is done, those of $ARMS1 on GPU 1 once GPU 1 is free too, with the same seed, data,
# hyper-parameters and deadline. `nvidia-smi` samples both GPUs' utilization every 15 s meanwhile. (The 94M model leaves an H200
# mostly idle in decode, so two arms per GPU get far more steps than two arms one after the other; the
# arms' speeds are not compared here, only what they learn per step.)
# $OUT receives log.txt (every log, concatenated) and one <arm>.json per arm (5 files with four arms: a
# device call brings back 8); then, here,
#   python scripts/exp_rl.py --replot $OUT/*.json --out experiments/results/exp2-<date>
# writes the merged JSON, the table and the plots.
#
#   OUT=... SFT_STEPS=250 DEADLINE=540 scripts/exp_two_gpus.sh                       # defaults shown
#   ARMS0=bf16,fp8-rollout ARMS1=fp8-rollout-tis,jet SEED=0 scripts/exp_two_gpus.sh  # the arms per GPU
#   GPU1_CMD='python3 bench/rollout.py ... --json $OUT/b.json' GPU1_LIMIT=210 ...  # GPU 1's work during the SFT
#   SMOKE=1 SFT_STEPS=2 ARMS0=bf16 ARMS1=jet scripts/exp_two_gpus.sh                  # the whole path on CPU
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-runs/exp_two_gpus}"
SFT_STEPS="${SFT_STEPS:-250}"
DEADLINE="${DEADLINE:-540}"          # seconds after the start by which every RL run should be done
ARMS0="${ARMS0:-bf16,fp8-rollout}"
ARMS1="${ARMS1:-fp8-rollout-tis,jet}"
SEED="${SEED:-0}"
GPU_TESTS="${GPU_TESTS:-}"
GPU1_CMD="${GPU1_CMD:-}"
GPU1_LIMIT="${GPU1_LIMIT:-210}"
SMOKE="${SMOKE:-}"                   # 1: the tiny CPU model and sizes (the test suite runs it)
SMOKE_ARG=()
[ -n "$SMOKE" ] && SMOKE_ARG=(--smoke)
export PYTHONPATH="$PWD:$PWD/scripts${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
mkdir -p "$OUT"
WORK="$(mktemp -d)"
T0=$(date +%s)
LOGS="$WORK/logs"; mkdir -p "$LOGS"

gpu1_pid=""
if [ -n "$GPU_TESTS$GPU1_CMD" ]; then
  (export CUDA_VISIBLE_DEVICES=1
   if [ -n "$GPU_TESTS" ]; then
     timeout "$GPU1_LIMIT" python3 -m pytest -m gpu -q -p no:cacheprovider -n 6 $GPU_TESTS > "$LOGS/1_gpu_tests.log" 2>&1
     echo "gpu tests rc=$?" >> "$LOGS/1_gpu_tests.log"
   fi
   if [ -n "$GPU1_CMD" ]; then
     left1=$((GPU1_LIMIT - ($(date +%s) - T0)))
     [ "$left1" -gt 0 ] && timeout "$left1" bash -c "$GPU1_CMD" > "$LOGS/1_gpu1_cmd.log" 2>&1
     echo "gpu1 command rc=$? after $(($(date +%s) - T0)) s" >> "$LOGS/1_gpu1_cmd.log"
   fi) &
  gpu1_pid=$!
fi
CUDA_VISIBLE_DEVICES=0 python3 scripts/exp_sft.py ${SMOKE_ARG[@]+"${SMOKE_ARG[@]}"} --out-dir "$WORK/sft" \
  --steps "$SFT_STEPS" > "$LOGS/0_sft.log" 2>&1
sft_rc=$?
left=$((DEADLINE - ($(date +%s) - T0)))
echo "sft rc=$sft_rc after $(($(date +%s) - T0)) s; RL deadline $left s after the SFT" | tee -a "$LOGS/0_sft.log"
smi_pid=""
if command -v nvidia-smi > /dev/null; then
  nvidia-smi --query-gpu=timestamp,index,utilization.gpu,memory.used --format=csv,noheader -l 15 \
    > "$LOGS/3_nvidia_smi.log" 2>&1 &
  smi_pid=$!
fi
arm_pids=()
if [ "$sft_rc" -eq 0 ]; then
  for gpu in 0 1; do
    if [ "$gpu" -eq 1 ] && [ -n "$gpu1_pid" ]; then
      wait "$gpu1_pid"
    fi
    arms="ARMS$gpu"
    for arm in ${!arms//,/ }; do
      left=$((DEADLINE - ($(date +%s) - T0)))   # the same deadline for every arm, counted from each start
      CUDA_VISIBLE_DEVICES=$gpu python3 scripts/exp_rl.py ${SMOKE_ARG[@]+"${SMOKE_ARG[@]}"} --model "$WORK/sft" \
        --arms "$arm" --seeds "$SEED" --deadline "$left" --time-budget 100000 --work "$WORK/rl-$arm" \
        --out "$WORK/out-$arm" > "$LOGS/2_rl_$arm.log" 2>&1 &
      arm_pids+=($!)
    done
  done
  wait "${arm_pids[@]}"
  for arm in ${ARMS0//,/ } ${ARMS1//,/ }; do
    cp "$WORK/out-$arm/exp_rl.json" "$OUT/$arm.json" 2>/dev/null || echo "no result for $arm" >> "$LOGS/2_rl_$arm.log"
  done
fi
wait ${gpu1_pid:+"$gpu1_pid"} 2>/dev/null
[ -n "$smi_pid" ] && kill "$smi_pid" 2>/dev/null
cat "$LOGS"/*.log > "$OUT/log.txt"
echo "== after $(($(date +%s) - T0)) s"
for f in "$LOGS"/*.log; do echo "== $(basename "$f")"; tail -n 12 "$f"; done
