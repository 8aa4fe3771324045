#!/usr/bin/env bash
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
S15='{"model_type":"qwen2","rms_norm_eps":1e-06,"rope_theta":1000000.0,"rope_scaling":null,"vocab_size":151936,"hidden_size":1536,"intermediate_size":8960,"num_hidden_layers":28,"num_attention_heads":12,"num_key_value_heads":2,"tie_word_embeddings":true,"max_position_embeddings":32768}'
t0=$(date +%s)
timeout 150 python -m pytest -m gpu -q -p no:cacheprovider -n 4 tests/quant/test_kernels_gpu.py tests/quant/test_grouped_linear.py tests/rl/test_update_graphs_gpu.py -k "bias or fp8_linear or grouped or graph or replay or scoring or trainer or padded" > $OUT/t.log 2>&1; echo "tests rc=$? $(( $(date +%s)-t0 ))s"; grep -h "FAILED\|Error\|passed\|failed" $OUT/t.log | cut -c1-300 | tail -8
timeout 90 python bench/profile_step.py --shape "$S15" --parts update --micro-batch 32 --prompt-len 130 --new-tokens 290 --steps 2 --top 12 > $OUT/u.log 2>&1; echo "u rc=$? $(( $(date +%s)-t0 ))s"
grep -A12 "arms side by side" $OUT/u.log
timeout 250 python bench/train_run.py --shape qwen2.5-1.5b --recipes bf16,jet --steps 10 --data .data/gsm8k/train.jsonl --json $OUT/r15.json > $OUT/r15.log 2>&1; echo "r15 rc=$? $(( $(date +%s)-t0 ))s"
grep -A14 "^qwen2.5" $OUT/r15.log | cut -c1-200
