#!/usr/bin/env bash
# H100: jetrl train at 1.5B (bf16, jet) at HEAD (compare 26e50b4's H100 runs), GPU tests of rollout+rl, tests/parallel on torch 2.11
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
R=$OUT; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > $R/summary.txt
python -c "import torch, triton; print(torch.__version__, triton.__version__)" >> $R/summary.txt
T0=$SECONDS; S=$SECONDS
timeout 230 python bench/train_run.py --shape qwen2.5-1.5b --recipes bf16,jet --steps 10 --data .data/gsm8k_train.jsonl --workdir /tmp/trainrun --json $R/train_1.5b.json > $R/train_1.5b.log 2>&1; echo "train rc=$? $((SECONDS-S))s" >> $R/summary.txt
rm -rf /tmp/trainrun; S=$SECONDS
timeout $((400-(SECONDS-T0))) python -m pytest -m gpu -q -p no:cacheprovider tests/rollout tests/rl tests/quant/test_grouped_linear.py tests/quant/test_bf16_stack.py -n 8 > $R/gpu_rollout_rl.log 2>&1; echo "gpu tests rc=$? $((SECONDS-S))s: $(tail -1 $R/gpu_rollout_rl.log)" >> $R/summary.txt
S=$SECONDS; L=$((450-(SECONDS-T0)))
[ $L -gt 15 ] && { timeout $L python -m pytest -q -p no:cacheprovider tests/parallel -n 8 > $R/parallel.log 2>&1; echo "parallel rc=$? $((SECONDS-S))s: $(tail -1 $R/parallel.log)" >> $R/summary.txt; }
grep FAILED $R/gpu_rollout_rl.log $R/parallel.log | head -10
grep -B2 -A12 "^recipe" $R/train_1.5b.log | head -30
cat $R/summary.txt
