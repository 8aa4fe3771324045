#!/usr/bin/env bash
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
S15='{"model_type":"qwen2","rms_norm_eps":1e-06,"rope_theta":1000000.0,"rope_scaling":null,"vocab_size":151936,"hidden_size":1536,"intermediate_size":8960,"num_hidden_layers":28,"num_attention_heads":12,"num_key_value_heads":2,"tie_word_embeddings":true,"max_position_embeddings":32768}'
S7='{"model_type":"qwen2","rms_norm_eps":1e-06,"rope_theta":1000000.0,"rope_scaling":null,"vocab_size":152064,"hidden_size":3584,"intermediate_size":18944,"num_hidden_layers":8,"num_attention_heads":28,"num_key_value_heads":4,"tie_word_embeddings":false,"max_position_embeddings":32768}'
t0=$(date +%s)
timeout 150 python -m pytest -m gpu -q -p no:cacheprovider -n 4 tests/quant/test_swiglu_fp8_grad.py tests/quant/test_swiglu.py tests/quant/test_kernels_gpu.py > $OUT/t.log 2>&1; echo "tests rc=$? $(( $(date +%s)-t0 ))s"; grep -h "FAILED\|Error\|passed\|failed" $OUT/t.log | cut -c1-300 | tail -8
timeout 100 python bench/profile_step.py --shape "$S15" --arms "bf16,jet,jet@swiglu_grad_fp8=true" --parts update --micro-batch 32 --prompt-len 130 --new-tokens 290 --steps 2 --top 12 > $OUT/u15.log 2>&1; echo "u15 rc=$?"
timeout 120 python bench/profile_step.py --shape "$S7" --arms "bf16,jet,jet@swiglu_grad_fp8=true" --parts update --micro-batch 36 --prompt-len 130 --new-tokens 300 --steps 2 --top 12 > $OUT/u7.log 2>&1; echo "u7 rc=$?"
for f in u15 u7; do grep "swiglu" $OUT/$f.log; grep -A14 "arms side by side" $OUT/$f.log; done
