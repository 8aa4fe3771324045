#!/bin/bash
# H100: jetrl train at 1.5B (bf16, jet) at HEAD; the 0.5B rollout x256 under the q/k/v routing A/B; the 0.5B profile
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
R=$OUT; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > $R/gpu.txt
python -c "import torch, triton; print(torch.__version__, triton.__version__)" >> $R/gpu.txt
S=$SECONDS
timeout 300 python bench/train_run.py --shape qwen2.5-1.5b --recipes bf16,jet --steps 10 --data .data/gsm8k_train.jsonl --workdir /tmp/trainrun --json $R/train_1.5b.json > $R/train_1.5b.log 2>&1; echo "train rc=$? $((SECONDS-S))s" >> $R/gpu.txt
rm -rf /tmp/trainrun
for v in current no-grouped-05; do S=$SECONDS
timeout 40 python .gpujobs/rollout_routing.py $v -- --shape 0.5b --settings b256 --arms bf16,jet --json $R/rollout05_$v.json > $R/rollout05_$v.log 2>&1; echo "rollout $v rc=$? $((SECONDS-S))s" >> $R/gpu.txt; done
S=$SECONDS
timeout 40 python bench/decode_profile.py --shape 0.5b --batches 256 --arms bf16,jet --json $R/profile05.json > $R/profile05.log 2>&1; echo "profile05 rc=$? $((SECONDS-S))s" >> $R/gpu.txt
cat $R/gpu.txt; grep -A4 "^recipe" $R/train_1.5b.log | head -5
for v in current no-grouped-05; do echo "== $v"; grep -E "^0.5b " $R/rollout05_$v.log; done
